"""CIFAR-10-C: the 15 benchmark corruptions and 4 extra ones of Hendrycks & Dietterich (2019).

Source of every constant: ``ImageNet-C/create_c/make_cifar_c.py`` in hendrycks/robustness (the
script that generated CIFAR-10-C), cited by [QACT] and [NED] ("CIFAR10C"). Each
function below re-implements one corruption for a batch ``x`` (N, C, H, W) float in [0, 1]; the
result is clipped and quantised by :func:`shiftguard.corruptions.corrupt`.

Size scaling: the constants are for 32x32 images. For other sizes, lengths in pixels (blur
sigmas and radii, motion-blur radius/sigma, glass-blur displacement, snow grain, spatter
sigmas) are multiplied by ``s = min(H, W) / 32``; elastic constants are fractions of the image
size already; zoom factors, pixelate ratios, noise levels and colour constants are
scale-free. Grey images (C = 1) get the grey version of every colour operation.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from . import _kernels, _levels, _ops
from ._jpeg import jpeg_roundtrip
from .registry import CorruptionSpec

Tensor = torch.Tensor
REF_SIZE = 32


# ----------------------------------------------------------------------------- noise


def gaussian_noise(x, c, gen, s):
    """``x + N(0, c^2)``."""
    return x.add_(_ops.normal(x.shape, 0.0, c, gen, x))  # in place: x is corrupt()'s own buffer


def shot_noise(x, c, gen, s):
    """Poisson photon noise ``Poisson(c x) / c``."""
    return torch.poisson(x * c, generator=gen) / c


def impulse_noise(x, c, gen, s):
    """Salt-and-pepper (skimage ``random_noise(mode='s&p', amount=c)``): each value is replaced
    with probability ``c`` by 0 or 1 with equal odds."""
    # One uniform per value: below c/2 -> salt (1), in [c/2, c) -> pepper (0); P(flip) = c,
    # P(salt | flip) = 1/2, the law of skimage's random_noise(mode='s&p').
    u = _ops.uniform(x.shape, 0, 1, gen, x)
    return torch.where(u < c, (u < 0.5 * c).to(x.dtype), x)


def speckle_noise(x, c, gen, s):
    """Multiplicative noise ``x + x N(0, c^2)``."""
    return x.addcmul_(x, _ops.normal(x.shape, 0.0, c, gen, x))  # in place, as above


def _u8_blocks(x: Tensor, fn, block: int = 64) -> Tensor:
    """uint8 fast path of a corruption that is deterministic given its random draws: ``fn(b, i)``
    maps the float32 images ``b`` = ``x[i : i + block]`` on the 0..255 scale to the result on the
    same scale; it is clipped, rounded and returned as uint8. Blocks of ``block`` images keep the
    intermediates in cache (on a CPU several times faster than whole-batch passes)."""
    out = torch.empty_like(x)
    for i in range(0, x.shape[0], block):
        y = fn(x[i : i + block].to(torch.float32), i)
        out[i : i + block] = y.nan_to_num_(0.0).clamp_(0, 255).round_()
    return out


def _levels_u8(law):
    """uint8 fast path of a pixel-wise noise: draw each output level from its exact law given the
    input level (:mod:`._levels`), the law of the float function above, clipped and rounded."""

    def fn(x, c, gen, s):
        return _levels.sample_levels(x, _levels.cached_tables(law, c), gen)

    fn.__name__ = law.__name__.replace("_pmf", "_u8")
    return fn


# ----------------------------------------------------------------------------- blur


def gaussian_blur(x, c, gen, s):
    """skimage ``gaussian(x, sigma=c)`` (mode ``nearest``, truncate 4)."""
    return _ops.gaussian_blur(x, c * s)


def local_shuffle(x: Tensor, delta: int, iterations: int, gen, swap_prob: float = 1.0) -> Tensor:
    """The glass-blur pixel shuffle: for every pixel (h, w), h and w running from ``size - delta``
    down to ``delta + 1``, swap it with the pixel at a random offset in ``[-delta, delta)^2``,
    in that order (so displaced pixels can move again); ``iterations`` passes. With
    ``swap_prob < 1`` each swap happens with that probability (MNIST-C). The loop runs over pixel
    positions, each step one batched index swap on a permutation of the flattened images.

    Random draws per image row (h): offsets ``randint(-delta, delta, (len(ws), 2, N))`` then, for
    MNIST-C, ``rand((len(ws), N)) < swap_prob``."""
    N, C, H, W = x.shape
    hs = list(range(H - delta, delta, -1))
    ws = list(range(W - delta, delta, -1))
    if not hs or not ws:
        return x
    dev = x.device
    base = torch.arange(N, device=dev) * (H * W)
    ww = torch.tensor(ws, device=dev)[:, None]
    flat_perm = torch.arange(H * W, device=dev).repeat(N)
    for _ in range(iterations):
        for h in hs:
            d = torch.randint(-delta, delta, (len(ws), 2, N), generator=gen, device=dev)
            p = h * W + ww + base  # (len(ws), N) flat positions of this row's pixels
            q = (h + d[:, 1]) * W + (ww + d[:, 0]) + base
            if swap_prob < 1.0:
                do = torch.rand((len(ws), N), generator=gen, device=dev) < swap_prob
                q = torch.where(do, q, p)
            for t in range(len(ws)):
                pt, qt = p[t], q[t]
                a = flat_perm.index_select(0, pt)
                flat_perm.index_copy_(0, pt, flat_perm.index_select(0, qt))
                flat_perm.index_copy_(0, qt, a)
    perm = flat_perm.view(N, H * W)
    flat = x.reshape(N, C, H * W)
    return flat.gather(2, perm[:, None, :].expand(N, C, H * W)).reshape(N, C, H, W)


def glass_blur(x, c, gen, s):
    """Gaussian blur (sigma), truncation to 8 bit, local pixel shuffle (max_delta, iterations),
    Gaussian blur again."""
    sigma, delta, iters = c
    sigma = sigma * s
    delta = max(1, int(round(delta * s)))
    y = torch.floor(_ops.gaussian_blur(x, sigma).clamp(0, 1) * 255) / 255
    y = local_shuffle(y, delta, iters, gen)
    return _ops.gaussian_blur(y, sigma)


@lru_cache(maxsize=64)
def _disk(radius: float, alias_blur: float) -> Tensor:
    return _ops.crop_kernel(_ops.disk_kernel(radius, alias_blur))


def defocus_blur(x, c, gen, s):
    """Correlation with the anti-aliased disk ``disk(radius, alias_blur)`` (cv2 ``filter2D``,
    BORDER_REFLECT_101)."""
    radius, alias = c
    return _ops.filter2d(x, _disk(float(radius * s), float(alias)).to(x.device), "mirror")


def defocus_blur_u8(x, c, gen, s):
    """:func:`defocus_blur` of uint8 images on the 0..255 scale (it is linear), in cache-sized blocks."""
    radius, alias = c
    k = _disk(float(radius * s), float(alias)).to(x.device)
    return _u8_blocks(x, lambda b, i: _ops.filter2d(b, k, "mirror"))


def motion_blur(x, c, gen, s):
    """ImageMagick motion blur (radius, sigma) at an angle drawn uniformly in [-45, 45] degrees
    per image."""
    radius, sigma = c
    angle = _ops.uniform((x.shape[0],), -45.0, 45.0, gen, x)
    return _ops.motion_blur(x, radius * s, sigma * s, angle)


@lru_cache(maxsize=256)
def _zoom_matrix(n: int, zoom: float) -> Tensor:
    return _ops.clipped_zoom_matrix(n, zoom)


def zoom_blur(x, c, gen, s):
    """Mean of the image and its central zooms by every factor in ``c`` (``clipped_zoom``)."""
    H, W = x.shape[-2:]
    out = x.clone()
    for z in c:
        out += _ops.apply_separable(x, _zoom_matrix(H, float(z)), _zoom_matrix(W, float(z)))
    return out / (len(c) + 1)


# ----------------------------------------------------------------------------- weather


def snow(x, c, gen, s):
    """Snow layer: N(loc, scale) grain zoomed by ``zoom``, thresholded, motion-blurred (radius,
    sigma, angle in [-135, -45]); the image is brightened towards ``1.5 grey + 0.5`` with weight
    ``1 - blend`` and the layer added twice (as is and rotated by 180 degrees)."""
    loc, scale, zoom, thr, radius, sigma, blend = c
    N, C, H, W = x.shape
    layer = _ops.normal((N, 1, H, W), loc, scale, gen, x)
    z = max(1.0, zoom * s)
    layer = _ops.apply_separable(layer, _zoom_matrix(H, z), _zoom_matrix(W, z))
    layer = torch.where(layer < thr, torch.zeros_like(layer), layer)
    layer = torch.floor(layer.clamp(0, 1) * 255) / 255  # the 8-bit PNG handed to ImageMagick
    angle = _ops.uniform((N,), -135.0, -45.0, gen, x)
    layer = _ops.motion_blur(layer, radius * s, sigma * s, angle)
    layer = torch.round(layer * 255) / 255
    grey = _ops.rgb_to_gray(x)
    x = blend * x + (1 - blend) * torch.maximum(x, grey * 1.5 + 0.5)
    return x + layer + torch.rot90(layer, 2, dims=(-2, -1))


def frost_texture(n: int, channels: int, H: int, W: int, gen, like: Tensor) -> Tensor:
    """Procedural frost layer ``(n, channels, H, W)`` in [0, 1] (replaces the six frost photos).

    Ice needles: sparse bright seeds smeared by motion blur along two random directions per image,
    over a diamond-square haze, normalised per image, then given a brightness level drawn in
    [0.4, 0.9], a contrast (standard deviation) drawn in [0.08, 0.16] and a blue tint (-0.06 red,
    +0.05 blue). These ranges were set from 32x32 crops of the six frost photographs that ship
    with CIFAR-10-C / imagecorruptions (means 0.3-0.8, standard deviations 0.05-0.14, bluish) and
    tuned so that, at the same constants, the mean pixel change is within about 4 % of the
    ``imagecorruptions`` output on the same images (``benchmarks/bench_corruptions.py`` part C).
    """
    s = min(H, W) / REF_SIZE
    size = _ops.next_power_of_two(max(H, W))
    haze = _ops.plasma_fractal(n, size, 2.0, gen, like)[:, None, :H, :W]
    needles = []
    for _ in range(2):
        seeds = (_ops.uniform((n, 1, H, W), 0, 1, gen, like) < 0.08).to(like.dtype)
        seeds = seeds * _ops.uniform((n, 1, H, W), 0.5, 1.0, gen, like)
        angle = _ops.uniform((n,), -180.0, 180.0, gen, like)
        needles.append(_ops.motion_blur(seeds, 4 * s, 2.5 * s, angle))
    tex = 0.5 * haze + torch.maximum(needles[0], needles[1]) * 3.0
    tex = _ops.gaussian_blur(tex, 0.5 * s)
    flat = tex.reshape(n, -1)
    tex = (tex - flat.mean(1).view(n, 1, 1, 1)) / flat.std(1).clamp_min(1e-6).view(n, 1, 1, 1)
    level = _ops.uniform((n, 1, 1, 1), 0.4, 0.9, gen, like)
    spread = _ops.uniform((n, 1, 1, 1), 0.08, 0.16, gen, like)
    base = level + spread * tex
    if channels == 1:
        return base.clamp(0, 1)
    tint = torch.tensor([-0.06, 0.0, 0.05], dtype=like.dtype, device=like.device).view(1, 3, 1, 1)
    return (base + tint).clamp(0, 1)


def frost(x, c, gen, s):
    """``a x + b frost`` with a procedural frost texture (see :func:`frost_texture`)."""
    a, b = c
    N, C, H, W = x.shape
    return a * x + b * frost_texture(N, C, H, W, gen, x)


def fog(x, c, gen, s):
    """``(x + t plasma) * max / (max + t)`` with a diamond-square plasma (wibble decay ``d``) per
    image, map size the next power of two of the image side; ``max`` is the image's maximum."""
    t, decay = c
    N, C, H, W = x.shape
    size = _ops.next_power_of_two(max(H, W))
    plasma = _ops.plasma_fractal(N, size, decay, gen, x)[:, None, :H, :W]
    mx = x.amax(dim=(1, 2, 3), keepdim=True)
    return (x + t * plasma) * mx / (mx + t)


