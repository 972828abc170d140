"""Evaluation: top-1/top-5, per-class accuracy, confusion matrices and their reports."""
from .metrics import EvalResult, evaluate, save_confusion_png, write_report

__all__ = ["EvalResult", "evaluate", "save_confusion_png", "write_report"]
