"""Put QACT into any model: :func:`convert_activations`; manage its context: :func:`has_qact`,
:func:`set_context`, :func:`qact_context`, :func:`fit_context`.

:func:`convert_activations` mirrors ``nn.SyncBatchNorm.convert_sync_batchnorm``: it replaces every
activation module of a model, in place, by QACT [QACT, Alg. 1-2] -- by default the
BatchNorm -> QACT -> BatchNorm block ([QACT, Remark after Alg. 2], :class:`~shiftguard.nn.QACTBlock`),
which [QACT, Sec. 4] uses to "replace the usual ReLU activation with QACT". ``to="bn-relu-bn"``
(``"bn-prelu-bn"``, ``"bn-selu-bn"``) converts to the BatchNorm twin of that block instead
(:class:`~shiftguard.nn.BNActBlock`): the same BatchNorm layers in the same places, ReLU in place of
QACT, so that the QACT model can be compared with a ReLU model carrying as many BatchNorm layers.

Three things make this harder than a module swap, and are handled here:

- **Channel counts** are not known from an activation module. Each converted module is a
  :class:`ConvertedActivation` that creates its blocks at its first call, with ``num_features`` =
  dim 1 of the ``(N, C, *)`` input (like torch's Lazy modules). Parameters created then are not in an
  optimizer built before, so build the optimizer after materialisation: pass ``example_input`` (one
  forward in eval mode without gradients, which moves no running statistic) or run a forward first.
- **One activation object called at several places** (a ResNet block's ``self.relu`` used twice)
  must get one QACT state per *call site*: the k-th call of a converted module within one forward
  of the model goes to its k-th block. The count restarts at the outermost forward of any module
  that holds it (forward hooks on those modules), so the call order must be static: the same
  activation called a varying number of times (a loop of data-dependent length) gets an error, not
  a silently shared block, and so does a call outside a forward of the converted model
  (``model.forward(x)`` bypasses the hooks; call ``model(x)``). When a shared activation is used by
  two sibling submodules, calling one of them alone counts its calls from the start.
- **Functional activations** (``F.relu(x)``, ``torch.relu(x)``, ``x.relu()``, ``F.gelu``, ...)
  cannot be replaced. They are detected in the first forward (the ``example_input`` one, or the
  model's first call) with a ``TorchFunctionMode`` and named, with file and line, in one
  ``UserWarning``.

QACT normalises over dim 1 ([QACT, Sec. 3] "Extending to standard layers": a channel's context is all
its values in the batch); activations applied to channels-last tensors (a transformer's
``(N, T, D)``) would be given the wrong channel axis.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from shiftguard.nn.qact import (
    ACTIVATION_NAMES,
    ACTIVATION_REGISTRY,
    CONTEXT_MODES,
    TWIN_BASES,
    BNActBlock,
    QACTBlock,
    QuantileActivation,
)

__all__ = [
    "DEFAULT_ACTIVATION_TYPES",
    "ConvertedActivation",
    "convert_activations",
    "fit_context",
    "has_qact",
    "qact_context",
    "set_context",
]

DEFAULT_ACTIVATION_TYPES: tuple[type, ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.RReLU,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Hardswish,
    nn.Softplus,
)

# Functional forms of the activation modules (torch.nn.functional, torch.*, Tensor methods share names).
_FUNCTIONAL_NAMES: dict[str, type] = {
    "relu": nn.ReLU,
    "relu_": nn.ReLU,
    "relu6": nn.ReLU6,
    "leaky_relu": nn.LeakyReLU,
    "leaky_relu_": nn.LeakyReLU,
    "prelu": nn.PReLU,
    "rrelu": nn.RReLU,
    "rrelu_": nn.RReLU,
    "elu": nn.ELU,
    "elu_": nn.ELU,
    "celu": nn.CELU,
    "celu_": nn.CELU,
    "selu": nn.SELU,
    "selu_": nn.SELU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "mish": nn.Mish,
    "hardswish": nn.Hardswish,
    "softplus": nn.Softplus,
}

# Targets without state are shared by all call sites; the others get one module per call site.
_STATELESS = {"relu": nn.ReLU, "selu": nn.SELU}
# The BatchNorm twins of the QACT block: target name -> the activation between the BatchNorm layers.
_TWINS = {f"bn-{base}-bn": base for base in TWIN_BASES}


# --------------------------------------------------------------------------- the converted module
class _SiteDepth(threading.local):
    depth = 0


_INSIDE_SITE = _SiteDepth()  # functional calls inside a converted block are the block's own


class ConvertedActivation(nn.Module):
    """Stands in for one converted activation module: one block per call site, created at its first call.

    Built by :func:`convert_activations`; not meant to be constructed directly.

    Attributes:
        to_name: the target name (``"qact"``, ``"prelu"`` or a twin ``"bn-relu-bn"`` | ``"bn-prelu-bn"``
            | ``"bn-selu-bn"``).
        block: for ``"qact"``, whether each site is a :class:`~shiftguard.nn.QACTBlock` (else a bare
            :class:`~shiftguard.nn.QuantileActivation`).
        qact_kwargs: keyword arguments of every new QACT block; ``qact_kwargs["context"]`` is the
            context mode blocks are created in (:func:`set_context` keeps it in step).
        sites: ``nn.ModuleList`` of the blocks, in call order. Empty until the first forward (or a
            ``load_state_dict`` holding them); once a forward of the model has completed, their number is
            fixed.

    Shape: input ``(N, C, *)``, output the same. A block for ``C`` channels is created on the device
    and in the floating dtype the module was last moved to (``.to(...)``, ``.double()``), like a
    parameter; its training flag follows this module's.

    Raises:
        RuntimeError: when called outside a forward of the converted model, or more times within one
            forward than the number of call sites fixed by the first.
        ValueError: for an input with fewer than 2 dimensions.
    """

    _like: torch.Tensor

    def __init__(
        self, to: str, block: bool = True, qact_kwargs: Optional[dict] = None, like: Optional[torch.Tensor] = None
    ):
        super().__init__()
        self.to_name = to
        self.block = bool(block)
        self.qact_kwargs = dict(qact_kwargs or {})
        self.sites = nn.ModuleList()
        ref = like if like is not None else torch.empty(0)
        # Follows .to()/.double() of the model, so that blocks are created where the model lives.
        self.register_buffer("_like", torch.empty(0, dtype=ref.dtype, device=ref.device), persistent=False)
        self._calls = 0  # calls within the current outermost forward
        self._active = 0  # depth of forwards of modules holding this one
        self._materialised = False  # a forward of the model has completed: the number of sites is fixed

    def _make_site(self, num_features: int) -> nn.Module:
        site: nn.Module
        if self.to_name == "qact":
            site = (
                QACTBlock(num_features, **self.qact_kwargs)
                if self.block
                else QuantileActivation(num_features=num_features, **self.qact_kwargs)
            )
        elif self.to_name in _TWINS:
            site = BNActBlock(num_features, _TWINS[self.to_name])
        else:
            site = nn.PReLU(num_features)
        site.to(device=self._like.device, dtype=self._like.dtype)
        return site.train(self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._active == 0:
            raise RuntimeError(
                "ConvertedActivation called outside a forward of the model it was converted in (calling "
                "model.forward(x) bypasses the hooks that count call sites); call model(x)"
            )
        i = self._calls
        self._calls += 1
        if i == len(self.sites):
            if self._materialised:
                raise RuntimeError(
                    f"ConvertedActivation: called {i + 1} times within one forward, but earlier forwards fixed "
                    f"{len(self.sites)} call site(s); converted activations need a static call order "
                    "(shiftguard.nn.convert)"
                )
            if not isinstance(x, torch.Tensor) or x.dim() < 2:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"input: expected a tensor of shape (N, C, *), got {shape}")
            self.sites.append(self._make_site(int(x.shape[1])))
        _INSIDE_SITE.depth += 1
        try:
            return self.sites[i](x)
        finally:
            _INSIDE_SITE.depth -= 1

    def _site_features(self, state_dict, site_prefix: str) -> Optional[int]:
        # a block (QACT's or a twin's) is sized by its first BatchNorm
        if self.to_name == "prelu":
            key = site_prefix + "weight"
        elif self.block:
            key = site_prefix + "bn_in.running_mean"
        else:
            key = site_prefix + "running_quantiles"
        return int(state_dict[key].shape[0]) if key in state_dict else None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Blocks not created yet take their channel count from the stored tensors (like Lazy modules).
        if not self._materialised:
            head = prefix + "sites."
            indices = sorted(
                {
                    int(k[len(head) :].split(".", 1)[0])
                    for k in state_dict
                    if k.startswith(head) and k[len(head) :].split(".", 1)[0].isdigit()
                }
            )
            for i in range(len(self.sites), (indices[-1] + 1) if indices else 0):
                n = self._site_features(state_dict, f"{head}{i}.")
                if n is None:
                    break  # left to the strict check (missing keys)
                self.sites.append(self._make_site(n))
            self._materialised = self._materialised or len(self.sites) > 0
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        extra = f", block={self.block}" if self.to_name == "qact" else ""
        pending = "" if self.sites else ", call sites created at the first forward"
        return f"to={self.to_name!r}{extra}{pending}"


# --------------------------------------------------------------------------- call-site counting hooks
def _converted_in(module: nn.Module) -> list[ConvertedActivation]:
    return [m for m in module.modules() if isinstance(m, ConvertedActivation)]


def _enter_forward(module: nn.Module, args) -> None:
    for d in _converted_in(module):
        if d._active == 0:
            d._calls = 0
        d._active += 1


def _complete_forward(module: nn.Module, args, output) -> None:
    # Runs only when the forward returned (not on an exception): fixes the number of call sites.
    for d in _converted_in(module):
        if d._active == 1 and d._calls > 0:
            d._materialised = True


def _leave_forward(module: nn.Module, args, output) -> None:
    for d in _converted_in(module):
        d._active = max(d._active - 1, 0)


def _install_counting_hooks(module: nn.Module) -> None:
    # A second conversion must not count a forward twice; torch has no public lookup of hooks.
    if any(h is _enter_forward for h in module._forward_pre_hooks.values()):
        return
    module.register_forward_pre_hook(_enter_forward)
    module.register_forward_hook(_complete_forward)
    module.register_forward_hook(_leave_forward, always_call=True)


# --------------------------------------------------------------------------- functional detection
_TORCH_DIR = os.path.dirname(torch.__file__)
_PASS_THROUGH = {
    os.path.join(_TORCH_DIR, "overrides.py"),
    os.path.join(_TORCH_DIR, "nn", "functional.py"),
    os.path.join(_TORCH_DIR, "_tensor.py"),
}
_ACTIVATION_MODULES_FILE = os.path.join(_TORCH_DIR, "nn", "modules", "activation.py")
_MODULE_MACHINERY = {_ACTIVATION_MODULES_FILE, os.path.join(_TORCH_DIR, "nn", "modules", "module.py")}


def _display_name(func) -> str:
    name = getattr(func, "__name__", repr(func))
    module = getattr(func, "__module__", None) or ""
    if module in ("torch.nn.functional", "torch._C._nn"):
        return f"torch.nn.functional.{name}"
    if module.startswith("torch") and "Tensor" not in getattr(func, "__qualname__", ""):
        return f"torch.{name}"
    return f"Tensor.{name}"


class _FunctionalCalls(TorchFunctionMode):
    """Records calls of the watched activation functions made outside converted modules, by name and place."""

    def __init__(self, watched: frozenset):
        super().__init__()
        self.watched = watched
        self.found: dict[tuple[str, str], int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _INSIDE_SITE.depth == 0 and getattr(func, "__name__", None) in self.watched:
            self._record(func, sys._getframe(1))
        return func(*args, **(kwargs or {}))

    def _record(self, func, frame) -> None:
        while frame is not None and frame.f_code.co_filename in _PASS_THROUGH:
            frame = frame.f_back
        name = _display_name(func)
        if frame is not None and frame.f_code.co_filename == _ACTIVATION_MODULES_FILE:
            # Every registered module of the converted types was replaced, so an activation module
            # running here was created in forward or kept outside the module tree: name it and its caller.
            owner = frame.f_locals.get("self")
            name = f"nn.{type(owner).__name__} (not a registered submodule)"
            while frame is not None and frame.f_code.co_filename in _MODULE_MACHINERY:
                frame = frame.f_back
        if frame is None:
            return
        where = f"{frame.f_code.co_filename}:{frame.f_lineno} (in {frame.f_code.co_name})"
        self.found[(name, where)] = self.found.get((name, where), 0) + 1

    def message(self) -> str:
        calls = "; ".join(
            f"{name} at {where}" + (f" ({n} calls)" if n > 1 else "") for (name, where), n in self.found.items()
        )
        return (
            f"convert_activations: activations called as functions (or by modules outside the module tree) "
            f"cannot be converted and are left as they are: {calls}. Use an activation module registered in "
            "__init__ (self.act = nn.ReLU(), ...) at these places to have them converted"
        )


class _FirstForwardCheck:
    """Forward hooks on the converted root: watch its first forward for functional activations."""

    def __init__(self, watched: frozenset):
        self.watched = watched
        self.pending = True
        self._mode: Optional[_FunctionalCalls] = None

    def before(self, module, args) -> None:
        if self.pending and self._mode is None:
            self._mode = _FunctionalCalls(self.watched)
            self._mode.__enter__()

    def after(self, module, args, output) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        self.pending = False
        mode.__exit__(None, None, None)
        if mode.found:
            warnings.warn(mode.message(), UserWarning, stacklevel=2)


# --------------------------------------------------------------------------- convert_activations
def _check_types(types) -> tuple[type, ...]:
    if types is None:
        return DEFAULT_ACTIVATION_TYPES
    t = (types,) if isinstance(types, type) else types
    try:
        t = tuple(t)
    except TypeError:
        raise TypeError(
            f"types: expected an nn.Module subclass or a tuple of them, got {type(types).__name__}"
        ) from None
    if not t:
        raise ValueError("types: expected at least one nn.Module subclass, got an empty collection")
    for cls in t:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"types: expected nn.Module subclasses, got {cls!r}")
        if issubclass(cls, (ConvertedActivation, QuantileActivation, QACTBlock)):
            raise ValueError(f"types: {cls.__name__} is a converted activation already")
    return t


def _reference_tensor(model: nn.Module) -> torch.Tensor:
    """An empty tensor on the device and in the floating dtype of the model's first floating tensor."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return torch.empty(0, dtype=t.dtype, device=t.device)
    return torch.empty(0)


