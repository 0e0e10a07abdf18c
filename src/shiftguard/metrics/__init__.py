"""Metrics: classification (accuracy, NLL, Brier), calibration (ECE top-label / marginal,
reliability diagrams), retrieval on embeddings (Recall@K, MAP@K, MAP@R, R-precision, P@1) and
uncertainty ranking (AUROC of errors, R-AUROC, AURC). See ``docs/heads_metrics.md``. Hierarchy-informed
metrics (AHD@k, HP@k, HS@k, AHS@K, mean correlation) and embedding-change ratios: ``docs/hierarchy.md``.
"""

from shiftguard.metrics.bootstrap import bootstrap_ci, bootstrap_ece_ci, bootstrap_mean_ci
from shiftguard.metrics.calibration import ece
from shiftguard.metrics.classification import accuracy, brier, nll
from shiftguard.metrics.feature_space import embedding_change_ratios, norm_ratio, procrustes_scale
from shiftguard.metrics.hierarchy import (
    average_hierarchical_distance,
    class_prototypes,
    hierarchical_precision_at_k,
    hierarchical_similarity_at_k,
    hierarchy_metrics,
    mean_rank_correlation,
    representative_correlation,
)
from shiftguard.metrics.reliability import ReliabilityData, reliability_diagram
from shiftguard.metrics.retrieval import retrieval_metrics
from shiftguard.metrics.robustness import corruption_errors, mean_corruption_accuracy
from shiftguard.metrics.uncertainty import aurc, auroc_error, excess_aurc, one_nn_misses, r_auroc

__all__ = [
    "average_hierarchical_distance",
    "hierarchical_precision_at_k",
    "hierarchical_similarity_at_k",
    "hierarchy_metrics",
    "mean_rank_correlation",
    "class_prototypes",
    "representative_correlation",
    "embedding_change_ratios",
    "norm_ratio",
    "procrustes_scale",
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
    "excess_aurc",
    "one_nn_misses",
    "mean_corruption_accuracy",
    "corruption_errors",
    "bootstrap_ci",
    "bootstrap_mean_ci",
    "bootstrap_ece_ci",
]
