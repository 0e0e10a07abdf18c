"""End-to-end time and peak memory of a full-scale study, with the breakdown a user needs to see
where the minutes go: ``shiftguard run --config mnist-c-lenet`` (full MNIST: 48k train / 12k
validation / 10k test, 15 corruptions x 5 severities, every head) in a fresh process.

    python benchmarks/bench_full_study.py [--config mnist-c-lenet] [--root ../shared/data] [--threads N]

Peak memory is the largest resident set of the run's process (``getrusage(RUSAGE_CHILDREN)``).
The breakdown comes from the run's ``results.json``: the compile step, each model's training
(and the epochs it ran), and the evaluation split into embedding (model forward passes), fitting
the heads, scoring the cells and corrupting. Writes ``benchmarks/results/bench_full_study.json``.
Target: end to end <= 10 minutes on 2 cores, peak memory <= 4 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "bench_full_study.json"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="mnist-c-lenet")
    p.add_argument(
        "--root",
        default=str(Path(__file__).resolve().parents[2] / "shared" / "data"),
        help="folder holding mnist/ (SHIFTGUARD_DATA for the run)",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", metavar="DIR", help="keep the run directory under DIR (default: a temporary one)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        parent = Path(args.keep) if args.keep else Path(tmp)
        cmd = [
            sys.executable,
            "-m",
            "shiftguard",
            "run",
            "--config",
            args.config,
            "--out",
            str(parent),
            "--name",
            f"full-s{args.seed}",
            "--seed",
            str(args.seed),
            "--no-progress",
        ]
        if args.threads is not None:
            cmd += ["--threads", str(args.threads)]
        env = {**os.environ, "SHIFTGUARD_DATA": args.root}
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9  # ru_maxrss: KiB on Linux
        results = json.loads((parent / f"full-s{args.seed}" / "results.json").read_text())
    t = results["timings"]
    detail = t.get("evaluate_detail", {})
    rows = [("wall (process, incl. start-up)", wall), ("compile", t.get("compile_s", 0.0))]
    rows += [(f"train {name}", s) for name, s in t["train_s"].items()]
    rows += [("evaluate", t["evaluate_s"])]
    rows += [
        (f"  {k[:-2]}", detail[k])
        for k in ("embed_s", "fit_heads_s", "score_s", "corrupt_s", "attack_s")
        if k in detail
    ]
    # training time follows the epoch at which early stopping ends each model
    epochs = {name: summary.get("epochs_run") for name, summary in results.get("training", {}).items()}
    print(f"{args.config}, seed {args.seed}, threads {args.threads or 'default'}, {os.cpu_count()} CPUs")
    for name, s in rows:
        print(f"{name:34s} {s:8.1f} s  ({s / 60:5.1f} min)")
    print(f"{'peak resident memory':34s} {peak_gb:8.2f} GB")
    print(f"{'epochs run':34s} {', '.join(f'{k} {v}' for k, v in epochs.items())}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "config": args.config,
                "seed": args.seed,
                "threads": args.threads,
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "wall_s": wall,
                "peak_rss_gb": peak_gb,
                "breakdown_s": dict(rows),
                "epochs_run": epochs,
                "data": results["data"],
            },
            indent=1,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
