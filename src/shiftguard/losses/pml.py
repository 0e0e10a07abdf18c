"""Standard metric-learning losses from pytorch-metric-learning behind the ``(embeddings, labels)`` interface.

Thin wrappers: the maths is pytorch-metric-learning's (v2.9); we only add input validation and a uniform
constructor.  Proxy/classifier parameters live inside the wrapped module, so ``loss.parameters()`` must be
given to the optimiser (as for every loss with learnable parameters in :mod:`shiftguard.losses`).

* ``cross_entropy`` -- a linear classifier ``nn.Linear(embedding_dim, num_classes)`` (built by
  ``CrossEntropyLoss(num_classes=..., embedding_dim=...)``) on top of the
  embeddings followed by ``F.cross_entropy``; the classifier is part of the loss module.
* ``triplet`` -- ``TripletMarginLoss(margin)`` on triplets mined by ``TripletMarginMiner`` (semihard by
  default).
* ``proxy_nca`` -- ``ProxyNCALoss`` (default ``softmax_scale=1``).
* ``proxy_nca_pp`` -- the ProxyNCA++ loss (Teh et al. 2020, Sec. 3-4): L2-normalised embeddings and
  proxies, squared Euclidean distance, the positive proxy *in* the softmax denominator and
  temperature ``T = 1/9``: ``-log softmax_c(-||x^ - p^_c||^2 / T)[y]``. That is exactly
  pytorch-metric-learning's ``ProxyNCALoss(softmax_scale=1/T)`` (its NCA softmax includes the
  positive; its ``LpDistance(power=2)`` normalises both sides), so the maths stays PML's. ProxyNCA++'s
  other ingredients are training choices, not loss terms: fast-moving proxies (give
  ``loss.parameters()`` a much larger learning rate than the network; the authors use 4e2 vs 4e-3),
  global max pooling and layer norm in the backbone.
* ``proxy_anchor`` -- ``ProxyAnchorLoss(margin=0.1, alpha=32)``.
* ``normface`` -- ``NormalizedSoftmaxLoss(temperature=0.05)``.
* ``supcon`` -- ``SupConLoss(temperature=0.1)``.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from torch import nn

from shiftguard._deprecation import positional_dims
from shiftguard._validation import check_positive
from shiftguard.losses.base import EmbeddingLoss

__all__ = ["PMLLoss", "CrossEntropyLoss", "make_pml_loss", "PML_LOSSES"]


class PMLLoss(EmbeddingLoss):
    """Wrap a pytorch-metric-learning loss (and optional miner) as ``loss(embeddings, labels) -> scalar``."""

    def __init__(
        self,
        loss: nn.Module,
        miner: Optional[nn.Module] = None,
        num_classes: Optional[int] = None,
        embedding_dim: Optional[int] = None,
        *,
        validate_args: bool = True,
    ):
        super().__init__(validate_args=validate_args)
        self.loss = loss
        self.miner = miner
        self.num_classes = num_classes
        self.embedding_dim = embedding_dim

    def compute(self, embeddings, labels):
        if self.embedding_dim is not None and embeddings.shape[1] != self.embedding_dim:
            raise ValueError(
                f"embeddings: expected {self.embedding_dim} features (embedding_dim), got {embeddings.shape[1]}"
            )
        if self.validate_args and self.num_classes is not None and int(labels.max()) >= self.num_classes:
            raise ValueError(f"labels: must be < num_classes={self.num_classes}, got {int(labels.max())}")
        if self.miner is not None:
            return self.loss(embeddings, labels, self.miner(embeddings, labels))
        return self.loss(embeddings, labels)


class CrossEntropyLoss(EmbeddingLoss):
    """Softmax cross-entropy through a linear classifier over the embeddings (owned by the loss).

    ``CrossEntropyLoss(*, num_classes, embedding_dim)``: the classifier is
    ``nn.Linear(embedding_dim, num_classes)``. The dimensions are keyword-only; the former positional
    form ``CrossEntropyLoss(embedding_dim, num_classes)`` still works for one release (read in that
    order) and emits a ``DeprecationWarning`` asking for the keywords.
    """

    def __init__(
        self,
        *args: int,
        num_classes: Optional[int] = None,
        embedding_dim: Optional[int] = None,
        validate_args: bool = True,
    ):
        super().__init__(validate_args=validate_args)
        num_classes, embedding_dim = positional_dims(
            "CrossEntropyLoss(num_classes=..., embedding_dim=...)", args, num_classes, embedding_dim
        )
        num_classes, embedding_dim = _need(num_classes, embedding_dim, "cross_entropy")
        self.classifier = nn.Linear(embedding_dim, num_classes)

    def extra_repr(self) -> str:
        return f"num_classes={self.classifier.out_features}, embedding_dim={self.classifier.in_features}"

    def compute(self, embeddings, labels):
        if embeddings.shape[1] != self.classifier.in_features:
            raise ValueError(
                f"embeddings: expected {self.classifier.in_features} features (embedding_dim), "
                f"got {embeddings.shape[1]}"
            )
        if self.validate_args and int(labels.max()) >= self.classifier.out_features:
            raise ValueError(f"labels: must be < num_classes={self.classifier.out_features}, got {int(labels.max())}")
        w = self.classifier.weight.to(embeddings.dtype)
        b = self.classifier.bias.to(embeddings.dtype)
        return F.cross_entropy(F.linear(embeddings, w, b), labels)


def _need(num_classes, embedding_dim, name) -> tuple[int, int]:
    """``(num_classes, embedding_dim)``, both given and positive integers."""
    if num_classes is None or embedding_dim is None:
        raise ValueError(f"num_classes and embedding_dim: both are required for loss {name!r}")
    check_positive(num_classes, "num_classes", integer=True)
    check_positive(embedding_dim, "embedding_dim", integer=True)
    return num_classes, embedding_dim


def make_pml_loss(
    name: str, *args: Optional[int], num_classes: Optional[int] = None, embedding_dim: Optional[int] = None, **kw
):
    """Build one of :data:`PML_LOSSES` by name (``validate_args`` goes to the wrapper, the other
    keywords to the pytorch-metric-learning loss). ``num_classes`` and ``embedding_dim`` are
    keyword-only; the former positional ``(embedding_dim, num_classes)`` still works for one release,
    with a ``DeprecationWarning``."""
    num_classes, embedding_dim = positional_dims(
        "make_pml_loss(name, num_classes=..., embedding_dim=...)", args, num_classes, embedding_dim
    )
    validate_args = kw.pop("validate_args", True)
    if name == "cross_entropy":
        num_classes, embedding_dim = _need(num_classes, embedding_dim, name)
        return CrossEntropyLoss(num_classes=num_classes, embedding_dim=embedding_dim, validate_args=validate_args)
    if name == "triplet":
        margin = kw.pop("margin", 0.1)
        miner = pml_miners.TripletMarginMiner(margin=margin, type_of_triplets=kw.pop("type_of_triplets", "semihard"))
        return PMLLoss(pml_losses.TripletMarginLoss(margin=margin, **kw), miner, validate_args=validate_args)
    if name == "supcon":
        return PMLLoss(pml_losses.SupConLoss(temperature=kw.pop("temperature", 0.1), **kw), validate_args=validate_args)
    _need(num_classes, embedding_dim, name)
    if name == "proxy_nca":
        loss = pml_losses.ProxyNCALoss(num_classes, embedding_dim, **kw)
    elif name == "proxy_nca_pp":
        temperature = kw.pop("temperature", 1.0 / 9.0)
        check_positive(temperature, "temperature")
        loss = pml_losses.ProxyNCALoss(num_classes, embedding_dim, softmax_scale=1.0 / temperature, **kw)
    elif name == "proxy_anchor":
        loss = pml_losses.ProxyAnchorLoss(
            num_classes, embedding_dim, margin=kw.pop("margin", 0.1), alpha=kw.pop("alpha", 32), **kw
        )
    elif name == "normface":
        loss = pml_losses.NormalizedSoftmaxLoss(
            num_classes, embedding_dim, temperature=kw.pop("temperature", 0.05), **kw
        )
    else:  # pragma: no cover - guarded by the registry
        raise ValueError(f"name: unknown pytorch-metric-learning loss {name!r}")
    return PMLLoss(loss, num_classes=num_classes, embedding_dim=embedding_dim, validate_args=validate_args)


PML_LOSSES = ("cross_entropy", "triplet", "proxy_nca", "proxy_nca_pp", "proxy_anchor", "normface", "supcon")
