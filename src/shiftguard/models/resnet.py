"""ResNet-18, CIFAR variant (He et al., 2016): 3x3 stem, no initial max-pool, 4 stages of 2
basic blocks, global average pooling. ~11.2M parameters for 10 classes, as [QACT, Sec. 4] states.

Shapes: ``(N, in_channels, H, W)`` -> embeddings ``(N, 512)`` (or ``embedding_dim`` through a
linear projection).
"""

from __future__ import annotations

import torch
from torch import nn

from ._base import EmbeddingClassifier, check_activation, check_activation_kwargs, check_channels, norm_activation
from ._base import activation as make_act

__all__ = ["BasicBlock", "ResNet", "resnet18"]


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int, act: str, act_kwargs: dict | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.act1 = norm_activation(act, planes, kwargs=act_kwargs)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        # The block's output activation acts on the sum, so it carries no BatchNorm of its own
        # (qact and its twins bring their BN-act-BN block, the same one in both).
        self.act2 = make_act(act, planes, act_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act1(self.conv1(x))
        out = self.bn2(self.conv2(out))
        return self.act2(out + self.shortcut(x))


class ResNet(EmbeddingClassifier):
    def __init__(
        self,
        blocks: tuple[int, ...] = (2, 2, 2, 2),
        activation: str = "relu",
        num_classes: int = 10,
        in_channels: int = 3,
        embedding_dim: int | None = None,
        base_width: int = 64,
        activation_kwargs: dict | None = None,
    ):
        super().__init__()
        check_channels(in_channels, num_classes)
        self.activation = check_activation(activation)
        self.activation_kwargs = kw = check_activation_kwargs(activation_kwargs)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, base_width, 3, 1, 1, bias=False),
            norm_activation(self.activation, base_width, kwargs=kw),
        )
        stages, in_planes = [], base_width
        for i, n in enumerate(blocks):
            planes = base_width * 2**i
            for j in range(n):
                stages.append(BasicBlock(in_planes, planes, 2 if (i > 0 and j == 0) else 1, self.activation, kw))
                in_planes = planes
        self.stages = nn.Sequential(*stages)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projection, self.embedding_dim = self._projection(in_planes, embedding_dim)
        self.classifier = nn.Linear(self.embedding_dim, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.pool(self.stages(self.stem(x))))


def resnet18(**kw) -> ResNet:
    return ResNet((2, 2, 2, 2), **kw)
