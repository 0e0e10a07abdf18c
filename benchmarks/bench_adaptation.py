"""Cost of the test-time adaptation arms of ``shiftguard.evaluate(adapt=...)``, per cell.

Workload: one cell of ``--n`` MNIST-sized images (the embedded MNIST training images), scored in
batches of ``--batch-size`` by a LeNet (width 2, the default run's) built with QACT and by its
BatchNorm twin (BN-ReLU-BN blocks in place of BN-QACT-BN), QACT in the batch context. For each arm
the time of producing the cell's logits and embeddings the way the grid does
(``compute_outputs`` for ``none``, ``AdaptedModel.outputs_on`` for the others: reset to the
trained state, adapt, score), the minimum over ``--repeats`` runs, and its ratio to ``none`` in the
same run. What the arms should cost, in forward passes over the cell: ``none`` and ``bn-batch`` 1,
``bn`` 2 (one more to re-estimate the statistics), ``tent`` 1 forward and 1 backward per batch,
``refresh:passes=p`` p + 1.

Prints a table and writes ``benchmarks/results/bench_adaptation.json``. The machine is shared:
compare the ratios of one run, not seconds across runs.

    python benchmarks/bench_adaptation.py [--n 2000] [--batch-size 500] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from shiftguard.data import load_default
from shiftguard.evaluation import ModelOutputs, compute_outputs
from shiftguard.evaluation.adaptation import AdaptedModel, AdaptSpec
from shiftguard.functional import warm_up
from shiftguard.io import atomic_write_json
from shiftguard.models import build_model
from shiftguard.nn import qact_context
from shiftguard.train import to_model_input

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("none", "bn-batch", "bn", "tent", "refresh:passes=2")


def time_arm(outputs: ModelOutputs, spec: str, images: torch.Tensor, batch_size: int, repeats: int) -> float:
    arm = None if spec == "none" else AdaptedModel(AdaptSpec.parse(spec), outputs)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        if arm is None:
            with qact_context(outputs.model, "batch"):
                compute_outputs(outputs, images, batch_size)
        else:
            arm.outputs_on(images, batch_size, "cpu", "batch")
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_adaptation.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warm_up()
    images = load_default("train").images[: args.n]
    torch.manual_seed(0)
    results = []
    for activation in ("qact", "bn-relu-bn"):
        model = build_model("lenet", activation=activation, width=2).eval()
        outputs = ModelOutputs(model, preprocess=to_model_input)
        time_arm(outputs, "tent", images[: 2 * args.batch_size], args.batch_size, 1)  # first backward compiles
        base = None
        for spec in ARMS:
            s = time_arm(outputs, spec, images, args.batch_size, args.repeats)
            base = s if spec == "none" else base
            results.append({"model": f"lenet-{activation}", "arm": spec, "seconds": s, "x_none": s / base})
            print(f"lenet-{activation:<11} {spec:<18} {s:7.3f} s  {s / base:5.2f}x none", flush=True)
    atomic_write_json(
        Path(args.out),
        {
            "n_images": args.n,
            "batch_size": args.batch_size,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "results": results,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
