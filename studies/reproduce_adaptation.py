"""What QACT's robustness under shift is made of: QACT against its BatchNorm twin, each under every
test-time adaptation arm, on full MNIST and Fashion-MNIST with the 15 MNIST-C corruptions x 5
severities.

The QACT paper's headline (CIFAR10C drop 16.9 vs 35.5 points, [QACT, App. C, Table 1]) is measured,
in its public code, after training-mode passes over each corrupted test cell (the ``refresh`` arm,
``docs/evaluate.md``), and its QACT block carries two BatchNorms per activation that the ReLU
baseline lacks. Each run here trains four LeNets (width 1, the shipped ``mnist-c-lenet`` schedule:
Adam 1e-3, ReduceLROnPlateau and early stopping on validation accuracy, at most 30 epochs):

- ``lenet-relu-ce``: ReLU, no BatchNorm, cross-entropy;
- ``lenet-bnrelubn-ce``: the exact BatchNorm twin of the QACT LeNet (BN-ReLU-BN in place of
  BN-QACT-BN), cross-entropy;
- ``lenet-qact-watershed``: QACT + watershed, the paper's recipe, scored by the quantile classifier;
- ``lenet-qact-ce``: QACT + cross-entropy, scored by its own softmax;

each scored by its own head and by the logistic refit of [QACT, Sec. 4, Remark], under the arms
``none``, ``bn-batch``, ``bn``, ``tent``, ``refresh`` (QACT models in the batch context, their
own protocol's; ``refresh`` in the frozen one, as the reference code scores). Every cell holds
``--test-subset`` test images (2,000 by default: the whole grid at 10,000 does not fit this
2-core machine; the intervals say what that costs).

Run one dataset and seed per call (runs are resumable; finished ones are reused), then tabulate::

    python studies/reproduce_adaptation.py run --dataset mnist --seed 0 --root ../shared/data/mnist
    python studies/reproduce_adaptation.py table --dataset mnist

``table`` writes ``studies/results/adaptation_<dataset>.{json,md}``: per (model, context,
arm, head) the accuracy at severity 0 and 5, the drop 0 -> 5, the top-label ECE at 0 and 5 (mean
over the seeds, with a 95% t-interval over the seeds), the paired differences against the twin
under the same arm, and each run's bootstrap intervals over the test images.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from scipy.stats import t as student_t

from shiftguard.commands import config as C
from shiftguard.commands.report import load_run
from shiftguard.commands.run import COMPLETE_MARKER, execute, load_data, train_model
from shiftguard.io import atomic_write_json, atomic_write_text

HERE = Path(__file__).resolve().parent
#: The arms; TENT and the reference protocol in the batches of their papers' code (128 images), the
#: others in the evaluation batches of 1,000 (QACT's context).
ARMS = ["none", "bn-batch", "bn", "tent:batch_size=128", "refresh:batch_size=128"]
MODELS = [
    {
        "name": "lenet-relu-ce",
        "arch": "lenet",
        "activation": "relu",
        "loss": "cross_entropy",
        "heads": ["softmax", "logistic"],
    },
    {
        "name": "lenet-bnrelubn-ce",
        "arch": "lenet",
        "activation": "bn-relu-bn",
        "loss": "cross_entropy",
        "heads": ["softmax", "logistic"],
    },
    {
        "name": "lenet-qact-watershed",
        "arch": "lenet",
        "activation": "qact",
        "loss": "watershed",
        "heads": ["quantile", "logistic"],
    },
    {
        "name": "lenet-qact-ce",
        "arch": "lenet",
        "activation": "qact",
        "loss": "cross_entropy",
        "heads": ["softmax", "logistic"],
    },
]
#: Each model's own head (the protocol head of its loss).
OWN_HEAD = {
    "lenet-relu-ce": "softmax",
    "lenet-bnrelubn-ce": "softmax",
    "lenet-qact-watershed": "quantile",
    "lenet-qact-ce": "softmax",
}
TWIN = "lenet-bnrelubn-ce"


def config(
    dataset: str, seed: int, root: str, test_subset: int, arms: list[str], epochs: int = 30, train_subset: int = 0
) -> C.RunConfig:
    raw = {
        "name": f"adapt-{dataset}-seed{seed}",
        "seed": seed,
        "data": {
            "dataset": dataset,
            "root": root,
            "suite": "mnist-c",
            "severities": [1, 2, 3, 4, 5],
            "corrupted_source": "engine",
            "test_subset": test_subset,
            "train_subset": train_subset,
        },
        "train": {"epochs": epochs, "batch_size": 256, "early_stopping_patience": 5},
        "eval": {"batch_size": 1000, "frozen_context": False, "adapt": arms},
        "models": MODELS,
    }
    return C.config_from_dict(raw, source="studies/reproduce_adaptation.py")


def run(a) -> None:
    cfg = config(a.dataset, a.seed, a.root, a.test_subset, a.arms, a.epochs, a.train_subset)
    d = Path(a.out) / cfg.name
    if (d / COMPLETE_MARKER).is_file():
        print(f"{d}: complete, reused")
        return
    d.mkdir(parents=True, exist_ok=True)
    stored = {"config": json.loads(json.dumps(cfg.to_dict())), "source": cfg.source}
    if not (d / "config.json").is_file():
        atomic_write_json(d / "config.json", stored)
    execute(cfg, d, torch.device("cpu"), resume=True, progress=not a.no_progress)


# --------------------------------------------------------------------------- tables
def _series(res: dict) -> list[tuple]:
    return list(dict.fromkeys((r["model"], r["context"], r.get("adaptation", "none"), r["head"]) for r in res["rows"]))


def _numbers(res: dict, key: tuple) -> dict:
    """acc s0 / s5, drop 0->5, ECE s0 / s5 (in %) and the run's bootstrap intervals for ``key``."""
    agg = {
        a["severity"]: a
        for a in res["aggregates"]
        if (a["model"], a["context"], a.get("adaptation", "none"), a["head"]) == key
    }
    ivs = {
        i["metric"]: i
        for i in res.get("intervals") or []
        if (i["model"], i["context"], i.get("adaptation", "none"), i["head"]) == key
    }
    top = max(res["data"]["severities"])
    return {
        "acc_s0": 100 * agg[0]["accuracy_mean"],
        "acc_s5": 100 * agg[top]["accuracy_mean"],
        "drop": 100 * (agg[0]["accuracy_mean"] - agg[top]["accuracy_mean"]),
        "ece_s0": 100 * agg[0]["ece_top_label_mean"],
        "ece_s5": 100 * agg[top]["ece_top_label_mean"],
        "acc_corrupted": 100
        * statistics.mean(
            r["accuracy"]
            for r in res["rows"]
            if (r["model"], r["context"], r.get("adaptation", "none"), r["head"]) == key
            and r["severity"] > 0
            and r.get("group") == "benchmark"
        ),
        "intervals": {m: [100 * i["lo"], 100 * i["hi"]] for m, i in ivs.items()},
    }


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% Student t interval over the values (runs); the mean alone for one value."""
    m = statistics.mean(values)
    if len(values) < 2:
        return m, math.nan, math.nan
    if len(values) == 2:  # a t-interval on one degree of freedom (x12.7) says little: the two values
        return m, min(values), max(values)
    half = float(student_t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def load_trained(runs: str | Path, dataset: str, seed: int, test_subset: int, names) -> tuple:
    """``(config, data, {name: model}, {name: trained embedding loss})`` of the models ``names`` that
    ``run`` trained into ``<runs>/adapt-<dataset>-seed<seed>``, read back by the run pipeline's own
    loader (weights and learnt loss parameters, checksums checked), on ``test_subset`` test images."""
    run_dir = Path(runs) / f"adapt-{dataset}-seed{seed}"
    stored = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))["config"]
    stored["data"]["test_subset"] = test_subset
    cfg = C.config_from_dict(stored, source=str(run_dir / "config.json"))
    data = load_data(cfg)
    models, losses = {}, {}
    for m in cfg.models:
        if m.name in names:
            net, _, loss = train_model(cfg, m, data, run_dir, torch.device("cpu"), resume=True, progress=False)
            models[m.name] = net.eval()
            if loss is not None:
                losses[m.name] = loss
    return cfg, data, models, losses


def _fmt(m, lo, hi) -> str:
    return f"{m:.1f}" if math.isnan(lo) else f"{m:.1f} [{lo:.1f}, {hi:.1f}]"


FIELDS = (("acc_s0", "acc s0"), ("acc_s5", "acc s5"), ("drop", "drop 0→5"), ("ece_s0", "ECE s0"), ("ece_s5", "ECE s5"))


def table(a) -> None:
    runs = []
    for d in sorted(Path(a.out).glob(f"adapt-{a.dataset}-seed*")):
        if (d / COMPLETE_MARKER).is_file():
            runs.append(load_run(d))
    if not runs:
        raise SystemExit(f"no complete run adapt-{a.dataset}-seed* under {a.out}")
    seeds = sorted(r["seed"] for r in runs)
    keys = [k for k in _series(runs[0]) if all(k in _series(r) for r in runs)]
    per_key = {k: [_numbers(r, k) for r in runs] for k in keys}
    summary = {}
    for k, nums in per_key.items():
        summary["/".join(k)] = {f: t_interval([n[f] for n in nums]) for f, _ in FIELDS + (("acc_corrupted", ""),)}
    # paired differences against the twin under the same arm (own heads; QACT in its batch context,
    # the twin has none), per seed then t-interval
    paired = {}
    arms = list(dict.fromkeys(k[2] for k in keys))
    for model in ("lenet-qact-watershed", "lenet-qact-ce", "lenet-relu-ce"):
        for arm in arms:
            for ctx in ("batch", "frozen") if "qact" in model else ("none",):
                mk, tk = (model, ctx, arm, OWN_HEAD[model]), (TWIN, "none", arm, OWN_HEAD[TWIN])
                if mk in per_key and tk in per_key:
                    paired["/".join(mk)] = {
                        f: t_interval([x[f] - y[f] for x, y in zip(per_key[mk], per_key[tk])])
                        for f in ("acc_s0", "acc_s5", "drop", "ece_s5")
                    }
    first = runs[0]
    out = {
        "dataset": a.dataset,
        "seeds": seeds,
        "n_test": first["data"]["n_test"],
        "n_train": first["data"]["n_train"],
        "arms": first.get("adaptation"),
        "series": summary,
        "paired_vs_twin": paired,
        "per_run": {str(r["seed"]): {"/".join(k): _numbers(r, k) for k in keys} for r in runs},
        "training": {
            str(r["seed"]): {
                m: {"epochs": t.get("epochs_run"), "best_val_acc": t.get("best_val_acc")}
                for m, t in r["training"].items()
            }
            for r in runs
        },
        "timings_s": {str(r["seed"]): r["timings"] for r in runs},
        "versions": first.get("versions"),
    }
    res_dir = HERE / "results"
    atomic_write_json(res_dir / f"adaptation_{a.dataset}.json", out)
    md = markdown(out, keys)
    atomic_write_text(res_dir / f"adaptation_{a.dataset}.md", md)
    print(md)


def markdown(out: dict, keys: list[tuple]) -> str:
    n = len(out["seeds"])
    L = [
        f"# {out['dataset']}: QACT vs its BatchNorm twin under test-time adaptation",
        "",
        f"LeNet, {out['n_train']} training images, {out['n_test']} test images, 15 MNIST-C corruptions x 5 "
        f"severities (engine), seeds {out['seeds']}. Accuracy and top-label ECE in %, drop in points. "
        f"Each cell: mean over the {n} seeds [95% t-interval over the seeds; with two seeds, the two seeds' "
        "values]. s5 = mean over the 15 "
        "corruptions at severity 5.",
        "",
        "| model | context | arm | head | " + " | ".join(lab for _, lab in FIELDS) + " |",
        "|---|---|---|---|" + "---|" * len(FIELDS),
    ]
    for k in keys:
        s = out["series"]["/".join(k)]
        L.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(_fmt(*s[f]) for f, _ in FIELDS) + " |")
    L += [
        "",
        f"## Paired differences against the twin ({TWIN}, softmax) under the same arm",
        "",
        "Own heads; per seed the difference, then mean [95% t-interval over the seeds; with two seeds, the two "
        "values]. Positive accuracy "
        "= better than the twin; positive drop or ECE = worse.",
        "",
        "| model | context | arm | head | Δ acc s0 | Δ acc s5 | Δ drop 0→5 | Δ ECE s5 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, d in out["paired_vs_twin"].items():
        m, c, arm, h = key.split("/")
        cells = " | ".join(_fmt(*d[f]) for f in ("acc_s0", "acc_s5", "drop", "ece_s5"))
        L.append(f"| {m} | {c} | {arm} | {h} | {cells} |")
    L += ["", "## Training", ""]
    for seed, models in out["training"].items():
        L.append(
            f"seed {seed}: "
            + "; ".join(f"{m} {t['epochs']} epochs, val acc {100 * t['best_val_acc']:.2f}" for m, t in models.items())
        )
    return "\n".join(L) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--dataset", required=True, choices=["mnist", "fashion-mnist"])
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--root", required=True, help="folder of the dataset's IDX files")
    r.add_argument("--test-subset", type=int, default=2000, help="test images per cell (0 = all 10,000)")
    r.add_argument(
        "--epochs",
        type=int,
        default=30,
        help="most epochs (early stopping ends training at the validation plateau); fewer only to try the script",
    )
    r.add_argument("--train-subset", type=int, default=0, help="training images (0 = all); only to try the script")
    r.add_argument("--arms", nargs="+", default=ARMS)
    r.add_argument("--out", default="runs")
    r.add_argument("--threads", type=int)
    r.add_argument("--no-progress", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("--dataset", required=True, choices=["mnist", "fashion-mnist"])
    t.add_argument("--out", default="runs")
    a = p.parse_args()
    if getattr(a, "threads", None):
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    run(a) if a.cmd == "run" else table(a)
    print(f"{a.cmd}: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
