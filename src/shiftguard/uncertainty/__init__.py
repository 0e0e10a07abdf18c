"""Per-sample uncertainty scores (higher = more uncertain) and the loss-prediction head [Kirchhof, Ch. 5]."""

from shiftguard.uncertainty.loss_prediction import LossPredictionHead, loss_ranking_loss
from shiftguard.uncertainty.scores import (
    embedding_norm_uncertainty,
    entropy_uncertainty,
    kappa_uncertainty,
    knn_distance_uncertainty,
    margin_uncertainty,
    max_probability_uncertainty,
    ned_uncertainty,
)

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
]
