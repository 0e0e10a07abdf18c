"""Gradient attacks in pixel space: FGSM, BIM and PGD under an L-infinity or L2 budget.

- :func:`fgsm` -- one signed (L-inf) or normalised (L2) gradient step of size ``eps``
  (Goodfellow et al. 2015; its L2 form is the "fast gradient method").
- :func:`bim` -- ``steps`` such steps of size ``step_size``, each followed by the projection onto
  the budget (Kurakin et al. 2017).
- :func:`pgd` -- BIM from a uniformly random start inside the budget (Madry et al. 2018).
- :class:`AttackSpec` -- one of the three with its parameters and a stable name (``"pgd-linf"``),
  with ``eps`` kept apart so that it can serve as the severity of a shift grid.

Images are **pixels**, as everywhere in shiftguard: ``uint8`` (read as ``v / 255``) or floating point
in ``bounds`` (default ``[0, 1]``). The attack moves the pixels; ``preprocess`` (the user's
normalisation) runs between the pixels and the model, inside the gradient. Every iterate is the
Euclidean projection onto the *feasible set* ``B(x, eps) ∩ [lo, hi]^D``: the clamp to ``bounds`` is
what makes an image valid here, and it is part of the projection, not a repair after it. For L-inf
the feasible set is a box (a clamp is its exact projection). For L2 the exact projection is
``x + clamp(t * (y - x), lo - x, hi - x)`` with the largest ``t`` in ``[0, 1]`` inside the ball (the KKT
conditions of the separable problem), found by bisection; the usual "project onto the ball, then
clamp" is feasible but not the nearest point, and breaks the ascent property of projected gradient
steps that the tests check.

[NED, Sec. 5] attacks its deep-metric-learning models with FGSM, BIM and PGD (L-inf, PGD 40 steps of
0.01, BIM 10 steps of 0.02) through their training loss: pass any ``shiftguard.losses`` loss as
``loss_fn`` and a model that returns the embedding. See ``docs/adversarial.md``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard._validation import as_tensor, check_labels, check_positive

__all__ = ["ATTACK_NAMES", "NORMS", "AttackSpec", "bim", "fgsm", "pgd"]

#: The attacks :class:`AttackSpec` knows, in the order of their generality.
ATTACK_NAMES = ("fgsm", "bim", "pgd")
#: The perturbation budgets: ``||delta||_inf <= eps`` or ``||delta||_2 <= eps`` (per image).
NORMS = ("linf", "l2")

Bounds = Optional[Sequence[float]]
Preprocess = Optional[Callable[[torch.Tensor], torch.Tensor]]
LossFn = Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
#: ``make_projector(x)`` -> ``project(y)``: the projection onto the feasible set of the clean batch ``x``.
ProjectorFactory = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]

#: Bisection steps of the exact L2-ball-and-box projection: the scale ``t`` in [0, 1] to 2^-60.
_BISECTION_STEPS = 60


# ---------------------------------------------------------------------------------------- validation


def check_norm(norm) -> str:
    """``norm`` as one of :data:`NORMS` (``"inf"`` / ``"Linf"`` / ``"L2"`` / ``2`` accepted); ``ValueError`` else."""
    key = str(norm).strip().lower().replace("-", "").replace("_", "")
    key = {"inf": "linf", "linfinity": "linf", "2": "l2"}.get(key, key)
    if key not in NORMS:
        raise ValueError(f"norm: expected one of {', '.join(NORMS)}, got {norm!r}")
    return key


def check_bounds(bounds) -> Optional[tuple[float, float]]:
    """``bounds`` as ``(lo, hi)`` floats with ``lo < hi``, or ``None`` (no pixel range)."""
    if bounds is None:
        return None
    try:
        lo, hi = (float(b) for b in bounds)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"bounds: expected a pair (lo, hi) of numbers or None, got {bounds!r}") from exc
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"bounds: expected finite lo < hi, got {bounds!r}")
    return lo, hi


def check_pixels(images, name: str, bounds: Optional[tuple[float, float]]) -> tuple[torch.Tensor, torch.dtype]:
    """Pixels as a floating tensor to attack, and the dtype to return them in.

    ``uint8`` becomes float32 ``v / 255``; float32 and float64 stay; other floating dtypes are
    attacked in float32. Raises ``TypeError`` for other dtypes, ``ValueError`` for fewer than two
    dimensions, an empty batch, non-finite values or values outside ``bounds``.
    """
    t = as_tensor(images, name)
    dtype = t.dtype
    if dtype == torch.uint8:
        work = t.float().div(255.0)
    elif t.is_floating_point():
        work = t if dtype in (torch.float32, torch.float64) else t.float()
    else:
        raise TypeError(f"{name}: expected uint8 or floating-point pixels, got dtype {dtype}")
    if work.dim() < 2:
        raise ValueError(f"{name}: expected a batch (N, ...) with N images, got shape {tuple(work.shape)}")
    if work.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one image, got shape {tuple(work.shape)}")
    if not bool(torch.isfinite(work).all()):
        raise ValueError(f"{name}: contains non-finite values")
    if bounds is not None:
        lo, hi = float(work.min()), float(work.max())
        if lo < bounds[0] or hi > bounds[1]:
            raise ValueError(
                f"{name}: pixels must lie in bounds [{bounds[0]}, {bounds[1]}] "
                f"(uint8 is read as v / 255), got values in [{lo:.4g}, {hi:.4g}]"
            )
    return work, dtype


def check_callable(value, name: str) -> None:
    """Raise ``TypeError`` unless ``value`` is ``None`` or callable."""
    if value is not None and not callable(value):
        raise TypeError(f"{name}: expected a callable or None, got {type(value).__name__}")


def check_batch_size(batch_size) -> int:
    return check_positive(batch_size, "batch_size", integer=True)


def default_device(model: nn.Module, images: torch.Tensor) -> torch.device:
    """The device of the model's first parameter or buffer, else that of ``images``."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return images.device