def spatter(x, c, gen, s):
    """Water drops (mode 0) or mud (mode 1) over the image.

    A liquid layer N(loc, scale) is blurred (sigma) and thresholded. Water: the layer's Canny
    edges (OpenCV 50/150, L1 gradient), distance to them capped at 20, 3x3 mean, histogram
    equalisation, an emboss kernel, 3x3 mean; times the layer, normalised, scaled by
    ``intensity`` and added in pale turquoise (175, 238, 238). Mud: the thresholded mask blurred
    by ``intensity`` as sigma, values below 0.8 dropped, and the image covered by brown
    (63, 42, 20) in proportion.

    The layer is drawn for the whole batch, the rest runs on blocks of images that stay in cache.
    """
    liquid = _ops.normal((x.shape[0], 1) + tuple(x.shape[2:]), c[0], c[1], gen, x)
    out = torch.empty_like(x)
    for i in range(0, x.shape[0], _SPATTER_BLOCK):
        j = slice(i, i + _SPATTER_BLOCK)
        out[j] = _spatter_block(x[j], liquid[j], c, s)
    return out


def spatter_u8(x, c, gen, s):
    """:func:`spatter` of uint8 images: the same layer draws (float32, as ``corrupt`` works on
    uint8 input) and the same block computation, converted to 8 bit block by block."""
    like = torch.empty(0, dtype=torch.float32, device=x.device)
    liquid = _ops.normal((x.shape[0], 1) + tuple(x.shape[2:]), c[0], c[1], gen, like)
    return _u8_blocks(
        x, lambda b, i: _spatter_block(b.div_(255.0), liquid[i : i + _SPATTER_BLOCK], c, s).mul_(255.0), _SPATTER_BLOCK
    )


