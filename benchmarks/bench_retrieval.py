"""Time and peak memory of MAP@R, R-precision, Recall@K at 100k and 300k embeddings, against
pytorch-metric-learning's ``AccuracyCalculator`` (faiss k-NN) in the same run.

Workload: ``N x 128`` float32 embeddings, 1,000 classes (labels drawn uniformly, so class sizes
vary around ``N / 1000``), Gaussian class centres plus unit noise. Every sample queries all the
others, itself excluded. Each measurement runs in a fresh subprocess that generates the same data
from the same seed; its peak resident memory is the high-water mark ``VmHWM`` of that process (interpreter, torch,
the embeddings and the metric computation), and ``baseline`` is its resident memory just before
the timed call. Measured:

- ``shiftguard``: ``retrieval_metrics(emb, labels, ks=(1, 2, 4, 8))`` with the given back end
  (``auto``: faiss when installed, exact torch otherwise); queries in chunks, only per-query
  scalars kept, so the peak stays bounded at every N.
- ``pml``: ``AccuracyCalculator(k="max_bin_count")`` with its default ``FaissKNN``
  (``faiss.IndexFlatL2``) and ``ref_includes_query=True``: the same neighbours (k = largest class
  size - 1, the query's own row left out), held as whole ``(N, k)`` matrices. It can be given an
  address-space cap (``--pml-cap-gb``) so that a run that would exhaust a shared machine fails
  inside its own subprocess instead; a failure is reported, not hidden.

Values compared where both complete: MAP@R, R-precision and precision@1 (= Recall@1).

Prints a table and writes ``benchmarks/results/bench_retrieval.json``. The machine may be shared:
its load average is recorded with the results.

    python benchmarks/bench_retrieval.py [--sizes 100000 300000] [--large] [--backend faiss] [--repeats 2]
                                               [--skip-pml]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPARED = {"map@r": "mean_average_precision_at_r", "r_precision": "r_precision", "precision@1": "precision_at_1"}


def make_data(n: int, dim: int, classes: int, seed: int = 0):
    """``(N, dim)`` float32 embeddings and ``(N,)`` int64 labels, built in blocks (no ``N x dim``
    temporaries besides the result)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    centres = 0.5 * torch.randn(classes, dim, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    emb = torch.empty(n, dim)
    block = 65536
    for start in range(0, n, block):
        sl = slice(start, start + block)
        emb[sl] = centres[labels[sl]] + torch.randn(emb[sl].shape, generator=g)
    return emb, labels


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args) -> dict:
    """One measurement in this (fresh) process; returns the JSON record."""
    if args.cap_gb:
        cap = int(args.cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import torch

    emb, labels = make_data(args.n, args.dim, args.classes)
    record = {
        "who": args.worker,
        "n": args.n,
        "dim": args.dim,
        "classes": args.classes,
        "max_class_size": int(torch.bincount(labels).max()),
        "threads": torch.get_num_threads(),
    }
    if args.worker == "shiftguard":
        from shiftguard.metrics import retrieval_metrics

        def call():
            return retrieval_metrics(emb, labels, ks=(1, 2, 4, 8), backend=args.backend)

        record["backend"] = args.backend
    else:
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

        calc = AccuracyCalculator(include=tuple(COMPARED.values()), k="max_bin_count")

        def call():
            out = calc.get_accuracy(emb, labels, emb, labels, ref_includes_query=True)
            return {ours: out[theirs] for ours, theirs in COMPARED.items()}

    record["load_avg_before"] = os.getloadavg()[0]
    record["baseline_rss_bytes"] = _rss_bytes()
    t0 = time.perf_counter()
    try:
        record["metrics"] = call()
        record["ok"] = True
    except (MemoryError, RuntimeError) as exc:  # an allocation beyond the cap, reported as such
        record["ok"] = False
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    record["seconds"] = time.perf_counter() - t0
    with open("/proc/self/status") as fh:  # this process's high-water mark (ru_maxrss may carry the parent's)
        record["peak_rss_bytes"] = 1024 * int(next(ln for ln in fh if ln.startswith("VmHWM")).split()[1])
    return record


def run_worker(who: str, n: int, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        who,
        "--n",
        str(n),
        "--dim",
        str(args.dim),
        "--classes",
        str(args.classes),
        "--backend",
        args.backend,
    ]
    if who == "pml" and args.pml_cap_gb:
        cmd += ["--cap-gb", str(args.pml_cap_gb)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
        return {"who": who, "n": n, "ok": False, "error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def _gb(x) -> str:
    return f"{x / 2**30:.2f}" if x is not None else "-"


def _print_row(rec: dict, same_n: list) -> None:
    """One table row; a pytorch-metric-learning row also gets its difference to shiftguard's values."""
    ours = next((r for r in same_n if r["who"] == "shiftguard" and r.get("ok")), None)
    if rec["who"] == "pml" and rec.get("ok") and ours is not None:
        rec["abs_diff_vs_shiftguard"] = {key: abs(ours["metrics"][key] - rec["metrics"][key]) for key in COMPARED}
    m = rec.get("metrics", {})
    vals = " ".join(f"{m[k]:10.6f}" if k in m else f"{'-':>10}" for k in COMPARED)
    note = rec.get("error", "")
    if "abs_diff_vs_shiftguard" in rec:
        note = f"max |diff| vs shiftguard {max(rec['abs_diff_vs_shiftguard'].values()):.1e}"
    print(
        f"{rec['n']:>9} {rec['who']:<11} {rec.get('seconds', float('nan')):8.1f} "
        f"{_gb(rec.get('peak_rss_bytes')):>8} {_gb(rec.get('baseline_rss_bytes')):>11}  {vals}  {note}",
        flush=True,
    )


def _write(out: str, rows: list, summary: list, args) -> None:
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_at_end": os.getloadavg()},
        "pml_cap_gb": args.pml_cap_gb,
        "summary": summary,
        "rows": rows,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 300_000])
    p.add_argument("--large", action="store_true", help="also 1,000,000 embeddings")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--backend", default="faiss")
    p.add_argument("--skip-pml", action="store_true")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each side per size up to 100k (the fastest is summarised); larger N run once",
    )
    p.add_argument(
        "--pml-cap-gb",
        type=float,
        default=12.0,
        help="address-space cap of the pytorch-metric-learning subprocess (0: none)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_retrieval.json"))
    p.add_argument("--worker", choices=["shiftguard", "pml"], help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cap-gb", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    sizes = list(args.sizes) + ([1_000_000] if args.large else [])
    rows, summary = [], []
    print(
        f"{'N':>9} {'who':<11} {'seconds':>8} {'peak GB':>8} {'baseline GB':>11}  "
        f"{'MAP@R':>10} {'R-prec':>10} {'P@1':>10}  note"
    )
    for n in sizes:
        recs = []
        for rep in range(args.repeats if n <= 100_000 else 1):  # larger N take minutes a run
            # alternating order, so that neither side always runs first on a machine whose load drifts
            order = ["shiftguard"] + ([] if args.skip_pml else ["pml"])
            for who in order if rep % 2 == 0 else order[::-1]:
                rec = run_worker(who, n, args)
                rec["repeat"] = rep
                recs.append(rec)
                rows.append(rec)
                _print_row(rec, recs)
                _write(args.out, rows, summary, args)  # what finished is kept if a later run is stopped
        for who in ("shiftguard", "pml"):
            done = [r for r in recs if r["who"] == who and r.get("ok")]
            if done:
                summary.append(
                    {
                        "n": n,
                        "who": who,
                        "min_seconds": min(r["seconds"] for r in done),
                        "max_peak_rss_bytes": max(r["peak_rss_bytes"] for r in done),
                    }
                )
    for row in summary:
        print(
            f"summary: N={row['n']:>9} {row['who']:<11} fastest {row['min_seconds']:.1f} s, "
            f"peak {_gb(row['max_peak_rss_bytes'])} GB"
        )
    _write(args.out, rows, summary, args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
