"""Compiled CPU kernels (numba) for the corruptions whose batched torch form is many passes over
memory: each kernel does the same arithmetic as the torch code it replaces, in one pass per image.

- :func:`motion_blur_taps`: the tap loop of :func:`._ops.motion_blur` (``out += w_t * shifted``
  in tap order, the same float products and sums, so the result is bitwise the same); per image,
  tap and row, the interior of the shifted row is one contiguous multiply-add.
- :func:`sample_levels`: the alias-table draw of :func:`._levels.sample_levels` fused into one
  loop, its random bits from a counter-based generator (SplitMix64 of the seed and the value's
  index), so the output does not depend on how the batch is cut.
- :func:`canny_nms_hysteresis`: the sector selection, bilinear non-maximum test and thresholds of
  :func:`._ops.canny` per pixel (the same float products, sums and comparisons), then hysteresis
  as a flood fill from the strong pixels through 8-connected weak ones (the fixed point that the
  torch code reaches by repeated dilation).
- :func:`pil_box_resample`: PIL's two-pass fixed-point resampling of 8-bit planes (horizontal
  pass, rounded and clipped to 8 bit, then vertical), given per-axis taps and weights;
  :func:`pil_box_pairs` the same when every box holds one or two pixels, ``(a + b + 1) >> 1``.
- :func:`spatter_water`: the water layer of CIFAR-10-C ``spatter`` from the distance map on: 3x3
  mean, floor, histogram equalisation, emboss, 3x3 mean, times the liquid, normalised, scaled,
  coloured and clipped (the float operations of the torch code in its order).
- :func:`jpeg_rgb_to_ycc`: the forward colour conversion of :func:`._jpeg.jpeg_roundtrip` with
  its rounding, straight from the 8-bit values (no float copy of the images first).
- :func:`contrast_u8`: ``contrast`` of uint8 images, ``(v - mean) c + mean`` rounded and clipped.
- :func:`uniform`: float uniforms in [low, high) from 24 random bits each (the law of
  ``torch.rand`` in float32), SplitMix64 of a seed and the index.
- :func:`edge_distance`: the squared distances of :func:`._ops.distance_to_edges` (row scans,
  then the minimum over vertical offsets of ``g^2 + dy^2``, a row at a time, stopped once
  ``dy^2`` reaches the row's largest value; integers, the same exact minimum).
- :func:`sampling_grid`: the normalised ``grid_sample`` grid of :func:`._ops.sample_at` for source
  coordinates ``affine map of the pixel grid (+ a displacement field)``, written in one pass
  (the torch code spends a dozen elementwise passes, each a fresh 4-8 MB tensor, on it).

Each is used only for CPU tensors when numba is importable; the torch code stays the reference
and the path for other devices (``tests/test_corruptions_fastpaths.py`` checks both).
"""

from __future__ import annotations

import numpy as np
import torch

from shiftguard._numba import AVAILABLE, njit  # numba is a dependency; the torch code works without it

if AVAILABLE:
    from shiftguard._numba import splitmix64


def serves(x: torch.Tensor, floating: bool = False) -> bool:
    """Whether the kernels handle tensor ``x``: numba is importable and ``x`` is on the CPU (and,
    with ``floating``, float32 or float64); otherwise the torch code runs."""
    return AVAILABLE and x.device.type == "cpu" and (not floating or x.dtype in (torch.float32, torch.float64))


__all__ = [
    "AVAILABLE",
    "serves",
    "motion_blur_taps",
    "sample_levels",
    "canny_nms_hysteresis",
    "edge_distance",
    "pil_box_resample",
    "pil_box_pairs",
    "spatter_water",
    "jpeg_rgb_to_ycc",
    "contrast_u8",
    "uniform",
    "sampling_grid",
]