_SPATTER_BLOCK = 128


def _spatter_block(x: Tensor, liquid: Tensor, c, s) -> Tensor:
    """:func:`spatter` of images ``x`` given their liquid layer draws ``liquid`` (N, 1, H, W)."""
    _, _, sigma, thr, intensity, mode = c
    C = x.shape[1]
    liquid = _ops.gaussian_blur(liquid, sigma * s)
    liquid = liquid * (liquid >= thr)  # values below the threshold dropped (to a signed zero)
    if mode == 0:
        l8 = torch.floor(liquid.clamp(0, 1) * 255)
        edges = _ops.canny(l8, sigma=0.0, low=50.0, high=150.0, l1=True)
        dist = _ops.distance_to_edges(edges, 20.0).to(x.dtype)
        colour = torch.tensor([175.0, 238.0, 238.0], dtype=x.dtype, device=x.device).view(1, 3, 1, 1) / 255
        if _kernels.serves(x, floating=True):
            emboss = np.array([[-2.0, -1.0, 0.0], [-1.0, 1.0, 1.0], [0.0, 1.0, 2.0]], dtype=dist.numpy().dtype)
            args = (liquid[:, 0].contiguous().numpy(), dist[:, 0].contiguous().numpy(), emboss)
            add = torch.from_numpy(_kernels.spatter_water(*args, emboss.dtype.type(intensity), colour.view(3).numpy()))
            return x + (_ops.rgb_to_gray(add) if C == 1 else add)
        dist = torch.floor(_ops.box_blur3(dist))
        dist = _ops.equalize_hist_u8(dist)
        ker = torch.tensor([[-2.0, -1.0, 0.0], [-1.0, 1.0, 1.0], [0.0, 1.0, 2.0]], device=x.device)
        dist = _ops.filter2d(dist, ker, "mirror").round().clamp(0, 255)
        dist = _ops.box_blur3(dist)
        m = liquid * dist
        m = m / m.amax(dim=(2, 3), keepdim=True).clamp_min(1e-12)
        m = m * intensity
        add = (m * colour).clamp(0, 1)
        if C == 1:
            add = _ops.rgb_to_gray(add)
        return x + add
    m = (liquid > thr).to(x.dtype)
    m = _ops.gaussian_blur(m, intensity * s)
    m = m * (m >= 0.8)  # values below 0.8 dropped
    colour = torch.tensor([63.0, 42.0, 20.0], dtype=x.dtype, device=x.device).view(1, 3, 1, 1) / 255
    if C == 1:
        colour = _ops.rgb_to_gray(colour)
    return x * (1 - m) + colour * m


