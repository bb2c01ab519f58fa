"""Tables and figures written under reports/, and the analyses the notebooks show.

``save_figure`` / ``save_table`` write to ``reports/figures`` and ``reports/tables``;
``format_study`` and ``format_plots`` hold notebook 00's measurements and pictures.
"""
from twell.reports.save import (display_path, file_link, markdown_table, readable, relative_source, save_figure,
                                save_table, saved_image)

__all__ = ["display_path", "file_link", "markdown_table", "readable", "relative_source", "save_figure", "save_table",
           "saved_image"]
