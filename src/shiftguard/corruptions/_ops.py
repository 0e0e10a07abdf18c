"""Vectorised image primitives shared by the corruption suites.

Every function takes a float tensor ``(N, C, H, W)`` (values in ``[0, 1]`` unless said
otherwise) and works on the whole batch at once with pure torch ops, so it runs unchanged on
CPU or GPU. Randomness always comes from an explicit ``torch.Generator`` on the images' device.

The primitives re-create, in torch, the image operations that the published generation code of
CIFAR-10-C (hendrycks/robustness ``ImageNet-C/create_c/make_cifar_c.py``) and MNIST-C
(google-research/mnist-c ``corruptions.py``) borrow from scipy / scikit-image / OpenCV /
ImageMagick / PIL. Each docstring names the library call it stands for and the boundary
convention it reproduces, because those conventions are where re-implementations drift.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from . import _kernels

Tensor = torch.Tensor

# ----------------------------------------------------------------------------- random numbers


def uniform(shape: Sequence[int], low: float, high: float, gen: torch.Generator, like: Tensor) -> Tensor:
    """Uniform draws in ``[low, high)`` with the images' dtype and device."""
    u = torch.rand(tuple(shape), generator=gen, device=like.device, dtype=like.dtype)
    return u if (low, high) == (0, 1) else u.mul_(high - low).add_(low)


def normal(shape: Sequence[int], loc: float, scale: float, gen: torch.Generator, like: Tensor) -> Tensor:
    """Gaussian draws ``N(loc, scale^2)`` with the images' dtype and device."""
    z = torch.randn(tuple(shape), generator=gen, device=like.device, dtype=like.dtype).mul_(scale)
    return z.add_(loc) if loc else z


def random_sign(n: int, gen: torch.Generator, like: Tensor) -> Tensor:
    """``n`` independent draws from {-1, +1} (numpy ``np.random.choice([-1, 1])``)."""
    bits = torch.randint(0, 2, (n,), generator=gen, device=like.device)
    return (bits * 2 - 1).to(like.dtype)


# ----------------------------------------------------------------------------- padding / filtering


def lmul(A: Tensor, x: Tensor) -> Tensor:
    """``A @ x`` over the last two dims of ``x`` (…, h, w) for a matrix ``A`` (h', h).

    ``torch.matmul`` materialises ``A`` once per matrix of the batch for a left factor; a batched
    matmul over a stride-0 expansion does not (same products, fewer memory passes)."""
    if x.dim() < 3:
        return torch.matmul(A, x)
    lead = x.shape[:-2]
    xb = x.reshape(-1, *x.shape[-2:])
    return torch.bmm(A.expand(xb.shape[0], *A.shape), xb).view(*lead, A.shape[0], x.shape[-1])


def pad_index(n: int, before: int, after: int, mode: str, device) -> Tensor:
    """Source index for every position of a 1-D signal of length ``n`` padded by ``before``/``after``.

    ``mode`` follows scipy.ndimage names: ``nearest`` (a a | a b c | c c), ``reflect``
    (b a | a b c | c b: half-sample symmetric, scipy's default), ``mirror`` (c b | a b c | b a:
    whole-sample symmetric, OpenCV's BORDER_REFLECT_101 and torch's ``reflect``), ``wrap``.
    """
    i = torch.arange(-before, n + after, device=device)
    if mode == "nearest":
        return i.clamp(0, n - 1)
    if mode == "wrap":
        return i.remainder(n)
    if mode == "reflect":
        period = 2 * n
        i = i.remainder(period)
        return torch.where(i >= n, period - 1 - i, i)
    if mode == "mirror":
        if n == 1:
            return torch.zeros_like(i)
        period = 2 * n - 2
        i = i.remainder(period)
        return torch.where(i >= n, period - i, i)
    raise ValueError(f"mode: unknown padding mode {mode!r}")


def pad2d(x: Tensor, ph: tuple[int, int], pw: tuple[int, int], mode: str) -> Tensor:
    """Pad the last two dims of ``x``; ``mode`` as in :func:`pad_index` or ``constant`` (zeros)."""
    if mode == "constant":
        return F.pad(x, (pw[0], pw[1], ph[0], ph[1]))
    H, W = x.shape[-2:]
    x = x.index_select(-2, pad_index(H, ph[0], ph[1], mode, x.device))
    return x.index_select(-1, pad_index(W, pw[0], pw[1], mode, x.device))


def gaussian_kernel1d(sigma: float, truncate: float = 4.0, *, dtype=torch.float32, device=None) -> Tensor:
    """Normalised 1-D Gaussian, radius ``int(truncate * sigma + 0.5)`` (scipy ``gaussian_filter``)."""
    radius = int(truncate * float(sigma) + 0.5)
    t = torch.arange(-radius, radius + 1, dtype=torch.float64, device=device)
    k = torch.exp(-0.5 * (t / float(sigma)) ** 2)
    return (k / k.sum()).to(dtype)


