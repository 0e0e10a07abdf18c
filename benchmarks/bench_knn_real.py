"""NED fit + predict on real embeddings: the back ends of ``bench_knn.py`` on Fashion-MNIST.

``bench_knn.py`` measures on 10 Gaussian classes, data the pruned back end suits well. This script
repeats the torch / pruned / scikit-learn rows on embeddings a network actually produces: the
library's LeNet-5 (``shiftguard.models``, ReLU, 128-d embedding: the last hidden layer) trained
``--epochs`` epochs with cross-entropy on the 60,000 Fashion-MNIST training images; support = their
embeddings, queries = the 10,000 test images, k = 10. Same NED fit and eq. (3) as there.

Prints a table and writes ``benchmarks/results/bench_knn_real.json``; timings are noisy on a shared
machine, compare the same-run ratios.

    python benchmarks/bench_knn_real.py [--data-dir ../shared/data] [--repeats 2] [--epochs 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shiftguard.io import atomic_write_json
from shiftguard.models import build_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_knn import run_ned, run_sklearn_ned  # noqa: E402  (the same runners as the synthetic benchmark)


def embeddings(data_dir: Path, epochs: int, seed: int = 0):
    from shiftguard.data import load

    torch.manual_seed(seed)
    train, test = load("fashion-mnist", "train", root=data_dir), load("fashion-mnist", "test", root=data_dir)
    net = build_model("lenet", embedding_dim=128)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(train.labels))
        for i in range(0, len(order), 256):
            b = order[i : i + 256]
            loss = F.cross_entropy(net(train.images[b].float() / 255.0), train.labels[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        xs = torch.cat(
            [net.embed(train.images[i : i + 4096].float() / 255.0) for i in range(0, len(train.labels), 4096)]
        )
        xq = torch.cat([net.embed(test.images[i : i + 4096].float() / 255.0) for i in range(0, len(test.labels), 4096)])
    return xs, train.labels, xq, test.labels, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs per back end")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_knn_real.json")
    args = ap.parse_args()
    if not (args.data_dir / "fashion-mnist").is_dir():
        sys.exit(f"--data-dir: no fashion-mnist folder under {args.data_dir} (the official IDX files)")

    xs, ys, xq, yq, train_s = embeddings(args.data_dir, args.epochs)
    rows, probs = {}, {}
    for name in ("torch", "pruned", "sklearn"):
        for _ in range(args.repeats):
            res, p = run_sklearn_ned(xs, ys, xq, args.k) if name == "sklearn" else run_ned(name, xs, ys, xq, args.k)
            if name not in rows or res["total_s"] < rows[name]["total_s"]:
                rows[name] = res
            probs[name] = p
    for r in rows.values():
        r["speedup_vs_sklearn_ned"] = rows["sklearn"]["total_s"] / r["total_s"]
    accuracy = float((probs["torch"].argmax(1) == yq).double().mean())
    agree = float((probs["torch"].double() - probs["pruned"].double()).abs().max())

    print(
        f"NED on Fashion-MNIST LeNet-5 embeddings: support {tuple(xs.shape)}, {len(yq)} queries, k={args.k}, "
        f"{args.epochs} epochs ({train_s:.0f} s), NED test accuracy {accuracy:.3f}, "
        f"torch threads={torch.get_num_threads()}"
    )
    print(f"{'backend':10s} {'fit s':>8s} {'predict s':>10s} {'total s':>8s} {'x vs sklearn NED':>17s}")
    for name, r in rows.items():
        print(
            f"{name:10s} {r['fit_s']:8.2f} {r['predict_s']:10.2f} {r['total_s']:8.2f} "
            f"{r['speedup_vs_sklearn_ned']:17.2f}"
        )
    print(
        f"pruned: predict computed {rows['pruned']['predict_products_fraction']:.1%} of the brute-force products; "
        f"max |p_torch - p_pruned| = {agree:.1e}"
    )
    atomic_write_json(
        args.out,
        {
            "workload": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "load_average": os.getloadavg(),
            },
            "ned_test_accuracy": accuracy,
            "train_seconds": train_s,
            "results": rows,
            "torch_vs_pruned_max_abs_prob_diff": agree,
            "note": "shared machine: absolute timings are noisy; compare the same-run ratios",
        },
        indent=2,
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
