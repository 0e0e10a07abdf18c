"""DenseNet-121 (Huang et al., 2017), CIFAR variant: 3x3 stem, bottleneck dense layers
(BN-act-conv1x1-BN-act-conv3x3), transitions with compression 0.5, blocks (6, 12, 24, 16).

``growth_rate`` is configurable: 32 is the ImageNet DenseNet-121 (~7M parameters); 12 gives
the ~1M-parameter network [QACT, Sec. 4] uses.
Shapes: ``(N, in_channels, H, W)`` -> embeddings ``(N, num_features)`` (or ``embedding_dim``).
"""

from __future__ import annotations

import torch
from torch import nn

from ._base import EmbeddingClassifier, check_activation, check_activation_kwargs, check_channels, norm_activation

__all__ = ["DenseNet", "densenet121"]


class DenseLayer(nn.Module):
    def __init__(self, in_ch: int, growth: int, act: str, bn_size: int = 4, act_kwargs: dict | None = None):
        super().__init__()
        self.body = nn.Sequential(
            norm_activation(act, in_ch, kwargs=act_kwargs),
            nn.Conv2d(in_ch, bn_size * growth, 1, bias=False),
            norm_activation(act, bn_size * growth, kwargs=act_kwargs),
            nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.body(x)], 1)


class Transition(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int, act: str, act_kwargs: dict | None = None):
        super().__init__(
            norm_activation(act, in_ch, kwargs=act_kwargs), nn.Conv2d(in_ch, out_ch, 1, bias=False), nn.AvgPool2d(2)
        )


class DenseNet(EmbeddingClassifier):
    def __init__(
        self,
        blocks: tuple[int, ...] = (6, 12, 24, 16),
        growth_rate: int = 32,
        activation: str = "relu",
        num_classes: int = 10,
        in_channels: int = 3,
        embedding_dim: int | None = None,
        compression: float = 0.5,
        activation_kwargs: dict | None = None,
    ):
        super().__init__()
        check_channels(in_channels, num_classes)
        if growth_rate <= 0:
            raise ValueError(f"growth_rate: expected a positive integer, got {growth_rate}")
        self.activation = check_activation(activation)
        self.activation_kwargs = kw = check_activation_kwargs(activation_kwargs)
        c = 2 * growth_rate
        layers: list[nn.Module] = [nn.Conv2d(in_channels, c, 3, padding=1, bias=False)]
        for i, n in enumerate(blocks):
            for _ in range(n):
                layers.append(DenseLayer(c, growth_rate, self.activation, act_kwargs=kw))
                c += growth_rate
            if i < len(blocks) - 1:
                out = int(c * compression)
                layers.append(Transition(c, out, self.activation, kw))
                c = out
        layers += [norm_activation(self.activation, c, kwargs=kw), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.projection, self.embedding_dim = self._projection(c, embedding_dim)
        self.classifier = nn.Linear(self.embedding_dim, num_classes)


def densenet121(**kw) -> DenseNet:
    return DenseNet((6, 12, 24, 16), **kw)
