"""Evaluation: top-1/top-5, per-class accuracy, confusion matrices and their reports."""
from .fewshot import FewShotResult, fewshot, fewshot_from_features
from .metrics import TTA_MODES, EvalResult, check_tta, check_tta_margin, evaluate, save_confusion_png, tta_log_probs, tta_views, write_report

__all__ = ["FewShotResult", "fewshot", "fewshot_from_features", "TTA_MODES", "EvalResult", "check_tta", "check_tta_margin", "evaluate", "save_confusion_png", "tta_log_probs", "tta_views", "write_report"]
