#!/usr/bin/env python
"""Check that a change of code changes no number: one fixed evaluation at a git revision and in the
working tree, and their results compared.

    python scripts/same_results.py REV [--run] [--keep DIR]

The evaluation exercises every part of the evaluation floor at a small scale: a QACT LeNet and its
BatchNorm twin, five heads, two corruptions at two severities, the ``none``, ``bn`` and ``tent``
arms, LAC / APS sets with the weighted variant, FGSM with a transfer attack and the output cache.
Each side runs in its own process with its own source tree on ``PYTHONPATH`` (REV checked out with
``git worktree add`` into a temporary folder, removed afterwards) and the same thread count;
the results are compared after dropping what is meant to differ (``created``, ``timings``), and
the cache folders file by file. Exit status 0 when both are identical, 1 otherwise (the keys that
differ are printed).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

EVALUATION = r"""
import json, sys, torch
import shiftguard
from shiftguard.models import build_model

torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
x = torch.randint(0, 256, (160, 1, 28, 28), dtype=torch.uint8, generator=g)
y = torch.arange(160) % 4
models = {"q": build_model("lenet", num_classes=4, activation="qact"),
          "r": build_model("lenet", num_classes=4, activation="bn-relu-bn")}
res = shiftguard.evaluate(
    models, (x[:60], y[:60]), support=(x[60:120], y[60:120]), validation=(x[120:], y[120:]),
    corruptions=["fog", "shot_noise"], severities=[1, 5],
    heads=["softmax", "temperature", "knn", "ned", "logistic"], adapt=["none", "bn", "tent:steps=1"],
    conformal=["lac", "aps"], conformal_weighted=True, attacks=["fgsm"], attack_eps=[2 / 255],
    transfer_from=["r"], n_boot=50, batch_size=20, k=3, cache_dir=sys.argv[2],
)
results = dict(res.results)
for key in ("created", "timings"):
    results.pop(key, None)
with open(sys.argv[1], "w") as f:
    json.dump(results, f, sort_keys=True, default=str)
"""


def _evaluate(src: Path, out: Path, cache: Path, script: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    subprocess.run([sys.executable, str(script), str(out), str(cache)], check=True, env=env)
    return json.loads(out.read_text())


def _quick_run(src: Path, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "shiftguard", "run", "--quick", "--no-progress", "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    (results,) = out.glob("*/results.json")
    run = json.loads(results.read_text())
    for key in ("created", "timings", "command", "versions", "name"):
        run.pop(key, None)
    for summary in run.get("training", {}).values():
        summary.pop("seconds", None)
        for epoch in summary.get("history", []):
            epoch.pop("seconds", None)
    return run


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    if a == b:
        return []
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [prefix or "(top)"]
    keys = sorted(set(a) | set(b))
    return [d for k in keys for d in _differences(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)]


def _cache_differences(a: Path, b: Path) -> list[str]:
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    differ = sorted(str(p) for p in files_a ^ files_b)
    differ += sorted(str(p) for p in files_a & files_b if not filecmp.cmp(a / p, b / p, shallow=False))
    return differ


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev", help="the git revision to compare the working tree with (e.g. HEAD~3, a tag)")
    p.add_argument("--run", action="store_true", help="also compare `shiftguard run --quick`")
    p.add_argument("--keep", type=Path, help="keep both results and caches in this folder")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="same-results-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        script = work / "evaluation.py"
        script.write_text(EVALUATION)
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), args.rev], check=True)
        try:
            old = _evaluate(tree / "src", work / "old.json", work / "cache-old", script)
            old_run = _quick_run(tree / "src", work / "run-old") if args.run else {}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
        new = _evaluate(ROOT / "src", work / "new.json", work / "cache-new", script)
        new_run = _quick_run(ROOT / "src", work / "run-new") if args.run else {}
        differ = (
            _differences(old, new)
            + _differences(old_run, new_run, "run")
            + [f"cache: {f}" for f in _cache_differences(work / "cache-old", work / "cache-new")]
        )
    if differ:
        print(f"results differ from {args.rev}: " + ", ".join(differ[:20]) + (" ..." if len(differ) > 20 else ""))
        return 1
    also = f"; shiftguard run --quick: {len(new_run['rows'])} rows and the training" if args.run else ""
    print(f"identical to {args.rev}: {len(new['rows'])} rows, the aggregates, intervals and output cache{also}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
