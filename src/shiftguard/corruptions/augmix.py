"""AugMix (Hendrycks, Mu, Cubuk, Zoph, Gilmer, Lakshminarayanan, ICLR 2020): a training augmentation.

Each image becomes ``m * x + (1 - m) * sum_i w_i * chain_i(x)`` (the paper's Sec. 3, Algorithm 1):
``width`` chains (default 3), each a sequence of ``depth`` operations (``depth=-1``: a depth uniform
in 1..3 per chain and image), each operation drawn uniformly from the operation list and applied
with a magnitude drawn uniformly in ``[0.1, severity)`` on the 1..10 scale of the official code
(google-research/augmix ``augmentations.py``, "aug_severity" 3); ``w ~ Dirichlet(alpha, ...,
alpha)`` over the chains and ``m ~ Beta(alpha, alpha)``. The official training script weights the
clean image by ``1 - m``; ``Beta(alpha, alpha)`` is symmetric, so both forms have the same law.

Operations (:data:`OPS`) follow the official PIL ones, on float images:

* ``autocontrast`` -- per image and channel, ``(x - min) / (max - min)`` (the continuous form of
  PIL's ``ImageOps.autocontrast`` look-up table); a constant channel is unchanged.
* ``equalize`` -- PIL's ``ImageOps.equalize`` on the 8-bit levels ``round(255 x)`` per image and
  channel; the output lies on the 256 levels.
* ``posterize`` -- keep ``4 - int(level * 4 / 10)`` bits of ``round(255 x)`` (PIL ``posterize``).
* ``solarize`` -- ``1 - x`` where ``round(255 x) >= 256 - int(level * 256 / 10)``, else ``x``.
* ``rotate`` -- ``int(level * 30 / 10)`` degrees about the image centre, random sign.
* ``shear_x`` / ``shear_y`` -- PIL ``AFFINE (1, s, 0, 0, 1, 0)`` / ``(1, 0, 0, s, 1, 0)`` with
  ``s = level * 0.3 / 10``, random sign (a shear about the top row / left column).
* ``translate_x`` / ``translate_y`` -- ``int(level * side / 3 / 10)`` pixels, random sign (the
  official ``IMAGE_SIZE / 3`` with the image's own width / height).

The geometric ones reuse the corruption engine's bilinear warp (:func:`._ops.affine_warp`, zero
fill as PIL's ``transform``); in pixel-index coordinates PIL's affine map of the pixel centres
``(x + 0.5, y + 0.5)`` becomes the half-pixel offsets written in the matrices below.

Operation sets per suite (:func:`augmix_ops`): the official list (the nine above) leaves out
the operations that overlap the ImageNet-C test corruptions (contrast, colour, brightness,
sharpness). An operation that *is* a test corruption of the suite the model is evaluated on must
be left out as well, or the evaluation measures training on the test shift: MNIST-C has
``rotate``, ``shear`` and ``translate`` among its corruptions, so ``"mnist-c"`` keeps
autocontrast, equalize, posterize and solarize; ``"cifar-c"`` keeps the official nine.

Images: ``(N, C, H, W)`` with C in {1, 3} and H, W >= 8, float in [0, 1] or ``uint8`` (0..255),
checked as :func:`shiftguard.corruptions.corrupt` checks them. The result is floating point in
[0, 1]: float input keeps its dtype (float16 / bfloat16 computed in float32), ``uint8`` input
returns float32 (a mixture of images is not on the 8-bit grid; re-quantising it would add
rounding the paper does not have). All randomness comes from the ``generator`` (or torch's global
generator when it is None), drawn on the generator's device whatever the images' device, in a
fixed order that does not depend on the pixel values: the same generator state gives the same
output, and every image draws its own chains.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from . import _ops
from .engine import SUITE_REGISTRY, _check_images, names
from .mnist_c import _centred

Tensor = torch.Tensor

__all__ = ["AugMix", "OPS", "AUGMENTATIONS", "augmix_ops", "jensen_shannon_consistency", "JSD_WEIGHT", "MIXTURE_CLAMP"]

#: An operation: ``op(x (n, C, H, W) float in [0, 1], level (n,) float64 in [0.1, severity),
#: sign (n,) float64 in {-1, +1}) -> (n, C, H, W)`` in [0, 1].
Op = Callable[[Tensor, Tensor, Tensor], Tensor]

#: The consistency weight lambda of the official training script.
JSD_WEIGHT = 12.0

#: The mixture distribution is clamped to ``[MIXTURE_CLAMP, 1]`` before its log (official code).
MIXTURE_CLAMP = 1e-7


# ----------------------------------------------------------------------------- magnitudes


def _int_parameter(level: Tensor, maxval: float) -> Tensor:
    """``int(level * maxval / 10)`` of the official code (level > 0, so truncation is floor)."""
    return torch.floor(level * maxval / 10)


def _float_parameter(level: Tensor, maxval: float) -> Tensor:
    return level * maxval / 10


def _levels(x: Tensor) -> Tensor:
    """The 8-bit level ``round(255 x)`` of every value, int64 in 0..255."""
    return (x * 255).round_().clamp_(0, 255).long()


def _per_image(t: Tensor, x: Tensor) -> Tensor:
    """An ``(n,)`` tensor shaped to broadcast against ``x`` (n, C, H, W)."""
    return t.to(x.dtype).view(-1, 1, 1, 1)


# ----------------------------------------------------------------------------- colour operations


def autocontrast(x: Tensor, level: Tensor, sign: Tensor) -> Tensor:
    """Stretch every channel of every image to [0, 1]; a constant channel is left unchanged."""
    lo = x.amin(dim=(2, 3), keepdim=True)
    hi = x.amax(dim=(2, 3), keepdim=True)
    flat = hi <= lo
    scale = torch.where(flat, torch.ones_like(hi), 1.0 / (hi - lo).clamp_min(1e-12))
    return ((x - torch.where(flat, torch.zeros_like(lo), lo)) * scale).clamp_(0, 1)


def equalize(x: Tensor, level: Tensor, sign: Tensor) -> Tensor:
    """PIL ``ImageOps.equalize`` per image and channel on the levels ``round(255 x)``.

    PIL's table: ``step = (count of all pixels - count of the highest level present) // 255``;
    ``lut[i] = (step // 2 + count of pixels below level i) // step``; a channel with one level, or
    with ``step == 0``, is unchanged. Integer arithmetic, as PIL's."""
    n, C, H, W = x.shape
    v = _levels(x).view(n * C, H * W)
    rows = torch.arange(n * C, device=x.device)
    hist = torch.bincount((v + rows[:, None] * 256).view(-1), minlength=n * C * 256).view(n * C, 256)
    total = hist.sum(1)
    top = torch.where(hist > 0, torch.arange(256, device=x.device), -1).amax(1)  # highest level present
    step = (total - hist.gather(1, top[:, None])[:, 0]) // 255
    below = hist.cumsum(1) - hist
    lut = ((step[:, None] // 2 + below) // step.clamp_min(1)[:, None]).clamp_(max=255)
    identity = torch.arange(256, device=x.device).expand_as(lut)
    lut = torch.where((step == 0)[:, None], identity, lut)
    return (lut.gather(1, v).to(x.dtype) / 255).view(n, C, H, W)


def posterize(x: Tensor, level: Tensor, sign: Tensor) -> Tensor:
    """PIL ``ImageOps.posterize`` with ``4 - int(level * 4 / 10)`` bits, on ``round(255 x)``."""
    bits = 4 - _int_parameter(level, 4).long()
    q = (2 ** (8 - bits)).view(-1, 1, 1, 1)
    v = _levels(x)
    return (v - v % q).to(x.dtype) / 255


def solarize(x: Tensor, level: Tensor, sign: Tensor) -> Tensor:
    """PIL ``ImageOps.solarize`` with threshold ``256 - int(level * 256 / 10)``: invert the values
    whose 8-bit level reaches the threshold (``255 x >= threshold - 0.5``), keep the others."""
    threshold = 256 - _int_parameter(level, 256)
    return torch.where(x * 255 >= _per_image(threshold, x) - 0.5, 1 - x, x)


# ----------------------------------------------------------------------------- geometric operations


def _affine(x: Tensor, rows: tuple[tuple[Tensor | float, ...], ...]) -> Tensor:
    """:func:`._ops.affine_warp` with the per-image inverse map whose entries are ``rows``
    (2 x 3, each a float or an (n,) tensor); zero fill outside the image."""
    n = x.shape[0]
    M = torch.zeros(n, 2, 3, dtype=torch.float64, device=x.device)
    for r, row in enumerate(rows):
        for c, v in enumerate(row):
            M[:, r, c] = v
    return _ops.affine_warp(x, M, "zeros").clamp_(0, 1)


def rotate(x: Tensor, level: Tensor, sign: Tensor) -> Tensor:
    """``int(level * 30 / 10)`` degrees about the centre (PIL ``rotate``, bilinear, black fill)."""
    H, W = x.shape[-2:]
    a = torch.deg2rad(_int_parameter(level, 30) * sign)
    cos, sin = torch.cos(a), torch.sin(a)
    L = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], 1)
    return _ops.affine_warp(x, _centred(L, H, W), "zeros").clamp_(0, 1)


def shear_x(x: Tensor, level: Tensor, sign: Tensor) -> Tensor:
    """PIL ``AFFINE (1, s, 0, 0, 1, 0)``: pixel ``(col, row)`` reads ``(col + s (row + 0.5), row)``."""
    s = _float_parameter(level, 0.3) * sign
    return _affine(x, ((1.0, s, 0.5 * s), (0.0, 1.0, 0.0)))


def shear_y(x: Tensor, level: Tensor, sign: Tensor) -> Tensor:
    """PIL ``AFFINE (1, 0, 0, s, 1, 0)``: pixel ``(col, row)`` reads ``(col, row + s (col + 0.5))``."""
    s = _float_parameter(level, 0.3) * sign
    return _affine(x, ((1.0, 0.0, 0.0), (s, 1.0, 0.5 * s)))


def translate_x(x: Tensor, level: Tensor, sign: Tensor) -> Tensor:
    """Shift by ``int(level * W / 3 / 10)`` whole pixels along the rows, black fill."""
    t = _int_parameter(level, x.shape[-1] / 3) * sign
    return _affine(x, ((1.0, 0.0, t), (0.0, 1.0, 0.0)))


def translate_y(x: Tensor, level: Tensor, sign: Tensor) -> Tensor:
    """Shift by ``int(level * H / 3 / 10)`` whole pixels along the columns, black fill."""
    t = _int_parameter(level, x.shape[-2] / 3) * sign
    return _affine(x, ((1.0, 0.0, 0.0), (0.0, 1.0, t)))


#: The operations by name.
OPS: dict[str, Op] = {
    "autocontrast": autocontrast,
    "equalize": equalize,
    "posterize": posterize,
    "rotate": rotate,
    "solarize": solarize,
    "shear_x": shear_x,
    "shear_y": shear_y,
    "translate_x": translate_x,
    "translate_y": translate_y,
}

#: The official default list ``augmentations`` (order as there).
AUGMENTATIONS: tuple[str, ...] = tuple(OPS)

#: Operation -> the test corruptions it reproduces: it is left out for a suite that has any of them.
_OVERLAPS: dict[str, tuple[str, ...]] = {
    "rotate": ("rotate",),
    "shear_x": ("shear",),
    "shear_y": ("shear",),
    "translate_x": ("translate",),
    "translate_y": ("translate",),
}


def augmix_ops(suite: str) -> list[str]:
    """The operations of :data:`AUGMENTATIONS` that are no test corruption of ``suite``.

    ``"mnist-c"`` -> autocontrast, equalize, posterize, solarize (rotate, shear and translate are
    MNIST-C corruptions); ``"cifar-c"`` and ``"cifar-c-extra"`` -> the official nine.

    Raises:
        TypeError / ValueError: ``suite`` is not a str / not a known suite (the message names
            ``suite`` and lists the suites).
    """
    corruptions = set(names(SUITE_REGISTRY.canonical(suite)))
    return [op for op in AUGMENTATIONS if not corruptions.intersection(_OVERLAPS.get(op, ()))]


# ----------------------------------------------------------------------------- random draws


def _log_gamma(shape: tuple[int, ...], alpha: float, gen: Optional[torch.Generator], device) -> Tensor:
    """Logs of ``Gamma(alpha, 1)`` draws (float64), Marsaglia & Tsang (2000): for ``alpha >= 1``
    ``d v`` with ``d = alpha - 1/3``, ``v = (1 + z / sqrt(9 d))^3``, z standard normal, accepted when
    ``log u < z^2 / 2 + d - d v + d log v``; for ``alpha < 1`` a ``Gamma(alpha + 1)`` draw times
    ``u^(1 / alpha)``. Logs, so that Dirichlet and Beta draws of small alpha (tiny gammas) stay
    exact ratios instead of underflowing to 0 / 0."""
    a = alpha + 1.0 if alpha < 1.0 else alpha
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    n = math.prod(shape)
    out = torch.empty(n, dtype=torch.float64, device=device)
    todo = torch.arange(n, device=device)
    while todo.numel():
        z = torch.randn(todo.numel(), generator=gen, dtype=torch.float64, device=device)
        u = 1.0 - torch.rand(todo.numel(), generator=gen, dtype=torch.float64, device=device)  # (0, 1]
        v = (1.0 + c * z) ** 3
        ok = (v > 0) & (torch.log(u) < 0.5 * z * z + d - d * v + d * torch.log(v.clamp_min(1e-300)))
        out[todo[ok]] = math.log(d) + torch.log(v[ok])
        todo = todo[~ok]
    if alpha < 1.0:
        u = 1.0 - torch.rand(n, generator=gen, dtype=torch.float64, device=device)
        out += torch.log(u) / alpha
    return out.view(shape)


# ----------------------------------------------------------------------------- AugMix


def _check_int(v, name: str, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: expected an int {span}, got {v!r}")
    return v


class AugMix:
    """AugMix on batches of images (see the module docstring for the operations and the law).

    Args:
        suite: the corruption suite the model will be tested on (``"mnist-c"``, ``"cifar-c"``,
            ``"cifar-c-extra"``); it chooses the operations (:func:`augmix_ops`). May be None only
            when ``ops`` is given.
        severity: magnitude bound 1..10 (official "aug_severity", default 3); each operation draws
            its level uniformly in ``[0.1, severity)``.
        width: number of chains mixed (default 3).
        depth: operations per chain; ``-1`` draws 1..3 per chain and image.
        alpha: the Dirichlet and Beta parameter (default 1).
        ops: operation names of :data:`OPS`, or callables with the signature of :data:`Op`,
            instead of the suite's set.

    Attributes:
        ops: the names of the operations used (a callable's ``__name__``); ``excluded``: the
        official operations the suite leaves out; ``config``: all settings as a plain dict.

    Raises:
        ValueError: an argument out of range, an unknown suite or operation name, no suite and no
            ops, or an empty ``ops`` (each message names the argument).
    """

    def __init__(
        self,
        suite: Optional[str] = None,
        *,
        severity: int = 3,
        width: int = 3,
        depth: int = -1,
        alpha: float = 1.0,
        ops: Optional[Sequence[Union[str, Op]]] = None,
    ):
        self.severity = _check_int(severity, "severity", 1, 10)
        self.width = _check_int(width, "width", 1)
        if isinstance(depth, bool) or not isinstance(depth, int) or (depth != -1 and depth < 1):
            raise ValueError(f"depth: expected -1 (a random depth 1..3) or an int >= 1, got {depth!r}")
        self.depth = depth
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0 < alpha < math.inf):
            raise ValueError(f"alpha: expected a finite number > 0, got {alpha!r}")
        self.alpha = float(alpha)
        self.suite = SUITE_REGISTRY.canonical(suite) if suite is not None else None
        if ops is None:
            if self.suite is None:
                raise ValueError(
                    "suite: AugMix's operations depend on the corruption suite the model is tested "
                    "on; pass suite ('mnist-c', 'cifar-c', ...) or ops"
                )
            ops = augmix_ops(self.suite)
        if isinstance(ops, str) or not isinstance(ops, Sequence) or len(ops) == 0:
            raise ValueError(f"ops: expected a non-empty sequence of operation names or callables, got {ops!r}")
        fns: list[Op] = []
        op_names: list[str] = []
        for op in ops:
            if isinstance(op, str):
                if op not in OPS:
                    raise ValueError(f"ops: unknown operation {op!r}; expected some of {', '.join(OPS)}")
                fns.append(OPS[op])
                op_names.append(op)
            elif callable(op):
                fns.append(op)
                op_names.append(getattr(op, "__name__", type(op).__name__))
            else:
                raise ValueError(f"ops: expected operation names or callables, got {op!r}")
        self._fns = tuple(fns)
        self.ops: tuple[str, ...] = tuple(op_names)
        self.excluded: tuple[str, ...] = tuple(op for op in AUGMENTATIONS if op not in self.ops)

    @property
    def config(self) -> dict:
        """The settings (for logs and run records): suite, severity, width, depth, alpha, ops, excluded."""
        return {
            "suite": self.suite,
            "severity": self.severity,
            "width": self.width,
            "depth": self.depth,
            "alpha": self.alpha,
            "ops": list(self.ops),
            "excluded": list(self.excluded),
        }

    def __repr__(self) -> str:
        return (
            f"AugMix(suite={self.suite!r}, severity={self.severity}, width={self.width}, depth={self.depth}, "
            f"alpha={self.alpha}, ops={list(self.ops)})"
        )

    def _draw(self, n: int, gen: Optional[torch.Generator], device) -> dict:
        """Every random number of one call, in a fixed order: chain weights (n, width), skip
        weights (n,), then per chain its depths and per step the operation, level and sign."""
        dev = gen.device if gen is not None else device
        log_w = _log_gamma((n, self.width), self.alpha, gen, dev)
        log_m = _log_gamma((n, 2), self.alpha, gen, dev)
        steps = self.depth if self.depth > 0 else 3
        depth, op, level, sign = [], [], [], []
        for _ in range(self.width):
            if self.depth > 0:
                depth.append(torch.full((n,), self.depth, device=dev))
            else:
                depth.append(torch.randint(1, 4, (n,), generator=gen, device=dev))
            for _ in range(steps):
                op.append(torch.randint(0, len(self._fns), (n,), generator=gen, device=dev))
                u = torch.rand(n, generator=gen, dtype=torch.float64, device=dev)
                level.append(0.1 + u * (self.severity - 0.1))
                sign.append(torch.randint(0, 2, (n,), generator=gen, device=dev).double() * 2 - 1)
        return {
            "w": torch.softmax(log_w, dim=1).to(device),
            "m": torch.sigmoid(log_m[:, 0] - log_m[:, 1]).to(device),  # G1 / (G1 + G2)
            "steps": steps,
            "depth": torch.stack(depth).to(device),  # (width, n)
            "op": torch.stack(op).to(device).view(self.width, steps, n),
            "level": torch.stack(level).to(device).view(self.width, steps, n),
            "sign": torch.stack(sign).to(device).view(self.width, steps, n),
        }

    @torch.no_grad()
    def __call__(self, images: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
        """One AugMix view of every image: ``(N, C, H, W)`` float in [0, 1] (see the module docstring).

        Raises:
            TypeError / ValueError: ``images`` as :func:`shiftguard.corruptions.corrupt` refuses
                them; ``generator`` not a ``torch.Generator``.
        """
        x = _check_images(images)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
        out_dtype = images.dtype if images.is_floating_point() else torch.float32
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        x = x.to(work) / 255.0 if x.dtype == torch.uint8 else x.to(work)
        n = x.shape[0]
        if n == 0:
            return x.to(out_dtype, copy=True)
        p = self._draw(n, generator, x.device)
        mix = torch.zeros_like(x)
        for i in range(self.width):
            xa = x.clone()
            for s in range(p["steps"]):
                active = p["depth"][i] > s
                for k, fn in enumerate(self._fns):
                    sel = (active & (p["op"][i, s] == k)).nonzero().squeeze(1)
                    if sel.numel() == 0:
                        continue
                    y = fn(xa.index_select(0, sel), p["level"][i, s, sel], p["sign"][i, s, sel])
                    xa.index_copy_(0, sel, y.to(work).clamp_(0, 1))
            mix.add_(xa.mul_(p["w"][:, i].to(work).view(-1, 1, 1, 1)))
        m = p["m"].to(work).view(-1, 1, 1, 1)
        return (m * x).add_((1 - m) * mix).clamp_(0, 1).to(out_dtype)


# ----------------------------------------------------------------------------- consistency loss


def jensen_shannon_consistency(logits_clean: Tensor, logits_aug1: Tensor, logits_aug2: Tensor) -> Tensor:
    """The Jensen-Shannon consistency term of AugMix: ``(KL(p_c || M) + KL(p_1 || M) + KL(p_2 || M)) / 3``
    with ``p = softmax(logits)`` per row, ``M = (p_c + p_1 + p_2) / 3`` and ``log M`` taken of ``M``
    clamped to ``[1e-7, 1]`` (as the official code); KL summed over classes and averaged over rows.
    The training loss is ``CE(clean) + lambda * this`` (lambda = :data:`JSD_WEIGHT` = 12 there).

    Args: three ``(N, K)`` float tensors of the same shape. Returns a scalar tensor.

    Raises:
        TypeError: a non-tensor or non-float argument; ValueError: not 2-D, or shapes that differ
            from ``logits_clean``'s (the message names the argument).
    """
    args = (("logits_clean", logits_clean), ("logits_aug1", logits_aug1), ("logits_aug2", logits_aug2))
    for name, t in args:
        if not isinstance(t, Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"{name}: expected a float tensor (N, K), got {got}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected 2 dimensions (N, K), got shape {tuple(t.shape)}")
        if t.shape != logits_clean.shape:
            raise ValueError(
                f"{name}: expected the shape of logits_clean {tuple(logits_clean.shape)}, got {tuple(t.shape)}"
            )
    p = [F.softmax(t, dim=1) for _, t in args]
    log_m = ((p[0] + p[1] + p[2]) / 3.0).clamp(MIXTURE_CLAMP, 1.0).log()
    kl = [F.kl_div(log_m, q, reduction="batchmean") for q in p]  # sum_k q_k (log q_k - log M_k) / N
    return (kl[0] + kl[1] + kl[2]) / 3.0