def filter2d(x: Tensor, kernel: Tensor, mode: str) -> Tensor:
    """Correlate every channel of ``x`` (…, H, W) with one 2-D ``kernel`` (kh, kw), same size out.

    Correlation (not convolution), kernel anchored at its centre, like ``cv2.filter2D`` and
    ``scipy.ndimage.correlate``.
    """
    shape = x.shape
    H, W = shape[-2:]
    kh, kw = kernel.shape
    if mode == "mirror" and kh * kw > 9 and _is_even_kernel(kernel):
        return _mirror_even_filter(x, kernel)
    if H * W <= 1024 and kh * kw > 9 and mode != "constant":
        # Small images: one dense (HW x HW) matrix with the boundary folded in beats conv2d.
        M = _cached_dense_filter(H, W, kernel, mode, x)
        return torch.matmul(x.reshape(-1, H * W), M.transpose(0, 1)).reshape(shape)
    x4 = x.reshape(-1, 1, H, W)
    pads = (kh // 2, (kh - 1) // 2), (kw // 2, (kw - 1) // 2)
    if mode == "mirror" and max(pads[0]) < H and max(pads[1]) < W:  # torch's 'reflect' is the mirror
        x4 = F.pad(x4, (pads[1][0], pads[1][1], pads[0][0], pads[0][1]), mode="reflect")
    else:
        x4 = pad2d(x4, pads[0], pads[1], mode)
    if kh * kw <= 9:  # a few shifted copies: far cheaper than a one-channel convolution on CPU
        out = torch.zeros((x4.shape[0], 1, H, W), dtype=x.dtype, device=x.device)
        for (a, b), k in zip(((a, b) for a in range(kh) for b in range(kw)), kernel.flatten().tolist()):
            if k != 0:
                out.add_(x4[..., a : a + H, b : b + W], alpha=k)
        return out.reshape(shape)
    out = F.conv2d(x4, kernel.to(x.dtype).view(1, 1, kh, kw))
    return out.reshape(shape)


def _is_even_kernel(kernel: Tensor) -> bool:
    """Odd-sized and symmetric under both flips, ``k[a, b] = k[-a, b] = k[a, -b]`` (to 1e-12)."""
    kh, kw = kernel.shape
    if kh % 2 == 0 or kw % 2 == 0:
        return False
    k = kernel.detach().to("cpu", torch.float64)
    tol = 1e-12 * float(k.abs().max().clamp_min(1e-300))
    return bool((k - k.flip(0)).abs().max() <= tol) and bool((k - k.flip(1)).abs().max() <= tol)


def cosine_basis(n: int) -> Tensor:
    """``V[m, u] = cos(pi u m / (n - 1))`` (n x n, float64; DCT-I basis; ``[[1]]`` for n = 1)."""
    if n == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    m = torch.arange(n, dtype=torch.float64)
    return torch.cos(math.pi * m[:, None] * m[None, :] / (n - 1))


def _mirror_even_filter(x: Tensor, kernel: Tensor) -> Tensor:
    """:func:`filter2d` with ``mode="mirror"`` for a kernel even in both axes, via its eigenbasis.

    Mirror (BORDER_REFLECT_101) padding makes a signal of length ``n`` an even, ``2n - 2``
    periodic one, and the cosines ``cos(pi u m / (n - 1))`` are such signals; correlating one
    with an even kernel only multiplies it by ``sum_t k_t cos(pi u t / (n - 1))`` (the sine part
    cancels). In 2-D the products of these cosines are eigenvectors with eigenvalues
    ``lam[u, w] = sum_ab k[a, b] cos(pi u a / (H - 1)) cos(pi w b / (W - 1))``, so the filter is
    ``V_H (lam * (V_H^-1 x V_W^-T)) V_W^T``: four small matmuls per image instead of a
    convolution with all the kernel's taps (the same linear map, to rounding)."""
    shape = x.shape
    H, W = shape[-2:]
    key = ("even", H, W, tuple(kernel.detach().cpu().double().flatten().tolist()), kernel.shape, x.dtype, str(x.device))
    mats = _MATRIX_CACHE.get(key)
    if mats is None:
        k = kernel.detach().to("cpu", torch.float64)
        kh, kw = k.shape
        a = torch.arange(kh, dtype=torch.float64) - kh // 2
        b = torch.arange(kw, dtype=torch.float64) - kw // 2
        th = math.pi / (H - 1) if H > 1 else 0.0
        tw = math.pi / (W - 1) if W > 1 else 0.0
        ch = torch.cos(th * torch.arange(H, dtype=torch.float64)[:, None] * a[None, :])  # (H, kh)
        cw = torch.cos(tw * torch.arange(W, dtype=torch.float64)[:, None] * b[None, :])  # (W, kw)
        lam = ch @ k @ cw.T  # (H, W)
        VH, VW = cosine_basis(H), cosine_basis(W)
        mats = tuple(
            t.to(dtype=x.dtype, device=x.device).contiguous()
            for t in (torch.linalg.inv(VH), torch.linalg.inv(VW).T, lam, VH, VW.T)
        )
        if len(_MATRIX_CACHE) > 512:
            _MATRIX_CACHE.clear()
        _MATRIX_CACHE[key] = mats
    iVH, iVWt, lam, VH, VWt = mats
    y = torch.matmul(lmul(iVH, x), iVWt).mul_(lam)
    return torch.matmul(lmul(VH, y), VWt)


def filter_matrix(n: int, kernel: Tensor, mode: str) -> Tensor:
    """The ``(n, n)`` matrix of correlating a length-``n`` signal with the odd-length 1-D
    ``kernel`` under boundary ``mode`` (as in :func:`pad_index`, or ``constant`` = zeros):
    ``out = M @ signal``. Folding the boundary into the matrix lets small images be filtered with
    two batched matmuls, much faster on CPU than a convolution for 28x28 or 32x32 images."""
    k = kernel.detach().to("cpu", torch.float64)
    r = k.numel() // 2
    M = torch.zeros(n, n, dtype=torch.float64)
    rows = torch.arange(n)
    for t in range(k.numel()):
        src = rows + t - r
        if mode == "constant":
            ok = (src >= 0) & (src < n)
            M.index_put_((rows[ok], src[ok]), k[t].expand(int(ok.sum())), accumulate=True)
        else:
            j = pad_index(n, r, r, mode, "cpu")[rows + t]
            M.index_put_((rows, j), k[t].expand(n), accumulate=True)
    return M


_MATRIX_CACHE: dict = {}


def _cached_filter_matrix(n: int, kernel: Tensor, mode: str, like: Tensor) -> Tensor:
    key = (n, tuple(kernel.detach().cpu().double().tolist()), mode, like.dtype, str(like.device))
    M = _MATRIX_CACHE.get(key)
    if M is None:
        if len(_MATRIX_CACHE) > 512:
            _MATRIX_CACHE.clear()
        M = filter_matrix(n, kernel, mode).to(dtype=like.dtype, device=like.device)
        _MATRIX_CACHE[key] = M
    return M


def _cached_dense_filter(H: int, W: int, kernel: Tensor, mode: str, like: Tensor) -> Tensor:
    key = (
        "dense",
        H,
        W,
        tuple(kernel.detach().cpu().double().flatten().tolist()),
        kernel.shape,
        mode,
        like.dtype,
        str(like.device),
    )
    M = _MATRIX_CACHE.get(key)
    if M is None:
        kh, kw = kernel.shape
        k = kernel.detach().to("cpu", torch.float64)
        ri = pad_index(H, kh // 2, (kh - 1) // 2, mode, "cpu")
        ci = pad_index(W, kw // 2, (kw - 1) // 2, mode, "cpu")
        out_r = torch.arange(H)[:, None, None, None]
        out_c = torch.arange(W)[None, :, None, None]
        a = torch.arange(kh)[None, None, :, None]
        b = torch.arange(kw)[None, None, None, :]
        src = ri[out_r + a] * W + ci[out_c + b]  # (H, W, kh, kw)
        dst = (out_r * W + out_c).expand_as(src)
        D = torch.zeros(H * W, H * W, dtype=torch.float64)
        D.index_put_((dst.reshape(-1), src.reshape(-1)), k.expand(H, W, kh, kw).reshape(-1), accumulate=True)
        M = D.to(dtype=like.dtype, device=like.device)
        if len(_MATRIX_CACHE) > 512:
            _MATRIX_CACHE.clear()
        _MATRIX_CACHE[key] = M
    return M


def separable_filter(x: Tensor, k_rows: Optional[Tensor], k_cols: Optional[Tensor], mode: str) -> Tensor:
    """Apply a 1-D kernel down the rows (``k_rows``) then along the columns (``k_cols``).

    Small images (sides <= 64) use boundary-folded filter matrices (:func:`filter_matrix`),
    larger ones padded convolutions; both give the same result."""
    shape = x.shape
    H, W = shape[-2:]
    if max(H, W) <= 64:
        y = x
        if k_rows is not None and k_rows.numel() > 1:
            y = lmul(_cached_filter_matrix(H, k_rows, mode, x), y)
        if k_cols is not None and k_cols.numel() > 1:
            y = torch.matmul(y, _cached_filter_matrix(W, k_cols, mode, x).transpose(0, 1))
        return y
    y = x.reshape(-1, 1, H, W)
    if k_rows is not None and k_rows.numel() > 1:
        r = k_rows.numel() // 2
        y = pad2d(y, (r, r), (0, 0), mode)
        y = F.conv2d(y, k_rows.to(y.dtype).view(1, 1, -1, 1))
    if k_cols is not None and k_cols.numel() > 1:
        r = k_cols.numel() // 2
        y = pad2d(y, (0, 0), (r, r), mode)
        y = F.conv2d(y, k_cols.to(y.dtype).view(1, 1, 1, -1))
    return y.reshape(shape)


def gaussian_blur(x: Tensor, sigma: float, mode: str = "nearest", truncate: float = 4.0) -> Tensor:
    """``skimage.filters.gaussian(x, sigma)`` per channel (scipy ``gaussian_filter``; default mode
    ``nearest`` as in scikit-image). ``sigma <= 0`` returns ``x`` unchanged."""
    if sigma <= 0:
        return x
    k = gaussian_kernel1d(sigma, truncate, dtype=x.dtype, device=x.device)
    return separable_filter(x, k, k, mode)


def box_blur3(x: Tensor) -> Tensor:
    """``cv2.blur(x, (3, 3))``: 3x3 mean, BORDER_REFLECT_101 (sums of three shifted copies per
    axis, each times 1/3: a few cheap passes instead of two 32x32 matmuls per image)."""
    shape = x.shape
    H, W = shape[-2:]
    if H < 2 or W < 2:  # reflection needs two samples per axis
        k = torch.full((3,), 1.0 / 3.0, dtype=x.dtype, device=x.device)
        return separable_filter(x, k, k, "mirror")
    p = F.pad(x.reshape(-1, 1, H, W), (1, 1, 1, 1), mode="reflect")  # torch 'reflect' = mirror
    r = (p[..., :-2, :] + p[..., 1:-1, :]).add_(p[..., 2:, :]).mul_(1.0 / 3.0)
    return (r[..., :-2] + r[..., 1:-1]).add_(r[..., 2:]).mul_(1.0 / 3.0).reshape(shape)


def cv2_gaussian_kernel1d(ksize: int, sigma: float) -> Tensor:
    """``cv2.getGaussianKernel(ksize, sigma)`` (float64)."""
    t = torch.arange(ksize, dtype=torch.float64) - (ksize - 1) / 2
    k = torch.exp(-(t**2) / (2 * sigma * sigma))
    return k / k.sum()


def disk_kernel(radius: float, alias_blur: float) -> Tensor:
    """The anti-aliased disk of make_cifar_c.py ``disk()``: indicator of ``x^2 + y^2 <= r^2`` on
    ``[-8, 8]^2`` (``[-r, r]^2`` when ``r > 8``), normalised, then ``cv2.GaussianBlur`` with a
    3x3 (5x5 when ``r > 8``) kernel of sigma ``alias_blur`` (BORDER_REFLECT_101). Float64."""
    if radius <= 8:
        half, ksize = 8, 3
    else:
        half, ksize = int(radius), 5
    L = torch.arange(-half, half + 1, dtype=torch.float64)
    Y, X = torch.meshgrid(L, L, indexing="ij")
    d = ((X**2 + Y**2) <= radius**2).double()
    d = d / d.sum()
    g = cv2_gaussian_kernel1d(ksize, alias_blur)
    return separable_filter(d[None, None], g, g, "mirror")[0, 0]


def crop_kernel(kernel: Tensor, eps: float = 1e-12) -> Tensor:
    """Trim all-zero outer rows/columns symmetrically (same result, smaller convolution)."""
    nz = (kernel.abs() > eps).nonzero()
    if nz.numel() == 0:
        return kernel
    c = kernel.shape[0] // 2
    r = int(max((nz[:, 0] - c).abs().max(), (nz[:, 1] - c).abs().max()))
    return kernel[c - r : c + r + 1, c - r : c + r + 1]


# ----------------------------------------------------------------------------- motion blur


def motion_blur(x: Tensor, radius: float, sigma: float, angle_deg: Tensor) -> Tensor:
    """ImageMagick ``MotionBlurImage(radius, sigma, angle)`` on every image, one angle per image.

    Kernel width ``2 * ceil(radius) + 1`` with one-sided Gaussian weights ``exp(-i^2 / 2 sigma^2)``,
    i = 0..width-1 (normalised); tap ``i`` reads the pixel at
    ``(x + ceil(i cos a - 0.5), y + ceil(i sin a - 0.5))`` with edge replication, and taps that
    leave the image are dropped without renormalising (as the numpy port in ``imagecorruptions``
    does). Taps whose normalised weight is below 1e-7 are skipped (their total effect is far
    below one 8-bit level). ``angle_deg``: ``(N,)``.

    On CPU with numba the tap loop runs compiled (:func:`._kernels.motion_blur_taps`, the same
    arithmetic in the same order); otherwise as batched gathers over cache-sized image blocks.
    """
    N, C, H, W = x.shape
    width = 2 * int(math.ceil(radius)) + 1
    i = torch.arange(width, dtype=torch.float64)
    k = torch.exp(-(i**2) / (2 * float(sigma) ** 2))
    weights = (k / k.sum()).tolist()
    a = angle_deg.to(torch.float64) * (math.pi / 180.0)
    sin_a, cos_a = torch.sin(a), torch.cos(a)
    taps = []  # (weight, row offsets (N,), column offsets (N,), tap inside the image (N,))
    for t in range(width):
        if weights[t] < 1e-7:  # a far tail tap: changes no pixel by more than 1e-7 (skipped for speed)
            continue
        oy = torch.ceil(t * sin_a - 0.5).long().to(x.device)
        ox = torch.ceil(t * cos_a - 0.5).long().to(x.device)
        taps.append((weights[t], oy, ox, ((oy.abs() < H) & (ox.abs() < W)).to(x.dtype)))
    if _kernels.serves(x, floating=True) and taps:
        tap_oy = torch.stack([t[1] for t in taps]).numpy()
        tap_ox = torch.stack([t[2] for t in taps]).numpy()
        tap_w = torch.stack([kt * valid for kt, _, _, valid in taps]).numpy()
        return torch.from_numpy(_kernels.motion_blur_taps(x.detach().contiguous().numpy(), tap_oy, tap_ox, tap_w))
    rows = torch.arange(H, device=x.device)
    cols = torch.arange(W, device=x.device)
    out = torch.empty_like(x)
    step = max(1, _MOTION_BLOCK // (C * H * W))  # images per block: the buffers stay in cache
    for s in range(0, N, step):
        flat = x[s : s + step].reshape(-1, C, H * W)
        n = flat.shape[0]
        acc = torch.zeros_like(flat)
        idx = torch.empty(n, H, W, dtype=torch.long, device=x.device)
        buf = torch.empty_like(flat)
        for kt, oy, ox, valid in taps:
            rW = (rows[None, :] + oy[s : s + step, None]).clamp_(0, H - 1).mul_(W)
            c = (cols[None, :] + ox[s : s + step, None]).clamp_(0, W - 1)
            torch.add(rW[:, :, None], c[:, None, :], out=idx)
            torch.gather(flat, 2, idx.view(n, 1, H * W).expand(n, C, H * W), out=buf)
            acc += buf.mul_((kt * valid[s : s + step])[:, None, None])
        out[s : s + step] = acc.view(n, C, H, W)
    return out


_MOTION_BLOCK = 3 * 256 * 1024  # values per block of images in motion_blur


# ----------------------------------------------------------------------------- resampling


def linear_resample_matrix(src_pos: Tensor, n_in: int) -> Tensor:
    """Matrix ``(len(src_pos), n_in)`` of linear-interpolation weights at the source positions."""
    p = src_pos.to(torch.float64).clamp(0, n_in - 1)
    lo = p.floor().long().clamp(0, n_in - 1)
    hi = (lo + 1).clamp(max=n_in - 1)
    w = p - lo.double()
    A = torch.zeros(len(p), n_in, dtype=torch.float64)
    rows = torch.arange(len(p))
    A.index_put_((rows, lo), 1 - w, accumulate=True)
    A.index_put_((rows, hi), w, accumulate=True)
    return A


def clipped_zoom_matrix(n: int, zoom: float, centre_trim: bool = True) -> Tensor:
    """1-D linear map of make_cifar_c.py ``clipped_zoom``: crop the central ``ceil(n / zoom)``
    pixels, ``scipy.ndimage.zoom(order=1)`` them (output ``round(ch * zoom)`` samples, the end
    points aligned), then keep the central ``n`` (``centre_trim``; imagecorruptions keeps the
    first ``n`` instead). Returns ``(n, n)`` float64."""
    ch = int(math.ceil(n / float(zoom)))
    top = (n - ch) // 2
    n_out = int(round(ch * zoom))
    trim = (n_out - n) // 2 if centre_trim else 0
    j = torch.arange(n, dtype=torch.float64) + trim
    step = (ch - 1) / (n_out - 1) if n_out > 1 else 0.0
    return linear_resample_matrix(top + j * step, n)


def apply_separable(x: Tensor, A_rows: Tensor, A_cols: Tensor) -> Tensor:
    """``A_rows @ x @ A_cols^T`` over the last two dims (a separable linear resampling)."""
    A_rows = A_rows.to(dtype=x.dtype, device=x.device)
    A_cols = A_cols.to(dtype=x.dtype, device=x.device)
    return torch.matmul(lmul(A_rows, x), A_cols.transpose(0, 1))


def pil_box_matrix(n_in: int, n_out: int) -> Tensor:
    """Weights of PIL's ``Image.resize(..., Image.BOX)`` along one axis (libImaging Resample.c
    ``precompute_coeffs`` with the box filter, support 0.5). Returns ``(n_out, n_in)`` float64."""
    scale = n_in / n_out
    filterscale = max(scale, 1.0)
    support = 0.5 * filterscale
    A = torch.zeros(n_out, n_in, dtype=torch.float64)
    for xx in range(n_out):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), n_in)
        for xi in range(xmin, xmax):
            t = (xi - center + 0.5) / filterscale
            if -0.5 < t <= 0.5:
                A[xx, xi] = 1.0
        s = A[xx].sum()
        if s > 0:
            A[xx] /= s
    return A


def pixel_grid(H: int, W: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """Pixel-centre coordinates ``(xs, ys)``, each ``(H, W)``; x = column, y = row."""
    ys = torch.arange(H, device=like.device, dtype=like.dtype)
    xs = torch.arange(W, device=like.device, dtype=like.dtype)
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    return xx, yy


#: padding name -> (grid_sample padding_mode, align_corners). ``reflect`` needs align_corners=False:
#: grid_sample's reflection then reflects about -0.5 and n - 0.5 (scipy's half-sample symmetric).
_PADDING = {
    "zeros": ("zeros", True),
    "border": ("border", True),
    "mirror": ("reflection", True),
    "reflect": ("reflection", False),
}


def _grid_sample(x: Tensor, grid: Tensor, padding: str) -> Tensor:
    mode, align = _PADDING[padding]
    return F.grid_sample(x, grid, mode="bilinear", padding_mode=mode, align_corners=align)


def _sample_compiled(
    x: Tensor, matrix: Optional[Tensor], dx: Optional[Tensor], dy: Optional[Tensor], padding: str
) -> Tensor:
    """:func:`sample_at` at source coordinates ``matrix @ (col, row, 1)`` (identity if None) plus
    ``(dx, dy)`` (N, H, W) if given, its grid written by :func:`._kernels.sampling_grid` (CPU)."""
    N, C, H, W = x.shape
    if matrix is None:
        m = np.zeros((N, 2, 3))
        m[:, 0, 0] = 1.0
        m[:, 1, 1] = 1.0
    else:
        m = np.ascontiguousarray(matrix.detach().to(torch.float64).expand(N, 2, 3).numpy())
    if dx is None or dy is None:  # both or neither (the callers' contract)
        ddx = ddy = np.zeros((0, 1, 1), dtype=np.float32)
    else:
        ddx = np.ascontiguousarray(dx.detach().expand(N, H, W).numpy())
        ddy = np.ascontiguousarray(dy.detach().to(dx.dtype).expand(N, H, W).numpy())
    grid = np.empty((N, H, W, 2), dtype=np.float32 if x.dtype == torch.float32 else np.float64)
    _kernels.sampling_grid(m, ddx, ddy, _PADDING[padding][1], grid)
    return _grid_sample(x, torch.from_numpy(grid), padding)


def displaced_sample(x: Tensor, dx: Tensor, dy: Tensor, padding: str) -> Tensor:
    """Bilinear sample ``x`` (N, C, H, W) at ``(col + dx, row + dy)`` (dx, dy: (N, H, W)):
    :func:`sample_at` of the displaced pixel grid."""
    if _kernels.serves(x, floating=True):
        return _sample_compiled(x, None, dx, dy, padding)
    xx, yy = pixel_grid(x.shape[-2], x.shape[-1], x)
    return sample_at(x, xx + dx, yy + dy, padding)


def sample_at(x: Tensor, src_x: Tensor, src_y: Tensor, padding: str) -> Tensor:
    """Bilinear sample ``x`` (N, C, H, W) at pixel coordinates ``src_x/src_y`` (N, H', W').

    ``padding``: ``zeros`` (skimage ``warp(mode='constant')``, scipy ``mode='constant'``),
    ``mirror`` (OpenCV BORDER_REFLECT_101), ``reflect`` (scipy ``mode='reflect'``, half-sample
    symmetric), ``border`` (edge replication).
    """
    N, C, H, W = x.shape
    # the normalised grid is written straight into its (…, 2) buffer (stacking two maps afterwards
    # would add an interleaving copy as costly as the arithmetic)
    shape = torch.broadcast_shapes(src_x.shape, src_y.shape)
    grid = torch.empty(shape + (2,), dtype=torch.result_type(src_x, src_y), device=x.device)
    gx, gy = grid[..., 0], grid[..., 1]
    if _PADDING[padding][1]:
        torch.mul(src_x, 2, out=gx).div_(max(W - 1, 1)).sub_(1)  # 2 x / (W - 1) - 1
        torch.mul(src_y, 2, out=gy).div_(max(H - 1, 1)).sub_(1)
    else:
        torch.mul(src_x, 2, out=gx).add_(1).div_(W).sub_(1)  # (2 x + 1) / W - 1
        torch.mul(src_y, 2, out=gy).add_(1).div_(H).sub_(1)
    return _grid_sample(x, grid, padding)


def affine_warp(x: Tensor, matrix: Tensor, padding: str = "zeros") -> Tensor:
    """``out(p) = x(M p)`` for a per-image inverse map ``matrix`` (N, 2, 3) acting on pixel
    coordinates ``p = (col, row, 1)`` (skimage ``warp(x, inverse_map=M, order=1)``)."""
    N, C, H, W = x.shape
    if _kernels.serves(x, floating=True):
        return _sample_compiled(x, matrix, None, None, padding)
    xx, yy = pixel_grid(H, W, x)
    M = matrix.to(x.dtype)
    sx = M[:, 0, 0, None, None] * xx + M[:, 0, 1, None, None] * yy + M[:, 0, 2, None, None]
    sy = M[:, 1, 0, None, None] * xx + M[:, 1, 1, None, None] * yy + M[:, 1, 2, None, None]
    return sample_at(x, sx, sy, padding)


# ----------------------------------------------------------------------------- plasma fractal


def _jitter(t: Tensor, wibble: float, gen: torch.Generator) -> Tensor:
    """Diamond-square midpoint: the mean of four parents ``t / 4`` plus ``wibble * U(-wibble, wibble)``."""
    u = torch.rand(t.shape, generator=gen, device=t.device, dtype=t.dtype) * 2 - 1
    return t / 4 + wibble * wibble * u


def _diamond_square_levels(m: Tensor, wibble: float, wibbledecay: float, gen: torch.Generator) -> float:
    """Run every level of the periodic diamond-square recursion on ``m`` ``(n, S, S)`` in place,
    from step ``S`` down to 2 (square step, then the two diamond steps, wibble divided by
    ``wibbledecay`` per level); return the wibble of the next, finer level."""
    step = m.shape[1]
    while step >= 2:
        h = step // 2
        corner = m[:, 0::step, 0::step]
        sq = corner + torch.roll(corner, -1, dims=1)
        sq = sq + torch.roll(sq, -1, dims=2)
        m[:, h::step, h::step] = _jitter(sq, wibble, gen)
        dr = m[:, h::step, h::step]
        ul = m[:, 0::step, 0::step]
        m[:, 0::step, h::step] = _jitter(dr + torch.roll(dr, 1, dims=1) + ul + torch.roll(ul, -1, dims=2), wibble, gen)
        m[:, h::step, 0::step] = _jitter(dr + torch.roll(dr, 1, dims=2) + ul + torch.roll(ul, -1, dims=1), wibble, gen)
        step //= 2
        wibble /= wibbledecay
    return wibble


def plasma_fractal(n: int, mapsize: int, wibbledecay: float, gen: torch.Generator, like: Tensor) -> Tensor:
    """Diamond-square height maps ``(n, mapsize, mapsize)`` in [0, 1], one per image.

    The same recursion as ``plasma_fractal`` in make_cifar_c.py (wibble starts at 100, each
    midpoint is the mean of its four parents plus ``wibble * U(-wibble, wibble)``, wibble divided
    by ``wibbledecay`` per level, periodic neighbours), batched over images. ``mapsize`` must be
    a power of two.
    """
    if mapsize & (mapsize - 1):
        raise ValueError(f"mapsize: must be a power of two, got {mapsize}")
    dt = torch.float64 if like.dtype == torch.float64 else torch.float32
    m = torch.zeros(n, mapsize, mapsize, device=like.device, dtype=dt)
    _diamond_square_levels(m, 100.0, wibbledecay, gen)
    flat = m.reshape(n, -1)
    flat = flat - flat.min(dim=1, keepdim=True).values
    flat = flat / flat.max(dim=1, keepdim=True).values.clamp_min(1e-12)
    return flat.reshape(n, mapsize, mapsize).to(like.dtype)


def plasma_fractal_corner(
    n: int, mapsize: int, wibbledecay: float, crop: int, gen: torch.Generator, like: Tensor
) -> Tensor:
    """The top-left ``crop x crop`` corner of :func:`plasma_fractal` maps of side ``mapsize``,
    without computing the full-resolution maps (MNIST-C crops 28x28 out of 256x256).

    All levels down to step 8 are computed on the whole map, held at a quarter of the resolution
    (the points on multiples of 4, which is all those levels touch); the last two levels
    (steps 4 and 2) are computed only in a window around the corner, with a margin that absorbs
    the one-point reach of each level. Same recursion and noise law as the full map; the one
    approximation is the final min/max normalisation, taken over the quarter-resolution map
    (the last two levels can stretch the true range by at most ``wibble^2`` of those levels:
    about 1 % at MNIST-C's decay 1.4). Returns ``(n, crop, crop)`` in [0, 1].
    """
    if mapsize < 64 or mapsize < 4 * (crop + 8):
        return plasma_fractal(n, mapsize, wibbledecay, gen, like)[:, :crop, :crop]
    dt = torch.float64 if like.dtype == torch.float64 else torch.float32
    # Coarse: the reduced map of side mapsize/4 runs exactly the first levels - 2 levels.
    reduced = mapsize // 4
    m = torch.zeros(n, reduced, reduced, device=like.device, dtype=dt)
    wibble = _diamond_square_levels(m, 100.0, wibbledecay, gen)
    lo = m.reshape(n, -1).amin(1).view(n, 1, 1)
    hi = m.reshape(n, -1).amax(1).view(n, 1, 1)
    # Window: full-resolution coordinates -4 .. 4K-4 (K + 1 coarse points per side).
    K = (crop + 3) // 4 + 2
    idx = torch.arange(-1, K, device=like.device).remainder(reduced)
    L = 4 * K + 1
    win = torch.zeros(n, L, L, device=like.device, dtype=dt)
    win[:, 0::4, 0::4] = m[:, idx][:, :, idx]
    for step in (4, 2):
        h = step // 2
        cg = win[:, 0::step, 0::step]
        corners = cg[:, :-1, :-1] + cg[:, 1:, :-1] + cg[:, :-1, 1:] + cg[:, 1:, 1:]
        win[:, h::step, h::step] = _jitter(corners, wibble, gen)
        dr = win[:, h::step, h::step]
        ul = win[:, 0::step, 0::step]
        # rows on the corner grid, columns between: dr above/below, ul left/right
        a = dr[:, 1:, :] + dr[:, :-1, :] + ul[:, 1:-1, :-1] + ul[:, 1:-1, 1:]
        win[:, step:-step:step, h::step] = _jitter(a, wibble, gen)
        b = dr[:, :, 1:] + dr[:, :, :-1] + ul[:, :-1, 1:-1] + ul[:, 1:, 1:-1]
        win[:, h::step, step:-step:step] = _jitter(b, wibble, gen)
        wibble /= wibbledecay
    out = (win[:, 4 : 4 + crop, 4 : 4 + crop] - lo) / (hi - lo).clamp_min(1e-12)
    return out.clamp(0, 1).to(like.dtype)


def next_power_of_two(v: int) -> int:
    return 1 if v <= 1 else 1 << (int(v) - 1).bit_length()


# ----------------------------------------------------------------------------- colour


def rgb_to_gray(x: Tensor) -> Tensor:
    """ITU-R 601 luma ``0.299 R + 0.587 G + 0.114 B`` (``cv2.COLOR_RGB2GRAY``); (N, 1, H, W)."""
    if x.shape[1] == 1:
        return x
    w = torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x[:, :3] * w).sum(dim=1, keepdim=True)


def hsv_value_shift(x: Tensor, delta: float) -> Tensor:
    """skimage ``rgb2hsv`` -> ``V = clip(V + delta, 0, 1)`` -> ``hsv2rgb``, in closed form.

    For fixed hue and saturation every RGB channel is proportional to V, so the round trip is
    ``x * V' / V``; black pixels (V = 0, S = 0) become grey ``V'``. One channel: ``clip(x + delta)``.
    """
    v = x.amax(dim=1, keepdim=True)
    v_new = (v + delta).clamp(0, 1)
    ratio = torch.where(v > 0, v_new / v.clamp_min(1e-12), torch.zeros_like(v))
    return torch.where(v > 0, x * ratio, v_new.expand_as(x))


def hsv_saturation_affine(x: Tensor, gain: float, offset: float) -> Tensor:
    """skimage ``rgb2hsv`` -> ``S = clip(S * gain + offset, 0, 1)`` -> ``hsv2rgb`` on RGB (C = 3).

    Each channel is ``V - S * V * g_k(H)``, so a new saturation S' gives
    ``x_k' = V - (S'/S) (V - x_k)``. Grey pixels (S = 0) have hue 0 in skimage, so with
    ``S' > 0`` they turn red-tinted: ``(V, V (1 - S'), V (1 - S'))``.
    """
    v = x.amax(dim=1, keepdim=True)
    mn = x.amin(dim=1, keepdim=True)
    delta = v - mn
    s = torch.where(v > 0, delta / v.clamp_min(1e-12), torch.zeros_like(v))
    s_new = (s * gain + offset).clamp(0, 1)
    ratio = torch.where(s > 0, s_new / s.clamp_min(1e-12), torch.zeros_like(s))
    coloured = v - ratio * (v - x)
    grey = torch.cat([v, v * (1 - s_new), v * (1 - s_new)], dim=1)
    return torch.where(s > 0, coloured, grey)


# ----------------------------------------------------------------------------- edges


def _dilate3_u8(t: Tensor) -> Tensor:
    """3x3 binary dilation of a 0/1 uint8 batch (…, H, W), zero padding (separable ORs)."""
    p = F.pad(t, (1, 1, 0, 0))
    r = p[..., :-2] | p[..., 1:-1] | p[..., 2:]
    p = F.pad(r, (0, 0, 1, 1))
    return p[..., :-2, :] | p[..., 1:-1, :] | p[..., 2:, :]


def _select(a: Tensor, b: Tensor, take_b: Tensor) -> Tensor:
    """``b`` where ``take_b`` (0/1 float) is 1, else ``a``; exact for finite values (``lerp`` with
    weight 0 returns ``a``, with weight 1 returns ``b``), several times faster than
    ``torch.where`` on CPU."""
    return torch.lerp(a, b, take_b)


def canny(
    x: Tensor,
    sigma: float = 1.0,
    low: float = 0.1,
    high: float = 0.2,
    *,
    smooth_mode: str = "constant",
    l1: bool = False,
) -> Tensor:
    """Canny edges of a single-channel batch ``(N, 1, H, W)`` -> bool, like
    ``skimage.feature.canny(x, sigma, low, high)`` (the MNIST-C ``canny_edges`` call):
    Gaussian smoothing (zero padding), Sobel gradients (scipy ``sobel``, mode ``reflect``),
    bilinear non-maximum suppression in four sectors, the one-pixel image border masked out,
    then hysteresis over 8-connected components (a component survives when it holds a pixel
    above ``high``). ``l1`` uses ``|gx| + |gy|`` for the magnitude (OpenCV's default).
    """
    s = gaussian_blur(x, sigma, mode=smooth_mode) if sigma > 0 else x
    d = torch.tensor([-1.0, 0.0, 1.0], dtype=x.dtype, device=x.device)
    sm = torch.tensor([1.0, 2.0, 1.0], dtype=x.dtype, device=x.device)
    # ndimage.correlate1d orientation: out[i] = x[i+1] - x[i-1].
    gi = separable_filter(s, d, sm, "reflect")  # derivative along rows (axis 0)
    gj = separable_filter(s, sm, d, "reflect")  # derivative along columns (axis 1)
    H, W = x.shape[-2:]
    if _kernels.serves(x, floating=True) and H > 2 and W > 2:
        with torch.no_grad():
            mag = gi.abs() + gj.abs() if l1 else torch.hypot(gi, gj)
            dt = mag.numpy().dtype.type
            args = (t[:, 0].contiguous().numpy() for t in (gi, gj, mag))
            return torch.from_numpy(_kernels.canny_nms_hysteresis(*args, dt(low), dt(high)))[:, None]
    ai, aj = gi.abs(), gj.abs()
    mag = ai + aj if l1 else torch.hypot(gi, gj)
    with torch.no_grad():
        # skimage's four sectors, later ones overriding earlier ones where they overlap:
        #   A same signs, |gi| >= |gj|: w = |gj|/|gi|, neighbours (1, 0) and (1, 1)
        #   B same signs, |gi| <= |gj|: w = |gi|/|gj|, neighbours (0, 1) and (1, 1)
        #   C opposite,   |gi| <= |gj|: w = |gi|/|gj|, neighbours (0, 1) and (-1, 1)
        #   D opposite,   |gi| >= |gj|: w = |gj|/|gi|, neighbours (-1, 0) and (-1, 1)
        # (a zero component counts as both signs) and the mirrored neighbours on the other side.
        # Per pixel the last sector that applies is D or C where the signs are opposite, B or A
        # elsewhere; w is min/max of |gi|, |gj| in all four. (With numba: _kernels, per pixel.)
        opp = (torch.sign(gi) * torch.sign(gj)) <= 0
        ji = (ai > aj) | (opp & (ai == aj))  # sector A or D: the row neighbour (+-1, 0)
        w = torch.minimum(ai, aj).div_(torch.maximum(ai, aj))
        oppf, jif = opp.to(x.dtype), ji.to(x.dtype)
        p = F.pad(mag, (1, 1, 1, 1))
        m = lambda dy, dx: p[..., 1 + dy : 1 + dy + H, 1 + dx : 1 + dx + W]
        c1p = _select(m(0, 1), _select(m(1, 0), m(-1, 0), oppf), jif)
        c2p = _select(m(1, 1), m(-1, 1), oppf)
        c1m = _select(m(0, -1), _select(m(-1, 0), m(1, 0), oppf), jif)
        c2m = _select(m(-1, -1), m(1, -1), oppf)
        rest = 1 - w
        local_max = (c2p * w + c1p * rest <= mag) & (c2m * w + c1m * rest <= mag)
        local_max[..., 0, :] = False
        local_max[..., -1, :] = False
        local_max[..., :, 0] = False
        local_max[..., :, -1] = False
        low_mask = local_max & (mag >= low)
        seed = (low_mask & (mag >= high)).view(torch.uint8)
        lowu = low_mask.view(torch.uint8)
        # Hysteresis: grow the strong pixels through 8-connected weak ones until stable.
        for it in range(H * W):
            grown = _dilate3_u8(seed) & lowu
            if it % 4 == 3 and torch.equal(grown, seed):
                break
            seed = grown
    return seed.view(torch.bool)


def distance_to_edges(edges: Tensor, cap: float) -> Tensor:
    """Euclidean distance from every pixel to the nearest ``True`` pixel of ``edges`` (N, 1, H, W),
    capped at ``cap`` (images without edges get ``cap``). Exact, in two passes (Felzenszwalb &
    Huttenlocher style): the 1-D distance ``g`` to the nearest edge along each row by a forward
    and a backward scan, then ``min over |dy| <= cap of dy^2 + g(y + dy)^2``."""
    N, _, H, W = edges.shape
    if _kernels.serves(edges) and float(cap) == int(cap):
        d2 = torch.from_numpy(_kernels.edge_distance(edges[:, 0].contiguous().numpy(), float(cap)))
        return d2.sqrt_().clamp_(max=cap)[:, None]
    far = float(cap) + 1.0
    big = float(2**20)  # stands for "no edge on this side"; x +- big stays exact in float32
    e = edges[:, 0].to(torch.float32)
    xs = torch.arange(W, device=e.device, dtype=torch.float32)
    # forward scan as a running maximum: the column of the nearest edge at or left of x
    last = torch.cummax(e * (xs + big) - big, dim=-1).values
    g = (xs - last).clamp_(max=far)
    # backward scan as a running minimum from the right: the nearest edge at or right of x
    nxt = torch.cummin((e * (xs - big) + big).flip(-1), dim=-1).values.flip(-1)
    g = torch.minimum(g, (nxt - xs).clamp_(max=far))
    g2 = g * g
    d2 = g2.clone()
    reach = min(int(math.ceil(cap)), H - 1)
    for dy in range(1, reach + 1):
        torch.minimum(d2[:, dy:, :], g2[:, :-dy, :] + dy * dy, out=d2[:, dy:, :])
        torch.minimum(d2[:, :-dy, :], g2[:, dy:, :] + dy * dy, out=d2[:, :-dy, :])
    return d2.sqrt().clamp(max=cap)[:, None]


def equalize_hist_u8(x: Tensor) -> Tensor:
    """``cv2.equalizeHist`` per image on integer-valued ``x`` (N, 1, H, W) in 0..255."""
    N = x.shape[0]
    v = x.reshape(N, -1).to(torch.int32).clamp_(0, 255)
    idx = v + torch.arange(N, device=x.device, dtype=torch.int32)[:, None] * 256  # image n's bins
    hist = torch.bincount(idx.view(-1), minlength=N * 256).view(N, 256).double()
    cdf = hist.cumsum(1)
    total = cdf[:, -1:]
    # cv2: lut[v] = round((cdf[v] - cdf[first nonzero]) * 255 / (total - count of the first bin))
    first = torch.where(hist > 0, cdf, torch.full_like(cdf, float("inf"))).amin(dim=1, keepdim=True)
    denom = (total - first).clamp_min(1)
    lut = ((cdf - first) * 255.0 / denom).round().clamp(0, 255)
    # a flat image (one value) is left unchanged by OpenCV: the identity table
    flat = ((total - first) == 0).view(N)
    lut[flat] = torch.arange(256, device=x.device, dtype=lut.dtype)
    out = lut.to(x.dtype).view(-1).index_select(0, idx.view(-1))
    return out.reshape(x.shape)
