"""Is QACT's accuracy under a white-box attack robustness or gradient masking? The reproduction's
trained LeNets (``studies/reproduce_adaptation.py``: ReLU, its BatchNorm twin and QACT, each
with cross-entropy, and QACT with the watershed loss) under FGSM and PGD (L-inf, 10 steps) at
eps 0.1, 0.2 and 0.3, white-box on every model and transferred from the ReLU model and from the
twin (images made on them, scored on every model; Papernot et al. 2017; Athalye, Carlini & Wagner
2018, Sec. 3.1). QACT models in the batch context; the watershed model is attacked through its
trained loss, as ``shiftguard run`` does.

    python studies/transfer_attack_check.py run --dataset mnist --seed 0 --runs runs
    python studies/transfer_attack_check.py table --dataset mnist

``table`` writes ``studies/results/transfer_attack_<dataset>.{json,md}``: accuracy per model,
head and attack at each budget, per seed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from reproduce_adaptation import load_trained  # the sibling script that trained the models

import shiftguard
from shiftguard.io import atomic_write_json, atomic_write_text
from shiftguard.train import to_model_input

HERE = Path(__file__).resolve().parent
MODELS = {
    "lenet-relu-ce": ["softmax"],
    "lenet-bnrelubn-ce": ["softmax"],
    "lenet-qact-ce": ["softmax"],
    "lenet-qact-watershed": ["quantile"],
}
SOURCES = ["lenet-relu-ce", "lenet-bnrelubn-ce"]
EPS = [0.1, 0.2, 0.3]


def run(a) -> None:
    _, data, models, losses = load_trained(a.runs, a.dataset, a.seed, a.test_subset, MODELS)
    t0 = time.perf_counter()
    res = shiftguard.evaluate(
        models,
        data["test"],
        support=data["train"],
        heads=MODELS,
        corruptions=["fog"],
        severities=[1],
        preprocess=to_model_input,
        batch_size=500,
        contexts=("batch",),
        attacks=["fgsm", "pgd"],
        attack_eps=EPS,
        attack_steps=10,
        attack_loss=losses,
        transfer_from=SOURCES,
        seed=a.seed,
        n_boot=10,
        name=f"transfer-{a.dataset}-seed{a.seed}",
    )
    res.results["data"]["dataset"] = data["name"]
    out = Path(a.out) / f"transfer-{a.dataset}-seed{a.seed}"
    res.write_report(out)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")


def table(a) -> None:
    runs = sorted(Path(a.out).glob(f"transfer-{a.dataset}-seed*/results.json"))
    if not runs:
        raise SystemExit(f"no transfer-{a.dataset}-seed*/results.json under {a.out}")
    per_seed = {}
    for p in runs:
        res = json.loads(p.read_text(encoding="utf-8"))
        eps = {n: s["eps"] for n, s in res["data"]["attacks"].items()}
        cells = {}
        for r in res["rows"]:
            if r["group"] == "adversarial":
                cells[f"{r['model']}/{r['head']}/{r['corruption']}/{eps[r['corruption']][r['severity'] - 1]:g}"] = r[
                    "accuracy"
                ]
            elif r["corruption"] == "clean":
                cells[f"{r['model']}/{r['head']}/clean/0"] = r["accuracy"]
        per_seed[p.parent.name] = cells
    out_json = HERE / "results" / f"transfer_attack_{a.dataset}.json"
    atomic_write_json(out_json, {"dataset": a.dataset, "eps": EPS, "accuracy": per_seed})
    attacks = ["fgsm-linf", "pgd-linf", *(f"pgd-linf@{s}" for s in SOURCES)]
    lines = [
        f"# Accuracy (%) under white-box and transfer attacks, {a.dataset}",
        "",
        "Rows: model / head (seed); columns: attack at eps; `pgd-linf@M` = PGD images made on model M.",
        "",
        "| model / head (seed) | clean | " + " | ".join(f"{t} {e:g}" for t in attacks for e in EPS) + " |",
        "|---|---|" + "---|" * (len(attacks) * len(EPS)),
    ]
    for seed, cells in per_seed.items():
        for name, heads in MODELS.items():
            for h in heads:
                vals = [cells.get(f"{name}/{h}/clean/0")] + [
                    cells.get(f"{name}/{h}/{t}/{e:g}") for t in attacks for e in EPS
                ]
                lines.append(
                    f"| {name} / {h} ({seed.rsplit('-', 1)[1]}) | "
                    + " | ".join("—" if v is None else f"{100 * v:.1f}" for v in vals)
                    + " |"
                )
    atomic_write_text(HERE / "results" / f"transfer_attack_{a.dataset}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--dataset", required=True, choices=["mnist", "fashion-mnist"])
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--runs", required=True, help="the folder holding adapt-<dataset>-seed<s>/")
    r.add_argument("--out", default="runs")
    r.add_argument("--test-subset", type=int, default=1000)
    r.add_argument("--threads", type=int, default=0)
    t = sub.add_parser("table")
    t.add_argument("--dataset", required=True, choices=["mnist", "fashion-mnist"])
    t.add_argument("--out", default="runs")
    a = p.parse_args()
    if getattr(a, "threads", 0):
        torch.set_num_threads(a.threads)
    run(a) if a.cmd == "run" else table(a)


if __name__ == "__main__":
    main()
