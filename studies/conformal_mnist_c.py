"""Do conformal prediction sets keep their coverage under shift, and at what size? Full MNIST and
Fashion-MNIST under the 15 MNIST-C corruptions, alpha = 0.1, plain and weighted split conformal.

The models are the ones ``studies/reproduce_adaptation.py`` trained (one run directory per
dataset and seed, ``adapt-<dataset>-seed<s>``): the ReLU LeNet with cross-entropy, scored by its
softmax, temperature scaling, NED and the kNN vote, and the QACT LeNet with the watershed loss,
scored by its quantile classifier (batch context). Heads are fitted on the run's 48,000 training
images, temperature scaling and NED's temperature on half of its 12,000 validation images, and the
sets are calibrated on the other half; every cell holds all 10,000 test images; severities 3 and
5 beside the clean test set. LAC, APS and RAPS (randomised, as their papers), each plain and
weighted (Tibshirani et al. 2019, likelihood ratio estimated per cell: transductive).

    python studies/conformal_mnist_c.py run --dataset mnist --seed 0 --runs runs
    python studies/conformal_mnist_c.py table --dataset mnist

``table`` writes ``studies/results/conformal_<dataset>.{json,md}``: per head, method and variant
the coverage and mean set size at severities 0, 3 and 5 (mean over the seeds [95% t-interval]).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from reproduce_adaptation import load_trained, t_interval  # the sibling script that trained the models

import shiftguard
from shiftguard.io import atomic_write_json, atomic_write_text
from shiftguard.train import to_model_input

HERE = Path(__file__).resolve().parent
MODELS = {"lenet-relu-ce": ["softmax", "temperature", "ned", "knn"], "lenet-qact-watershed": ["quantile"]}
METHODS = ["lac", "aps", "raps"]
SEVERITIES = (0, 3, 5)


def run(a) -> None:
    _, data, models, _ = load_trained(a.runs, a.dataset, a.seed, a.test_subset, MODELS)
    t0 = time.perf_counter()
    res = shiftguard.evaluate(
        models,
        data["test"],
        support=data["train"],
        validation=data["val"],
        heads=MODELS,
        severities=[s for s in SEVERITIES if s],
        preprocess=to_model_input,
        batch_size=1000,
        contexts=("batch",),
        conformal=METHODS,
        conformal_weighted=True,
        seed=a.seed,
        n_boot=200,
        name=f"conformal-{a.dataset}-seed{a.seed}",
    )
    res.results["data"]["dataset"] = data["name"]
    out = Path(a.out) / f"conformal-{a.dataset}-seed{a.seed}"
    res.write_report(out)
    print(res.summary())
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")


def _fmt(t: tuple[float, float, float], scale: float = 100.0, nd: int = 1) -> str:
    m, lo, hi = t
    if math.isnan(lo):
        return f"{m * scale:.{nd}f}"
    return f"{m * scale:.{nd}f} [{lo * scale:.{nd}f}, {hi * scale:.{nd}f}]"


def table(a) -> None:
    runs = [
        json.loads((d / "results.json").read_text(encoding="utf-8"))
        for d in sorted(Path(a.out).glob(f"conformal-{a.dataset}-seed*"))
        if (d / "results.json").is_file()
    ]
    if not runs:
        raise SystemExit(f"no conformal-{a.dataset}-seed*/results.json under {a.out}")
    seeds = sorted(r["seed"] for r in runs)
    out: dict = {
        "dataset": a.dataset,
        "seeds": seeds,
        "alpha": runs[0]["conformal"]["alpha"],
        "n_test": runs[0]["data"]["n_test"],
        "n_calibration": runs[0]["conformal"]["n_calibration"],
        "series": {},
    }
    L = [
        f"# {a.dataset}: conformal prediction sets under MNIST-C (alpha = {out['alpha']})",
        "",
        f"{out['n_test']} test images per cell, sets calibrated on {out['n_calibration']} clean validation images; "
        f"seeds {seeds}. Coverage in %, set size in labels; each cell: mean over the seeds [95% t-interval; "
        "with two seeds, the two seeds' values]; "
        "s3 / s5: mean over the 15 corruptions at that severity. Target coverage: "
        f"{100 * (1 - out['alpha']):.0f}%.",
        "",
        "| model | head | method | coverage s0 | coverage s3 | coverage s5 | size s0 | size s3 | size s5 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, heads in MODELS.items():
        for head in heads:
            for method in METHODS:
                for variant in ("", "_weighted"):
                    cov, size = f"coverage_{method}{variant}", f"set_size_{method}{variant}"
                    per = {f"{k}_s{s}": [] for k in ("coverage", "size") for s in SEVERITIES}
                    for r in runs:
                        aggs = {
                            g["severity"]: g
                            for g in r["aggregates"]
                            if (g["model"], g["head"], g.get("adaptation", "none")) == (model, head, "none")
                        }
                        for s in SEVERITIES:
                            per[f"coverage_s{s}"].append(aggs[s][f"{cov}_mean"])
                            per[f"size_s{s}"].append(aggs[s][f"{size}_mean"])
                    stats = {k: t_interval(v) for k, v in per.items()}
                    out["series"][f"{model}/{head}/{method}{variant}"] = stats
                    label = method + (" (weighted)" if variant else "")
                    L.append(
                        f"| {model} | {head} | {label} | "
                        + " | ".join(_fmt(stats[f"coverage_s{s}"]) for s in SEVERITIES)
                        + " | "
                        + " | ".join(_fmt(stats[f"size_s{s}"], 1.0, 2) for s in SEVERITIES)
                        + " |"
                    )
    res_dir = HERE / "results"
    atomic_write_json(res_dir / f"conformal_{a.dataset}.json", out)
    md = "\n".join(L) + "\n"
    atomic_write_text(res_dir / f"conformal_{a.dataset}.md", md)
    print(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--dataset", required=True, choices=["mnist", "fashion-mnist"])
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--runs", default="runs", help="the folder of reproduce_adaptation.py's run directories")
    r.add_argument("--test-subset", type=int, default=0, help="test images per cell (0 = all 10,000)")
    r.add_argument("--out", default="runs")
    r.add_argument("--threads", type=int)
    t = sub.add_parser("table")
    t.add_argument("--dataset", required=True, choices=["mnist", "fashion-mnist"])
    t.add_argument("--out", default="runs")
    a = p.parse_args()
    if getattr(a, "threads", None):
        torch.set_num_threads(a.threads)
    run(a) if a.cmd == "run" else table(a)


if __name__ == "__main__":
    main()
