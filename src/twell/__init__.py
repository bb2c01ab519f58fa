"""TwELL: sparse transformer feedforward blocks (formats, kernels, training, evaluation).

Reproduction of "Sparser, Faster, Lighter Transformer Language Models" (arXiv 2603.23198).
"""
__version__ = "0.1.0"
