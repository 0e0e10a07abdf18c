"""Architectures with a swappable activation and an ``embed()`` / ``classifier`` split.

``build_model(name, activation="relu", num_classes=10, in_channels=1, **kw)`` is the registry
entry point used by configs and the CLI; every model is an
:class:`~shiftguard.models._base.EmbeddingClassifier`.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ._base import ACTIVATIONS, EmbeddingClassifier
from .densenet import DenseNet, densenet121
from .lenet import LeNet5
from .mlp import MLP
from .resnet import ResNet, resnet18
from .vgg import VGG, vgg11, vgg16

__all__ = [
    "ACTIVATIONS", "MODELS", "EmbeddingClassifier", "LeNet5", "MLP", "ResNet", "VGG", "DenseNet",
    "resnet18", "vgg11", "vgg16", "densenet121", "build_model", "model_names",
]

MODELS: dict[str, Callable[..., EmbeddingClassifier]] = {
    "lenet": LeNet5,
    "mlp": MLP,
    "resnet18": resnet18,
    "vgg11": vgg11,
    "vgg16": vgg16,
    "densenet121": densenet121,
}


def model_names() -> list[str]:
    return sorted(MODELS)


def build_model(name: str, activation: str = "relu", num_classes: int = 10, in_channels: int = 1, **kw) -> EmbeddingClassifier:
    """Build a registered architecture by name (see :data:`MODELS`).

    Extra keywords go to the constructor (``embedding_dim``, ``width`` for LeNet, ``growth_rate``
    for DenseNet, ``hidden``/``input_size`` for the MLP); an unknown keyword is a ``ValueError``.
    """
    key = str(name).lower().replace("-", "").replace("_", "")
    aliases = {"lenet5": "lenet", "densenet": "densenet121", "resnet": "resnet18"}
    key = aliases.get(key, key)
    if key not in MODELS:
        raise ValueError(f"model: unknown name {name!r}; expected one of {', '.join(model_names())}")
    try:
        model = MODELS[key](activation=activation, num_classes=num_classes, in_channels=in_channels, **kw)
    except TypeError as exc:
        raise ValueError(f"model {name!r}: {exc}") from None
    return model
