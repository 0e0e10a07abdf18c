"""Forward+backward time of BN-QACT-BN vs BN-ReLU-BN (same run, CPU float32, default threads).

Prints a table (median of repeats, ratio QACT/ReLU per shape) and writes
``benchmarks/results/bench_qact.json``. Also checks, per shape, that the layer's training-mode
output (batch context, the path timed) equals the exact reference computed channel by channel
(numpy weighted quantiles, Alg. 1 of QACT) and that the density its backward multiplies by is within
the proven KDE grid error bound of the exact KDE of its samples.
Timings are noisy on a shared machine: compare the ratios, measured in the same run.

Usage: python benchmarks/bench_qact.py [--repeats 5] [--shapes 256x64x12x12,...] [--no-check]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from shiftguard.functional import channel_values, gaussian_kde, gaussian_kde_grid, kde_grid_error_bound
from shiftguard.functional.kde import POINTS_PER_BANDWIDTH, TRUNCATE
from shiftguard.functional.quantile import _forward
from shiftguard.io import atomic_write_json
from shiftguard.nn import QACTBlock

SHAPES = [(256, 64, 12, 12), (128, 64, 16, 16), (256, 512), (1024, 128)]
OUT = Path(__file__).resolve().parent / "results" / "bench_qact.json"


def relu_block(c: int, rank: int) -> nn.Module:
    bn = nn.BatchNorm2d if rank == 4 else nn.BatchNorm1d
    return nn.Sequential(bn(c), nn.ReLU(), bn(c))


def _fwd_bwd_seconds(block: nn.Module, x: torch.Tensor, g: torch.Tensor) -> float:
    xi = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    block(xi).backward(g)
    return time.perf_counter() - t0


def time_interleaved(blocks: list, x: torch.Tensor, g: torch.Tensor, repeats: int) -> list:
    """Median forward+backward seconds of each block, the blocks timed in turn within each repeat
    (so that a slow spell of the shared machine hits all of them alike); one warm-up call each."""
    for block in blocks:
        _fwd_bwd_seconds(block, x, g)
    times = [[] for _ in blocks]
    for _ in range(repeats):
        for i, block in enumerate(blocks):
            times[i].append(_fwd_bwd_seconds(block, x, g))
    return [statistics.median(t) for t in times]


def check_exact(x: torch.Tensor) -> dict:
    """What the layer computes in training (the batch context with its gradient's density, the
    path timed above) against the references: the forward output == the numpy weighted-quantile
    reference (all channels), the density the backward multiplies by within the grid bound of the
    exact KDE of the layer's own KDE samples (4 channels)."""
    xv = channel_values(x).double()
    fwd = _forward(x, None, None, 100, 100.0, 1000, torch.Generator().manual_seed(0), True)
    stats = fwd.stats
    counts = torch.round(channel_values(fwd.output).double() * 100).long()
    mism = 0
    beyond = 0
    levels = np.arange(1, 101) / 101
    for ch in range(xv.shape[0]):
        v = np.concatenate([xv[ch].numpy(), [-100.0, 100.0]])
        neg = v < 0
        w = np.where(neg, 0.5 / neg.sum(), 0.5 / (~neg).sum())
        o = np.argsort(v, kind="stable")
        v, w = v[o], w[o]
        p = np.cumsum(w) - w / 2
        q = np.interp(levels, p, v)  # linear interpolation, clamped outside [p_1, p_K]
        ref = np.searchsorted(q, xv[ch].numpy(), side="right")
        bad = ref != counts[ch].numpy()
        mism += int(bad.sum())
        if bad.any():  # float32 layer: x within float32 rounding (4 ulp) of a reference quantile?
            xb = xv[ch].numpy()[bad]
            dist = np.abs(xb[:, None] - q[None, :]).min(axis=1)
            beyond += int((dist > 4 * np.spacing(np.abs(xb).astype(np.float32)).astype(np.float64)).sum())
    sub = xv[:4, :20000]
    dens = channel_values(fwd.density).double()[:4, :20000]
    h = stats.bandwidth[:4].double()
    exact = gaussian_kde(sub, stats.samples[:4].double(), h)
    _, spacing = gaussian_kde_grid(sub, stats.samples[:4].double(), h, return_spacing=True)
    err = (dens - exact).abs().max(dim=1).values
    # the grid bound, plus the float32 rounding of the layer's convolution ((n_taps + 4) * 2^-24 of
    # the density, n_taps = 2 ceil(truncate * points_per_bandwidth) + 1)
    n_taps = 2 * math.ceil(TRUNCATE * POINTS_PER_BANDWIDTH) + 1
    bound = kde_grid_error_bound(h, spacing) + (n_taps + 4) * 2.0**-24 * exact.max(dim=1).values
    peak = 1.0 / (h * (2 * np.pi) ** 0.5)  # the kernel peak phi(0) / h
    return {
        "forward_mismatches": mism,
        "forward_mismatches_beyond_float32_rounding": beyond,
        "kde_max_abs_error": float(err.max()),
        "kde_max_error_rel_to_peak": float((err / peak).max()),
        "kde_error_within_bound": bool((err <= bound * 1.0001 + 1e-12).all()),
        "kde_bound_rel_to_peak": float((kde_grid_error_bound(h, spacing) / peak).max()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--shapes", type=str, default=None, help="comma-separated, e.g. 256x512,64x16x8x8")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    rows = []
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, float32 CPU, median of {args.repeats}")
    print(f"{'shape':<20}{'BN-ReLU-BN ms':>15}{'BN-QACT-BN ms':>15}{'ratio':>8}  check")
    for shape in shapes:
        x = torch.randn(shape)
        g = torch.randn(shape)
        c = shape[1]
        relu = relu_block(c, len(shape)).train()
        qact = QACTBlock(c).train()
        t_relu, t_qact = time_interleaved([relu, qact], x, g, args.repeats)
        row = {"shape": list(shape), "relu_ms": t_relu * 1e3, "qact_ms": t_qact * 1e3, "ratio": t_qact / t_relu}
        if not args.no_check:
            row["check"] = check_exact(x)
        rows.append(row)
        chk = (
            ""
            if args.no_check
            else (
                f"fwd mismatches {row['check']['forward_mismatches']} "
                f"({row['check']['forward_mismatches_beyond_float32_rounding']} beyond fp32 rounding), "
                f"kde in bound {row['check']['kde_error_within_bound']} "
                f"(max error {100 * row['check']['kde_max_error_rel_to_peak']:.3f}% of kernel peak)"
            )
        )
        print(
            f"{'x'.join(map(str, shape)):<20}{row['relu_ms']:>15.1f}{row['qact_ms']:>15.1f}{row['ratio']:>8.1f}  {chk}"
        )
    atomic_write_json(
        OUT,
        {
            "benchmark": "bench_qact",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "repeats": args.repeats,
            "rows": rows,
        },
    )
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
