"""A multilayer perceptron on flattened images, with a swappable activation.

Shapes: ``(N, in_channels, input_size, input_size)`` (or ``(N, in_features)``) ->
embeddings ``(N, hidden[-1])``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ._base import EmbeddingClassifier, check_activation, check_activation_kwargs, check_channels
from ._base import activation as make_act

__all__ = ["MLP"]


class MLP(EmbeddingClassifier):
    """Flatten, then ``Linear -> activation`` for each hidden width; the last is the embedding.
    ``activation_kwargs`` go to every activation (:func:`shiftguard.nn.make_activation`)."""

    def __init__(
        self,
        activation: str = "relu",
        num_classes: int = 10,
        in_channels: int = 1,
        input_size: int = 28,
        hidden: Sequence[int] = (256, 128),
        embedding_dim: int | None = None,
        activation_kwargs: dict | None = None,
    ):
        super().__init__()
        check_channels(in_channels, num_classes)
        self.activation = check_activation(activation)
        self.activation_kwargs = check_activation_kwargs(activation_kwargs)
        widths = [int(h) for h in hidden]
        if embedding_dim is not None:
            widths = widths[:-1] + [int(embedding_dim)] if widths else [int(embedding_dim)]
        if not widths or min(widths) <= 0:
            raise ValueError(f"hidden: expected positive widths, got {list(hidden)}")
        layers: list[nn.Module] = [nn.Flatten()]
        d = in_channels * input_size * input_size
        self.in_features = d
        for w in widths:
            layers += [nn.Linear(d, w), make_act(self.activation, w, self.activation_kwargs)]
            d = w
        self.body = nn.Sequential(*layers)
        self.embedding_dim = d
        self.classifier = nn.Linear(d, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and x[0].numel() != self.in_features:
            raise ValueError(f"x: expected {self.in_features} values per sample, got shape {tuple(x.shape)}")
        return self.body(x)
