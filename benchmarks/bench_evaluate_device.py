"""``shiftguard.evaluate`` of a ResNet-18 over the CIFAR-10-C grid on one device, end to end.

The evaluation of ``docs/performance.md``'s target: a ResNet-18 (``shiftguard.models``, random
weights: the time does not depend on them) on ``--n`` 32x32 test images x the 19 CIFAR-10-C
corruptions (15 + 4 extra) x 5 severities, with the softmax, temperature and kNN heads (a support
set of ``--n`` images, a validation set of ``--n // 10``). The images are random (no CIFAR files
here); with ``--data device`` (default) they are given on the device, so the corruption engine runs
there too.

Measured, each in the same run:

- the evaluation's wall time (the device synchronised at the end) and its images per second
  (test images x cells / wall time);
- the forward passes alone: the model over the same number of images in batches of the same size,
  synchronised, and their share of the evaluation's wall time (target: >= 70%);
- on CUDA, the share of the wall time the GPU is busy: the union of the kernels' intervals in a
  ``torch.profiler`` trace of a one-corruption evaluation, over its wall time (approximate: the
  profiler adds its own overhead to the wall time);
- on CUDA, the GPU memory a one-corruption evaluation allocates at its peak above what was resident
  before the call (the model and the images given on the device), with all ``--n`` test and support
  images and with a quarter of them: what the batches need stays, what grows with the data (the
  outputs the heads are fitted and scored on, a few MiB a thousand images) is the difference.

``--smoke``: 64 images, base width 8, two corruptions at one severity (the CPU check of the
script). Prints a table and writes JSON to ``--out`` (the path is printed).

Usage: ``python benchmarks/bench_evaluate_device.py --device cuda --out DIR`` (``device_check.sh``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import shiftguard
from shiftguard import corruptions as K
from shiftguard.models import resnet18

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_device import report_header, sync

HEADS = ["softmax", "temperature", "knn"]


def _images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(n) % 10


def _forward_seconds(model, x: torch.Tensor, batch_size: int, repeats: int, dev: torch.device) -> float:
    """Seconds of ``repeats`` eval-mode forward passes over ``x`` in batches, on ``dev``."""
    model.eval()
    sync(dev)
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(repeats):
            for a in range(0, x.shape[0], batch_size):
                model(x[a : a + batch_size].to(dev, torch.float32).div_(255.0))
    sync(dev)
    return time.perf_counter() - t0


def _busy_share(evaluate, dev: torch.device) -> float:
    """Union of the CUDA kernels' intervals in a profile of ``evaluate()`` over its wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync(dev)
        t0 = time.perf_counter()
        evaluate()
        sync(dev)
        wall = time.perf_counter() - t0
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # microseconds
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / 1e6 / wall


def _peak_above_resident(evaluate, dev: torch.device) -> int:
    """Bytes of GPU memory ``evaluate()`` allocates at its peak above what was allocated before it."""
    sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    resident = torch.cuda.memory_allocated(dev)
    evaluate()
    sync(dev)
    return torch.cuda.max_memory_allocated(dev) - resident


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--n", type=int, default=10_000, help="test images (and support images)")
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--data", default="device", choices=("device", "host"), help="where the images are given")
    p.add_argument("--smoke", action="store_true", help="64 images, base width 8, two cells")
    args = p.parse_args()
    path, info = report_header("bench_evaluate_device", args.device, args.out, args.smoke, data=args.data)
    if "skipped" in info:
        return 0
    dev = torch.device(args.device)
    n = 64 if args.smoke else args.n
    corruptions = ["gaussian_noise", "fog"] if args.smoke else K.names("cifar-c") + K.names("cifar-c-extra")
    severities = [3] if args.smoke else [1, 2, 3, 4, 5]
    torch.manual_seed(0)
    model = resnet18(activation="relu", num_classes=10, base_width=8 if args.smoke else 64).to(dev).eval()
    test, support, validation = _images(n, 0), _images(n, 1), _images(max(n // 10, 20), 2)
    if args.data == "device":
        test, support, validation = (tuple(t.to(dev) for t in part) for part in (test, support, validation))
    kw = dict(
        support=support,
        validation=validation,
        suite="cifar-c",
        heads=HEADS,
        batch_size=args.batch_size,
        device=dev,
        n_boot=10,
        extra=True,
    )

    def evaluate(cs=corruptions, ss=severities, m=n):
        if m == n:
            return shiftguard.evaluate(model, test, corruptions=cs, severities=ss, **kw)
        part = dict(kw, support=tuple(t[:m] for t in support))
        return shiftguard.evaluate(model, tuple(t[:m] for t in test), corruptions=cs, severities=ss, **part)

    evaluate(cs=corruptions[:1], ss=[1])  # warm-up: kernels, cuDNN's choices, the corruption tables
    sync(dev)
    t0 = time.perf_counter()
    res = evaluate()
    sync(dev)
    wall = time.perf_counter() - t0
    cells = 1 + len(corruptions) * len(severities)  # the clean test set is a cell too
    images = n * cells + 2 * n + validation[1].numel()  # + the support and validation passes
    forward = _forward_seconds(model, test[0], args.batch_size, cells + 2, dev)
    row = {
        "bench": "evaluate resnet18 cifar-c grid",
        "n": n,
        "cells": cells,
        "heads": HEADS,
        "wall_s": round(wall, 3),
        "images_per_s": round(images / wall, 1),
        "forward_s": round(forward, 3),
        "forward_share": round(forward / wall, 3),
        "timings": res.results.get("timings"),
    }
    info["row"] = row
    path.write_text(json.dumps(info, indent=1))  # (kept if a time limit stops the extras below)
    if dev.type == "cuda":
        row["gpu_busy_share"] = round(_busy_share(lambda: evaluate(cs=corruptions[:1]), dev), 3)
        path.write_text(json.dumps(info, indent=1))
        for m in (n, n // 4):
            peak = _peak_above_resident(lambda: evaluate(cs=corruptions[:1], m=m), dev)
            row[f"peak_above_resident_gib_n{m}"] = round(peak / 2**30, 3)
        path.write_text(json.dumps(info, indent=1))
    print(json.dumps(row), flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
