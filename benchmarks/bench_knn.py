"""Speed of NED (fit + predict) with each kNN back end, against scikit-learn.

Workload: a support of 60,000 x 128 float32 embeddings (10 Gaussian classes), 10,000
queries, k = 10. "fit" = the leave-one-out temperature fit of NED (default: 5,000 calibration
queries against the full support, own row excluded) and "predict" = kNN of the 10k queries +
[NED, eq. (3)]. Back ends, in the same run on the same data:

- ``torch``: shiftguard's exact chunked matmul + topk (``knn_search(backend="torch")``);
- ``faiss``: ``faiss.IndexFlatL2`` (``knn_search(backend="faiss")``);
- ``pruned``: shiftguard's exact pruned search (``knn_search(backend="pruned")``, NED builds its
  ``PrunedKNNIndex`` once in ``fit``; the build is part of the fit time): the torch back end's
  arithmetic, minus the (query, support cluster) products a lower bound rules out;
- ``sklearn``: ``KNeighborsClassifier(n_neighbors=k, n_jobs=-1)`` doing the same neighbour
  searches (``kneighbors``), with the same temperature fit and eq. (3) on its output;
- ``sklearn-vote``: plain ``KNeighborsClassifier.predict_proba`` (vote share, no fit of T), for scale;
- ``matmul floor``: only the float32 products ``queries @ support.T`` that every exact brute-force
  search has to do for the same queries (fit + predict), in 256-row blocks, nothing else (the
  faster of torch's and numpy's BLAS). No exact method does less arithmetic, so
  ``sklearn NED / floor`` bounds the speed-up an exact *brute-force* back end can reach on this
  machine (the pruned back end computes fewer products, so it is not bound by it);
- ``torch, unclustered`` / ``pruned, unclustered``: the same NED measurement on data without
  cluster structure (isotropic Gaussian support and queries, random labels), where no product can
  be pruned: what the pruned back end costs when it cannot help (its fallback to brute force).
  Their ``x vs torch`` column compares them with torch on that same data.

Prints a table and writes ``benchmarks/results/bench_knn.json``. The machine is shared: timings
are noisy, the speed-up ratios (same run) are what to compare. Target: an exact back end >= 5x
faster than the sklearn NED and under 5 s on 2 cores.

    python benchmarks/bench_knn.py [--n-support 60000] [--n-query 10000] [--dim 128] [--k 10] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from shiftguard.heads import NED
from shiftguard.heads.ned import ned_probabilities
from shiftguard.io import atomic_write_json

ROOT = Path(__file__).resolve().parents[1]


def make_data(n_support, n_query, dim, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = 1.5 * torch.randn(classes, dim, generator=g)
    ys = torch.arange(n_support) % classes
    yq = torch.randint(0, classes, (n_query,), generator=g)
    xs = centres[ys] + torch.randn(n_support, dim, generator=g) * 1.2
    xq = centres[yq] + torch.randn(n_query, dim, generator=g) * 1.2
    return xs, ys, xq, yq


def make_unclustered_data(n_support, n_query, dim, classes=10, seed=1):
    """Isotropic Gaussian support and queries with random labels: nothing for pruning to use."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n_support, dim, generator=g)
    xq = torch.randn(n_query, dim, generator=g)
    ys = torch.arange(n_support) % classes
    return xs, ys[torch.randperm(n_support, generator=g)], xq


def run_ned(backend, xs, ys, xq, k):
    t0 = time.perf_counter()
    head = NED(k=k, backend=backend).fit(xs, ys)
    t1 = time.perf_counter()
    p = head.predict_proba(xq)
    t2 = time.perf_counter()
    res = {"fit_s": t1 - t0, "predict_s": t2 - t1, "total_s": t2 - t0, "temperature": head.temperature_}
    if head.knn_index_ is not None:
        st = head.knn_index_.last_stats  # of the predict search
        res["predict_products_fraction"] = st["products"] / st["brute_products"]
        res["predict_fallback_queries"] = st["fallback_queries"]
    return res, p


def run_sklearn_ned(xs, ys, xq, k, max_fit_queries=5000, seed=0):
    from sklearn.neighbors import KNeighborsClassifier

    xs_np, ys_np, xq_np = xs.numpy(), ys.numpy(), xq.numpy()
    t0 = time.perf_counter()
    clf = KNeighborsClassifier(n_neighbors=k, n_jobs=-1).fit(xs_np, ys_np)
    rows = torch.randperm(len(ys_np), generator=torch.Generator().manual_seed(seed))[:max_fit_queries].numpy()
    d, idx = clf.kneighbors(xs_np[rows], n_neighbors=k + 1)
    # drop each query's own row (or the farthest when a duplicate came first), as NED does
    is_self = idx == rows[:, None]
    is_self[~is_self.any(1), -1] = True
    keep = np.argsort(is_self, axis=1, kind="stable")[:, :k]
    d = np.take_along_axis(d, keep, 1) ** 2
    idx = np.take_along_axis(idx, keep, 1)
    same = torch.from_numpy(ys_np[idx] == ys_np[rows][:, None])
    temperature, _, _ = NED._fit_temperature(torch.from_numpy(d), same)
    t1 = time.perf_counter()
    dq, iq = clf.kneighbors(xq_np)
    p = ned_probabilities(torch.from_numpy(dq**2), torch.from_numpy(ys_np[iq]), temperature, 10)
    t2 = time.perf_counter()
    return {"fit_s": t1 - t0, "predict_s": t2 - t1, "total_s": t2 - t0, "temperature": temperature}, p