# ----------------------------------------------------------------------------------------- internals


@contextlib.contextmanager
def eval_mode(*modules) -> Iterator[None]:
    """Every ``nn.Module`` among ``modules`` in eval mode inside, each submodule's flag restored after.

    Eval mode freezes BatchNorm statistics and makes losses with training-time side effects
    (the adaptive scale of ProxyDR) pure functions of their input.
    """
    flags = [(m, m.training) for mod in modules if isinstance(mod, nn.Module) for m in mod.modules()]
    for mod in modules:
        if isinstance(mod, nn.Module):
            mod.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def cross_entropy_sum(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The default attack loss: summed cross-entropy of logits ``(B, C)`` (sum, so that every image's
    gradient is its own loss's gradient whatever the batch size)."""
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2:
        shape = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise ValueError(
            f"model: the default loss_fn (cross-entropy) needs logits (N, C), got {shape}; "
            "pass loss_fn for other outputs"
        )
    return F.cross_entropy(outputs, labels, reduction="sum")


def input_gradient(
    model: nn.Module, x: torch.Tensor, labels: torch.Tensor, loss_fn: Callable, preprocess: Preprocess
) -> torch.Tensor:
    """``d loss_fn(model(preprocess(x)), labels) / d x``; nothing accumulates in any ``.grad``."""
    with torch.enable_grad():
        xr = x.detach().requires_grad_(True)
        out = model(preprocess(xr) if preprocess is not None else xr)
        loss = loss_fn(out, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            if isinstance(loss, torch.Tensor) and loss.dim() == 1 and loss.shape[0] == x.shape[0]:
                loss = loss.sum()  # per-image losses: each image ascends its own
            else:
                raise ValueError(
                    "loss_fn: expected a scalar loss (or one per image), got "
                    f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
                )
        (grad,) = torch.autograd.grad(loss.reshape(()), xr, allow_unused=True)
    if grad is None:
        raise ValueError("model: the loss does not depend on the images through a differentiable path")
    return grad.detach()


def steepest_direction(grad: torch.Tensor, norm: str) -> torch.Tensor:
    """The unit-norm ascent direction of the budget's norm: ``sign(g)`` (L-inf) or ``g / ||g||_2`` per
    image (L2; an image with a zero gradient does not move)."""
    if norm == "linf":
        return grad.sign()
    flat = grad.flatten(1)
    n = flat.norm(dim=1, keepdim=True)
    unit = torch.where(n > 0, flat / n.clamp_min(torch.finfo(grad.dtype).tiny), torch.zeros_like(flat))
    return unit.view_as(grad)


def project_ball_box(
    y: torch.Tensor, x: torch.Tensor, eps: float, norm: str, bounds: Optional[tuple[float, float]]
) -> torch.Tensor:
    """Euclidean projection of ``y`` onto ``B(x, eps) ∩ [lo, hi]^D`` (per image; ``x`` feasible).

    L-inf: a clamp to the intersection box. L2: ``x + clamp(t d, lo - x, hi - x)`` with ``d = y - x`` and
    the largest ``t`` in ``[0, 1]`` whose point lies in the ball (``||clamp(t d, ...)||`` grows with ``t``
    because the box holds 0); ``t = 1`` where ``clamp(d)`` already does (module docstring).
    ``eps = inf`` leaves the box alone.
    """
    if norm == "linf":
        lo_t = x - eps
        hi_t = x + eps
        if bounds is not None:
            lo_t = lo_t.clamp_min(bounds[0])
            hi_t = hi_t.clamp_max(bounds[1])
        return torch.maximum(torch.minimum(y, hi_t), lo_t)
    d = (y - x).flatten(1)
    xf = x.flatten(1)

    def clamped(t: torch.Tensor) -> torch.Tensor:
        v = d * t
        if bounds is not None:
            v = torch.minimum(torch.maximum(v, bounds[0] - xf), bounds[1] - xf)
        return v

    full = clamped(torch.ones(d.shape[0], 1, dtype=d.dtype, device=d.device))
    if math.isinf(eps):
        return (xf + full).view_as(y)
    inside = full.norm(dim=1) <= eps
    if bool(inside.all()):
        return (xf + full).view_as(y)
    if bounds is None:
        n = d.norm(dim=1, keepdim=True)
        t = torch.where(inside.unsqueeze(1), torch.ones_like(n), eps / n.clamp_min(torch.finfo(d.dtype).tiny))
        return (xf + d * t).view_as(y)
    lo = torch.zeros(d.shape[0], 1, dtype=d.dtype, device=d.device)
    hi = torch.ones_like(lo)
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        ok = clamped(mid).norm(dim=1, keepdim=True) <= eps
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    # lo is feasible at every step (t = 0 gives the centre), so the result stays in the ball.
    v = torch.where(inside.unsqueeze(1), full, clamped(lo))
    return (xf + v).view_as(y)


def random_start_noise(
    shape: Sequence[int], eps: float, norm: str, dtype: torch.dtype, generator: Optional[torch.Generator]
) -> torch.Tensor:
    """Noise uniform in the budget's ball for ``shape[0]`` images, drawn at once so that the start of an
    image does not depend on the batch size: L-inf ``U(-eps, eps)`` per pixel; L2 a Gaussian direction
    with radius ``eps * U^(1 / D)`` (uniform in the ball's volume; ``D`` pixels per image)."""
    device = generator.device if generator is not None else torch.device("cpu")
    if norm == "linf":
        u = torch.rand(tuple(shape), generator=generator, device=device, dtype=torch.float64)
        return ((2.0 * u - 1.0) * eps).to(dtype)
    n = int(shape[0])
    dim = math.prod(int(s) for s in shape[1:])
    g = torch.randn(n, dim, generator=generator, device=device, dtype=torch.float64)
    r = torch.rand(n, 1, generator=generator, device=device, dtype=torch.float64).pow(1.0 / dim) * eps
    g = g / g.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return (g * r).view(tuple(shape)).to(dtype)


def quantise_like(adv: torch.Tensor, clean: torch.Tensor, dtype: torch.dtype, eps: float, norm: str) -> torch.Tensor:
    """Return ``adv`` in ``dtype``. For ``uint8`` the perturbation is rounded to whole levels without
    leaving the budget: to the nearest level within ``floor(255 eps)`` levels (L-inf), truncated toward
    the clean image (L2, where rounding up could leave the ball)."""
    if dtype != torch.uint8:
        return adv.to(dtype)
    levels = (adv - clean) * 255.0
    if norm == "linf":
        budget = math.floor(255.0 * eps + 1e-6) if math.isfinite(eps) else 255
        k = levels.round().clamp(-budget, budget)
    else:
        k = levels.trunc()
    return (clean * 255.0).round().add(k).clamp(0, 255).to(torch.uint8)


def run_attack(
    model: nn.Module,
    images,
    labels,
    eps: float,
    *,
    norm: str,
    steps: int,
    step_size: float,
    random_start: bool,
    targeted: bool,
    loss_fn: LossFn,
    preprocess: Preprocess,
    bounds: Optional[tuple[float, float]],
    batch_size: int,
    generator: Optional[torch.Generator],
    device,
    make_projector: Optional[ProjectorFactory] = None,
    quantise: bool = True,
) -> torch.Tensor:
    """The shared loop of every attack here (validated arguments): ``steps`` projected steepest-ascent
    steps of ``step_size`` from ``x`` or a random start, per batch of ``batch_size`` images."""
    work, dtype = check_pixels(images, "images", bounds)
    y = check_labels(labels, "labels", n=work.shape[0])
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    check_callable(loss_fn, "loss_fn")
    check_callable(preprocess, "preprocess")
    loss = loss_fn if loss_fn is not None else cross_entropy_sum
    dev = torch.device(device) if device is not None else default_device(model, work)

    def ball_projector(xb: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda v: project_ball_box(v, xb, eps, norm, bounds)

    projector = make_projector if make_projector is not None else ball_projector
    noise = random_start_noise(work.shape, eps, norm, work.dtype, generator) if random_start else None
    out = torch.empty_like(work)
    with eval_mode(model, loss_fn):
        for start in range(0, work.shape[0], batch_size):
            sl = slice(start, start + batch_size)
            xb, yb = work[sl].to(dev), y[sl].to(dev)
            project = projector(xb)
            adv = project(xb + noise[sl].to(dev)) if noise is not None else xb.clone()
            for _ in range(steps):
                g = input_gradient(model, adv, yb, loss, preprocess)
                direction = steepest_direction(g, norm)
                adv = project(adv - step_size * direction if targeted else adv + step_size * direction)
            out[sl] = adv.detach().to(out.device)
    if not quantise:
        return out
    return quantise_like(out, work, dtype, eps, norm)


def _check_attack_args(eps, steps, step_size, norm) -> tuple[float, int, Optional[float], str]:
    eps = float(check_positive(eps, "eps", strict=False))
    steps = check_positive(steps, "steps", integer=True)
    if step_size is not None:
        step_size = float(check_positive(step_size, "step_size"))
    return eps, steps, step_size, check_norm(norm)


# -------------------------------------------------------------------------------------------- public


def fgsm(
    model: nn.Module,
    images,
    labels,
    eps: float,
    *,
    norm: str = "linf",
    targeted: bool = False,
    loss_fn: LossFn = None,
    preprocess: Preprocess = None,
    bounds: Bounds = (0.0, 1.0),
    batch_size: int = 256,
    device=None,
) -> torch.Tensor:
    """Fast gradient sign method (Goodfellow et al. 2015): ``x + eps * sign(grad_x L)``, projected.

    Args:
        model: any ``nn.Module``; run in eval mode (BatchNorm and QACT running statistics do not move;
            a QACT layer keeps its context mode: ``"batch"`` makes the attacked batch its own context,
            ``"frozen"`` uses the stored statistics), each submodule's training flag restored after.
            Its parameters' ``requires_grad`` are not touched and no ``.grad`` is written.
        images: pixels ``(N, ...)``: ``uint8``, or float in ``bounds``.
        labels: ``(N,)`` int class labels; with ``targeted=True`` the target classes.
        eps: the budget, ``>= 0`` in pixel units (``8 / 255`` is 8 levels); ``0`` returns the images.
        norm: ``"linf"`` (signed step) or ``"l2"`` (step ``eps * g / ||g||_2`` per image).
        targeted: descend the loss of ``labels`` instead of ascending it.
        loss_fn: ``loss_fn(model_output, labels) -> scalar`` (or per-image ``(N,)``, summed); default the
            summed cross-entropy of logits. Any ``shiftguard.losses`` loss attacks an embedding model
            through its training loss [NED, Sec. 5]; losses over pairs in a batch (triplet, ...) make an
            image's attack depend on the other images of its batch.
        preprocess: callable applied to the pixels before the model, inside the gradient.
        bounds: the valid pixel range (the feasible set is ``B(x, eps) ∩ [lo, hi]^D``); ``None`` for
            unbounded inputs (features, not images).
        batch_size: images per forward/backward pass (memory bound).
        device: where the model runs (default: the device of its parameters).

    Returns:
        The adversarial images, detached, with the shape, dtype and device of ``images`` (``uint8``:
        the perturbation rounded to whole levels within the budget).

    Raises:
        TypeError: ``model`` not a module; ``images`` of another dtype; non-callable ``loss_fn`` /
            ``preprocess``.
        ValueError: ``eps < 0``; unknown ``norm``; ``images`` outside ``bounds`` or non-finite;
            ``labels`` not ``(N,)`` non-negative ints; a loss without a gradient path to the images.
    """
    eps, _, _, norm = _check_attack_args(eps, 1, None, norm)
    return run_attack(
        model,
        images,
        labels,
        eps,
        norm=norm,
        steps=1,
        step_size=eps,
        random_start=False,
        targeted=bool(targeted),
        loss_fn=loss_fn,
        preprocess=preprocess,
        bounds=check_bounds(bounds),
        batch_size=check_batch_size(batch_size),
        generator=None,
        device=device,
    )


def default_step_size(attack: str, eps: float, steps: int) -> float:
    """The step size when none is given: ``1.25 eps / steps`` for BIM (Kurakin et al. 2017 take one
    level per step for ``min(eps + 4, 1.25 eps)`` steps, a path of about ``1.25 eps``) and
    ``2.5 eps / steps`` for PGD (a path that crosses the ball from a random start)."""
    return (2.5 if attack == "pgd" else 1.25) * eps / steps


def bim(
    model: nn.Module,
    images,
    labels,
    eps: float,
    *,
    steps: int = 10,
    step_size: Optional[float] = None,
    norm: str = "linf",
    targeted: bool = False,
    loss_fn: LossFn = None,
    preprocess: Preprocess = None,
    bounds: Bounds = (0.0, 1.0),
    batch_size: int = 256,
    device=None,
) -> torch.Tensor:
    """Basic iterative method (Kurakin et al. 2017): ``steps`` FGSM steps of ``step_size`` from the clean
    images, each projected onto ``B(x, eps) ∩ [lo, hi]^D``.

    ``step_size`` defaults to ``1.25 * eps / steps`` (:func:`default_step_size`); [NED, Sec. 5] uses
    10 steps of 0.02. Other arguments, the return value and the errors are those of :func:`fgsm`;
    ``steps < 1`` and ``step_size <= 0`` raise ``ValueError``.
    """
    eps, steps, step_size, norm = _check_attack_args(eps, steps, step_size, norm)
    alpha = step_size if step_size is not None else default_step_size("bim", eps, steps)
    return run_attack(
        model,
        images,
        labels,
        eps,
        norm=norm,
        steps=steps,
        step_size=alpha,
        random_start=False,
        targeted=bool(targeted),
        loss_fn=loss_fn,
        preprocess=preprocess,
        bounds=check_bounds(bounds),
        batch_size=check_batch_size(batch_size),
        generator=None,
        device=device,
    )


def pgd(
    model: nn.Module,
    images,
    labels,
    eps: float,
    *,
    steps: int = 10,
    step_size: Optional[float] = None,
    random_start: bool = True,
    norm: str = "linf",
    targeted: bool = False,
    loss_fn: LossFn = None,
    preprocess: Preprocess = None,
    bounds: Bounds = (0.0, 1.0),
    batch_size: int = 256,
    generator: Optional[torch.Generator] = None,
    device=None,
) -> torch.Tensor:
    """Projected gradient descent (Madry et al. 2018): BIM from a random start uniform in the ball.

    The start is drawn for all images at once from ``generator`` (default: torch's global generator),
    so the result is the same for every ``batch_size`` and reproducible from a seeded generator.
    ``step_size`` defaults to ``2.5 * eps / steps`` (:func:`default_step_size`); [NED, Sec. 5] uses
    40 steps of 0.01. ``random_start=False`` is BIM. Other arguments, the return value and the errors
    are those of :func:`fgsm`.
    """
    eps, steps, step_size, norm = _check_attack_args(eps, steps, step_size, norm)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    alpha = step_size if step_size is not None else default_step_size("pgd", eps, steps)
    return run_attack(
        model,
        images,
        labels,
        eps,
        norm=norm,
        steps=steps,
        step_size=alpha,
        random_start=bool(random_start),
        targeted=bool(targeted),
        loss_fn=loss_fn,
        preprocess=preprocess,
        bounds=check_bounds(bounds),
        batch_size=check_batch_size(batch_size),
        generator=generator,
        device=device,
    )


@dataclass(frozen=True)
class AttackSpec:
    """One attack with its parameters: the single entry point of adversarial shift in a grid.

    Attributes:
        attack: ``"fgsm"``, ``"bim"`` or ``"pgd"``.
        norm: ``"linf"`` or ``"l2"``.
        eps: the budget (the severity of the shift axis); ``>= 0``.
        steps: iterations of BIM / PGD (FGSM takes one step of ``eps``).
        step_size: per-step size; ``None`` = :func:`default_step_size`.
        random_start: PGD's random start; ``None`` = True for PGD. Only PGD has one.
        targeted: ``labels`` passed to :meth:`run` are target classes.

    ``name`` (``"pgd-linf"``, ``"fgsm-l2-targeted"``) names the attack without ``eps``, stably:
    :meth:`parse` reads it back.

    >>> spec = AttackSpec.parse("pgd-linf", eps=8 / 255)
    >>> spec.name, spec.steps, spec.random_start
    ('pgd-linf', 10, True)
    """

    attack: str = "pgd"
    norm: str = "linf"
    eps: float = 8.0 / 255.0
    steps: int = 10
    step_size: Optional[float] = None
    random_start: Optional[bool] = field(default=None)
    targeted: bool = False

    def __post_init__(self) -> None:
        attack = str(self.attack).strip().lower()
        if attack not in ATTACK_NAMES:
            raise ValueError(f"attack: expected one of {', '.join(ATTACK_NAMES)}, got {self.attack!r}")
        eps, steps, step_size, norm = _check_attack_args(self.eps, self.steps, self.step_size, self.norm)
        random_start = self.random_start
        if random_start is None:
            random_start = attack == "pgd"
        elif attack != "pgd" and random_start:
            raise ValueError(f"random_start: only pgd has a random start, got random_start=True for {attack!r}")
        for key, value in (
            ("attack", attack),
            ("norm", norm),
            ("eps", eps),
            ("steps", steps),
            ("step_size", step_size),
            ("random_start", bool(random_start)),
            ("targeted", bool(self.targeted)),
        ):
            object.__setattr__(self, key, value)

    @property
    def name(self) -> str:
        """``"<attack>-<norm>"``, with ``"-targeted"`` appended for targeted attacks."""
        return f"{self.attack}-{self.norm}" + ("-targeted" if self.targeted else "")

    @classmethod
    def parse(cls, name: str, **kwargs) -> "AttackSpec":
        """The spec named ``name``: ``"<attack>[-<norm>][-targeted]"`` (``"fgsm"``, ``"pgd-l2"``,
        ``"bim-linf-targeted"``; case, ``_`` and ``-`` are free; the norm defaults to ``linf``).
        ``kwargs`` set the other fields (``eps``, ``steps``, ...).

        Raises:
            TypeError: ``name`` is not a str.
            ValueError: an unknown attack or norm in ``name``, or a field given twice.
        """
        if not isinstance(name, str):
            raise TypeError(f"name: expected a str, got {type(name).__name__}")
        parts = [p for p in name.strip().lower().replace("_", "-").split("-") if p]
        targeted = bool(parts) and parts[-1] == "targeted"
        if targeted:
            parts = parts[:-1]
        if not parts or len(parts) > 2 or parts[0] not in ATTACK_NAMES:
            raise ValueError(
                f"name: expected '<attack>[-<norm>][-targeted]' with attack in "
                f"{', '.join(ATTACK_NAMES)} and norm in {', '.join(NORMS)}, got {name!r}"
            )
        fields: dict[str, Any] = {"attack": parts[0], "norm": check_norm(parts[1]) if len(parts) == 2 else "linf"}
        if targeted:
            fields["targeted"] = True
        clash = sorted(set(fields) & set(kwargs))
        if clash:
            raise ValueError(f"name: {name!r} already sets {', '.join(clash)}; do not pass them again")
        return cls(**fields, **kwargs)

    def with_eps(self, eps: float) -> "AttackSpec":
        """The same attack with budget ``eps``."""
        return replace(self, eps=eps)

    def run(
        self,
        model: nn.Module,
        images,
        labels,
        *,
        preprocess: Preprocess = None,
        loss_fn: LossFn = None,
        seed: int = 0,
        batch_size: int = 256,
        bounds: Bounds = (0.0, 1.0),
        device=None,
    ) -> torch.Tensor:
        """Attack ``images`` (see :func:`fgsm` for the arguments, the return value and the errors).

        ``seed`` seeds a CPU generator for PGD's random start: the same spec, seed and images give the
        same result on any device and for any ``batch_size``.
        """
        seed = check_positive(seed, "seed", strict=False, integer=True)
        if self.attack == "fgsm":
            return fgsm(
                model,
                images,
                labels,
                self.eps,
                norm=self.norm,
                targeted=self.targeted,
                loss_fn=loss_fn,
                preprocess=preprocess,
                bounds=bounds,
                batch_size=batch_size,
                device=device,
            )
        if self.attack == "bim":
            return bim(
                model,
                images,
                labels,
                self.eps,
                steps=self.steps,
                step_size=self.step_size,
                norm=self.norm,
                targeted=self.targeted,
                loss_fn=loss_fn,
                preprocess=preprocess,
                bounds=bounds,
                batch_size=batch_size,
                device=device,
            )
        gen = torch.Generator().manual_seed(seed) if self.random_start else None
        return pgd(
            model,
            images,
            labels,
            self.eps,
            steps=self.steps,
            step_size=self.step_size,
            random_start=bool(self.random_start),
            norm=self.norm,
            targeted=self.targeted,
            loss_fn=loss_fn,
            preprocess=preprocess,
            bounds=bounds,
            batch_size=batch_size,
            generator=gen,
            device=device,
        )
