"""Quantile activation modules: ``QuantileActivation``, ``QACTBlock``, its BatchNorm twin ``BNActBlock``,
``make_activation``.

``QuantileActivation`` is a thin module over :mod:`shiftguard.functional.quantile` [QACT, Alg. 1-2].

BatchNorm twins: :class:`QACTBlock` wraps QACT in two BatchNorm layers [QACT, Remark after Alg. 2], so
a QACT model carries twice the BatchNorm layers of its ReLU counterpart. :class:`BNActBlock` is the
same block with ReLU, PReLU or SELU in place of QACT (activation names ``bn-relu-bn``,
``bn-prelu-bn``, ``bn-selu-bn``; :func:`twin_activation`), with the same BatchNorm classes under the
same attribute names: a model built with ``bn-relu-bn`` has the BatchNorm layers, parameters and
state-dict keys of the one built with ``qact``, apart from QACT's own buffers.

Context modes [QACT, Sec. 3 "Inference with QACT"]:

- ``"batch"`` (default, in training *and* evaluation): the current input is its own context. This
  is training, and the paper's context-aware inference ("we include several samples from the
  context distribution"). ``model.eval()`` does **not** change the mode -- unlike BatchNorm -- because
  the paper evaluates with the test batch as context; switch explicitly.
- ``"frozen"``: the stored statistics are used, so a single sample can be classified (approach (1)
  of QACT, Sec. 3). The stored statistics are running estimates updated in every *training-mode*
  forward in batch context, like BatchNorm's running stats: with momentum ``m`` (default 0.1),
  ``running = (1 - m) * running + m * batch`` for the quantiles ``(C, n_tau)``, the sorted KDE
  samples ``(C, S)`` and the bandwidth ``(C,)`` (averaging sorted samples averages quantile
  functions, so rows stay sorted); ``momentum=None`` gives the cumulative average. They start at the
  statistics of a standard normal (the BatchNorm-normalised input the block expects).
- ``fit_context(x)`` replaces the stored statistics by those of a reference set ``x`` and switches
  to ``"frozen"``; ``with layer.context(x): ...`` does the same temporarily and restores both the
  statistics and the mode on exit.

``layer.context`` reads as the mode string (``"batch"``/``"frozen"``), can be assigned a mode, and can
be called with a reference set to get the context manager above.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch
from torch import nn

from shiftguard._validation import check_positive, check_tensor
from shiftguard.functional.quantile import (
    QACTStatistics,
    channel_values,
    check_bandwidth,
    default_statistics,
    qact_statistics,
    quantile_activation,
)
from shiftguard.registry import Registry, normalize

__all__ = [
    "QuantileActivation",
    "QACTBlock",
    "BNActBlock",
    "make_activation",
    "twin_activation",
    "CONTEXT_MODES",
    "ACTIVATION_NAMES",
    "BN_BLOCK_ACTIVATIONS",
    "TWIN_BASES",
]

CONTEXT_MODES = ("batch", "frozen")
#: The activations a :class:`BNActBlock` can hold (its ``activation`` argument).
TWIN_BASES = ("relu", "prelu", "selu")
#: The keyword arguments ``make_activation("qact", ...)`` passes on to :class:`QuantileActivation`.
_QACT_KWARGS = ("n_tau", "c", "n_samples", "context", "momentum", "bandwidth")


def _base_activation(base: str, num_features: int) -> nn.Module:
    """``relu`` | ``prelu`` (one slope per channel) | ``selu`` for ``num_features`` channels."""
    if base == "prelu":
        return nn.PReLU(check_positive(num_features, "num_features", integer=True))
    return nn.ReLU() if base == "relu" else nn.SELU()


def _without_kwargs(name: str, build):
    """The factory of an activation that takes no keyword arguments: any it is given is an error."""

    def factory(num_features: int, **kwargs) -> nn.Module:
        if kwargs:
            raise TypeError(
                f"activation_kwargs: activation {name!r} takes no keyword arguments, got {', '.join(sorted(kwargs))}"
            )
        return build(num_features)

    return factory


def _twin_block(base: str, num_features: int) -> nn.Module:
    return BNActBlock(num_features, base)


def _qact_factory(num_features: int, **kwargs) -> nn.Module:
    unknown = sorted(set(kwargs) - set(_QACT_KWARGS))
    if unknown:
        raise TypeError(
            f"activation_kwargs: {', '.join(unknown)} not accepted by activation 'qact'; "
            f"expected some of {', '.join(_QACT_KWARGS)}"
        )
    return QACTBlock(check_positive(num_features, "num_features", integer=True), **kwargs)


#: Activations by name: ``name -> factory(num_features, **kwargs) -> nn.Module`` (see
#: :func:`make_activation`). Names are matched ignoring case, ``-`` and ``_``; the canonical names
#: are the ones registered here (``"bn-relu-bn"``, ...).
ACTIVATION_REGISTRY: Registry = Registry("activation", argument="name")
for _base in TWIN_BASES:
    ACTIVATION_REGISTRY.register(_base, _without_kwargs(_base, functools.partial(_base_activation, _base)))
ACTIVATION_REGISTRY.register("qact", _qact_factory)
for _base in TWIN_BASES:
    _twin = f"bn-{_base}-bn"
    ACTIVATION_REGISTRY.register(_twin, _without_kwargs(_twin, functools.partial(_twin_block, _base)))
del _base, _twin
#: The activation names (canonical), in registration order.
ACTIVATION_NAMES = tuple(ACTIVATION_REGISTRY)
#: The activation names whose module is a block that starts and ends with BatchNorm (``qact`` and
#: its twins): an architecture puts no BatchNorm of its own in front of them.
BN_BLOCK_ACTIVATIONS = ("qact",) + tuple(f"bn-{b}-bn" for b in TWIN_BASES)


class _ContextMode(str):
    """The mode string of a :class:`QuantileActivation`; calling it with a reference set gives the
    ``with layer.context(x):`` context manager."""

    _owner: "QuantileActivation"

    def __new__(cls, value: str, owner: "QuantileActivation"):
        obj = super().__new__(cls, value)
        obj._owner = owner
        return obj

    def __call__(self, reference: torch.Tensor):
        return self._owner._temporary_context(reference)


def _check_mode(mode) -> str:
    if not isinstance(mode, str) or mode not in CONTEXT_MODES:
        raise ValueError(f"context: expected one of {', '.join(CONTEXT_MODES)}, got {mode!r}")
    return str(mode)


class QuantileActivation(nn.Module):
    """QACT [QACT, Alg. 1-2]: each value becomes its grounded quantile level in its channel's context.

    Args:
        n_tau: number of quantile levels ``tau_i = i / (n_tau + 1)``.
        c: grounding bound appended as ``+-c`` to every context (QACT: ``c = 100``).
        n_samples: KDE sample size ``S`` for the backward (QACT: ``S = 1000``).
        context: ``"batch"`` or ``"frozen"`` (module docstring).
        momentum: running-statistics momentum for ``"frozen"`` (None = cumulative average).
        num_features: number of channels ``C``; when None the stored statistics are created at the
            first forward (and resized when a state dict is loaded).
        bandwidth: the KDE bandwidth of the backward. None (default): Silverman's rule per channel
            on the KDE samples. A positive float: that bandwidth for every channel, in every context
            (:func:`~shiftguard.functional.quantile_activation`); ``running_bandwidth`` starts at it
            and then holds it. The forward does not depend on it.

    Shape: input ``(N, C)`` or ``(N, C, *spatial)``, output the same, values in ``[0, 1]``.
    The KDE samples are given by a seed drawn from the default generator of the input's device
    (torch's global RNG on the CPU), so results are deterministic given ``torch.manual_seed``
    (which seeds every device).
    """

    running_quantiles: torch.Tensor
    running_samples: torch.Tensor
    running_bandwidth: torch.Tensor
    num_batches_tracked: torch.Tensor

    def __init__(
        self,
        n_tau: int = 100,
        c: float = 100.0,
        n_samples: int = 1000,
        context: str = "batch",
        momentum: Optional[float] = 0.1,
        num_features: Optional[int] = None,
        bandwidth: Optional[float] = None,
    ):
        super().__init__()
        self.n_tau = check_positive(n_tau, "n_tau", integer=True)
        self.c = float(check_positive(c, "c"))
        self.n_samples = check_positive(n_samples, "n_samples", integer=True)
        if momentum is not None and not (0.0 < float(momentum) <= 1.0):
            raise ValueError(f"momentum: expected a value in (0, 1] or None, got {momentum}")
        self.momentum = momentum
        self._context = _check_mode(context)
        self.bandwidth = check_bandwidth(bandwidth)
        self.num_features = num_features
        if num_features is not None:
            check_positive(num_features, "num_features", integer=True)
            s = default_statistics(num_features, n_tau, n_samples, bandwidth=self.bandwidth)
        else:
            s = QACTStatistics(torch.empty(0, n_tau), torch.empty(0, n_samples), torch.empty(0))
        self.register_buffer("running_quantiles", s.quantiles)
        self.register_buffer("running_samples", s.samples)
        self.register_buffer("running_bandwidth", s.bandwidth)
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    # ------------------------------------------------------------------ context mode
    @property
    def context(self) -> _ContextMode:
        return _ContextMode(self._context, self)

    @context.setter
    def context(self, mode: str) -> None:
        self._context = _check_mode(mode)

    def statistics(self) -> QACTStatistics:
        """The stored (frozen) statistics."""
        return QACTStatistics(self.running_quantiles, self.running_samples, self.running_bandwidth)

    def _generator(self, device: torch.device) -> torch.Generator:
        seed = int(torch.randint(0, 2**62, (1,)).item())  # from torch's global RNG
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        return g

    def _ensure_buffers(self, x: torch.Tensor) -> None:
        """Create the lazily sized statistics for ``x``'s channels, or refuse another channel count."""
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == self.running_quantiles.shape[0] > 0:
            return
        x = check_tensor(x, "input", min_ndim=2, floating=True, nonempty=True)
        ch = x.shape[1]
        if self.running_quantiles.shape[0] == 0:
            s = default_statistics(
                ch, self.n_tau, self.n_samples, dtype=x.dtype, device=x.device, bandwidth=self.bandwidth
            )
            self.running_quantiles, self.running_samples, self.running_bandwidth = s
            self.num_features = ch
        elif self.running_quantiles.shape[0] != ch:
            raise ValueError(f"input: expected {self.running_quantiles.shape[0]} channels, got shape {tuple(x.shape)}")

    def batch_statistics(self, x: torch.Tensor, with_samples: bool = True) -> QACTStatistics:
        """Statistics with ``x`` ``(N, C, *)`` as the context (no gradient). Without samples (when no
        gradient and no running update is needed) the KDE sample is skipped."""
        x = check_tensor(x, "x", min_ndim=2, floating=True, nonempty=True, finite=True)
        s = self.n_samples if with_samples else 0
        return qact_statistics(
            channel_values(x.detach()), self.n_tau, self.c, s, self._generator(x.device), bandwidth=self.bandwidth
        )

    @torch.no_grad()
    def fit_context(self, x: torch.Tensor) -> "QuantileActivation":
        """Store the statistics of the reference set ``x`` ``(N, C, *)`` and switch to ``"frozen"``."""
        x = check_tensor(x, "input", min_ndim=2, floating=True, nonempty=True, finite=True)
        self._ensure_buffers(x)
        s = self.batch_statistics(x)
        self.running_quantiles.copy_(s.quantiles)
        self.running_samples.copy_(s.samples)
        self.running_bandwidth.copy_(s.bandwidth)
        self._context = "frozen"
        return self

    @contextlib.contextmanager
    def _temporary_context(self, reference: torch.Tensor) -> Iterator["QuantileActivation"]:
        saved = (self.running_quantiles.clone(), self.running_samples.clone(), self.running_bandwidth.clone())
        mode, was_empty = self._context, self.running_quantiles.shape[0] == 0
        try:
            yield self.fit_context(reference)
        finally:
            if was_empty:
                self.running_quantiles, self.running_samples, self.running_bandwidth = saved
            else:
                self.running_quantiles.copy_(saved[0])
                self.running_samples.copy_(saved[1])
                self.running_bandwidth.copy_(saved[2])
            self._context = mode

    def _next_momentum(self) -> float:
        """The weight of the next batch in the running statistics (cumulative average: 1 / (n + 1))."""
        return 1.0 / float(self.num_batches_tracked + 1) if self.momentum is None else float(self.momentum)

    # ------------------------------------------------------------------ forward
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._ensure_buffers(input)
        batch = self._context == "batch"
        update = self.training and batch
        # The KDE draws are given by this seed, drawn from the default generator of the input's
        # device (torch's global RNG on the CPU): a tensor, so that the forward traces under
        # torch.compile with the same draws eager or compiled, and made on the device, so that a
        # CUDA graph replays a fresh draw each time (docs/qact.md, "Randomness"). A cumulative
        # average (momentum=None) reads the update count inside the traced operator.
        out = quantile_activation(
            input,
            self.running_quantiles,
            self.running_samples,
            self.running_bandwidth,
            training=update,
            momentum=self.momentum if update else 1.0,
            context=self._context,
            n_tau=self.n_tau,
            c=self.c,
            n_samples=self.n_samples,
            bandwidth=self.bandwidth,
            seed=torch.randint(0, 2**62, (1,), device=input.device) if batch else None,
            num_batches_tracked=self.num_batches_tracked,
        )
        if update:  # counted once the update is done: an input refused leaves every buffer as it was
            self.num_batches_tracked.add_(1)
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Lazily-sized buffers take the stored shape (like nn.LazyModule).
        for name in ("running_quantiles", "running_samples", "running_bandwidth"):
            key = prefix + name
            current = getattr(self, name)
            if key in state_dict and current.shape != state_dict[key].shape and current.shape[0] == 0:
                setattr(self, name, torch.empty_like(state_dict[key], device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"n_tau={self.n_tau}, c={self.c}, n_samples={self.n_samples}, context={self._context!r}, "
            f"momentum={self.momentum}, bandwidth={self.bandwidth}"
        )


class _BatchNormAnyRank(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over dim 1 of any ``(N, C, *)`` input (BatchNorm1d/2d/3d share parameters)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"input: expected at least 2 dimensions, got shape {tuple(input.shape)}")


_BN_BY_DIM = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def _batchnorm_class(dim: Optional[int]) -> type:
    """``BatchNorm{dim}d``, or the any-rank BatchNorm for ``dim=None`` (the blocks' BatchNorm layers)."""
    if dim is not None and dim not in _BN_BY_DIM:
        raise ValueError(f"dim: expected 1, 2, 3 or None, got {dim!r}")
    return _BN_BY_DIM[dim] if dim is not None else _BatchNormAnyRank


class QACTBlock(nn.Module):
    """BatchNorm -> QACT -> BatchNorm, the stable-training recipe of QACT (Remark after Alg. 2:
    "we prepend and append the quantile activation with BatchNorm layers").

    Args:
        num_features: channels ``C``.
        dim: 1, 2 or 3 to use ``BatchNorm{dim}d``; None (default) accepts any ``(N, C, *)`` rank.
        **qact_kwargs: passed to :class:`QuantileActivation`.
    """

    def __init__(self, num_features: int, dim: Optional[int] = None, **qact_kwargs):
        super().__init__()
        check_positive(num_features, "num_features", integer=True)
        bn = _batchnorm_class(dim)
        self.num_features = num_features
        self.bn_in = bn(num_features)
        self.act = QuantileActivation(num_features=num_features, **qact_kwargs)
        self.bn_out = bn(num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn_out(self.act(self.bn_in(x)))


class BNActBlock(nn.Module):
    """BatchNorm -> ``activation`` -> BatchNorm: the BatchNorm twin of :class:`QACTBlock`.

    The same BatchNorm classes under the same attribute names (``bn_in``, ``act``, ``bn_out``), so
    a model with these blocks in place of its QACT blocks has the same BatchNorm layers, parameters
    and state-dict keys (module docstring), and a comparison with the QACT model differs in the
    activation only.

    Args:
        num_features: channels ``C``.
        activation: ``"relu"`` | ``"prelu"`` (one slope per channel) | ``"selu"`` (case, ``-`` and
            ``_`` ignored).
        dim: 1, 2 or 3 to use ``BatchNorm{dim}d``; None (default) accepts any ``(N, C, *)`` rank.
    """

    def __init__(self, num_features: int, activation: str = "relu", dim: Optional[int] = None):
        super().__init__()
        check_positive(num_features, "num_features", integer=True)
        if not isinstance(activation, str) or normalize(activation) not in TWIN_BASES:
            raise ValueError(f"activation: expected one of {', '.join(TWIN_BASES)}, got {activation!r}")
        bn = _batchnorm_class(dim)
        self.num_features = num_features
        self.activation = normalize(activation)
        self.bn_in = bn(num_features)
        self.act = _base_activation(self.activation, num_features)
        self.bn_out = bn(num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn_out(self.act(self.bn_in(x)))


def make_activation(name: str, num_features: int, **kwargs) -> nn.Module:
    """Activation by name: ``relu`` | ``prelu`` (one slope per channel) | ``selu`` | ``qact``
    (the :class:`QACTBlock`, [QACT, Sec. 4] "replace the usual ReLU activation with QACT") |
    ``bn-relu-bn`` | ``bn-prelu-bn`` | ``bn-selu-bn`` (the :class:`BNActBlock` twins of ``qact``).

    ``name`` is matched ignoring case, ``-`` and ``_``; ``num_features`` (channels) is used, and
    checked, by all but ``relu`` and ``selu``. ``kwargs`` go to the block: for ``qact`` the
    arguments of :class:`QuantileActivation` (``n_tau``, ``c``, ``n_samples``, ``context``,
    ``momentum``, ``bandwidth``); the other activations take none. The architectures pass their
    ``activation_kwargs`` here, which the errors name.

    Raises:
        TypeError: ``name`` is not a str; ``num_features`` is not an int (``prelu``, ``qact``, the
            twins); ``kwargs`` the activation does not take.
        ValueError: an unknown ``name`` (the message lists :data:`ACTIVATION_NAMES` and suggests
            the closest); ``num_features < 1`` (``prelu``, ``qact``, the twins); a QACT argument out
            of its domain.
    """
    return ACTIVATION_REGISTRY.get(name)(num_features, **kwargs)


def twin_activation(name: str, base: str = "relu") -> str:
    """The name of the BatchNorm twin of activation ``name``: ``"qact"`` -> ``"bn-relu-bn"``
    (``"bn-prelu-bn"``, ``"bn-selu-bn"`` with ``base="prelu"``, ``"selu"``).

    A model built with the twin has the QACT model's BatchNorm layers (:class:`BNActBlock`), so
    ``qact`` against its twin compares the activation alone; against plain ``relu`` it also compares
    twice the BatchNorm layers.

    Raises:
        ValueError: ``name`` is not ``qact`` (case, ``-`` and ``_`` ignored; only QACT has a
            BatchNorm twin), or ``base`` is not one of :data:`TWIN_BASES`.
    """
    if ACTIVATION_REGISTRY.canonical(name) != "qact":
        raise ValueError(f"name: only 'qact' has a BatchNorm twin, got {name!r}")
    if not isinstance(base, str) or normalize(base) not in TWIN_BASES:
        raise ValueError(f"base: expected one of {', '.join(TWIN_BASES)}, got {base!r}")
    return f"bn-{normalize(base)}-bn"