def run_sklearn_vote(xs, ys, xq, k):
    from sklearn.neighbors import KNeighborsClassifier

    t0 = time.perf_counter()
    clf = KNeighborsClassifier(n_neighbors=k, n_jobs=-1).fit(xs.numpy(), ys.numpy())
    t1 = time.perf_counter()
    clf.predict_proba(xq.numpy())
    t2 = time.perf_counter()
    return {"fit_s": t1 - t0, "predict_s": t2 - t1, "total_s": t2 - t0}


def run_matmul_floor(xs, xq, n_fit_queries=5000, block=256):
    """Time of the bare products an exact search of the fit + predict queries needs: the faster of
    torch's BLAS (MKL here) and numpy's (OpenBLAS), 256-row blocks, nothing else."""
    queries = torch.cat([xs[:n_fit_queries], xq])
    support_t = xs.t().contiguous()
    q_np, s_np = queries.numpy(), support_t.numpy()
    times = []
    for product in (lambda a, b: torch.mm(a, b), lambda a, b: a @ b):
        args = (queries, support_t) if not times else (q_np, s_np)
        t0 = time.perf_counter()
        for start in range(0, len(queries), block):
            product(args[0][start : start + block], args[1])
        times.append(time.perf_counter() - t0)
    return {"fit_s": 0.0, "predict_s": 0.0, "total_s": min(times), "torch_mm_s": times[0], "numpy_matmul_s": times[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-support", type=int, default=60000)
    ap.add_argument("--n-query", type=int, default=10000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1, help="best of this many runs per back end")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_knn.json")
    args = ap.parse_args()

    xs, ys, xq, yq = make_data(args.n_support, args.n_query, args.dim)
    for backend in ("torch", "pruned"):  # warm-up (imports, allocator, first LAPACK call)
        NED(k=args.k, backend=backend).fit(xs[:2000], ys[:2000]).predict_proba(xq[:100])
    xs_u, ys_u, xq_u = make_unclustered_data(args.n_support, args.n_query, args.dim)
    rows, probs = {}, {}
    for name in (
        "torch",
        "faiss",
        "pruned",
        "sklearn",
        "sklearn-vote",
        "matmul floor",
        "torch, unclustered",
        "pruned, unclustered",
    ):
        best = None
        for _ in range(args.repeats):
            if name == "matmul floor":
                res, p = run_matmul_floor(xs, xq), None
            elif name == "sklearn":
                res, p = run_sklearn_ned(xs, ys, xq, args.k)
            elif name == "sklearn-vote":
                res, p = run_sklearn_vote(xs, ys, xq, args.k), None
            elif name.endswith(", unclustered"):
                res, p = run_ned(name.split(",")[0], xs_u, ys_u, xq_u, args.k)
            else:
                res, p = run_ned(name, xs, ys, xq, args.k)
            if best is None or res["total_s"] < best["total_s"]:
                best = res
            if p is not None:
                probs[name] = p
        rows[name] = best
    base = rows["sklearn"]["total_s"]
    for name, r in rows.items():
        r["speedup_vs_sklearn_ned"] = base / r["total_s"]
        torch_row = rows["torch, unclustered" if name.endswith(", unclustered") else "torch"]
        if name.startswith(("torch", "pruned")):
            r["speedup_vs_torch_same_data"] = torch_row["total_s"] / r["total_s"]
    agree = {
        f"{a}_vs_{b}_max_abs_prob_diff": float((probs[a].double() - probs[b].double()).abs().max())
        for a, b in (
            ("torch", "faiss"),
            ("torch", "sklearn"),
            ("torch", "pruned"),
            ("torch, unclustered", "pruned, unclustered"),
        )
    }

    print(
        f"NED fit+predict: support {args.n_support} x {args.dim}, {args.n_query} queries, k={args.k}, "
        f"torch threads={torch.get_num_threads()}, cpus={os.cpu_count()}"
    )
    print(
        f"{'backend':20s} {'fit s':>8s} {'predict s':>10s} {'total s':>8s} {'x vs sklearn NED':>17s} "
        f"{'x vs torch':>11s}"
    )
    for name, r in rows.items():
        vs_torch = f"{r['speedup_vs_torch_same_data']:11.2f}" if "speedup_vs_torch_same_data" in r else f"{'-':>11s}"
        print(
            f"{name:20s} {r['fit_s']:8.2f} {r['predict_s']:10.2f} {r['total_s']:8.2f} "
            f"{r['speedup_vs_sklearn_ned']:17.2f} {vs_torch}"
        )
    for key, val in agree.items():
        print(f"{key}: {val:.2e}")
    for name in ("pruned", "pruned, unclustered"):
        r = rows[name]
        print(
            f"{name}: predict computed {r['predict_products_fraction']:.1%} of the brute-force products "
            f"({r['predict_fallback_queries']} queries fell back to brute force)"
        )
    print(
        f"largest speed-up an exact brute-force back end can reach here (sklearn NED / matmul floor): "
        f"{rows['matmul floor']['speedup_vs_sklearn_ned']:.1f}x; pruned NED: "
        f"{rows['pruned']['speedup_vs_sklearn_ned']:.1f}x"
    )
    result = {
        "workload": vars(args) | {"out": str(args.out)},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
        },
        "results": rows,
        "agreement": agree,
        "note": "shared machine: absolute timings are noisy; compare the same-run ratios",
    }
    atomic_write_json(args.out, result, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
