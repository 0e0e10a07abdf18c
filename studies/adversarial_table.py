"""Accuracy and top-label ECE under attack, mean +- std over the seeds of several runs of one config.

Reads the ``results.json`` of ``shiftguard run`` directories made with the same config and
different ``--seed`` (e.g. ``shiftguard run --config mnist-adversarial --seed 0..2``), and prints,
per (model, context, head), the clean cell and every (attack, eps) cell; ``--out FILE.json``
keeps the table. Used for the reproduction of [NED, Sec. 5, Table 3] in ``docs/adversarial.md``.

    python studies/adversarial_table.py runs/s0 runs/s1 runs/s2 --out studies/results/adversarial_mnist.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def cells(results: dict) -> dict[tuple, dict[str, float]]:
    """``{(model, context, head, attack, eps): {"accuracy", "ece"}}``; the clean cell as attack "clean", eps 0."""
    eps_of = {n: a["eps"] for n, a in (results["data"].get("attacks") or {}).items()}
    out = {}
    for r in results["rows"]:
        if r["corruption"] == "clean":
            attack, eps = "clean", 0.0
        elif r.get("group") == "adversarial":
            attack, eps = r["corruption"], eps_of[r["corruption"]][r["severity"] - 1]
        else:
            continue
        out[(r["model"], r["context"], r["head"], attack, eps)] = {"accuracy": r["accuracy"], "ece": r["ece_top_label"]}
    return out


def table(run_dirs: list[Path]) -> list[dict]:
    per_run = [cells(json.loads((d / "results.json").read_text())) for d in run_dirs]
    keys = [k for k in per_run[0] if all(k in c for c in per_run)]
    out = []
    for k in keys:
        acc = np.array([c[k]["accuracy"] for c in per_run]) * 100
        ece = np.array([c[k]["ece"] for c in per_run]) * 100
        out.append(
            {
                "model": k[0],
                "context": k[1],
                "head": k[2],
                "attack": k[3],
                "eps": k[4],
                "seeds": len(per_run),
                "accuracy_mean": float(acc.mean()),
                "accuracy_std": float(acc.std()),
                "ece_mean": float(ece.mean()),
                "ece_std": float(ece.std()),
            }
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories of one config, different seeds")
    p.add_argument("--out", type=Path, help="write the table as JSON")
    args = p.parse_args(argv)
    rows = table(args.runs)
    print(f"accuracy / top-label ECE in %, mean +- std over {len(args.runs)} seeds")
    for r in rows:
        print(
            f"{r['model']:22s} {r['context']:6s} {r['head']:11s} {r['attack']:9s} {r['eps']:<4g} "
            f"{r['accuracy_mean']:5.1f} +- {r['accuracy_std']:4.1f}   {r['ece_mean']:5.1f} +- {r['ece_std']:4.1f}"
        )
    if args.out:
        args.out.write_text(json.dumps({"runs": [str(d) for d in args.runs], "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
