"""The model's own classifier as a head: ``p = softmax(logits)``, nothing fitted.

The inputs of this head are the model's logits ``(N, C)``, not embeddings: it is the baseline
every calibration method is compared with ([NED, Sec. 3]: "softmax" rows; [QACT, Sec. 4]).
"""

from __future__ import annotations

import torch

from shiftguard._validation import check_tensor
from shiftguard.heads.base import EmbeddingHead

__all__ = ["SoftmaxHead"]


class SoftmaxHead(EmbeddingHead):
    """``softmax(logits)`` of a trained classifier; ``fit`` only records the number of classes.

    Learned state: ``num_classes_`` (the logit width seen by ``fit``, or by the first
    ``predict_proba`` when ``fit`` was skipped).
    """

    def fit(self, train_logits, train_labels=None, val_logits=None, val_labels=None):
        self._no_validation(val_logits, val_labels, "val_logits")
        logits = check_tensor(train_logits, "train_logits", ndim=2, floating=True, finite=True)
        self.num_classes_ = logits.shape[1]
        if self.num_classes is not None and self.num_classes_ != self.num_classes:
            raise ValueError(f"train_logits: {self.num_classes_} columns, num_classes={self.num_classes}")
        return self

    def predict_proba(self, logits) -> torch.Tensor:
        """``softmax(logits)`` in float32 (float64 input stays float64), ``(N, C)``."""
        logits = check_tensor(logits, "logits", ndim=2, floating=True, finite=True)
        expected = getattr(self, "num_classes_", self.num_classes)
        if expected is not None and logits.shape[1] != expected:
            raise ValueError(f"logits: {logits.shape[1]} columns, expected {expected}")
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return torch.softmax(logits.to(dtype), dim=1)
