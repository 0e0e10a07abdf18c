"""Exact sampling of per-pixel noise for 8-bit images: one alias-table draw per value.

A pixel-wise noise corruption of an 8-bit image (``gaussian_noise``, ``shot_noise``,
``impulse_noise``, ``speckle_noise``) sends each input level ``v`` in 0..255 to a random output
level that depends on ``v`` alone: its law is a distribution ``P[v, k]`` on the 256 output levels
``k``, which can be written down exactly (e.g. for Gaussian noise ``P[v, k]`` is the mass of
``N(v / 255, c^2)`` that ``round(255 * clip(y, 0, 1))`` sends to ``k``). So instead of drawing a
float noise value, adding, clipping and rounding, :func:`sample_levels` draws the output level
directly from ``P[v, :]``, with Walker's alias method (Vose's construction): 8 random bits pick one
of 256 equally likely columns of row ``v``, 32 more decide between the column's own level and its
alias. Two table look-ups and integer arithmetic per value, no float pass over the images.

Exactness: the sampled law is ``P`` up to the 32-bit quantisation of each column's threshold
(an error below ``2^-32`` per column, below 1e-9 on any probability; a float32 uniform has a
resolution of ``2^-24``). ``alias_tables(...).pmf()`` returns the law the tables implement, which
the tests compare with ``P``.

Random bits: on CPU with numba, the whole draw is one compiled loop (:mod:`._kernels`) whose 64
bits per value come from SplitMix64 of a 63-bit seed drawn from the corruption's
``torch.Generator`` plus the value's index. Without numba the torch code below draws them from
numpy's SFC64 generator seeded the same way (several times faster than torch's CPU generator),
and on other devices from ``torch.randint`` with that generator. Either way the same seed gives
the same output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import _kernels

Tensor = torch.Tensor
K = 256  # output levels = alias columns (8 random bits)


@dataclass(frozen=True)
class AliasTables:
    """Alias tables of 256 distributions over 0..255, flattened row-major (row = input level).

    thresholds: int32 ``(65536,)``: column ``j`` of row ``v`` keeps its own level ``j`` when a
        uniform 32-bit word, read as a signed int32, is below ``thresholds[256 v + j]``.
    outcomes: uint8 ``(131072,)``: ``[alias levels (65536), own levels (65536)]`` (the second
        half is ``256 v + j -> j``, kept for :meth:`pmf` and readers of the layout).
    """

    thresholds: Tensor
    outcomes: Tensor

    def to(self, device) -> "AliasTables":
        return AliasTables(self.thresholds.to(device), self.outcomes.to(device))

    def pmf(self) -> np.ndarray:
        """The distributions ``(256, 256)`` float64 that these tables sample exactly."""
        thr = (self.thresholds.cpu().numpy().astype(np.float64) + 2.0**31) / 2.0**32
        alias = self.outcomes[: K * K].cpu().numpy().astype(np.int64)
        rows = np.repeat(np.arange(K), K)
        p = np.zeros((K, K))
        np.add.at(p, (rows, np.tile(np.arange(K), K)), thr / K)
        np.add.at(p, (rows, alias), (1.0 - thr) / K)
        return p


def alias_tables(pmf: np.ndarray) -> AliasTables:
    """Vose's alias construction for each row of ``pmf`` (256, 256) (rows are renormalised)."""
    pmf = np.asarray(pmf, dtype=np.float64)
    if pmf.shape != (K, K) or not np.isfinite(pmf).all() or (pmf < 0).any():
        raise ValueError(f"pmf: expected a finite non-negative ({K}, {K}) array")
    pmf = pmf / pmf.sum(axis=1, keepdims=True)
    thr = np.ones((K, K))
    alias = np.tile(np.arange(K), (K, 1))
    for v in range(K):
        q = (pmf[v] * K).tolist()
        small = [j for j in range(K) if q[j] < 1.0]
        large = [j for j in range(K) if q[j] >= 1.0]
        t, a = thr[v], alias[v]
        while small and large:
            s = small.pop()
            big = large[-1]
            t[s] = q[s]
            a[s] = big
            q[big] -= 1.0 - q[s]
            if q[big] < 1.0:
                large.pop()
                small.append(big)
        # columns left in either list hold (up to rounding) exactly 1: they keep their own level
    thr = np.clip(thr, 0.0, 1.0)
    alias = np.where(thr >= 1.0, np.arange(K)[None, :], alias)  # a full column never aliases
    words = np.clip(np.round(thr * 2.0**32) - 2.0**31, -(2.0**31), 2.0**31 - 1).astype(np.int32)
    own = np.tile(np.arange(K), K)
    outcomes = np.concatenate([alias.reshape(-1), own]).astype(np.uint8)
    return AliasTables(torch.from_numpy(words.reshape(-1)), torch.from_numpy(outcomes))


