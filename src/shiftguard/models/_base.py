"""Shared pieces of every architecture: the embed()/classifier contract and activation blocks.

Every model is an :class:`EmbeddingClassifier`: ``embed(x)`` maps images ``(N, C, H, W)`` to
embeddings ``(N, D)`` and ``classifier`` (an ``nn.Linear(D, num_classes)``) maps embeddings to
logits, so ``forward(x) == classifier(embed(x))``. Heads (logistic refit, quantile classifier,
NED, kNN) and embedding losses (watershed, ...) attach to ``embed``; cross-entropy uses
``forward``.

Activations are built by name through :func:`shiftguard.nn.make_activation` so that swapping
ReLU for QACT is one keyword ([QACT, Sec. 4]: "replace the usual ReLU activation with QACT"), and
every architecture takes ``activation_kwargs`` for the activation's own arguments (e.g.
``{"bandwidth": 0.5}`` for ``qact``). ``bn-relu-bn`` (``bn-prelu-bn``, ``bn-selu-bn``) builds the
BatchNorm twin of the ``qact`` model: the same module structure, each QACT block replaced by
:class:`shiftguard.nn.BNActBlock` (``docs/qact.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
from torch import nn

from shiftguard.nn import ACTIVATION_NAMES, BN_BLOCK_ACTIVATIONS, make_activation
from shiftguard.nn.qact import ACTIVATION_REGISTRY

ACTIVATIONS = ACTIVATION_NAMES  # the names shiftguard.nn.make_activation builds

__all__ = [
    "ACTIVATIONS",
    "EmbeddingClassifier",
    "activation",
    "norm_activation",
    "check_activation",
    "check_activation_kwargs",
]


def check_activation(name: str) -> str:
    """The canonical name of activation ``name`` (case, ``-`` and ``_`` ignored)."""
    if not isinstance(name, str) or name not in ACTIVATION_REGISTRY:
        raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {name!r}")
    return ACTIVATION_REGISTRY.canonical(name)


def check_activation_kwargs(kwargs: Optional[Mapping]) -> dict:
    """``activation_kwargs`` of an architecture as a new dict (None: no arguments)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"activation_kwargs: expected a dict of keyword arguments or None, got {kwargs!r}")
    return dict(kwargs)


def activation(name: str, num_features: int, kwargs: Optional[Mapping] = None) -> nn.Module:
    """The activation ``name`` for ``num_features`` channels/features, built with ``kwargs``
    (an architecture's ``activation_kwargs``).

    ``qact`` gives the BN-QACT-BN block of [QACT, Remark after Alg. 2] ("we prepend and append the
    quantile activation with BatchNorm layers"), ``bn-relu-bn`` its BatchNorm twin, built by
    ``shiftguard.nn.make_activation``.
    """
    return make_activation(check_activation(name), num_features, **check_activation_kwargs(kwargs))


def norm_activation(name: str, num_features: int, dim: int = 2, kwargs: Optional[Mapping] = None) -> nn.Module:
    """BatchNorm followed by the activation, as in conv-BN-act stacks.

    For ``qact`` and its twins (``bn-relu-bn``, ...) the block from :func:`activation` already starts
    with a BatchNorm, so no extra one is prepended (BN-BN would be a no-op pair that only costs
    time), and the ``qact`` model and its twin have their BatchNorm layers in the same places.
    """
    name = check_activation(name)
    if name in BN_BLOCK_ACTIVATIONS:
        return activation(name, num_features, kwargs)
    bn = nn.BatchNorm2d(num_features) if dim == 2 else nn.BatchNorm1d(num_features)
    return nn.Sequential(bn, activation(name, num_features, kwargs))


class EmbeddingClassifier(nn.Module):
    """Base class: ``forward(x) = classifier(embed(x))``.

    Subclasses set ``self.activation``, ``self.embedding_dim`` and ``self.classifier``; the default
    :meth:`embed` is ``projection(features(x))`` (VGG, DenseNet), others override it.
    """

    activation: str
    activation_kwargs: dict
    embedding_dim: int
    classifier: nn.Linear
    features: nn.Module
    projection: nn.Module

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.features(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embed(x))

    def extra_repr(self) -> str:
        kwargs = getattr(self, "activation_kwargs", None)
        extra = f", activation_kwargs={kwargs!r}" if kwargs else ""
        return f"activation={self.activation!r}{extra}, embedding_dim={self.embedding_dim}"

    @staticmethod
    def _projection(in_dim: int, embedding_dim: int | None) -> tuple[nn.Module, int]:
        """Optional linear projection of the pooled features to ``embedding_dim``."""
        if embedding_dim is None or embedding_dim == in_dim:
            return nn.Identity(), in_dim
        if int(embedding_dim) <= 0:
            raise ValueError(f"embedding_dim: expected a positive integer, got {embedding_dim}")
        return nn.Linear(in_dim, int(embedding_dim)), int(embedding_dim)


def check_channels(in_channels: int, num_classes: int) -> None:
    if not isinstance(in_channels, int) or in_channels <= 0:
        raise ValueError(f"in_channels: expected a positive integer, got {in_channels!r}")
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes: expected an integer >= 2, got {num_classes!r}")
