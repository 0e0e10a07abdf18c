"""Metrics: classification (accuracy, NLL, Brier), calibration (ECE top-label / marginal,
reliability diagrams), retrieval on embeddings (Recall@K, MAP@K, MAP@R, R-precision, P@1) and
uncertainty ranking (AUROC of errors, R-AUROC, AURC). See ``docs/heads_metrics.md``.
"""

from shiftguard.metrics.bootstrap import bootstrap_ci, bootstrap_ece_ci, bootstrap_mean_ci
from shiftguard.metrics.calibration import ece
from shiftguard.metrics.classification import accuracy, brier, nll
from shiftguard.metrics.reliability import ReliabilityData, reliability_diagram
from shiftguard.metrics.retrieval import retrieval_metrics
from shiftguard.metrics.robustness import corruption_errors, mean_corruption_accuracy
from shiftguard.metrics.uncertainty import aurc, auroc_error, r_auroc

__all__ = [
    "accuracy",
    "nll",
    "brier",
    "ece",
    "reliability_diagram",
    "ReliabilityData",
    "retrieval_metrics",
    "auroc_error",
    "r_auroc",
    "aurc",
    "mean_corruption_accuracy",
    "corruption_errors",
    "bootstrap_ci",
    "bootstrap_mean_ci",
    "bootstrap_ece_ci",
]
