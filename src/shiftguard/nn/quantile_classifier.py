"""Quantile classifier ([QACT, Sec. 3] "Quantile Classifier"): Linear -> QACT -> per-class probability.

QACT returns values in [0, 1] that are read as one-vs-rest class probabilities. Two changes from a
softmax classifier [QACT, Sec. 3]: (i) binary cross-entropy per class (one-vs-rest) instead of
softmax + NLL; (ii) the class imbalance of one-vs-rest labels is compensated by weighting the
positives with ``(K - 1) / K`` and the negatives with ``1 / K`` (0.9 / 0.1 for K = 10 classes).

Context: the QACT inside needs a context at prediction time. In the default ``"batch"`` mode the
evaluated batch is the context -- how the paper evaluates ("train the Quantile Classifier on the train
embedding and evaluate it on test/corrupted embedding") -- so the *evaluation batch size matters*:
``predict_proba(x, batch_size=None)`` uses all of ``x`` as one context, a ``batch_size`` splits it
into contexts of that size. ``context="frozen"`` instead uses the statistics of the training
embeddings (stored by ``shiftguard.heads.fit_quantile_classifier`` at the end of training), so single
samples can be scored.

This module is the model (forward pass and loss); training it on embeddings is
``shiftguard.heads.fit_quantile_classifier`` (used by ``shiftguard.heads.QuantileClassifierHead``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard._validation import check_labels, check_positive, check_tensor
from shiftguard.nn.qact import QuantileActivation

__all__ = ["QuantileClassifier", "quantile_classifier_loss"]


def quantile_classifier_loss(probs: torch.Tensor, labels: torch.Tensor, n_tau: int = 100) -> torch.Tensor:
    """Class-weighted one-vs-rest BCE of [QACT, Sec. 3] (mean over all ``N * K`` entries).

    ``loss = mean_{i,k} w_ik * BCE(p~_ik, 1[y_i = k])`` with ``w = (K-1)/K`` for the positive entry
    and ``1/K`` for the negatives. The step outputs of QACT include exactly 0 and 1, where BCE is
    infinite, so it is evaluated at the continuity-corrected level ``p~ = (n_tau p + 1/2) / (n_tau + 1)``
    (strictly inside (0, 1), same ordering, gradient preserved).

    Args:
        probs: ``(N, K)`` per-class probabilities in [0, 1] (the classifier's forward output).
        labels: ``(N,)`` int labels in ``[0, K)``.
    """
    probs = check_tensor(probs, "probs", ndim=2, floating=True, finite=True)
    if probs.numel() and (float(probs.detach().min()) < 0 or float(probs.detach().max()) > 1):
        raise ValueError("probs: expected per-class probabilities in [0, 1] (the classifier output, not logits)")
    k = probs.shape[1]
    labels = check_labels(labels, "labels", num_classes=k, n=probs.shape[0]).to(probs.device)
    target = F.one_hot(labels, k).to(probs.dtype)
    weight = torch.where(target > 0, torch.full_like(target, (k - 1) / k), torch.full_like(target, 1.0 / k))
    if k == 1:
        weight = torch.ones_like(target)
    p = (probs * n_tau + 0.5) / (n_tau + 1)
    return F.binary_cross_entropy(p, target, weight=weight, reduction="mean")


class QuantileClassifier(nn.Module):
    """Linear -> QACT over the batch -> ``(N, K)`` one-vs-rest probabilities [QACT, Sec. 3].

    Args:
        in_features: embedding dimension ``D``. num_classes: ``K >= 2``.
        n_tau, c, n_samples: QACT parameters (:class:`QuantileActivation`).
        context: ``"batch"`` (default: the evaluated batch is the context) or ``"frozen"``.

    ``forward(x)`` returns the per-class probabilities (not normalised across classes);
    :meth:`predict_proba` normalises rows to sum 1 (for accuracy/calibration metrics).
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        n_tau: int = 100,
        c: float = 100.0,
        n_samples: int = 1000,
        context: str = "batch",
    ):
        super().__init__()
        check_positive(in_features, "in_features", integer=True)
        check_positive(num_classes, "num_classes", integer=True)
        if num_classes < 2:
            raise ValueError(f"num_classes: expected >= 2, got {num_classes}")
        self.in_features = in_features
        self.num_classes = num_classes
        self.linear = nn.Linear(in_features, num_classes)
        self.qact = QuantileActivation(n_tau=n_tau, c=c, n_samples=n_samples, context=context, num_features=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, K)`` per-class QACT probabilities of ``x (N, D)``, in the parameters' dtype.

        A floating ``x`` of another dtype (float64, float16, bfloat16) is cast to the parameters'
        dtype first, as ``class_scores`` does (gradients flow back to ``x`` in its own dtype); the
        module's precision is set by its parameters (``.double()``, ``.half()``), not by the input.
        Raises ``TypeError`` for a non-floating ``x``, ``ValueError`` for a wrong shape or NaN/inf.
        """
        x = check_tensor(x, "x", ndim=2, floating=True, finite=True, nonempty=True)
        if x.shape[1] != self.in_features:
            raise ValueError(f"x: expected {self.in_features} features, got shape {tuple(x.shape)}")
        return self.qact(self.linear(x.to(self.linear.weight.dtype)))

    def loss(self, probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """:func:`quantile_classifier_loss` of the forward output ``probs`` ``(N, K)``."""
        return quantile_classifier_loss(probs, labels, n_tau=self.qact.n_tau)

    @torch.no_grad()
    def class_scores(self, x, batch_size: Optional[int] = None) -> torch.Tensor:
        """``(N, K)`` per-class QACT probabilities; each chunk of ``batch_size`` rows (all rows when
        None) is one context in ``"batch"`` mode."""
        x = check_tensor(x, "x", ndim=2, floating=True, finite=True, nonempty=True)
        x = x.to(self.linear.weight.device, self.linear.weight.dtype)
        was_training = self.training
        self.eval()
        try:
            if batch_size is None:
                return self(x)
            check_positive(batch_size, "batch_size", integer=True)
            return torch.cat([self(x[s : s + batch_size]) for s in range(0, x.shape[0], batch_size)])
        finally:
            self.train(was_training)

    def predict_proba(self, x, batch_size: Optional[int] = None) -> torch.Tensor:
        """``(N, K)`` class probabilities: the per-class QACT outputs normalised to sum 1 per row
        (a row of zeros becomes uniform). Needed because one-vs-rest outputs need not sum to 1,
        while accuracy/calibration metrics (ECE, NLL, Brier) expect a distribution."""
        p = self.class_scores(x, batch_size)
        s = p.sum(dim=1, keepdim=True)
        uniform = torch.full_like(p, 1.0 / p.shape[1])
        return torch.where(s > 0, p / s.clamp_min(torch.finfo(p.dtype).tiny), uniform)

    def predict(self, x, batch_size: Optional[int] = None) -> torch.Tensor:
        """``(N,)`` int64 labels: argmax of the per-class probabilities."""
        return self.class_scores(x, batch_size).argmax(dim=1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}"