class _Bits:
    """Uniform random words and bytes, in pieces, from one stream per call of
    :func:`sample_levels` (numpy SFC64 on CPU, seeded from the torch generator; ``torch.randint``
    with the generator elsewhere)."""

    def __init__(self, gen: torch.Generator, device: torch.device):
        self.gen, self.device = gen, device
        self.bg = None
        if device.type == "cpu":
            self.bg = np.random.SFC64(int(torch.randint(0, 2**63 - 1, (1,), generator=gen, device=device)))

    def words(self, n: int) -> Tensor:
        """``n`` int32, every one of the 2^32 values equally likely."""
        if self.bg is not None:
            return torch.from_numpy(self.bg.random_raw((n + 1) // 2).view(np.int32)[:n])
        w = torch.randint(-(2**31), 2**31, (n,), generator=self.gen, device=self.device, dtype=torch.int64)
        return w.to(torch.int32)

    def bytes(self, n: int) -> Tensor:
        """``n`` uniform uint8."""
        if self.bg is not None:
            return torch.from_numpy(self.bg.random_raw((n + 7) // 8).view(np.uint8)[:n])
        return torch.randint(0, K, (n,), generator=self.gen, device=self.device, dtype=torch.uint8)


#: Values per step of :func:`sample_levels` (its buffers then stay in the CPU caches).
STEP = 1 << 18


def sample_levels(x: Tensor, tables: AliasTables, gen: torch.Generator) -> Tensor:
    """For every value ``v`` of the uint8 tensor ``x``, an independent draw from row ``v`` of the
    distributions that ``tables`` encode. Returns uint8 with the shape of ``x``."""
    if x.dtype != torch.uint8:
        raise TypeError(f"x: expected uint8, got {x.dtype}")
    if tables.thresholds.device != x.device:
        tables = tables.to(x.device)
    thresholds, alias = tables.thresholds, tables.outcomes[: K * K]
    if _kernels.serves(x):  # one compiled loop, counter-based bits
        seed = int(torch.randint(0, 2**63 - 1, (1,), generator=gen))
        flat_np = x.reshape(-1).contiguous().numpy()
        return torch.from_numpy(_kernels.sample_levels(flat_np, thresholds.numpy(), alias.numpy(), seed)).view(x.shape)
    bits = _Bits(gen, x.device)
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    for i in range(0, flat.numel(), STEP):
        v = flat[i : i + STEP]
        words, col = bits.words(v.numel()), bits.bytes(v.numel())
        idx = v.to(torch.int32)
        torch.add(col, idx, alpha=K, out=idx)  # 256 v + column
        keep = (words < thresholds.index_select(0, idx)).view(torch.uint8)
        o = alias.index_select(0, idx)
        # o + keep * (column - o) in uint8 (mod 256): the column where kept, else its alias
        out[i : i + STEP] = o.add_(col.sub_(o).mul_(keep))
    return out.view(x.shape)


# ----------------------------------------------------------------------------- laws
# P[v, k] of the float pipeline of shiftguard.corruptions.corrupt for 8-bit input: the image is
# x = v / 255, the corruption gives y, the output is round(255 * clip(y, 0, 1)).


def _levels() -> tuple[np.ndarray, np.ndarray]:
    return np.arange(K, dtype=np.float64)[:, None], np.arange(K, dtype=np.float64)[None, :]


def _normal_bins(lo_z: np.ndarray, hi_z: np.ndarray) -> np.ndarray:
    """``P(lo_z < Z < hi_z)`` for a standard normal Z, computed on the tail that keeps precision."""
    lo = torch.from_numpy(np.ascontiguousarray(lo_z, dtype=np.float64))
    hi = torch.from_numpy(np.ascontiguousarray(hi_z, dtype=np.float64))
    # P = Phi(hi) - Phi(lo), or Phi(-lo) - Phi(-hi) when both are in the upper tail
    upper = lo > 0
    a = torch.where(
        upper, torch.special.ndtr(-lo) - torch.special.ndtr(-hi), torch.special.ndtr(hi) - torch.special.ndtr(lo)
    )
    return a.clamp_min(0).numpy()


def _cell_edges() -> tuple[np.ndarray, np.ndarray]:
    """Output level k collects y * 255 in (k - 0.5, k + 0.5), level 0 everything below 0.5 and
    level 255 everything from 254.5 up (the clip)."""
    _, k = _levels()
    lo = np.where(k == 0, -np.inf, k - 0.5)
    hi = np.where(k == K - 1, np.inf, k + 0.5)
    return lo, hi


def gaussian_noise_pmf(c: float) -> np.ndarray:
    """``y = x + N(0, c^2)``."""
    v, _ = _levels()
    lo, hi = _cell_edges()
    s = 255.0 * float(c)
    return _normal_bins((lo - v) / s, (hi - v) / s)


def speckle_noise_pmf(c: float) -> np.ndarray:
    """``y = x + x N(0, c^2)``: for ``v > 0``, ``255 y / v - 1 = c Z``; level 0 stays 0."""
    v, _ = _levels()
    lo, hi = _cell_edges()
    vv = np.maximum(v, 1.0)
    p = _normal_bins((lo / vv - 1.0) / float(c), (hi / vv - 1.0) / float(c))
    p[0] = 0.0
    p[0, 0] = 1.0
    return p


def impulse_noise_pmf(c: float) -> np.ndarray:
    """Each value replaced with probability ``c`` by 0 or 255 with equal odds."""
    c = float(c)
    p = np.eye(K) * (1.0 - c)
    p[:, 0] += c / 2
    p[:, K - 1] += c / 2
    return p


def shot_noise_pmf(c: float) -> np.ndarray:
    """``y = Poisson(c x) / c``: the Poisson counts ``j`` that land on each output level.

    The rate ``c x`` and the map ``j -> round(255 clip(j / c, 0, 1))`` are computed in float32,
    the arithmetic of the float pipeline; every count ``j >= c`` lands on 255."""
    c = float(c)
    rate = (torch.arange(K, dtype=torch.float32) / 255.0 * c).double()  # x * c as corrupt() computes it
    jmax = int(np.ceil(c))  # counts below c; the rest clip to 255
    j = torch.arange(jmax, dtype=torch.float64)
    level = torch.round((j.float() / c).clamp(0, 1) * 255).long()
    lam = rate[:, None]
    logp = j[None, :] * torch.log(lam.clamp_min(1e-300)) - lam - torch.lgamma(j + 1)[None, :]
    pj = torch.exp(logp)
    pj[0] = 0.0
    pj[0, 0] = 1.0  # rate 0: the count is 0
    p = torch.zeros(K, K, dtype=torch.float64)
    p.index_add_(1, level, pj)
    p[:, K - 1] += (1.0 - pj.sum(1)).clamp_min(0)
    return p.numpy()


_CACHE: dict = {}


def cached_tables(law: Callable[[float], np.ndarray], c) -> AliasTables:
    """Alias tables of ``law(c)``, built once per (law, constant) and reused: building costs far more than a draw."""
    key = (law.__name__, c)
    t = _CACHE.get(key)
    if t is None:
        if len(_CACHE) > 256:
            _CACHE.clear()
        t = _CACHE[key] = alias_tables(law(c))
    return t
