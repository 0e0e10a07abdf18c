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
- :func:`edge_distance`: the squared distances of :func:`._ops.distance_to_edges` (row scans,
  then per column the lower envelope of the parabolas ``g^2 + dy^2`` in integer arithmetic; the
  same exact minimum).

Each is used only for CPU tensors when numba is importable; the torch code stays the reference
and the path for other devices (``tests/test_corruptions_fastpaths.py`` checks both).
"""

from __future__ import annotations

import numpy as np

try:  # numba is a dependency, but the torch code works without it
    from numba import njit

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    AVAILABLE = False

__all__ = [
    "AVAILABLE", "motion_blur_taps", "sample_levels", "canny_nms_hysteresis", "edge_distance", "pil_box_resample",
    "pil_box_pairs",
]

if AVAILABLE:
    _M1 = np.uint64(0x9E3779B97F4A7C15)
    _M2 = np.uint64(0xBF58476D1CE4E5B9)
    _M3 = np.uint64(0x94D049BB133111EB)
    _S8 = np.uint64(8)
    _S27 = np.uint64(27)
    _S30 = np.uint64(30)
    _S31 = np.uint64(31)
    _B8 = np.uint64(0xFF)
    _B32 = np.uint64(0xFFFFFFFF)
    _H32 = np.int64(1 << 31)

    @njit(inline="always")
    def _splitmix64(key):
        """SplitMix64 finaliser: 64 well-mixed bits from the counter ``key``."""
        z = key * _M1
        z = (z ^ (z >> _S30)) * _M2
        z = (z ^ (z >> _S27)) * _M3
        return z ^ (z >> _S31)

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
            b = _splitmix64(base + np.uint64(i))
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
                    v = m[i, j]
                    is_max = (c2p * wt + c1p * rt <= v) and (c2m * wt + c1m * rt <= v)
                    weak[i, j] = is_max and v >= low
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
        g2 = np.empty((H, W), dtype=np.int64)
        v = np.empty(H, dtype=np.int64)  # parabolas of the envelope
        zn = np.empty(H, dtype=np.int64)  # where each starts: zn / zd
        zd = np.empty(H, dtype=np.int64)
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
            # columns: d2[i] = min_k g2[k] + (i - k)^2, the lower envelope of the parabolas
            # (Felzenszwalb & Huttenlocher) in integers: intersections are kept as fractions and
            # compared by cross-multiplication, so the minimum is exact. Offsets beyond the cap
            # cannot win: (cap + 1)^2 >= g2 of the pixel itself.
            for j in range(W):
                k = 0
                v[0] = 0
                for q in range(1, H):
                    fq = g2[q, j] + q * q
                    while k > 0:  # drop the parabolas that q's hides (the first never goes)
                        p = v[k]
                        if (fq - (g2[p, j] + p * p)) * zd[k] > zn[k] * (2 * (q - p)):
                            break
                        k -= 1
                    p = v[k]
                    k += 1
                    v[k] = q
                    zn[k] = fq - (g2[p, j] + p * p)
                    zd[k] = 2 * (q - p)
                last = k
                k = 0
                for q in range(H):
                    while k < last and zn[k + 1] < q * zd[k + 1]:
                        k += 1
                    p = v[k]
                    out[n, q, j] = np.float32(g2[p, j] + (q - p) * (q - p))
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
