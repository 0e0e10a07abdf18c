"""Confidence heads: fitted on clean data, they return calibrated class probabilities for new,
possibly shifted, inputs.

Every head follows ``fit(train_x, train_labels, val_x=None, val_labels=None) -> self``,
``predict_proba(x) -> (N, C)``, ``predict(x) -> (N,)``, and declares its contract as class
attributes (:class:`Head`): ``input`` (``"logits"`` for :class:`LogitHead`, ``"embeddings"`` for
:class:`EmbeddingHead`), ``needs_support``, ``uses_validation``, ``needs_validation``. As
scikit-learn's estimators, a head keeps its ``__init__`` arguments unchanged and checks them in
``fit``, has ``get_params`` / ``set_params`` and ``classes_`` after fit; :func:`clone` gives an
unfitted copy. See ``docs/heads_metrics.md``.
"""

from shiftguard.heads.base import HEAD_INPUTS, EmbeddingHead, Head, LogitHead, NotFittedError, clone
from shiftguard.heads.distance_ratio import DistanceRatioHead
from shiftguard.heads.knn_baselines import KNNVote, OneNN, WeightedKNN
from shiftguard.heads.logistic import LogisticRegressionHead
from shiftguard.heads.ned import NED
from shiftguard.heads.quantile import QuantileClassifierHead, fit_quantile_classifier
from shiftguard.heads.registry import (
    EMBEDDING_HEADS,
    HEAD_NAMES,
    LOGIT_HEADS,
    build_head,
    head_class,
    head_input,
)
from shiftguard.heads.softmax import SoftmaxHead
from shiftguard.heads.temperature import TemperatureScaling
from shiftguard.neighbors import knn_search  # re-exported: the search the kNN heads use

__all__ = [
    "Head",
    "EmbeddingHead",
    "LogitHead",
    "HEAD_INPUTS",
    "NotFittedError",
    "clone",
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
    "head_class",
    "head_input",
]
