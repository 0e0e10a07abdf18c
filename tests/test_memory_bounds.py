"""Memory bounds: kNN heads and retrieval metrics never build an N x N matrix.

Method. ``tracemalloc`` cannot see torch's allocations, so the peak *resident set size* of a fresh
subprocess is measured instead: before each operation the kernel's peak counter is reset (writing
``5`` to ``/proc/self/clear_refs`` resets ``VmHWM``, Linux >= 4.0), the current ``VmRSS`` is the
baseline, and after the operation ``VmHWM - baseline`` is the extra memory the operation touched at
its peak (every torch CPU tensor lives in resident pages once written). A fresh process keeps
pytest's own heap out of the measurement, and ``MALLOC_MMAP_THRESHOLD_`` makes glibc hand freed
buffers back to the kernel at once, so one operation's freed heap cannot mask the next one's peak.

The claim tested (kNN search, the KNNVote and NED heads, the retrieval metrics; R-AUROC and the
run's Recall@1 misses call the same ``knn_search``): at N = 20,000 (an N x N float32 matrix would
be 1.6 GB) the working set is set by the chunking budget, not by N^2; and with the same budget the
peak does not grow when N grows 4x (it would grow 16x if anything were N x N). 100k x 100k follows:
the budget, not N, bounds the block (only O(N k) outputs grow with N).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MiB = 2**20

SCRIPT = r"""
import gc, json, sys
import torch
torch.set_num_threads(1)
from shiftguard.heads import KNNVote, NED, knn_search
from shiftguard.metrics import retrieval_metrics


def status(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024


def peak_extra(fn):
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    base = status("VmRSS")
    out = fn()
    del out
    return status("VmHWM") - base


budget = int(sys.argv[1])
res = {}
for n in map(int, sys.argv[2:]):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(n, 32, generator=g)
    fine = torch.arange(n) % (n // 10)   # 10 samples per class
    r = {}
    r["knn_search (budget)"] = peak_extra(lambda: knn_search(emb, emb, 10, exclude_self=True,
                                                             memory_budget_bytes=budget))
    r["retrieval_metrics (budget)"] = peak_extra(lambda: retrieval_metrics(emb, fine, ks=(1, 4, 8),
                                                                           memory_budget_bytes=budget))
    r["KNNVote fit + predict_proba (default)"] = peak_extra(lambda: KNNVote(k=10).fit(emb, fine).predict_proba(emb))
    r["NED fit + predict_proba (default)"] = peak_extra(lambda: NED(k=10).fit(emb, fine).predict_proba(emb))
    res[n] = r
print(json.dumps(res))
"""


def record(**row) -> None:
    path = os.environ.get("SHIFTGUARD_RELIABILITY_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"file": "test_memory_bounds.py", **row}) + "\n")


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _can_reset_peak(),
    reason="needs Linux /proc/self/clear_refs to reset the peak RSS counter",
)
def test_knn_heads_and_retrieval_metrics_stay_within_their_chunk_budget():
    from shiftguard.neighbors import DEFAULT_MEMORY_BUDGET_BYTES

    budget = 32 * MiB
    small, big = 5_000, 20_000
    # A fixed mmap threshold makes glibc return every freed tensor buffer to the kernel at once, so
    # memory freed by one operation cannot hide (as already-resident heap) the peak of the next.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(budget), str(small), str(big)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    full_matrix = big * big * 4  # one float32 N x N matrix: 1.6 GB
    for op, extra in res[big].items():
        limit = 2 * budget + 32 * MiB if "(budget)" in op else 2 * DEFAULT_MEMORY_BUDGET_BYTES + 128 * MiB
        assert extra < limit, f"{op}: {extra / MiB:.0f} MiB at N={big} exceeds {limit / MiB:.0f} MiB"
        assert extra < full_matrix / 2, op
        if "(budget)" in op:
            # Same budget, 4x the rows: an N x N temporary would make the peak 16x; chunking keeps it flat.
            assert extra < 2 * res[small][op] + 48 * MiB, (
                f"{op}: peak grows with N ({res[small][op] / MiB:.0f} -> {extra / MiB:.0f} MiB)"
            )
        record(
            group="memory",
            case=op,
            n=big,
            outcome=f"peak +{extra / MiB:.0f} MiB at N={big} (+{res[small][op] / MiB:.0f} MiB at N={small}); "
            f"N x N float32 = {full_matrix / MiB:.0f} MiB",
        )
