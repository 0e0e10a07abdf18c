"""LeNet-5 (LeCun et al., 1998) with a swappable activation, for 28x28 or 32x32 inputs.

[QACT, Sec. 4] evaluates an "(overparametrized) LeNet" on MNIST-C; ``width`` multiplies the
channel and hidden sizes to get that over-parametrised variant.
Shapes: ``(N, in_channels, H, W)`` with H, W >= 16 -> embeddings ``(N, embedding_dim)``.
"""

from __future__ import annotations

import torch
from torch import nn

from shiftguard.nn import AdaptiveAvgPool2d, MaxPool2d

from ._base import EmbeddingClassifier, check_activation, check_activation_kwargs, check_channels
from ._base import activation as make_act

__all__ = ["LeNet5"]


class LeNet5(EmbeddingClassifier):
    """conv5-act-pool, conv5-act-pool, fc-act, fc-act (embedding), linear classifier.

    The pools are ``shiftguard.nn``'s subclasses of torch's (the same results, faster on the CPU:
    :mod:`shiftguard.nn.pool`). ``activation_kwargs`` go to every activation
    (:func:`shiftguard.nn.make_activation`, e.g. ``{"bandwidth": 0.5}`` for ``qact``)."""

    def __init__(
        self,
        activation: str = "relu",
        num_classes: int = 10,
        in_channels: int = 1,
        embedding_dim: int = 84,
        width: int = 1,
        activation_kwargs: dict | None = None,
    ):
        super().__init__()
        check_channels(in_channels, num_classes)
        self.activation = check_activation(activation)
        self.activation_kwargs = kw = check_activation_kwargs(activation_kwargs)
        if width < 1:
            raise ValueError(f"width: expected an integer >= 1, got {width}")
        c1, c2, h = 6 * width, 16 * width, 120 * width
        self.features = nn.Sequential(
            # padding=2 keeps the classic 32x32 geometry for 28x28 MNIST digits.
            nn.Conv2d(in_channels, c1, 5, padding=2),
            make_act(self.activation, c1, kw),
            MaxPool2d(2),
            nn.Conv2d(c1, c2, 5),
            make_act(self.activation, c2, kw),
            MaxPool2d(2),
            # 28x28 gives 5x5 here already; 32x32 gives 6x6: pool to the classic 5x5.
            AdaptiveAvgPool2d(5),
            nn.Flatten(),
        )
        self.fc = nn.Sequential(
            nn.Linear(c2 * 25, h),
            make_act(self.activation, h, kw),
            nn.Linear(h, embedding_dim),
            make_act(self.activation, embedding_dim, kw),
        )
        self.embedding_dim = int(embedding_dim)
        self.classifier = nn.Linear(self.embedding_dim, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))