def _call_model(model: nn.Module, example_input):
    if isinstance(example_input, torch.Tensor):
        return model(example_input)
    if isinstance(example_input, (tuple, list)):
        return model(*example_input)
    if isinstance(example_input, dict):
        return model(**example_input)
    raise TypeError(
        f"example_input: expected a tensor, a tuple of positional inputs or a dict of keyword "
        f"inputs, got {type(example_input).__name__}"
    )


def _cuda_devices(example_input) -> list[int]:
    """The CUDA device indices of the tensors of ``example_input`` (a tensor, a tuple / list, a dict),
    whose default generators QACT's forward draws its seeds from there."""
    if isinstance(example_input, dict):
        values = list(example_input.values())
    elif isinstance(example_input, (tuple, list)):
        values = list(example_input)
    else:
        values = [example_input]
    return sorted(
        {
            t.device.index if t.device.index is not None else torch.cuda.current_device()
            for t in values
            if isinstance(t, torch.Tensor) and t.is_cuda
        }
    )


def _restore_training(flags: dict) -> None:
    for m, flag in flags.items():
        m.training = flag
    for m in flags:
        if isinstance(m, ConvertedActivation):
            for site in m.sites:
                site.train(m.training)


def _materialise(model: nn.Module, example_input, watched: frozenset) -> Optional[_FunctionalCalls]:
    """One forward in eval mode without gradients: blocks are created, no running statistic moves
    (BatchNorm and QACT update theirs only in training mode) and torch's random generators (QACT
    draws its KDE seeds from that of its input's device: the CPU's, and the default generator of each
    CUDA device ``example_input`` is on) are left as they were. Returns the functional-call record when ``watched``."""
    flags = {m: m.training for m in model.modules()}
    probe = _FunctionalCalls(watched) if watched else None
    try:
        with torch.random.fork_rng(devices=_cuda_devices(example_input)), torch.no_grad():
            model.eval()
            with probe if probe is not None else contextlib.nullcontext():
                _call_model(model, example_input)
    finally:
        _restore_training(flags)
    return probe