# ----------------------------------------------------------------------------- digital


def brightness(x, c, gen, s):
    """HSV value ``V + c`` (skimage rgb2hsv / hsv2rgb round trip, closed form)."""
    return _ops.hsv_value_shift(x, c)


def saturate(x, c, gen, s):
    """HSV saturation ``S * gain + offset``. Grey images are returned unchanged (the red
    channel of the round trip, which is V, as imagecorruptions does)."""
    gain, offset = c
    if x.shape[1] != 3:
        return x
    return _ops.hsv_saturation_affine(x, gain, offset)


def contrast(x, c, gen, s):
    """``(x - m) c + m`` with ``m`` the per-image, per-channel mean."""
    m = x.mean(dim=(2, 3), keepdim=True)
    return (x - m) * c + m


def contrast_u8(x, c, gen, s):
    """:func:`contrast` of uint8 images on the 0..255 scale (it is affine), rounded and clipped;
    one compiled pass per image and channel on CPU with numba."""
    if _kernels.serves(x):
        planes = x.reshape(-1, x.shape[-2] * x.shape[-1]).contiguous().numpy()
        return torch.from_numpy(_kernels.contrast_u8(planes, float(c))).view(x.shape)
    return _u8_blocks(x, lambda b, i: contrast(b, c, gen, s), 1024)


