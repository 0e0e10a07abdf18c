"""Test-time adaptation as an axis of the evaluation grid: what a model may learn from a shifted
test cell before (or while) it is scored.

Every arm is scored on every cell, side by side, and starts every cell from the trained weights and
statistics; it works on a private copy of the model, so the caller's model (weights, buffers,
training flags, device) is never changed. Arms:

- ``"none"``: the static model (BatchNorm on its training running statistics).
- ``"bn-batch"``: every BatchNorm normalises with the statistics of the evaluated batch
  (prediction-time BatchNorm, Nado et al. 2020), the BatchNorm analogue of QACT's batch context.
- ``"bn"``: every BatchNorm's running statistics are re-estimated over the whole unlabelled cell
  before it is scored (Schneider et al., NeurIPS 2020, Sec. 2): one forward pass over the cell
  with BatchNorm in training mode and a cumulative average over its batches (``momentum=None``,
  what ``torch.optim.swa_utils.update_bn`` does), then ``prior`` ``N`` mixes in the source
  statistics, ``N / (N + n)`` source and ``n / (N + n)`` cell for a cell of ``n`` images
  (Schneider et al., eq. 3; ``N = 0``, the default, is full re-estimation).
- ``"tent"``: TENT (Wang et al., ICLR 2021, Sec. 3): the BatchNorm affine parameters minimise the
  entropy of the predictions, one optimiser step per test batch, online through the cell, every
  BatchNorm on test-batch statistics; each batch is scored by the forward pass before its own
  step (the official code's ``forward_and_adapt``). Adam, learning rate 1e-3, betas (0.9, 0.999),
  no weight decay: the paper's CIFAR-10/100-C setting (Sec. 4); ``optimizer="sgd"`` takes its
  ImageNet-C setting (momentum 0.9; give ``lr=0.00025``). Reset at every cell (episodic per cell,
  as the official CIFAR-10-C script resets the model for every corruption x severity).
- ``"refresh"``: the public QACT reference protocol (``adityac20/quantile_activation``,
  ``src/compute_corrupted_accuracy.py``): ``passes`` (default 20, as at the commit of its CIFAR10C
  results file) forward passes without gradient over the cell's images in random order, with every
  BatchNorm and QACT layer in training mode so that their running statistics and QACT's stored
  context move to the cell; then the cell is scored with QACT in the frozen context. The
  reference's passes see the cell without the training augmentations at that commit (its latest
  commit adds them) and carry statistics over from the previous cell; here every cell starts
  from the trained state.

Only BatchNorm and QACT layers change mode during an adaptation: dropout and every other layer
stay in evaluation mode. ``bn``, ``tent`` and ``refresh`` are *transductive*: they see the
unlabelled test cell (``bn``, ``refresh``: all of it; ``tent``: the batches before each one)
before scoring it; results record each arm's passes and images. ``bn-batch`` (like QACT's batch
context) makes each prediction depend on the other images of its batch, and sees nothing else.

Arms are named by a string, ``"name"`` or ``"name:option=value,..."`` (``"bn:prior=16"``,
``"tent:lr=0.00025,optimizer=sgd"``, ``"refresh:passes=2"``), or given as :class:`AdaptSpec`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import Optional, Sequence, Union

import torch
from torch import nn

from shiftguard._rng import seeded
from shiftguard.nn import QuantileActivation, has_qact, qact_context
from shiftguard.registry import Registry

from .outputs import ModelOutputs, batch_order, compute_outputs, in_input_order

__all__ = [
    "ARMS",
    "AdaptSpec",
    "AdaptedModel",
    "adapt_specs",
    "arm_contexts",
    "batchnorm_layers",
    "skip_reason",
    "softmax_entropy",
]

#: The adaptation arms, in the order reports list them.
ARMS = ("none", "bn-batch", "bn", "tent", "refresh")

# Arm names are matched ignoring case, '-', '_' and spaces ("BN_Batch", "bn batch" -> "bn-batch").
_ARM_REGISTRY: Registry[str] = Registry("arm", argument="adapt")
for _arm in ARMS:
    _ARM_REGISTRY.register(_arm, _arm)
del _arm


def _canonical_arm(name) -> str:
    """The registered spelling of arm ``name``; one-line errors naming ``adapt``."""
    if not isinstance(name, str):
        raise TypeError(f"adapt: expected an arm name (str), got {type(name).__name__}")
    return _ARM_REGISTRY.canonical(name, words=True)


_BatchNorm = nn.modules.batchnorm._BatchNorm

#: Per arm, the options it takes (others are refused by name).
_OPTIONS = {
    "none": (),
    "bn-batch": (),
    "bn": ("prior",),
    "tent": ("lr", "steps", "optimizer", "batch_size"),
    "refresh": ("passes", "batch_size"),
}


@dataclass(frozen=True)
class AdaptSpec:
    """One adaptation arm and its options (module docstring).

    Attributes:
        name: one of :data:`ARMS`.
        prior: ``bn``: the prior strength ``N`` of the source statistics (Schneider et al. 2020,
            eq. 3), in images; 0 = full re-estimation.
        lr: ``tent``: the learning rate of the BatchNorm affine parameters.
        steps: ``tent``: optimiser steps per test batch (the batch is scored by the last step's
            forward pass, before that step's update).
        optimizer: ``tent``: ``"adam"`` (betas 0.9, 0.999) or ``"sgd"`` (momentum 0.9).
        passes: ``refresh``: training-mode passes over the cell before it is scored.
        batch_size: ``tent``: its test batches (each scored, then one step); ``refresh``: the
            batches of its passes (the reference code's DataLoader takes 128). None (default): the
            evaluation's batch size.
    """

    name: str
    prior: float = 0.0
    lr: float = 1e-3
    steps: int = 1
    optimizer: str = "adam"
    passes: int = 20
    batch_size: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "name", _canonical_arm(self.name))  # frozen: the one spelling, set once
        if (
            isinstance(self.prior, bool)
            or not isinstance(self.prior, (int, float))
            or not (math.isfinite(self.prior) and self.prior >= 0)
        ):
            raise ValueError(f"adapt: {self.name}: prior must be a finite number >= 0, got {self.prior!r}")
        if (
            isinstance(self.lr, bool)
            or not isinstance(self.lr, (int, float))
            or not (math.isfinite(self.lr) and self.lr > 0)
        ):
            raise ValueError(f"adapt: {self.name}: lr must be a finite number > 0, got {self.lr!r}")
        for key in ("steps", "passes"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"adapt: {self.name}: {key} must be an integer >= 1, got {v!r}")
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 2
        ):
            raise ValueError(
                f"adapt: {self.name}: batch_size must be an integer >= 2 (BatchNorm needs a batch of 2), "
                f"got {self.batch_size!r}"
            )
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"adapt: {self.name}: optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        changed = [f.name for f in fields(self) if f.name != "name" and getattr(self, f.name) != f.default]
        foreign = [k for k in changed if k not in _OPTIONS[self.name]]
        if foreign:
            takes = ", ".join(_OPTIONS[self.name]) or "no options"
            raise ValueError(f"adapt: {self.name}: does not take {', '.join(foreign)} (it takes {takes})")

    @classmethod
    def parse(cls, text: str) -> "AdaptSpec":
        """``"name"`` or ``"name:key=value,key=value"``."""
        if not isinstance(text, str):
            raise TypeError(f"adapt: expected an arm name or an AdaptSpec, got {type(text).__name__}")
        name, _, rest = text.strip().partition(":")
        name = _canonical_arm(name)
        kwargs: dict = {}
        types = {f.name: f.type for f in fields(cls)}
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or key not in types or key == "name":
                raise ValueError(
                    f"adapt: {text!r}: expected 'key=value' options of {name} "
                    f"({', '.join(_OPTIONS[name]) or 'none'}), got {part!r}"
                )
            value = value.strip()
            try:
                kwargs[key] = (
                    int(value)
                    if types[key] in ("int", int, "Optional[int]")
                    else float(value)
                    if types[key] in ("float", float)
                    else value
                )
            except ValueError:
                raise ValueError(f"adapt: {text!r}: {key} = {value!r} is not a number") from None
        return cls(name, **kwargs)

    @property
    def label(self) -> str:
        """The arm's name in results: the name, with the options that differ from the defaults."""
        opts = [
            f"{f.name}={getattr(self, f.name):g}"
            if isinstance(getattr(self, f.name), float)
            else f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name != "name" and getattr(self, f.name) != f.default
        ]
        return self.name + (":" + ",".join(opts) if opts else "")

    @property
    def transductive(self) -> bool:
        """Whether the arm sees the unlabelled test cell (beyond the batch it scores) before scoring."""
        return self.name in ("bn", "tent", "refresh")

    def describe(self, n_images: int) -> dict:
        """What ``results["adaptation"]`` records of the arm for cells of ``n_images`` images."""
        passes = {"bn": 1, "tent": self.steps, "refresh": self.passes}.get(self.name, 0)
        what = {
            "none": "static model: BatchNorm on its training statistics",
            "bn-batch": "every BatchNorm on the statistics of the evaluated batch (Nado et al. 2020)",
            "bn": "BatchNorm statistics re-estimated on each whole cell before scoring (Schneider et al. 2020)"
            + (f", source prior N = {self.prior:g}" if self.prior else ""),
            "tent": f"TENT (Wang et al. 2021): entropy minimisation of the BatchNorm affine parameters, "
            f"{self.optimizer} lr {self.lr:g}, {self.steps} step(s) per batch"
            + (f" of {self.batch_size}" if self.batch_size else "")
            + ", online through each cell",
            "refresh": f"QACT reference protocol: {self.passes} training-mode passes over each cell"
            + (f" in batches of {self.batch_size}" if self.batch_size else "")
            + ", then scored with QACT in the frozen context",
        }[self.name]
        return {
            "name": self.label,
            "arm": self.name,
            "transductive": self.transductive,
            "passes": passes,
            "images": n_images if self.transductive else 0,
            "description": what,
        }


def adapt_specs(adapt: Union[str, AdaptSpec, Sequence[Union[str, AdaptSpec]]]) -> list[AdaptSpec]:
    """``adapt`` as specs (names parsed); a single name is a list of one; an arm listed twice (the
    same label) is an error naming ``adapt``."""
    items = [adapt] if isinstance(adapt, (str, AdaptSpec)) else list(adapt)
    if not items:
        raise ValueError('adapt: expected at least one arm ("none" is the static evaluation)')
    specs = [a if isinstance(a, AdaptSpec) else AdaptSpec.parse(a) for a in items]
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"adapt: {', '.join(map(repr, dup))} listed more than once (it would be scored twice)")
    return specs


def batchnorm_layers(model: nn.Module, *, with_statistics: bool = False) -> list[_BatchNorm]:
    """The BatchNorm layers of ``model`` (every ``torch.nn`` BatchNorm, SyncBatchNorm and subclasses),
    with ``with_statistics`` only those that keep running statistics."""
    out = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    if with_statistics:
        out = [m for m in out if m.running_mean is not None and m.running_var is not None]
    return out


def _buffer(bn: _BatchNorm, name: str) -> torch.Tensor:
    t = getattr(bn, name)
    assert isinstance(t, torch.Tensor)  # batchnorm_layers(with_statistics=True) keeps layers that have it
    return t


def _qact_layers(model: nn.Module) -> list[QuantileActivation]:
    return [m for m in model.modules() if isinstance(m, QuantileActivation)]


def skip_reason(spec: AdaptSpec, outputs: ModelOutputs) -> Optional[str]:
    """Why ``spec`` cannot adapt the model of ``outputs`` (None when it can)."""
    if spec.name == "none":
        return None
    if not outputs.rebindable:
        return "embed= is a callable bound to the model; an adapted copy needs embed= as a submodule name"
    model = outputs.model
    if spec.name in ("bn-batch", "bn") and not batchnorm_layers(model, with_statistics=True):
        return "the model has no BatchNorm layer with running statistics"
    if spec.name == "tent":
        if not outputs.has_logits:
            return "TENT minimises the entropy of the predictions and needs logits (output='embedding')"
        if not any(m.weight is not None for m in batchnorm_layers(model)):
            return "the model has no BatchNorm affine parameters to adapt"
    if spec.name == "refresh" and not batchnorm_layers(model, with_statistics=True) and not has_qact(model):
        return "the model has neither BatchNorm running statistics nor a QACT context to refresh"
    return None


def arm_contexts(spec: AdaptSpec, contexts: Sequence[str]) -> list[str]:
    """The QACT contexts ``spec`` is scored in, of a QACT model's ``contexts``: all of them, except
    ``refresh``, whose protocol scores in the frozen context it has just refreshed (in the batch
    context the refreshed context would never be read). A model without QACT has ``["none"]``."""
    if list(contexts) == ["none"]:
        return ["none"]
    return ["frozen"] if spec.name == "refresh" else list(contexts)


def _drop_running_statistics(model: nn.Module) -> None:
    # running_mean/var of None make BatchNorm normalise with the batch's statistics in eval mode too
    # (nn.Module's __setattr__ is typed for modules and tensors; the buffers are Optional in torch)
    for bn in batchnorm_layers(model):
        bn.track_running_stats = False
        bn.register_buffer("running_mean", None)
        bn.register_buffer("running_var", None)
        bn.register_buffer("num_batches_tracked", None)


class AdaptedModel:
    """One arm applied to one model: a private copy of ``outputs.model``, reset to the trained
    state before each cell (:meth:`outputs_on`).

    Args:
        spec: the arm (not ``"none"``: the static arm scores the model itself).
        outputs: the model's :class:`~shiftguard.evaluation.ModelOutputs` (rebound to the copy).
        seed: seed of the batch order of the passes (``refresh``).
    """

    def __init__(self, spec: AdaptSpec, outputs: ModelOutputs, seed: int = 0):
        if spec.name == "none":
            raise ValueError("spec: the 'none' arm scores the model itself; there is nothing to adapt")
        reason = skip_reason(spec, outputs)
        if reason is not None:
            raise ValueError(f"adapt: {spec.label}: {reason}")
        self.spec = spec
        self.seed = seed
        self.model = copy.deepcopy(outputs.model)
        for p in self.model.parameters():
            p.grad = None
        self.outputs = outputs.rebind(self.model)
        if spec.name in ("bn-batch", "tent"):
            _drop_running_statistics(self.model)
        self._trained = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def reset(self) -> None:
        """Back to the trained weights and statistics."""
        self.model.load_state_dict(self._trained)

    def outputs_on(self, images: torch.Tensor, batch_size: int, device, context: str) -> dict:
        """``{"embeddings", "logits"}`` of the cell ``images`` under this arm, the model adapted from
        its trained state; QACT layers in ``context`` (``refresh``: the frozen context; its passes
        run in the batch context)."""
        self.reset()
        name = self.spec.name
        if name == "bn":
            self._reestimate(images, batch_size, device, context)
        elif name == "refresh":
            self._refresh(images, self.spec.batch_size or batch_size, device)
            context = "frozen"
        elif name == "tent":
            return self._tent(images, self.spec.batch_size or batch_size, device, context)
        with qact_context(self.model, "batch" if context == "none" else context):
            return compute_outputs(self.outputs, images, batch_size, device)

    # -- the arms --------------------------------------------------------------------------------
    def _set_modes(self, *, batchnorm: bool, qact: bool) -> None:
        self.model.eval()
        for bn in batchnorm_layers(self.model):
            bn.train(batchnorm)
        for q in _qact_layers(self.model):
            q.train(qact)

    @torch.no_grad()
    def _reestimate(self, images: torch.Tensor, batch_size: int, device, context: str) -> None:
        layers = batchnorm_layers(self.model, with_statistics=True)
        source = [(_buffer(bn, "running_mean").clone(), _buffer(bn, "running_var").clone()) for bn in layers]
        momenta = [bn.momentum for bn in layers]
        for bn in layers:
            bn.reset_running_stats()
            bn.momentum = None  # cumulative average over the cell's batches
        self._set_modes(batchnorm=True, qact=False)
        order, bounds = batch_order(images.shape[0], batch_size, device=images.device)
        try:
            with seeded(0, device), qact_context(self.model, "batch" if context == "none" else context):
                for a, b in zip(bounds[:-1], bounds[1:]):
                    self.outputs.raw(images[order[a:b]], device)
        finally:
            for bn, m in zip(layers, momenta):
                bn.momentum = m
            self.model.eval()
        n = float(images.shape[0])
        if self.spec.prior:
            w = self.spec.prior / (self.spec.prior + n)
            for bn, (mean, var) in zip(layers, source):
                _buffer(bn, "running_mean").lerp_(mean, w)
                _buffer(bn, "running_var").lerp_(var, w)

    @torch.no_grad()
    def _refresh(self, images: torch.Tensor, batch_size: int, device) -> None:
        self._set_modes(batchnorm=True, qact=True)
        n = images.shape[0]
        try:
            with seeded(0, device), qact_context(self.model, "batch"):
                for p in range(self.spec.passes):
                    seed = self.seed * 1_000_003 + p + 1
                    order, bounds = batch_order(n, batch_size, order_seed=seed, device=images.device)
                    for a, b in zip(bounds[:-1], bounds[1:]):
                        self.outputs.raw(images[order[a:b]], device)
        finally:
            self.model.eval()

    def _tent(self, images: torch.Tensor, batch_size: int, device, context: str) -> dict:
        model = self.model
        model.eval()  # BatchNorm without running statistics normalises with the batch's in eval mode
        flags = {p: p.requires_grad for p in model.parameters()}
        model.requires_grad_(False)
        params: list[torch.Tensor] = []
        for bn in batchnorm_layers(model):
            for name in ("weight", "bias"):
                p = getattr(bn, name)
                if isinstance(p, torch.Tensor):
                    p.requires_grad_(True)
                    params.append(p)
        opt: torch.optim.Optimizer
        if self.spec.optimizer == "adam":
            opt = torch.optim.Adam(params, lr=self.spec.lr, betas=(0.9, 0.999), weight_decay=0.0)
        else:
            opt = torch.optim.SGD(params, lr=self.spec.lr, momentum=0.9, weight_decay=0.0)
        n = images.shape[0]
        order, bounds = batch_order(n, batch_size, device=images.device)
        embs: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        try:
            with seeded(0, device), qact_context(model, "batch" if context == "none" else context):
                for a, b in zip(bounds[:-1], bounds[1:]):
                    x = images[order[a:b]]
                    emb: Optional[torch.Tensor] = None
                    lg: Optional[torch.Tensor] = None
                    for _ in range(self.spec.steps):
                        with torch.enable_grad():
                            emb, lg = self.outputs.raw(x, device)
                            assert lg is not None  # skip_reason keeps TENT to models with logits
                            loss = softmax_entropy(lg.reshape(lg.shape[0], -1)).mean()
                            opt.zero_grad(set_to_none=True)
                            loss.backward()
                        opt.step()
                    assert lg is not None  # steps >= 1
                    logits.append(lg.detach().reshape(lg.shape[0], -1).float())
                    if emb is not None:
                        embs.append(emb.detach().reshape(emb.shape[0], -1).float())
        finally:
            opt.zero_grad(set_to_none=True)
            for p, f in flags.items():
                p.requires_grad_(f)
        return {
            "embeddings": in_input_order(embs, order) if self.outputs.has_embeddings else None,
            "logits": in_input_order(logits, order),
        }


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``H(softmax(logits))`` per row (nats), the objective TENT minimises [Wang et al. 2021, eq. 2]."""
    return -(logits.softmax(1) * logits.log_softmax(1)).sum(1)