def convert_activations(
    model: nn.Module, to: str = "qact", block: bool = True, *, types=None, example_input=None, **kwargs
) -> nn.Module:
    """Replace every activation module of ``model`` by QACT [QACT, Alg. 1-2] or by another activation.

    Like ``nn.SyncBatchNorm.convert_sync_batchnorm``, ``model`` is converted **in place** and returned
    (a model that is itself an activation module is replaced, so use the return value).

    Args:
        model: any ``nn.Module``.
        to: ``"qact"`` (default), or ``"relu"`` | ``"prelu"`` | ``"selu"`` | ``"bn-relu-bn"`` |
            ``"bn-prelu-bn"`` | ``"bn-selu-bn"`` (names of :func:`~shiftguard.nn.make_activation`,
            matched ignoring case, ``-`` and ``_``; ``"prelu"`` gets one slope per channel; the
            ``bn-*-bn`` twins get the BatchNorm -> activation -> BatchNorm block
            :class:`~shiftguard.nn.BNActBlock`, whose BatchNorm layers are those ``"qact"`` would put in
            the same model).
        block: for ``"qact"``: True (default) for the BatchNorm -> QACT -> BatchNorm block
            (:class:`~shiftguard.nn.QACTBlock`, [QACT, Remark after Alg. 2]), False for a bare
            :class:`~shiftguard.nn.QuantileActivation`.
        types: the module classes to replace (an ``nn.Module`` subclass or a tuple; instances of
            subclasses count); default :data:`DEFAULT_ACTIVATION_TYPES` (ReLU, ReLU6, LeakyReLU, PReLU,
            RReLU, ELU, CELU, SELU, GELU, SiLU, Mish, Hardswish, Softplus).
        example_input: optional input for one forward in eval mode under ``torch.no_grad`` (a tensor,
            a tuple of positional inputs or a dict of keyword inputs) that creates the blocks now;
            no running statistic of BatchNorm or QACT moves, torch's global RNG is left as it was and
            every module's training flag is restored. Without it the blocks are created at the first
            forward. **Build the optimizer after that** (parameters created later are not in it): an
            optimiser built from ``model.parameters()`` before the first forward is refused at its
            first step (a global step hook; its message says how to fix it).
        **kwargs: for ``"qact"``, keyword arguments of :class:`~shiftguard.nn.QuantileActivation`
            (``n_tau``, ``c``, ``n_samples``, ``context``, ``momentum``, ``bandwidth``; and ``dim`` of
            :class:`~shiftguard.nn.QACTBlock` with ``block=True``); the channel count is inferred.

    ``"qact"``, ``"prelu"`` and the ``bn-*-bn`` twins hold state, so each converted module becomes a
    :class:`ConvertedActivation` with one block per call site (module docstring: call order must be
    static); ``"relu"`` and ``"selu"`` have none and become one ``nn.ReLU()`` / ``nn.SELU()`` each.
    ``to="qact"`` and a twin give a model the same BatchNorm layers (names, shapes, state-dict keys).
    One activation object registered at several places becomes one converted module.

    Warns (``UserWarning``) when no activation module is found (nothing converted), and, once, naming
    each activation called as a function (``F.relu(x)``, ``torch.relu(x)``, ``x.relu()``, ...) with
    its file and line, in the ``example_input`` forward or else the model's first forward.

    Raises:
        ValueError: unknown ``to``; ``block=False`` with a target other than ``"qact"``; empty ``types``.
        TypeError: ``model`` not an ``nn.Module``; ``types`` not module classes; ``kwargs`` for a target
            other than ``"qact"`` or not accepted by QACT; a bad ``example_input``.

    Examples:
        >>> from torch import nn
        >>> net = convert_activations(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        >>> type(net[1]).__name__, has_qact(net)
        ('ConvertedActivation', True)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(to, str) or to not in ACTIVATION_REGISTRY:
        raise ValueError(f"to: unknown activation {to!r}; expected one of {', '.join(ACTIVATION_NAMES)}")
    target = ACTIVATION_REGISTRY.canonical(to)
    if not isinstance(block, bool):
        raise TypeError(f"block: expected a bool, got {type(block).__name__}")
    if target != "qact" and not block:
        raise ValueError(f"block: block=False selects a bare QuantileActivation and needs to='qact', got to={to!r}")
    if target != "qact" and kwargs:
        raise TypeError(f"kwargs: {', '.join(sorted(kwargs))} apply to to='qact' only, got to={to!r}")
    classes = _check_types(types)
    if target == "qact":
        if "num_features" in kwargs:
            raise TypeError("num_features: inferred from each call site's input; do not pass it")
        # Fail now, not at the first forward, on arguments QACT does not accept.
        QACTBlock(1, **kwargs) if block else QuantileActivation(num_features=1, **kwargs)

    like = _reference_tensor(model)
    replaced: dict[int, nn.Module] = {}

    def replacement(old: nn.Module) -> nn.Module:
        if id(old) not in replaced:
            if target in _STATELESS:
                new = _STATELESS[target]()
            else:
                new = ConvertedActivation(target, block, kwargs, like=like)
            replaced[id(old)] = new.train(old.training)
        return replaced[id(old)]

    visited: set[int] = set()

    def visit(parent: nn.Module) -> None:
        if id(parent) in visited or isinstance(parent, ConvertedActivation):
            return
        visited.add(id(parent))
        # Not named_children(): it yields a module registered under two names once, and both must go.
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if isinstance(child, classes):
                setattr(parent, name, replacement(child))
            else:
                visit(child)

    root = replacement(model) if isinstance(model, classes) else model
    visit(root)

    watched = frozenset(
        n
        for n, cls in _FUNCTIONAL_NAMES.items()
        if issubclass(cls, classes)
        and not (target in _STATELESS and cls is _STATELESS[target])
        and not (target == "prelu" and cls is nn.PReLU)
    )
    if not replaced:
        message = (
            f"convert_activations: no activation module of types ({', '.join(c.__name__ for c in classes)}) "
            "in model; nothing converted"
        )
        if example_input is not None:
            probe = _materialise(root, example_input, watched)
            if probe is not None and probe.found:
                message += ". " + probe.message()
        warnings.warn(message, UserWarning, stacklevel=2)
        return root

    # Call sites are counted from the outermost forward of any module that holds a converted one.
    for m in root.modules():
        if m is root or not isinstance(m, ConvertedActivation):
            if any(isinstance(c, ConvertedActivation) for c in m.modules()):
                _install_counting_hooks(m)

    if example_input is not None:
        probe = _materialise(root, example_input, watched)
        if probe is not None and probe.found:
            warnings.warn(probe.message(), UserWarning, stacklevel=2)
    else:
        if watched:
            check = _FirstForwardCheck(watched)
            root.register_forward_pre_hook(check.before)
            root.register_forward_hook(check.after, always_call=True)
        if any(isinstance(m, ConvertedActivation) for m in replaced.values()):
            _OptimizerCheck(root).install()
    return root


class _OptimizerCheck:
    """Without ``example_input`` the converted blocks' parameters appear at the model's first
    forward, so an optimiser built from ``model.parameters()`` before it never updates them. A
    global optimiser step hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``) refuses
    the first step of an optimiser that holds every parameter the model had when it was converted but
    none of those the blocks created since. It is done once an optimiser holding the model's
    parameters has passed it, or once the model is gone; done hooks are unregistered at the next
    installation (torch iterates over the hooks while calling them, so none may leave during a step)."""

    _installed: list = []

    def __init__(self, root: nn.Module):
        import weakref

        self._root = weakref.ref(root)
        self._before = {id(p) for p in root.parameters()}
        self._handle: Any = None
        self.done = False

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        for old in [c for c in _OptimizerCheck._installed if c.done or c._root() is None]:
            old._handle.remove()
            _OptimizerCheck._installed.remove(old)
        self._handle = register_optimizer_step_pre_hook(self)
        _OptimizerCheck._installed.append(self)

    def __call__(self, optimizer, args, kwargs) -> None:
        root = self._root()
        if self.done or root is None:
            self.done = True
            return
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not self._before or not self._before <= held:
            return  # an optimiser of other parameters (or of part of this model): not this check's case
        created = [p for m in _converted_in(root) for p in m.sites.parameters() if p.requires_grad]
        if not created:
            return  # no forward yet: nothing to miss so far
        if not any(id(p) in held for p in created):
            n = sum(p.numel() for p in created)
            raise RuntimeError(
                f"optimizer: it holds the model's parameters from before its first forward but not the {n} parameters "
                "that its converted activations (convert_activations) created at that forward, which would never be "
                "trained; build the optimizer after a first forward, or pass example_input to convert_activations"
            )
        self.done = True


# --------------------------------------------------------------------------- context management
def _check_mode(mode) -> str:
    if not isinstance(mode, str) or mode not in CONTEXT_MODES:
        raise ValueError(f"mode: expected one of {', '.join(map(repr, CONTEXT_MODES))}, got {mode!r}")
    return mode


def _qact_converted(model: nn.Module) -> list[ConvertedActivation]:
    return [m for m in model.modules() if isinstance(m, ConvertedActivation) and m.to_name == "qact"]


def _qact_modules(model: nn.Module) -> list[QuantileActivation]:
    return [m for m in model.modules() if isinstance(m, QuantileActivation)]


def has_qact(model: nn.Module) -> bool:
    """Whether ``model`` holds a :class:`~shiftguard.nn.QuantileActivation`, or a converted activation
    that will create QACT blocks at its first forward."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    return bool(_qact_modules(model) or _qact_converted(model))