if AVAILABLE:
    _S8 = np.uint64(8)
    _B8 = np.uint64(0xFF)
    _B32 = np.uint64(0xFFFFFFFF)
    _H32 = np.int64(1 << 31)

    @njit(inline="always")
    def _axpy(dst, d, src, s, n, a):
        """``dst[d + k] += a * src[s + k]`` for k < n (unsigned indices: no wraparound checks)."""
        for k in range(np.uint64(n)):
            dst[np.uint64(d) + k] += a * src[np.uint64(s) + k]

    @njit(inline="always")
    def _add_const(dst, d, v, n):
        """``dst[d + k] += v`` for k < n."""
        for k in range(np.uint64(n)):
            dst[np.uint64(d) + k] += v

    @njit(nogil=True, cache=True, error_model="numpy")
    def motion_blur_taps(x, oy, ox, w):
        """``out[n, c, i, j] = sum_t w[t, n] * x[n, c, clamp(i + oy[t, n]), clamp(j + ox[t, n])]``,
        taps summed in order from zero (edge replication). ``x`` (N, C, H, W) contiguous float,
        ``oy``/``ox`` (T, N) int64, ``w`` (T, N) of ``x``'s dtype."""
        N, C, H, W = x.shape
        out = np.zeros_like(x)
        xf = x.reshape(-1)
        of = out.reshape(-1)
        for n in range(N):
            for t in range(oy.shape[0]):
                dy, dx, wt = oy[t, n], ox[t, n], w[t, n]
                j0 = min(max(-dx, 0), W)  # columns j < j0 read column 0
                j1 = max(min(W - dx, W), j0)  # columns j >= j1 read column W - 1
                for c in range(C):
                    plane = (n * C + c) * H * W
                    for i in range(H):
                        s = plane + min(max(i + dy, 0), H - 1) * W  # the source row
                        d = plane + i * W
                        _add_const(of, d, wt * xf[s], j0)
                        _axpy(of, d + j0, xf, s + j0 + dx, j1 - j0, wt)
                        _add_const(of, d + j1, wt * xf[s + W - 1], W - j1)
        return out

    @njit(nogil=True, cache=True, error_model="numpy")
    def sample_levels(x, thresholds, alias, seed):
        """For every uint8 value ``v`` of ``x`` (flat): 64 random bits ``b`` = SplitMix64(seed +
        index); column ``j`` = the low 8 bits, kept when the next 32 bits (as a signed int32) are
        below ``thresholds[256 v + j]``, else ``alias[256 v + j]``."""
        out = np.empty_like(x)
        base = np.uint64(seed)
        for i in range(x.shape[0]):
            b = splitmix64(base + np.uint64(i))
            j = np.int64(b & _B8)
            word = np.int64((b >> _S8) & _B32) - _H32  # uniform over the int32 range
            k = np.int64(x[i]) * 256 + j
            a = alias[k]  # both loads unconditional: a select instead of an unpredictable branch
            out[i] = np.uint8(j) if word < thresholds[k] else a
        return out

    @njit(nogil=True, cache=True, error_model="numpy")
    def canny_nms_hysteresis(gi, gj, mag, low, high):
        """Edges (N, H, W) bool of :func:`._ops.canny` from its Sobel gradients ``gi`` (along
        rows), ``gj`` (along columns), their magnitude ``mag`` and the thresholds ``low``/``high``
        (all of one float dtype). Per pixel: the sector (opposite signs -> C/D, else A/B; the row
        neighbour when ``|gi| > |gj|``, or ``>=`` with opposite signs), ``w = min/max`` of
        ``|gi|, |gj|``, the bilinear test ``c2 w + c1 (1 - w) <= mag`` on both sides."""
        N, H, W = mag.shape
        one = mag.dtype.type(1)
        edges = np.zeros((N, H, W), dtype=np.bool_)
        weak = np.zeros((H, W), dtype=np.bool_)
        stack = np.empty(H * W, dtype=np.int64)
        for n in range(N):
            m = mag[n]
            top = 0
            for i in range(1, H - 1):
                for j in range(1, W - 1):
                    v = m[i, j]
                    if not v >= low:  # below the low threshold (or NaN): never an edge
                        weak[i, j] = False
                        continue
                    a, b = gi[n, i, j], gj[n, i, j]
                    ai, aj = abs(a), abs(b)
                    o = np.sign(a) * np.sign(b) <= 0
                    if o:
                        c2p, c2m = m[i - 1, j + 1], m[i + 1, j - 1]
                    else:
                        c2p, c2m = m[i + 1, j + 1], m[i - 1, j - 1]
                    if ai > aj or (o and ai == aj):
                        if o:
                            c1p, c1m = m[i - 1, j], m[i + 1, j]
                        else:
                            c1p, c1m = m[i + 1, j], m[i - 1, j]
                    else:
                        c1p, c1m = m[i, j + 1], m[i, j - 1]
                    wt = min(ai, aj) / max(ai, aj)
                    rt = one - wt
                    is_max = (c2p * wt + c1p * rt <= v) and (c2m * wt + c1m * rt <= v)
                    weak[i, j] = is_max
                    if weak[i, j] and v >= high:
                        edges[n, i, j] = True
                        stack[top] = i * W + j
                        top += 1
            # hysteresis: flood fill from the strong pixels through 8-connected weak ones
            while top > 0:
                top -= 1
                i, j = stack[top] // W, stack[top] % W
                for a in range(max(i - 1, 0), min(i + 2, H)):
                    for b in range(max(j - 1, 0), min(j + 2, W)):
                        if weak[a, b] and not edges[n, a, b]:
                            edges[n, a, b] = True
                            stack[top] = a * W + b
                            top += 1
            weak[:, :] = False
        return edges

    @njit(nogil=True, cache=True, error_model="numpy")
    def edge_distance(edges, cap):
        """Squared Euclidean distance (N, H, W) float32 from every pixel to the nearest edge pixel,
        exact up to ``(cap + 1)^2`` (``(cap + 1)^2`` everywhere in an image without edges); the
        caller takes the square root with torch, as the torch code does (torch's float32 sqrt
        is not always the correctly rounded one that numba computes). ``cap`` is an integer."""
        N, H, W = edges.shape
        far = np.int64(cap) + 1
        out = np.empty((N, H, W), dtype=np.float32)
        g2 = np.empty((H, W), dtype=np.int32)
        cur = np.empty(W, dtype=np.int32)
        for n in range(N):
            for i in range(H):  # distance to the nearest edge in the row, capped at far
                last = -far
                for j in range(W):
                    if edges[n, i, j]:
                        last = j
                    g2[i, j] = j - last
                nxt = W - 1 + far
                for j in range(W - 1, -1, -1):
                    if edges[n, i, j]:
                        nxt = j
                    g = g2[i, j]
                    if nxt - j < g:
                        g = nxt - j
                    if far < g:
                        g = far
                    g2[i, j] = g * g
            # columns: d2[i] = min over dy of g2[i +- dy] + dy^2, a row at a time (vectorised
            # over the row); once dy^2 reaches the row's largest d2 no further offset can lower
            # it. Offsets beyond the cap cannot win: (cap + 1)^2 >= g2 of the pixel itself.
            for i in range(H):
                for j in range(W):
                    cur[j] = g2[i, j]
                for dy in range(1, H):
                    dd = dy * dy
                    top = cur[0]
                    for j in range(1, W):
                        top = cur[j] if cur[j] > top else top
                    if dd >= top:
                        break
                    if i - dy >= 0:
                        for j in range(W):
                            c = g2[i - dy, j] + dd
                            cur[j] = c if c < cur[j] else cur[j]
                    if i + dy < H:
                        for j in range(W):
                            c = g2[i + dy, j] + dd
                            cur[j] = c if c < cur[j] else cur[j]
                for j in range(W):
                    out[n, i, j] = np.float32(cur[j])
        return out

    @njit(nogil=True, cache=True, error_model="numpy")
    def pil_box_resample(x, ri, rw, ci, cw, bits):
        """uint8 planes ``x`` (P, H, W) -> (P, H', W'): ``tmp[i, j] = clip8((sum_t x[i, ci[t, j]]
        cw[t, j] + 2^(bits-1)) >> bits)``, then the same down the columns with ``ri``/``rw`` (PIL
        ``ImagingResample``: horizontal pass first, 8-bit in between). Taps (T, n) int64, weights
        (T, n) int64 (zero weights for padding taps)."""
        P, H, W = x.shape
        Ho, Wo = ri.shape[1], ci.shape[1]
        half = np.int64(1) << (bits - 1)
        out = np.empty((P, Ho, Wo), dtype=np.uint8)
        tmp = np.empty((H, Wo), dtype=np.int64)
        acc = np.empty(Wo, dtype=np.int64)
        for p in range(P):
            for i in range(H):
                row = x[p, i]
                acc[:] = half
                for t in range(ci.shape[0]):
                    idx, wt = ci[t], cw[t]
                    for j in range(Wo):
                        acc[j] += np.int64(row[idx[j]]) * wt[j]
                for j in range(Wo):
                    tmp[i, j] = min(max(acc[j] >> bits, 0), 255)
            for i in range(Ho):
                acc[:] = half
                for t in range(ri.shape[0]):
                    src, wt = tmp[ri[t, i]], rw[t, i]
                    for j in range(Wo):
                        acc[j] += src[j] * wt
                dst = out[p, i]
                for j in range(Wo):
                    dst[j] = min(max(acc[j] >> bits, 0), 255)
        return out

    @njit(nogil=True, cache=True, error_model="numpy")
    def pil_box_pairs(x, r1, r2, c1, c2):
        """:func:`pil_box_resample` for boxes of one or two pixels: ``tmp[i, j] = (x[i, c1[j]] +
        x[i, c2[j]] + 1) >> 1`` (a lone pixel listed twice), then ``out[i, j] = (tmp[r1[i], j] +
        tmp[r2[i], j] + 1) >> 1``."""
        P, H, W = x.shape
        Ho, Wo = r1.shape[0], c1.shape[0]
        out = np.empty((P, Ho, Wo), dtype=np.uint8)
        tmp = np.empty((H, Wo), dtype=np.int32)
        for p in range(P):
            for i in range(H):
                row = x[p, i]
                for j in range(Wo):
                    tmp[i, j] = (np.int32(row[c1[j]]) + np.int32(row[c2[j]]) + 1) >> 1
            for i in range(Ho):
                a, b = tmp[r1[i]], tmp[r2[i]]
                dst = out[p, i]
                for j in range(Wo):
                    dst[j] = np.uint8((a[j] + b[j] + 1) >> 1)
        return out

    @njit(inline="always")
    def _pad_mirror(src, P, H, W):
        """``P`` (H + 2, W + 2) = ``src`` (H, W) padded by one pixel, BORDER_REFLECT_101."""
        for i in range(H):
            for j in range(W):
                P[i + 1, j + 1] = src[i, j]
        for i in range(1, H + 1):
            P[i, 0] = P[i, 2]
            P[i, W + 1] = P[i, W - 1]
        for j in range(W + 2):
            P[0, j] = P[2, j]
            P[H + 1, j] = P[H - 1, j]

    @njit(inline="always")
    def _box3(src, dst, P, R, H, W, third):
        """``cv2.blur(src, (3, 3))`` into ``dst``: rows (a + b) + c times 1/3, then the columns
        (on the padded copy ``P``, with ``R`` (H, W + 2) for the row pass)."""
        _pad_mirror(src, P, H, W)
        for i in range(H):
            for j in range(W + 2):
                R[i, j] = (P[i, j] + P[i + 1, j] + P[i + 2, j]) * third
        for i in range(H):
            for j in range(W):
                dst[i, j] = (R[i, j] + R[i, j + 1] + R[i, j + 2]) * third

    @njit(nogil=True, cache=True, error_model="numpy")
    def spatter_water(liquid, dist, kernel, intensity, colour):
        """``add`` (N, 3, H, W): the water colour layer of ``spatter`` from the thresholded liquid
        ``liquid`` (N, H, W) and the capped edge distance ``dist`` (N, H, W): floor(box3(dist)),
        equalised (cv2 ``equalizeHist``: lut = round((cdf - cdf[first]) 255 / (total - count of the
        first bin)), a flat image unchanged), correlated with the 3x3 ``kernel`` (mirror), rounded
        and clipped to 0..255, box3 again, times ``liquid``, divided by its maximum (at least
        1e-12), times ``intensity``, times each of the 3 ``colour`` values, clipped to [0, 1]."""
        N, H, W = liquid.shape
        t = liquid.dtype.type
        third, zero, one, top = t(1.0 / 3.0), t(0), t(1), t(255)
        tiny = t(1e-12)
        out = np.empty((N, 3, H, W), dtype=liquid.dtype)
        d = np.empty((H, W), dtype=liquid.dtype)
        e = np.empty((H, W), dtype=liquid.dtype)
        P = np.empty((H + 2, W + 2), dtype=liquid.dtype)
        R = np.empty((H, W + 2), dtype=liquid.dtype)
        hist = np.zeros(256, dtype=np.int64)
        lut = np.empty(256, dtype=np.float64)
        for n in range(N):
            _box3(dist[n], d, P, R, H, W, third)
            hist[:] = 0
            for i in range(H):
                for j in range(W):
                    d[i, j] = np.floor(d[i, j])
                    hist[min(max(np.int64(d[i, j]), 0), 255)] += 1
            total, first, cum = H * W, -1, 0
            for v in range(256):
                cum += hist[v]
                if first < 0 and hist[v] > 0:
                    first = cum  # the cdf at the first non-empty bin
                lut[v] = cum
            denom = total - first
            for v in range(256):
                if denom == 0:
                    lut[v] = v  # a flat image is left unchanged
                else:
                    lut[v] = min(max(np.rint((lut[v] - first) * 255.0 / max(denom, 1)), 0.0), 255.0)
            for i in range(H):
                for j in range(W):
                    d[i, j] = t(lut[min(max(np.int64(d[i, j]), 0), 255)])
            _pad_mirror(d, P, H, W)  # emboss, taps in row-major order, zero taps skipped
            e[:, :] = zero
            for a in range(3):
                for b in range(3):
                    k = kernel[a, b]
                    if k != 0:
                        for i in range(H):
                            for j in range(W):
                                e[i, j] += k * P[i + a, j + b]
            for i in range(H):
                for j in range(W):
                    e[i, j] = min(max(np.rint(e[i, j]), zero), top)
            _box3(e, d, P, R, H, W, third)
            mx = zero
            for i in range(H):
                for j in range(W):
                    d[i, j] = liquid[n, i, j] * d[i, j]
                    mx = max(mx, d[i, j])
            mx = max(mx, tiny)
            for i in range(H):
                for j in range(W):
                    m = d[i, j] / mx * intensity
                    for c in range(3):
                        out[n, c, i, j] = min(max(m * colour[c], zero), one)
        return out

    @njit(nogil=True, cache=True, error_model="numpy")
    def jpeg_rgb_to_ycc(v, m):
        """``v`` (B, 3, P) 8-bit values (any real dtype) -> ``y`` (B, P) = round(m[0] . rgb - 128)
        and ``cc`` (2B, P) = round(m[1:] . rgb) (Cb then Cr of each image), in ``m``'s dtype."""
        B, _, P = v.shape
        t = m.dtype.type
        y = np.empty((B, P), dtype=m.dtype)
        cc = np.empty((2 * B, P), dtype=m.dtype)
        shift = t(128)
        for b in range(B):
            for k in range(P):
                r, g, bl = t(v[b, 0, k]), t(v[b, 1, k]), t(v[b, 2, k])
                y[b, k] = np.rint(m[0, 0] * r + m[0, 1] * g + m[0, 2] * bl - shift)
                cc[2 * b, k] = np.rint(m[1, 0] * r + m[1, 1] * g + m[1, 2] * bl)
                cc[2 * b + 1, k] = np.rint(m[2, 0] * r + m[2, 1] * g + m[2, 2] * bl)
        return y, cc

    @njit(nogil=True, cache=True, error_model="numpy")
    def contrast_u8(x, c):
        """uint8 planes ``x`` (P, n) -> ``round(clip((v - m) c + m, 0, 255))`` per plane, ``m`` the
        plane's mean (float32 arithmetic)."""
        P, n = x.shape
        out = np.empty_like(x)
        cf = np.float32(c)
        lo, hi = np.float32(0), np.float32(255)
        for p in range(P):
            s = np.float64(0)
            for k in range(n):
                s += x[p, k]
            m = np.float32(s / n)
            for k in range(n):
                val = (np.float32(x[p, k]) - m) * cf + m
                out[p, k] = np.uint8(np.rint(min(max(val, lo), hi)))
        return out

    @njit(nogil=True, cache=True, error_model="numpy")
    def uniform(n, low, high, seed, bits, dtype_probe):
        """``n`` uniforms in [low, high) of ``dtype_probe``'s dtype: ``(b >> (64 - bits)) 2^-bits``
        from 64 bits ``b`` = SplitMix64(seed + index) (torch.rand's law: 24 bits for float32, 53
        for float64), then ``* (high - low) + low`` (the affine map of :func:`._ops.uniform`)."""
        t = dtype_probe.dtype.type
        out = np.empty(n, dtype=dtype_probe.dtype)
        base = np.uint64(seed)
        shift = np.uint64(64 - bits)
        scale, span, lo = t(2.0**-bits), t(high - low), t(low)
        for i in range(n):
            b = splitmix64(base + np.uint64(i))
            out[i] = t(np.float64(b >> shift)) * scale * span + lo
        return out

    @njit(nogil=True, cache=True)
    def sampling_grid(m, dx, dy, align_corners, out):
        """``out[n, i, j] = normalise(m[n] @ (j, i, 1) + (dx, dy)[n, i, j])``, the grid of
        ``grid_sample`` for source pixel coordinates (x = column, y = row); ``dx`` empty: no
        displacement. Normalisation as :func:`._ops.sample_at`: ``2 x / (W - 1) - 1``
        (``align_corners``) or ``(2 x + 1) / W - 1``. m (N, 2, 3) float64, out (N, H, W, 2)."""
        n_img, h, w = out.shape[0], out.shape[1], out.shape[2]
        disp = dx.shape[0] > 0
        if align_corners:
            scale_x, shift_x = 2.0 / max(w - 1, 1), -1.0
            scale_y, shift_y = 2.0 / max(h - 1, 1), -1.0
        else:
            scale_x, shift_x = 2.0 / w, 1.0 / w - 1.0
            scale_y, shift_y = 2.0 / h, 1.0 / h - 1.0
        for n in range(n_img):
            a, b, c0 = m[n, 0, 0], m[n, 0, 1], m[n, 0, 2]
            d, e, f0 = m[n, 1, 0], m[n, 1, 1], m[n, 1, 2]
            for i in range(h):
                for j in range(w):
                    sx = a * j + b * i + c0
                    sy = d * j + e * i + f0
                    if disp:
                        sx += dx[n, i, j]
                        sy += dy[n, i, j]
                    out[n, i, j, 0] = sx * scale_x + shift_x
                    out[n, i, j, 1] = sy * scale_y + shift_y
