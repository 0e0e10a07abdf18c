"""Architectures with a swappable activation and an ``embed()`` / ``classifier`` split.

``build_model(name, activation="relu", num_classes=10, in_channels=1, **kw)`` is the registry
entry point used by configs and the CLI; every registered model is an
:class:`~shiftguard.models._base.EmbeddingClassifier`. ``name`` may also be a user factory,
``"package.module:factory"`` (see :func:`build_model`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from shiftguard.registry import Registry

from ._base import ACTIVATIONS, EmbeddingClassifier, check_activation_kwargs
from .densenet import DenseNet, densenet121
from .lenet import LeNet5
from .mlp import MLP
from .resnet import ResNet, resnet18
from .vgg import VGG, vgg11, vgg16

__all__ = [
    "ACTIVATIONS",
    "MODELS",
    "EmbeddingClassifier",
    "LeNet5",
    "MLP",
    "ResNet",
    "VGG",
    "DenseNet",
    "resnet18",
    "vgg11",
    "vgg16",
    "densenet121",
    "build_model",
    "build_user_model",
    "model_names",
    "MODEL_REGISTRY",
]

#: The architectures :func:`build_model` builds by name: ``name -> constructor``. Names are matched
#: ignoring case, ``-`` and ``_``; ``lenet5``, ``resnet`` and ``densenet`` are aliases.
MODEL_REGISTRY: Registry[Callable[..., EmbeddingClassifier]] = Registry(
    "model", argument="arch", hint="or a factory 'package.module:function'"
)
MODEL_REGISTRY.register("lenet", LeNet5, aliases=("lenet5",))
MODEL_REGISTRY.register("mlp", MLP)
MODEL_REGISTRY.register("resnet18", resnet18, aliases=("resnet",))
MODEL_REGISTRY.register("vgg11", vgg11)
MODEL_REGISTRY.register("vgg16", vgg16)
MODEL_REGISTRY.register("densenet121", densenet121, aliases=("densenet",))

#: ``name -> constructor`` of :data:`MODEL_REGISTRY` as a dict (a snapshot taken at import:
#: register new architectures with ``MODEL_REGISTRY.register``).
MODELS: dict[str, Callable[..., EmbeddingClassifier]] = MODEL_REGISTRY.as_dict()


def model_names() -> list[str]:
    """The registered architecture names, sorted."""
    return MODEL_REGISTRY.names()


def build_model(
    name: str,
    activation: str = "relu",
    num_classes: int = 10,
    in_channels: int = 1,
    *,
    example_input: Optional[torch.Tensor] = None,
    **kw,
) -> nn.Module:
    """Build a registered architecture by name (see :data:`MODEL_REGISTRY`), or a user factory.

    Registered names: extra keywords go to the constructor (``embedding_dim``, ``width`` for LeNet,
    ``growth_rate`` for DenseNet, ``hidden``/``input_size`` for the MLP, and for every one
    ``activation_kwargs``, the activation's own arguments such as ``{"bandwidth": 0.5}`` for
    ``qact``); an unknown keyword is a ``ValueError``. ``example_input`` is not used by them.
    ``activation="bn-relu-bn"`` (``bn-prelu-bn``, ``bn-selu-bn``) builds the BatchNorm twin of the
    ``activation="qact"`` model (:class:`shiftguard.nn.BNActBlock`).

    ``"package.module:factory"`` (``factory`` may be dotted, ``module:Class.method``): the module is
    imported (the current directory is searched after ``sys.path``, while it is imported and the
    factory runs, so ``mymodels.py`` next to a config works from the console script as from
    ``python -m``) and ``factory`` is called with those of ``num_classes``, ``in_channels`` and
    ``activation`` its signature accepts (all of them where it takes ``**kwargs``), plus ``kw``.
    It must return an ``nn.Module``. When the factory does not take ``activation`` and
    ``activation`` is not ``"relu"`` (the default, meaning "as the factory builds it"), the model's
    activation modules are replaced by :func:`shiftguard.nn.convert_activations` (``to=activation``);
    ``example_input`` (a dummy batch ``(N, C, H, W)`` shaped like the data) is passed to it so that
    the new layers' parameters exist before an optimizer is built: build the optimizer after this
    call. ``activation_kwargs`` in ``kw``, where the factory does not take it and the activations
    are converted, goes to :func:`shiftguard.nn.convert_activations` (e.g. ``{"bandwidth": 0.5}``).
    An embedding loss or head needs the model to have ``embed(x)`` (checked by the caller).

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: an unknown registered name (the message lists the registered names and
            suggests the closest); a spec without one ``:`` between a module and an
            attribute; a module that cannot be imported; a missing attribute; a factory that is not
            callable, rejects ``kw`` or returns something other than an ``nn.Module``; an activation
            to convert to while ``shiftguard.nn.convert_activations`` is unavailable. Each message
            names ``arch`` (the config key) and the spec.
    """
    if isinstance(name, str) and ":" in name:
        return build_user_model(name, activation, num_classes, in_channels, example_input=example_input, **kw)
    constructor = MODEL_REGISTRY.get(name)
    try:
        model = constructor(activation=activation, num_classes=num_classes, in_channels=in_channels, **kw)
    except TypeError as exc:
        raise ValueError(f"model {name!r}: {exc}") from None
    return model


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    """The current directory on ``sys.path`` (last: installed modules of the same name win) for the
    duration: the console script ``shiftguard``, unlike ``python -m``, does not put it there."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)