def set_context(model: nn.Module, mode: str) -> nn.Module:
    """Set the context mode (``"batch"`` | ``"frozen"``, see :class:`~shiftguard.nn.QuantileActivation`)
    of every QACT layer in ``model``, and of the QACT blocks converted activations create later.

    A model without QACT is left as it is (:func:`has_qact` tells). Returns ``model``.

    Raises:
        ValueError: ``mode`` not ``"batch"`` or ``"frozen"``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    mode = _check_mode(mode)
    for m in _qact_modules(model):
        m.context = mode
    for d in _qact_converted(model):
        d.qact_kwargs["context"] = mode
    return model


@contextlib.contextmanager
def qact_context(model: nn.Module, mode: str) -> Iterator[nn.Module]:
    """``with qact_context(model, "frozen"): ...`` -- :func:`set_context` for the block, then every
    QACT layer's own mode back (layers created inside the block take their converted module's mode).

    A model without QACT is left as it is. Raises ``ValueError`` for a bad ``mode``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    mode = _check_mode(mode)
    layers = {m: str(m.context) for m in _qact_modules(model)}
    pending = {d: d.qact_kwargs.get("context", "batch") for d in _qact_converted(model)}
    set_context(model, mode)
    try:
        yield model
    finally:
        for m, old in layers.items():
            m.context = old
        for d, old in pending.items():
            d.qact_kwargs["context"] = old
            for m in _qact_modules(d):
                if m not in layers:
                    m.context = old


