"""Temperature scaling (Guo et al. 2017, "On calibration of modern neural networks"; [Patel, Ch. 6]
Sec. 6.5.8 and Fig. 6.2, "we estimated the temperature on a holdout set (20% of the test set)";
[NED, Sec. 1.2]): ``p = softmax(logits / T)`` with one ``T > 0`` fitted by NLL on held-out logits.
``T = exp(log_T)`` is fitted with L-BFGS (SciPy, torch autograd gradient); the NLL is convex in 1/T.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from shiftguard._validation import check_labels, check_positive, check_same_length, check_tensor
from shiftguard.heads._optim import minimize_lbfgs
from shiftguard.heads.base import LogitHead, _compute_dtype

__all__ = ["TemperatureScaling", "fit_temperature"]


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, max_iter: int = 100) -> float:
    """The ``T`` minimising ``mean CE(logits / T, labels)`` (float64 L-BFGS over ``log T`` from 0)."""
    logits = logits.detach().double()
    labels = labels.to(logits.device)
    params, _, _ = minimize_lbfgs(
        lambda p: F.cross_entropy(logits * torch.exp(-p[0]), labels),
        torch.zeros(1, dtype=torch.float64),
        max_iter=max_iter,
    )
    log_t = params[0]
    return float(torch.exp(log_t.detach()))


class TemperatureScaling(LogitHead):
    """Calibrate any logit model with one temperature.

    Args:
        logit_fn: maps inputs to logits ``(N, C)`` (e.g. ``LogisticRegressionHead().decision_function``
            or a model's classifier). When None, the inputs given to ``fit``/``predict_proba`` *are*
            the logits (``input = "logits"``, as the registered ``"temperature"`` head reads them).
        num_classes: optional check of the logit width.

    ``fit(x, labels, val_x=None, val_labels=None)``: T is fitted on ``val_*`` when given (the
    held-out split of Guo et al.; ``x`` and ``labels`` may then be None), otherwise on
    ``(x, labels)``, which should then be held-out data (``needs_validation``: an evaluation fits
    it on its validation set only). Learned state: ``temperature_``, ``num_classes_``, ``classes_``.
    """

    _param_names = ("logit_fn", "num_classes")
    _shared_params = ("logit_fn",)
    uses_validation = True
    needs_validation = True

    def __init__(
        self,
        logit_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        num_classes: Optional[int] = None,
        max_iter: int = 100,
    ):
        super().__init__(num_classes)
        self.logit_fn = logit_fn
        self.max_iter = max_iter

    def _validate_params(self) -> None:
        super()._validate_params()
        if self.logit_fn is not None and not callable(self.logit_fn):
            raise TypeError(f"logit_fn: expected a callable or None, got {type(self.logit_fn).__name__}")
        check_positive(self.max_iter, "max_iter", integer=True)

    def _logits(self, x, name: str) -> torch.Tensor:
        x = check_tensor(x, name, ndim=2, floating=True, finite=True)
        logits = self.logit_fn(x) if self.logit_fn is not None else x
        logits = _compute_dtype(check_tensor(logits, f"logit_fn({name})", ndim=2, floating=True, finite=True))
        if self.num_classes is not None and logits.shape[1] != self.num_classes:
            raise ValueError(f"{name}: logits have {logits.shape[1]} columns, num_classes={self.num_classes}")
        return logits

    def fit(self, train_embeddings, train_labels, val_embeddings=None, val_labels=None):
        self._validate_params()
        if (val_embeddings is None) != (val_labels is None):
            raise ValueError("val_embeddings and val_labels: give both or neither")
        x, y, name = (
            (val_embeddings, val_labels, "val_embeddings")
            if val_embeddings is not None
            else (train_embeddings, train_labels, "train_embeddings")
        )
        logits = self._logits(x, name)
        y = check_labels(y, name.replace("embeddings", "labels"), num_classes=logits.shape[1])
        check_same_length([(name, logits), ("labels", y)])
        if logits.shape[0] == 0:
            raise ValueError(f"{name}: expected a non-empty tensor")
        self.temperature_ = fit_temperature(logits, y, self.max_iter)
        self._set_classes(logits.shape[1], logits.device)
        return self

    def predict_proba(self, embeddings) -> torch.Tensor:
        """``softmax(logits / T)``, ``(N, C)``."""
        self._check_is_fitted()
        logits = self._logits(embeddings, "embeddings")
        if logits.shape[1] != self.num_classes_:
            raise ValueError(f"embeddings: logits have {logits.shape[1]} columns, fitted with {self.num_classes_}")
        return torch.softmax(logits / self.temperature_, dim=1)