def elastic_transform(x, c, gen, s):
    """Random affine (three control points moved by up to ``affine * size``; OpenCV
    ``warpAffine``, BORDER_REFLECT_101) then a smooth random displacement field
    (``uniform(-1, 1)`` smoothed by a Gaussian of ``sigma * size``, truncate 3, times
    ``alpha * size``; scipy ``map_coordinates(order=1, mode='reflect')``)."""
    alpha_f, sigma_f, affine_f = c
    N, C, H, W = x.shape
    size = min(H, W)
    alpha, sigma, aff = alpha_f * size, sigma_f * size, affine_f * size
    dt = torch.float64
    cy, cx = float(H // 2), float(W // 2)
    sq = float(size // 3)
    # cv2 points are (x, y); make_cifar_c builds them from (H, W)-ordered centre values.
    pts1 = torch.tensor([[cy + sq, cx + sq], [cy + sq, cx - sq], [cy - sq, cx - sq]], dtype=dt, device=x.device)
    pts2 = pts1 + _ops.uniform((N, 3, 2), -aff, aff, gen, x).to(dt)
    P = torch.cat([pts1, torch.ones(3, 1, dtype=dt, device=x.device)], dim=1)  # (3, 3)
    M = torch.linalg.solve(P.expand(N, 3, 3), pts2).transpose(1, 2)  # (N, 2, 3): dst = M [p; 1]
    L, t = M[:, :, :2], M[:, :, 2:]
    Linv = torch.linalg.inv(L)
    inv = torch.cat([Linv, -Linv @ t], dim=2)
    y = _ops.affine_warp(x, inv.to(x.dtype), padding="mirror")
    fields = []
    for _ in range(2):
        f = _fast_uniform((N, 1, H, W), -1.0, 1.0, gen, x)
        f = _ops.gaussian_blur(f, sigma, mode="reflect", truncate=3.0) if sigma > 0 else f
        fields.append(f[:, 0] * alpha)
    dx, dy = fields
    return _ops.displaced_sample(y, dx, dy, "reflect")


def _fast_uniform(shape, low: float, high: float, gen: torch.Generator, like: Tensor) -> Tensor:
    """:func:`._ops.uniform` (same law: float uniforms from 24 random bits, mapped affinely); on
    CPU with numba from a counter-based generator seeded by one draw of ``gen`` (several times
    faster than torch's CPU generator), elsewhere :func:`._ops.uniform` itself."""
    if not _kernels.serves(like, floating=True):
        return _ops.uniform(shape, low, high, gen, like)
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=gen))
    n = int(np.prod(shape))
    bits = 24 if like.dtype == torch.float32 else 53  # torch.rand's resolution for the dtype
    probe = np.empty(0, dtype=np.float32 if like.dtype == torch.float32 else np.float64)
    return torch.from_numpy(_kernels.uniform(n, float(low), float(high), seed, bits, probe)).view(tuple(shape))


