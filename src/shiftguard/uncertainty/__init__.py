"""Per-sample uncertainty scores (higher = more uncertain), the loss-prediction head [Kirchhof, Ch. 5] and
the uncertainty estimators of the URL benchmark [Kirchhof, URL Sec. 4.1, App. B.7-B.11]."""

from shiftguard.uncertainty.ensemble import DeepEnsemble
from shiftguard.uncertainty.estimator import (
    UncertaintyEstimator,
    entropy_from_log_probs,
    jensen_shannon_divergence,
    log_mean_exp,
)
from shiftguard.uncertainty.hetxl import HETXL
from shiftguard.uncertainty.loss_prediction import (
    LossPredictionHead,
    LossPredictionL2,
    loss_prediction_l2_loss,
    loss_ranking_loss,
)
from shiftguard.uncertainty.mc_dropout import MCDropout
from shiftguard.uncertainty.registry import ESTIMATOR_NAMES, ESTIMATOR_REGISTRY, build_estimator
from shiftguard.uncertainty.scores import (
    embedding_norm_uncertainty,
    entropy_uncertainty,
    kappa_uncertainty,
    knn_distance_uncertainty,
    margin_uncertainty,
    max_probability_uncertainty,
    ned_uncertainty,
)
from shiftguard.uncertainty.sngp import SNGP, spectral_normalize

__all__ = [
    "max_probability_uncertainty",
    "entropy_uncertainty",
    "margin_uncertainty",
    "knn_distance_uncertainty",
    "ned_uncertainty",
    "embedding_norm_uncertainty",
    "kappa_uncertainty",
    "LossPredictionHead",
    "loss_ranking_loss",
    "UncertaintyEstimator",
    "DeepEnsemble",
    "MCDropout",
    "SNGP",
    "HETXL",
    "LossPredictionL2",
    "loss_prediction_l2_loss",
    "spectral_normalize",
    "log_mean_exp",
    "entropy_from_log_probs",
    "jensen_shannon_divergence",
    "build_estimator",
    "ESTIMATOR_NAMES",
    "ESTIMATOR_REGISTRY",
]
