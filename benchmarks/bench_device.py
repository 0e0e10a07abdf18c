"""GPU timings of the paths users run, each beside its baseline in the same run.

- BN-QACT-BN vs BN-ReLU-BN forward+backward on the device (QACT's eager torch path, the GPU path);
- the corruption engine: ``n`` 28x28 images through the 15 MNIST-C corruptions x 5 severities;
- kNN search (60k x 128 support, 10k queries, k = 10) and retrieval metrics (MAP@R, Recall@1) on
  ``n_retrieval`` x 128 embeddings with 1,000 classes, with peak device memory;
- ``shiftguard.evaluate`` of a small CNN over the whole MNIST-C grid on the device vs the CPU.

Prints one table and writes JSON to ``--out``. Usage (on a machine with CUDA; see device_check.sh):
``python benchmarks/bench_device.py --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn


def sync(dev: torch.device) -> None:
    """Wait for ``dev``'s queued work (a no-op off CUDA): what every timing here reads the clock after."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def write_skipped(path: Path, info: dict, reason: str) -> None:
    """Record in the report at ``path`` that nothing was measured, and why; say so."""
    info["skipped"] = reason
    print(f"{info['benchmark']}: {reason}")
    path.write_text(json.dumps(info, indent=1))
    print(f"wrote {path}")


def report_header(benchmark: str, device: str, out: str, smoke: bool, **fields) -> tuple[Path, dict]:
    """``(path, info)`` of a device benchmark's JSON report: ``<out>/<benchmark>_<device>[_smoke].json``
    (the folder made) and its header (versions, platform, threads, ``fields``). Without CUDA for
    ``device="cuda"`` the report says it was skipped and is written at once: the caller checks
    ``"skipped" in info``."""
    import platform

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{benchmark}_{device}{'_smoke' if smoke else ''}.json"
    info: dict = {
        "benchmark": benchmark,
        "device": device,
        "smoke": smoke,
        **fields,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
    }
    if device == "cuda" and not torch.cuda.is_available():
        write_skipped(path, info, "no CUDA device: nothing measured")
    elif device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return path, info


def timed(fn, dev, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after ``warmup`` (the device synchronised)."""
    return timed_in_turn({"fn": fn}, dev, repeats, warmup)["fn"]


def timed_in_turn(fns: dict, dev, repeats: int, warmup: int) -> dict:
    """Median seconds of each of ``fns`` (name -> step), the steps timed in turn (one of each per
    round), so that a drift of the machine's speed during the run falls on both sides alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(dev)
    spent: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync(dev)
            spent[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in spent.items()}


def bench_qact(dev, rows):
    from shiftguard.nn import QACTBlock

    for shape in [(256, 64, 12, 12), (128, 64, 16, 16), (256, 512), (1024, 128)]:
        c = shape[1]
        bn = nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d
        relu = nn.Sequential(bn(c), nn.ReLU(), bn(c)).to(dev)
        qact = QACTBlock(c).to(dev)
        x = torch.randn(*shape, device=dev, requires_grad=True)

        def step(block):
            return lambda: block(x).pow(2).mean().backward()

        t_relu, t_qact = timed(step(relu), dev), timed(step(qact), dev)
        rows.append(
            {
                "bench": "qact fwd+bwd",
                "case": "x".join(map(str, shape)),
                "baseline": "BN-ReLU-BN",
                "baseline_ms": 1e3 * t_relu,
                "ms": 1e3 * t_qact,
                "ratio": t_qact / t_relu,
            }
        )


def bench_corruptions(dev, rows, n):
    from shiftguard import corruptions as K

    x = torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    xd = x.to(dev)
    t0 = time.perf_counter()
    for name in K.names("mnist-c"):
        for s in range(1, 6):
            K.corrupt(xd, name, s, seed=0)
    sync(dev)
    t = time.perf_counter() - t0
    rows.append({"bench": "corruptions", "case": f"{n} x 28x28, 15 x 5", "ms": 1e3 * t, "images_per_s": 75 * n / t})


def bench_neighbours(dev, rows, n_retrieval):
    from shiftguard.heads import knn_search
    from shiftguard.metrics import retrieval_metrics

    g = torch.Generator().manual_seed(0)
    support = torch.randn(60_000, 128, generator=g).to(dev)
    query = torch.randn(10_000, 128, generator=g).to(dev)
    t = timed(lambda: knn_search(query, support, 10), dev, repeats=3, warmup=1)
    rows.append({"bench": "knn_search", "case": "60k x 128 support, 10k queries, k=10", "ms": 1e3 * t})
    labels = torch.randint(0, 1000, (n_retrieval,), generator=g).to(dev)
    centres = torch.randn(1000, 128, generator=g).to(dev)
    emb = centres[labels] + 0.8 * torch.randn(n_retrieval, 128, generator=g).to(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    r = retrieval_metrics(emb, labels, ks=(1,))
    sync(dev)
    t = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    rows.append(
        {
            "bench": "retrieval_metrics",
            "case": f"{n_retrieval} x 128, 1000 classes",
            "ms": 1e3 * t,
            "peak_gib": peak,
            "map@r": float(r.get("map@r", float("nan"))),
            "recall@1": float(r["recall@1"]),
        }
    )


def bench_evaluate(dev, rows, n):
    import shiftguard

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 49, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    times = {}
    for d in ("cpu", str(dev)):
        t0 = time.perf_counter()
        shiftguard.evaluate(net, (x, y), support=(x, y), heads=["softmax", "knn"], device=d, n_boot=200)
        times[d] = time.perf_counter() - t0
    rows.append(
        {
            "bench": "evaluate (15 x 5 MNIST-C grid)",
            "case": f"{n} test images, CNN, softmax + kNN",
            "baseline": "cpu",
            "baseline_ms": 1e3 * times["cpu"],
            "ms": 1e3 * times[str(dev)],
            "ratio": times[str(dev)] / times["cpu"],
        }
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--n-images", type=int, default=10_000)
    p.add_argument("--n-retrieval", type=int, default=100_000)
    p.add_argument("--n-eval", type=int, default=5_000, help="test images of the evaluate() comparison")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_device: no CUDA device; nothing measured")
        return 0
    dev = torch.device("cuda")
    rows: list[dict] = []
    for fn, extra in (
        (bench_qact, ()),
        (bench_corruptions, (args.n_images,)),
        (bench_neighbours, (args.n_retrieval,)),
        (bench_evaluate, (args.n_eval,)),
    ):
        t0 = time.perf_counter()
        try:
            fn(dev, rows, *extra)
        except Exception as exc:  # report and go on: one failing path must not hide the others
            rows.append({"bench": fn.__name__, "error": f"{type(exc).__name__}: {exc}"})
        print(f"{fn.__name__}: {time.perf_counter() - t0:.1f} s", flush=True)
    info = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "rows": rows,
    }
    for r in rows:
        print(json.dumps(r))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_device.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
