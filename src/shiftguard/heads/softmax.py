"""The model's own classifier as a head: ``p = softmax(logits)``, nothing fitted.

The inputs of this head are the model's logits ``(N, C)``, not embeddings: it is the baseline
every calibration method is compared with ([NED, Sec. 3]: "softmax" rows; [QACT, Sec. 4]).
"""

from __future__ import annotations

import torch

from shiftguard._validation import check_tensor
from shiftguard.heads.base import LogitHead

__all__ = ["SoftmaxHead"]


class SoftmaxHead(LogitHead):
    """``softmax(logits)`` of a trained classifier; ``fit`` only records the number of classes.

    ``fit(train_logits=None, train_labels=None)``: the width of ``train_logits`` is the number of
    classes; without them, ``num_classes`` is (labels are not read; ``val_*`` are refused).
    Learned state: ``num_classes_``, ``classes_``.
    """

    def fit(self, train_logits=None, train_labels=None, val_logits=None, val_labels=None):
        self._validate_params()
        self._no_validation(val_logits, val_labels, "val_logits")
        if train_logits is None:
            if self.num_classes is None:
                raise ValueError(
                    "train_logits: give the logits (their width is the number of classes) or "
                    "construct the head with num_classes"
                )
            self._set_classes(self.num_classes)
            return self
        logits = check_tensor(train_logits, "train_logits", ndim=2, floating=True, finite=True)
        if self.num_classes is not None and logits.shape[1] != self.num_classes:
            raise ValueError(f"train_logits: {logits.shape[1]} columns, num_classes={self.num_classes}")
        self._set_classes(logits.shape[1], logits.device)
        return self

    def predict_proba(self, logits) -> torch.Tensor:
        """``softmax(logits)`` in float32 (float64 input stays float64), ``(N, C)``."""
        self._check_is_fitted()
        logits = check_tensor(logits, "logits", ndim=2, floating=True, finite=True)
        if logits.shape[1] != self.num_classes_:
            raise ValueError(f"logits: {logits.shape[1]} columns, expected {self.num_classes_}")
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return torch.softmax(logits.to(dtype), dim=1)
