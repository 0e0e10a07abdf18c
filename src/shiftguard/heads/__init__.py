"""Confidence heads on embeddings: fitted on (clean) train embeddings, they return calibrated
class probabilities for new, possibly shifted, embeddings.

Every head follows ``fit(train_emb, train_labels, val_emb=None, val_labels=None) -> self``,
``predict_proba(emb) -> (N, C)``, ``predict(emb) -> (N,)``. See ``docs/heads_metrics.md``.
"""

from shiftguard.heads.base import EmbeddingHead, NotFittedError
from shiftguard.heads.distance_ratio import DistanceRatioHead
from shiftguard.heads.knn_baselines import KNNVote, OneNN, WeightedKNN
from shiftguard.heads.logistic import LogisticRegressionHead
from shiftguard.heads.ned import NED
from shiftguard.heads.quantile import QuantileClassifierHead, fit_quantile_classifier
from shiftguard.heads.registry import EMBEDDING_HEADS, HEAD_NAMES, LOGIT_HEADS, build_head, head_input
from shiftguard.heads.softmax import SoftmaxHead
from shiftguard.heads.temperature import TemperatureScaling
from shiftguard.neighbors import knn_search  # re-exported: the search the kNN heads use

__all__ = [
    "EmbeddingHead",
    "NotFittedError",
    "NED",
    "OneNN",
    "KNNVote",
    "WeightedKNN",
    "TemperatureScaling",
    "LogisticRegressionHead",
    "DistanceRatioHead",
    "QuantileClassifierHead",
    "fit_quantile_classifier",
    "SoftmaxHead",
    "knn_search",
    "HEAD_NAMES",
    "LOGIT_HEADS",
    "EMBEDDING_HEADS",
    "build_head",
    "head_input",
]