def _resolve_factory(spec: str, what: str) -> Callable:
    """The callable ``"package.module:attr.path"`` names; errors name ``what`` (the option or key)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"{what} {spec!r}: expected a registered name or 'package.module:factory'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{what} {spec!r}: cannot import module {module_name!r} ({exc}); it must be importable "
            "from sys.path or the current directory"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable factory")
    return obj


def _accepted(factory: Callable, offered: dict) -> dict:
    """The entries of ``offered`` whose names ``factory``'s signature takes."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no introspectable signature: offer nothing implicit
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    takes = {
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {k: v for k, v in offered.items() if k in takes}


def build_user_model(
    spec: str,
    activation: str = "relu",
    num_classes: int = 10,
    in_channels: int = 1,
    *,
    example_input: Optional[torch.Tensor] = None,
    what: str = "arch",
    **kw,
) -> nn.Module:
    """``build_model`` for a factory spec ``"package.module:factory"``; errors name ``what`` (the
    config key or command-line option the spec came from)."""
    with _cwd_importable():
        factory = _resolve_factory(spec, what)
        implicit = _accepted(
            factory, {"num_classes": num_classes, "in_channels": in_channels, "activation": activation}
        )
        converted = "activation" not in implicit and str(activation).lower() != "relu"
        activation_kwargs = None
        if converted and "activation_kwargs" in kw and not _accepted(factory, {"activation_kwargs": None}):
            kw = dict(kw)
            activation_kwargs = kw.pop("activation_kwargs")
        try:  # a TypeError raised inside the factory is the factory's own and keeps its traceback
            inspect.signature(factory).bind(**implicit, **kw)
        except TypeError as exc:
            raise ValueError(
                f"{what} {spec!r}: the factory does not take these arguments ({exc}); "
                f"passed: {', '.join(sorted({**implicit, **kw})) or 'none'}"
            ) from None
        except ValueError:  # no introspectable signature: the call itself checks
            pass
        model = factory(**implicit, **kw)
    if not isinstance(model, nn.Module):
        raise ValueError(f"{what} {spec!r}: the factory returned a {type(model).__name__}, expected a torch.nn.Module")
    if converted:
        try:
            from shiftguard.nn import convert_activations
        except ImportError:
            raise ValueError(
                f"{what} {spec!r}: activation {activation!r} needs shiftguard.nn.convert_activations, "
                "which this installation lacks; use activation = 'relu' or a factory taking "
                "an activation argument"
            ) from None
        try:
            model = convert_activations(
                model,
                to=str(activation).lower(),
                example_input=example_input,
                **check_activation_kwargs(activation_kwargs),
            )
        except (ValueError, TypeError) as exc:  # e.g. an activation name or argument it does not know
            if isinstance(exc, TypeError) and activation_kwargs is None:
                raise
            raise ValueError(f"{what} {spec!r}: activation {activation!r}: {exc}") from None
    return model
