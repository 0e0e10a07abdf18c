"""VGG-11 / VGG-16 with BatchNorm (Simonyan & Zisserman, 2015), CIFAR-style head.

The five max-pools use ``ceil_mode`` so 28x28 inputs (MNIST) reach 1x1 like 32x32 ones.
VGG-16-BN has ~14.7M parameters for 10 classes ([QACT, Sec. 4] quotes "15M").
Shapes: ``(N, in_channels, H, W)`` -> embeddings ``(N, 512)`` (or ``embedding_dim``).
"""

from __future__ import annotations

from torch import nn

from shiftguard.nn import AdaptiveAvgPool2d, MaxPool2d

from ._base import EmbeddingClassifier, check_activation, check_activation_kwargs, check_channels, norm_activation

__all__ = ["VGG", "CONFIGS", "vgg11", "vgg16"]

CONFIGS: dict[str, list] = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}


class VGG(EmbeddingClassifier):
    def __init__(
        self,
        depth: str = "vgg16",
        activation: str = "relu",
        num_classes: int = 10,
        in_channels: int = 3,
        embedding_dim: int | None = None,
        activation_kwargs: dict | None = None,
    ):
        super().__init__()
        check_channels(in_channels, num_classes)
        if depth not in CONFIGS:
            raise ValueError(f"depth: expected one of {sorted(CONFIGS)}, got {depth!r}")
        self.activation = check_activation(activation)
        self.activation_kwargs = kw = check_activation_kwargs(activation_kwargs)
        layers: list[nn.Module] = []
        c = in_channels
        for v in CONFIGS[depth]:
            if v == "M":
                layers.append(MaxPool2d(2, ceil_mode=True))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1, bias=False), norm_activation(self.activation, v, kwargs=kw)]
                c = v
        self.features = nn.Sequential(*layers, AdaptiveAvgPool2d(1), nn.Flatten())
        self.projection, self.embedding_dim = self._projection(c, embedding_dim)
        self.classifier = nn.Linear(self.embedding_dim, num_classes)


def vgg11(**kw) -> VGG:
    return VGG("vgg11", **kw)


def vgg16(**kw) -> VGG:
    return VGG("vgg16", **kw)
