"""Wall time of ``shiftguard run --quick`` with the default threading and with ``--threads 1``, on
an idle machine and beside one competing busy process, measured in the same run.

Each case runs the command in a fresh process (kernels already compiled: one warm-up run first),
``--repeats`` times, the two thread settings alternating, and reports the median. The busy process
is a pure-Python loop (one core).

    python benchmarks/bench_threads.py [--repeats 3] [--job quick|default]

Writes ``benchmarks/results/bench_threads.json`` (``--job quick``) or
``benchmarks/results/bench_threads_default.json`` (``--job default``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "bench_threads.json"


def _busy(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def run_once(job: str, threads: int | None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "shiftguard", "run", "--no-progress", "--out", tmp, "--name", "b"]
        if job == "quick":
            cmd.append("--quick")
        if threads is not None:
            cmd += ["--threads", str(threads)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
        return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--job", choices=("quick", "default"), default="quick")
    args = p.parse_args()
    run_once(args.job, 1)  # compile / cache everything first
    rows = []
    for load in ("idle", "one busy process"):
        stop = mp.Event()
        busy = mp.Process(target=_busy, args=(stop,), daemon=True) if load != "idle" else None
        if busy is not None:
            busy.start()
        try:
            # the two settings alternate, so that a drift of the machine's speed hits both alike
            times: dict = {None: [], 1: []}
            for _ in range(args.repeats):
                for threads in times:
                    times[threads].append(run_once(args.job, threads))
            for threads, runs in times.items():
                rows.append(
                    {
                        "load": load,
                        "threads": "default" if threads is None else threads,
                        "median_s": statistics.median(runs),
                        "runs_s": runs,
                    }
                )
                print(
                    f"{args.job:7s} {load:17s} threads={rows[-1]['threads']!s:8s} "
                    f"median {rows[-1]['median_s']:.1f} s  runs {', '.join(f'{t:.1f}' for t in runs)}",
                    flush=True,
                )
        finally:
            if busy is not None:
                stop.set()
                busy.join()
    out = OUT if args.job == "quick" else OUT.with_name(f"bench_threads_{args.job}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"job": args.job, "cpus": os.cpu_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
