"""What conformal prediction sets add to an evaluation's time.

Workload: ``shiftguard.evaluate`` of a LeNet (width 2) on the embedded MNIST subset (8,000 support,
1,000 validation images that fit temperature scaling and NED, 1,000 calibration images, 1,000 test
images), heads softmax, temperature, logistic, NED and kNN, ``--corruptions`` x 5 severities; once
without conformal sets, once with ``lac``, ``aps`` and ``raps`` (``calibration=`` the 1,000
calibration images) and once with the weighted variant too. The heads see the same data in all
three, so the difference is what the sets cost: the calibration images' outputs, the calibrators'
fits and the sets of every cell.
The three runs alternate ``--repeats`` times; the minimum of each is compared (same process, same
data). The target: plain conformal scoring adds at most 5% to the evaluation.

Prints a table and writes ``benchmarks/results/bench_conformal.json``.

    python benchmarks/bench_conformal.py [--corruptions 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

import shiftguard
from shiftguard import corruptions as K
from shiftguard.data import load_default
from shiftguard.io import atomic_write_json
from shiftguard.models import build_model
from shiftguard.train import to_model_input

ROOT = Path(__file__).resolve().parents[1]
HEADS = ["softmax", "temperature", "logistic", "ned", "knn"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corruptions", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_conformal.json"))
    args = ap.parse_args()
    train, test = load_default("train"), load_default("test")
    support = (train.images[:8000], train.labels[:8000])
    validation = (train.images[8000:9000], train.labels[8000:9000])
    calibration = (train.images[9000:], train.labels[9000:])
    torch.manual_seed(0)
    model = build_model("lenet", activation="relu", width=2).eval()
    kw = dict(
        support=support,
        validation=validation,
        heads=HEADS,
        preprocess=to_model_input,
        corruptions=K.names("mnist-c")[: args.corruptions],
        n_boot=100,
    )
    sets = {"conformal": ["lac", "aps", "raps"], "calibration": calibration}
    settings = {"none": {}, "plain": sets, "weighted": {**sets, "conformal_weighted": True}}
    times: dict[str, list[float]] = {k: [] for k in settings}
    shiftguard.evaluate(model, (test.images, test.labels), **{**kw, "corruptions": ["fog"], "severities": [1]})
    for _ in range(args.repeats):
        for name, extra in settings.items():
            t0 = time.perf_counter()
            shiftguard.evaluate(model, (test.images, test.labels), **kw, **extra)
            times[name].append(time.perf_counter() - t0)
    base = min(times["none"])
    rows = [{"setting": k, "seconds": min(v), "all": v, "x_none": min(v) / base} for k, v in times.items()]
    for r in rows:
        print(f"{r['setting']:<9} {r['seconds']:7.2f} s  {100 * (r['x_none'] - 1):+6.1f}%", flush=True)
    atomic_write_json(
        Path(args.out),
        {
            "corruptions": args.corruptions,
            "severities": 5,
            "n_test": int(test.labels.numel()),
            "heads": HEADS,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "cores": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "results": rows,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
