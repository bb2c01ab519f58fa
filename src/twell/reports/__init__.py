"""Tables and figures written under reports/, and the analyses the notebooks show.

``save_figure`` / ``save_table`` write to ``reports/figures`` and ``reports/tables``;
``format_study`` and ``format_plots`` hold notebook 00's measurements and pictures.
"""
from twell.reports.save import markdown_table, save_figure, save_table

__all__ = ["markdown_table", "save_figure", "save_table"]
