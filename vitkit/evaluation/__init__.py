"""Evaluation: top-1/top-5, per-class accuracy, confusion matrices and their reports."""
from .metrics import TTA_MODES, EvalResult, check_tta, evaluate, save_confusion_png, tta_log_probs, tta_views, write_report

__all__ = ["TTA_MODES", "EvalResult", "check_tta", "evaluate", "save_confusion_png", "tta_log_probs", "tta_views", "write_report"]
