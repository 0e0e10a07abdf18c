"""Adapter exposing ``shiftguard.nn.QuantileClassifier`` (000 Sec. 3, the calibrated quantile
classifier fitted "on the train embedding") through the head interface.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from shiftguard.heads.base import EmbeddingHead
from shiftguard.nn import QuantileClassifier

__all__ = ["QuantileClassifierHead"]


class QuantileClassifierHead(EmbeddingHead):
    """Quantile classifier (000) on embeddings.

    Args:
        num_classes: number of classes; inferred when None.
        classifier_kwargs: keyword arguments for ``QuantileClassifier(in_features, num_classes, **kw)``.
        fit_kwargs: keyword arguments for ``QuantileClassifier.fit_embeddings(emb, labels, **kw)``.

    Learned state: ``classifier_`` (the fitted ``QuantileClassifier``), ``num_classes_``.
    """

    _param_names = ("num_classes", "classifier_kwargs", "fit_kwargs")

    def __init__(self, num_classes: Optional[int] = None, classifier_kwargs: Optional[dict[str, Any]] = None,
                 fit_kwargs: Optional[dict[str, Any]] = None):
        super().__init__(num_classes)
        self.classifier_kwargs = dict(classifier_kwargs or {})
        self.fit_kwargs = dict(fit_kwargs or {})

    def fit(self, train_embeddings, train_labels, val_embeddings=None, val_labels=None):
        emb, y, num_classes = self._check_fit_inputs(train_embeddings, train_labels)
        clf = QuantileClassifier(emb.shape[1], num_classes, **self.classifier_kwargs).to(emb.device)
        clf.fit_embeddings(emb, y, **self.fit_kwargs)
        self.classifier_ = clf
        self.in_features_ = emb.shape[1]
        self.num_classes_ = num_classes
        return self

    def predict_proba(self, embeddings) -> torch.Tensor:
        """``(N, C)`` rows on the simplex: the one-vs-rest probabilities renormalised to sum 1
        (for NLL and other metrics that need a distribution; the arg-max is unchanged)."""
        self._check_is_fitted()
        emb = self._check_query(embeddings, self.in_features_)
        if emb.shape[0] == 0:  # an empty query has an empty answer (QACT needs a non-empty context)
            return torch.zeros(0, self.num_classes_, dtype=emb.dtype, device=emb.device)
        with torch.no_grad():
            probs = self.classifier_.predict_proba(emb)
        return probs

    def predict_one_vs_rest(self, embeddings) -> torch.Tensor:
        """``(N, C)`` one-vs-rest probabilities, one per class, as the quantile classifier outputs
        them (000 Sec. 3; rows need not sum to 1). These are what 000 calibrates and reports:
        measure them with ``metrics.ece(..., one_vs_rest=True)``."""
        self._check_is_fitted()
        emb = self._check_query(embeddings, self.in_features_)
        if emb.shape[0] == 0:
            return torch.zeros(0, self.num_classes_, dtype=emb.dtype, device=emb.device)
        with torch.no_grad():
            return self.classifier_.class_scores(emb)