@lru_cache(maxsize=64)
def _pixelate_matrices(n: int, ratio: float) -> tuple[Tensor, Tensor]:
    m = int(n * ratio)
    return _ops.pil_box_matrix(n, m), _ops.pil_box_matrix(m, n)


def pixelate(x, c, gen, s):
    """PIL ``resize`` to ``int(size * c)`` with the BOX filter and back (8-bit in between)."""
    H, W = x.shape[-2:]
    Dr, Ur = _pixelate_matrices(H, float(c))
    Dc, Uc = _pixelate_matrices(W, float(c))
    small = torch.round(_ops.apply_separable(x, Dr, Dc) * 255) / 255
    return _ops.apply_separable(small, Ur, Uc)


_PIL_BITS = 22  # PIL Resample.c PRECISION_BITS for 8-bit images (32 - 8 - 2)


@lru_cache(maxsize=64)
def _pixelate_taps(n: int, ratio: float) -> tuple[Tensor, Tensor]:
    """For each output pixel of one axis: the source pixels of the box it comes from (the BOX
    upscale copies one small pixel) ``(T, n)`` and their weights in PIL's fixed point
    (``trunc(0.5 + 2^22 / count)``), zero for padding taps."""
    D, U = _pixelate_matrices(n, ratio)
    up = U.argmax(1)
    nz = D[up] > 0  # (n, n): source pixels of each output pixel's box
    count = nz.sum(1)
    T = int(count.max())
    order = torch.argsort((~nz).to(torch.int8), dim=1, stable=True)[:, :T]  # box pixels first
    idx = order.T.contiguous()
    kk = torch.trunc(0.5 + (1 << _PIL_BITS) / count.double()).to(torch.int32)
    w = torch.where(torch.arange(T)[:, None] < count[None, :], kk[None, :], torch.zeros_like(kk)[None, :])
    return idx, w.contiguous()


def _pil_box_pass(xt: Tensor, idx: Tensor, w: Tensor, pairs: Optional[Tensor]) -> Tensor:
    """One PIL BOX pass along dim 2 of the 8-bit values ``xt`` (B, C, n_in, m): weighted sums in
    fixed point, rounded half up and clipped to 8 bit. Where every box holds one or two pixels
    (every ratio >= 0.5) ``pairs`` (2, n) lists them (a lone pixel twice) and the pass is
    ``(a + b + 1) >> 1``, the same arithmetic in int16."""
    if pairs is not None:
        h = xt.index_select(2, pairs[0]).to(torch.int16).add_(xt.index_select(2, pairs[1]))
        return h.add_(1).bitwise_right_shift_(1)
    half = 1 << (_PIL_BITS - 1)
    acc = torch.zeros(xt.shape[:2] + (idx.shape[1],) + xt.shape[3:], dtype=torch.int64, device=xt.device)
    for t in range(idx.shape[0]):
        acc += xt.index_select(2, idx[t]).to(torch.int64) * w[t].view(-1, 1)
    return acc.add_(half).bitwise_right_shift_(_PIL_BITS).clamp_(0, 255)


def pixelate_u8(x, c, gen, s):
    """:func:`pixelate` of uint8 images in PIL's own integer arithmetic: the BOX downscale runs
    horizontally then vertically, each pass a fixed-point weighted mean rounded half up to 8 bit
    (PIL ``ImagingResample``); the BOX upscale copies the nearest small pixel. Down- and upscale
    compose into one pass per axis (with numba: one compiled loop, :func:`._kernels.pil_box_resample`;
    otherwise row gathers of the images transposed in between)."""
    H, W = x.shape[-2:]
    (ri, rw, rp), (ci, cw, cp) = (_pixelate_axis(n, float(c), str(x.device)) for n in (H, W))
    if _kernels.serves(x):
        planes = x.reshape(-1, H, W).contiguous().numpy()
        if rp is not None and cp is not None:
            y = _kernels.pil_box_pairs(planes, *(t.numpy() for t in (rp[0], rp[1], cp[0], cp[1])))
        else:
            y = _kernels.pil_box_resample(planes, *(t.numpy().astype(np.int64) for t in (ri, rw, ci, cw)), _PIL_BITS)
        return torch.from_numpy(y).view(x.shape)
    out = torch.empty_like(x)
    for i in range(0, x.shape[0], 128):
        xt = x[i : i + 128].transpose(-1, -2).contiguous()  # (B, C, W, H): columns as rows
        h = _pil_box_pass(xt, ci, cw, cp).transpose(-1, -2).contiguous()  # horizontal pass
        out[i : i + 128] = _pil_box_pass(h, ri, rw, rp)  # vertical pass
    return out