def _batches(data, batch_size: Optional[int]) -> Iterable:
    if isinstance(data, torch.Tensor):
        if data.dim() == 0 or data.shape[0] == 0:
            raise ValueError(f"data: expected a non-empty batch of inputs (N, ...), got shape {tuple(data.shape)}")
        if batch_size is None:
            return [data]
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size: expected a positive int or None, got {batch_size!r}")
        return list(torch.split(data, batch_size))
    if isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        if batch_size is None:
            raise ValueError("batch_size: needed to batch a Dataset of samples (or pass a DataLoader)")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
        return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)
    if batch_size is not None:
        raise ValueError("batch_size: applies to a tensor or a Dataset; an iterable of batches is used as it comes")
    if not hasattr(data, "__iter__"):
        raise TypeError(f"data: expected a tensor, a Dataset or an iterable of batches, got {type(data).__name__}")
    return data


def _input_of(batch, device) -> torch.Tensor:
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"data: expected batches that are tensors or (input, label, ...) tuples, got {type(x).__name__}"
        )
    return x if device is None else x.to(device)


def fit_context(model: nn.Module, data, *, batch_size: Optional[int] = None, device=None) -> nn.Module:
    """Refresh the stored (frozen) context of every QACT layer of ``model`` from ``data``, then leave
    them in ``"frozen"`` mode (like ``torch.optim.swa_utils.update_bn`` for BatchNorm).

    What is stored: each QACT layer's running statistics become the **equal-weight average over the
    batches of data** of its batch statistics -- the quantiles ``(C, n_tau)``, the sorted KDE samples
    ``(C, S)`` and the bandwidth ``(C,)`` [QACT, Alg. 1-2] of that layer's input, i.e. the cumulative
    average of ``momentum=None``; ``num_batches_tracked`` is left at the number of batches. With one
    batch they are that batch's statistics. While collecting, every other module is in eval mode
    (BatchNorm uses and keeps its running statistics, dropout is off) and each QACT layer uses the
    batch as its context, so a layer sees earlier QACT layers' batch-context outputs (as ``update_bn``
    lets BatchNorm see batch-normalised inputs). BatchNorm statistics are unchanged. Converted
    activations not created yet are created with the first batch (eval mode, no gradients).

    Args:
        model: a model holding QACT (:func:`has_qact`).
        data: a tensor ``(N, *)`` (split into ``batch_size`` rows; ``None``: one batch), a
            ``Dataset`` of samples (batched by ``batch_size``, in order), or an iterable of batches,
            each a tensor or an ``(input, label, ...)`` tuple/list whose first item is the input.
        batch_size: see ``data``; must be None for an iterable of batches.
        device: inputs are moved there (the model is not moved).

    Each module's training flag and each QACT layer's momentum are restored on exit; the QACT
    layers end in ``"frozen"``. On an error the stored statistics and modes are restored. Returns ``model``.

    Raises:
        ValueError: ``model`` without QACT; empty ``data``; a bad ``batch_size``.
        TypeError: ``data`` (or one of its batches) of a type not listed above.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not has_qact(model):
        raise ValueError("model: holds no QuantileActivation (add one with shiftguard.nn.convert_activations)")
    iterator = iter(_batches(data, batch_size))
    try:
        first = _input_of(next(iterator), device)
    except StopIteration:
        raise ValueError("data: holds no batch") from None

    flags = {m: m.training for m in model.modules()}
    if any(not d._materialised for d in _qact_converted(model)):
        _materialise(model, first, frozenset())
        flags = {m: m.training for m in model.modules()}
    layers = _qact_modules(model)
    saved = [
        (
            m.momentum,
            str(m.context),
            m.num_batches_tracked.clone(),
            [t.clone() for t in (m.running_quantiles, m.running_samples, m.running_bandwidth)],
        )
        for m in layers
    ]
    ok = False
    try:
        model.eval()
        for m in layers:
            m.momentum = None
            m.num_batches_tracked.zero_()
            m.context = "batch"
            m.train()
        with torch.no_grad():
            model(first)
            for batch in iterator:
                model(_input_of(batch, device))
        ok = True
    finally:
        _restore_training(flags)
        for m, (momentum, mode, count, stats) in zip(layers, saved):
            m.momentum = momentum
            if ok:
                m.context = "frozen"
            else:
                m.context = mode
                m.num_batches_tracked.copy_(count)
                for buf, old in zip((m.running_quantiles, m.running_samples, m.running_bandwidth), stats):
                    buf.copy_(old)
    return model