@lru_cache(maxsize=64)
def _pixelate_axis(n: int, ratio: float, device: str) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """:func:`_pixelate_taps` on ``device``, and the pixel pairs when every box holds one or two."""
    idx, w = _pixelate_taps(n, ratio)
    half = 1 << (_PIL_BITS - 1)
    pairs = None
    if idx.shape[0] <= 2 and bool(((w == half) | (w == 2 * half) | (w == 0)).all()):
        pairs = torch.stack([idx[0], torch.where(w[-1] > 0, idx[-1], idx[0])])
        pairs = pairs.to(device)
    return idx.to(device), w.to(device), pairs


def jpeg_compression(x, c, gen, s):
    """Baseline JPEG at quality ``c`` (vectorised, see :mod:`shiftguard.corruptions._jpeg`)."""
    if x.shape[1] not in (1, 3):
        raise ValueError(f"images: jpeg_compression needs 1 or 3 channels, got {x.shape[1]}")
    return jpeg_roundtrip(x * 255, int(c)) / 255


def jpeg_compression_u8(x, c, gen, s):
    """:func:`jpeg_compression` of uint8 images (the codec works on the 0..255 scale anyway)."""
    if x.shape[1] not in (1, 3):
        raise ValueError(f"images: jpeg_compression needs 1 or 3 channels, got {x.shape[1]}")
    return jpeg_roundtrip(x, int(c))


# ----------------------------------------------------------------------------- severity tables

_ZOOMS = [
    tuple(np.arange(1, 1.06, 0.01).tolist()),
    tuple(np.arange(1, 1.11, 0.01).tolist()),
    tuple(np.arange(1, 1.16, 0.01).tolist()),
    tuple(np.arange(1, 1.21, 0.01).tolist()),
    tuple(np.arange(1, 1.26, 0.01).tolist()),
]

# name -> (function, five severity settings), in the order of the CIFAR-10-C release.
_TABLE = {
    "gaussian_noise": (gaussian_noise, (0.04, 0.06, 0.08, 0.09, 0.10)),
    "shot_noise": (shot_noise, (500, 250, 100, 75, 50)),
    "impulse_noise": (impulse_noise, (0.01, 0.02, 0.03, 0.05, 0.07)),
    "defocus_blur": (defocus_blur, ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1))),
    "glass_blur": (glass_blur, ((0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2))),
    "motion_blur": (motion_blur, ((6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5))),
    "zoom_blur": (zoom_blur, tuple(_ZOOMS)),
    "snow": (
        snow,
        (
            (0.1, 0.2, 1, 0.6, 8, 3, 0.95),
            (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
            (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
            (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
            (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8),
        ),
    ),
    "frost": (frost, ((1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45))),
    "fog": (fog, ((0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75))),
    "brightness": (brightness, (0.05, 0.1, 0.15, 0.2, 0.3)),
    "contrast": (contrast, (0.75, 0.5, 0.4, 0.3, 0.15)),
    "elastic_transform": (
        elastic_transform,
        ((0, 0, 0.08), (0.05, 0.2, 0.07), (0.08, 0.06, 0.06), (0.1, 0.04, 0.05), (0.1, 0.03, 0.03)),
    ),
    "pixelate": (pixelate, (0.95, 0.9, 0.85, 0.75, 0.65)),
    "jpeg_compression": (jpeg_compression, (80, 65, 58, 50, 40)),
}
_EXTRA = {
    "speckle_noise": (speckle_noise, (0.06, 0.1, 0.12, 0.16, 0.2)),
    "gaussian_blur": (gaussian_blur, (0.4, 0.6, 0.7, 0.8, 1)),
    "spatter": (
        spatter,
        (
            (0.62, 0.1, 0.7, 0.7, 0.5, 0),
            (0.65, 0.1, 0.8, 0.7, 0.5, 0),
            (0.65, 0.3, 1, 0.69, 0.5, 0),
            (0.65, 0.1, 0.7, 0.69, 0.6, 1),
            (0.65, 0.1, 0.5, 0.68, 0.6, 1),
        ),
    ),
    "saturate": (saturate, ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2))),
}

_SOURCE = "hendrycks/robustness ImageNet-C/create_c/make_cifar_c.py"

# uint8 fast paths (same law as the float function, then clip and round; see CorruptionSpec.u8)
_U8 = {
    "gaussian_noise": _levels_u8(_levels.gaussian_noise_pmf),
    "shot_noise": _levels_u8(_levels.shot_noise_pmf),
    "impulse_noise": _levels_u8(_levels.impulse_noise_pmf),
    "speckle_noise": _levels_u8(_levels.speckle_noise_pmf),
    "defocus_blur": defocus_blur_u8,
    "jpeg_compression": jpeg_compression_u8,
    "pixelate": pixelate_u8,
    "spatter": spatter_u8,
    "contrast": contrast_u8,
}

CIFAR_C: dict[str, CorruptionSpec] = {
    k: CorruptionSpec(k, "cifar-c", fn, params, REF_SIZE, _SOURCE, _U8.get(k)) for k, (fn, params) in _TABLE.items()
}
CIFAR_C_EXTRA: dict[str, CorruptionSpec] = {
    k: CorruptionSpec(k, "cifar-c-extra", fn, params, REF_SIZE, _SOURCE, _U8.get(k))
    for k, (fn, params) in _EXTRA.items()
}


#: The constants of the ``imagecorruptions`` package 1.1.2 (bethgelab; the ImageNet-C values of
#: hendrycks/robustness ``make_imagenet_c.py``), for the corruptions whose algorithm is the same
#: as the CIFAR-10-C one above. Used only to compare with that package, through
#: ``corrupt(..., params=IMAGECORRUPTIONS_PARAMS[name][severity - 1])``.
IMAGECORRUPTIONS_PARAMS = {
    "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    "shot_noise": (60, 25, 12, 5, 3),
    "impulse_noise": (0.03, 0.06, 0.09, 0.17, 0.27),
    "speckle_noise": (0.15, 0.2, 0.35, 0.45, 0.6),
    "defocus_blur": ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)),
    "motion_blur": ((10, 3), (15, 5), (15, 8), (15, 12), (20, 15)),
    "zoom_blur": tuple(
        tuple(np.arange(*a).tolist())
        for a in ((1, 1.11, 0.01), (1, 1.16, 0.01), (1, 1.21, 0.02), (1, 1.26, 0.02), (1, 1.31, 0.03))
    ),
    "snow": (
        (0.1, 0.3, 3, 0.5, 10, 4, 0.8),
        (0.2, 0.3, 2, 0.5, 12, 4, 0.7),
        (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
        (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65),
        (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55),
    ),
    "frost": ((1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75)),
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
    "brightness": (0.1, 0.2, 0.3, 0.4, 0.5),
    "saturate": ((0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (20, 0.2)),
    "jpeg_compression": (25, 18, 15, 10, 7),
    "spatter": (
        (0.65, 0.3, 4, 0.69, 0.6, 0),
        (0.65, 0.3, 3, 0.68, 0.6, 0),
        (0.65, 0.3, 2, 0.68, 0.5, 0),
        (0.65, 0.3, 1, 0.65, 1.5, 1),
        (0.67, 0.4, 1, 0.65, 1.5, 1),
    ),
    "gaussian_blur": (1, 2, 3, 4, 6),
    "glass_blur": ((0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)),
    "fog": ((1.5, 2), (2.0, 2), (2.5, 1.7), (2.5, 1.5), (3.0, 1.4)),
}
