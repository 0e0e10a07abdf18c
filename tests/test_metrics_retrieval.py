"""Retrieval metrics against pytorch-metric-learning's AccuracyCalculator and a slow reference."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shiftguard.metrics import retrieval_metrics


def slow_reference(x, y, ks):
    """Per query: sort all other samples by distance and apply the textbook formulas."""
    n = len(y)
    acc = (
        {f"recall@{k}": [] for k in ks}
        | {f"map@{k}": [] for k in ks}
        | {"map@r": [], "r_precision": [], "precision@1": []}
    )
    for q in range(n):
        d = ((x - x[q]) ** 2).sum(1)
        d[q] = float("inf")
        order = torch.argsort(d)[: n - 1]
        rel = (y[order] == y[q]).double()
        r = int(rel.sum())
        if r == 0:
            continue
        prec = torch.cumsum(rel, 0) / torch.arange(1, n, dtype=torch.float64)
        acc["precision@1"].append(float(rel[0]))
        acc["r_precision"].append(float(rel[:r].sum() / r))
        acc["map@r"].append(float((prec[:r] * rel[:r]).sum() / r))
        for k in ks:
            acc[f"recall@{k}"].append(float(rel[:k].max()))
            acc[f"map@{k}"].append(float((prec[:k] * rel[:k]).sum() / min(k, r)))
    return {key: sum(v) / len(v) for key, v in acc.items()}


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 6, (300,), generator=g)
    x = torch.randn(300, 5, generator=g, dtype=torch.float64) + 0.8 * torch.nn.functional.one_hot(y, 6)[:, :5]
    return x, y


def test_matches_a_slow_reference(data):
    x, y = data
    got = retrieval_metrics(x, y, ks=(1, 3, 10))
    ref = slow_reference(x, y, (1, 3, 10))
    for key, val in ref.items():
        assert got[key] == pytest.approx(val, abs=1e-12), key


def test_without_r_metrics_the_k_metrics_are_unchanged(data):
    x, y = data
    full = retrieval_metrics(x, y, ks=(1, 3, 10))
    short = retrieval_metrics(x, y, ks=(1, 3, 10), r_metrics=False)
    assert set(full) - set(short) == {"map@r", "r_precision"}
    for key in short:
        assert short[key] == pytest.approx(full[key], abs=1e-12), key


@pytest.mark.parametrize("budget", [2**25, 4096])
def test_return_nearest_gives_each_querys_nearest_other_sample(data, budget):
    x, y = data
    metrics, nearest = retrieval_metrics(
        x, y, ks=(1, 3), r_metrics=False, return_nearest=True, memory_budget_bytes=budget
    )
    d = torch.cdist(x, x)
    d.fill_diagonal_(float("inf"))
    assert torch.equal(nearest, d.argmin(1))
    assert metrics == retrieval_metrics(x, y, ks=(1, 3), r_metrics=False, memory_budget_bytes=budget)
    assert float((y[nearest] == y).double().mean()) == pytest.approx(metrics["precision@1"])


def test_map_r_r_precision_and_precision_at_1_equal_pytorch_metric_learning(data):
    calc_mod = pytest.importorskip("pytorch_metric_learning.utils.accuracy_calculator")
    x, y = data
    x = x.float()
    calc = calc_mod.AccuracyCalculator(
        include=("mean_average_precision_at_r", "r_precision", "precision_at_1"), k="max_bin_count"
    )
    theirs = calc.get_accuracy(x, y, x, y, ref_includes_query=True)
    ours = retrieval_metrics(x, y)
    assert ours["map@r"] == pytest.approx(theirs["mean_average_precision_at_r"], abs=1e-6)
    assert ours["r_precision"] == pytest.approx(theirs["r_precision"], abs=1e-6)
    assert ours["precision@1"] == pytest.approx(theirs["precision_at_1"], abs=1e-6)


@pytest.mark.parametrize("backend", ["torch", "faiss", "pruned"])
def test_results_are_bit_identical_for_every_chunking(data, backend):
    if backend == "faiss":
        pytest.importorskip("faiss")
    x, y = data
    x = x.float() if backend == "faiss" else x
    full = retrieval_metrics(x, y, ks=(1, 3, 10), backend=backend)
    # 2 KiB: one query per chunk; 2**16: chunks of a few hundred rows with lists of different lengths
    for budget in (2048, 5000, 2**16):
        assert retrieval_metrics(x, y, ks=(1, 3, 10), backend=backend, memory_budget_bytes=budget) == full, budget


def test_unequal_classes_and_lone_queries_match_the_slow_reference_in_small_chunks():
    g = torch.Generator().manual_seed(5)
    # one class of 150, others of 40, 9, 2 and three lone samples: chunks of very different list lengths
    y = torch.cat(
        [torch.full((150,), 0), torch.full((40,), 1), torch.full((9,), 2), torch.full((2,), 3), torch.tensor([4, 5, 6])]
    )[torch.randperm(204, generator=g)]
    x = torch.randn(204, 6, generator=g, dtype=torch.float64) + 0.7 * torch.nn.functional.one_hot(y, 7)[:, :6]
    ref = slow_reference(x, y, (1, 4))
    for budget in (2048, 2**14, 2**25):
        got, nearest = retrieval_metrics(x, y, ks=(1, 4), memory_budget_bytes=budget, return_nearest=True)
        assert got["n_queries"] == 201 and got["n_lone_queries"] == 3
        for key, val in ref.items():
            assert got[key] == pytest.approx(val, abs=1e-12), (key, budget)
        d = torch.cdist(x, x)
        d.fill_diagonal_(float("inf"))
        assert torch.equal(nearest, d.argmin(1))  # lone queries included


@given(seed=st.integers(0, 2**31 - 1), budget=st.integers(1, 2**18), n_classes=st.integers(2, 12))
@settings(max_examples=10, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_memory_budget_gives_the_same_values_as_the_default(seed, budget, n_classes):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, n_classes, (120,), generator=g)
    x = torch.randn(120, 4, generator=g, dtype=torch.float64)
    assert retrieval_metrics(x, y, ks=(1, 5), memory_budget_bytes=budget) == retrieval_metrics(x, y, ks=(1, 5))


_PEAK_SCRIPT = """
import os, sys, torch
from shiftguard.metrics import retrieval_metrics
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
y = torch.arange(4000) % 2  # R = 1999 for every query: one (N, R) float64 matrix is 64 MB
x = torch.randn(4000, 8, generator=g) + 2.0 * torch.nn.functional.one_hot(y, 8)
retrieval_metrics(x[:200], y[:200], backend=sys.argv[1])  # libraries' lazy set-up counts as baseline
with open("/proc/self/statm") as fh:
    before = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
m = retrieval_metrics(x, y, ks=(1, 10), backend=sys.argv[1], memory_budget_bytes=int(sys.argv[2]))
with open("/proc/self/status") as fh:  # this process's own high-water mark (ru_maxrss can carry the parent's)
    peak = 1024 * int(next(line for line in fh if line.startswith("VmHWM")).split()[1])
print(peak - before, m["map@r"])
"""


@pytest.mark.parametrize("backend, budget", [("torch", 2**21), ("faiss", 2**23)])
def test_peak_memory_stays_within_a_few_budgets_when_classes_are_large(backend, budget):
    if backend == "faiss":
        pytest.importorskip("faiss")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, backend, str(budget)], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    extra_bytes, map_r = int(out[0]), float(out[1])
    assert 0.0 < map_r < 1.0
    # one chunk's lists, the distance block and the per-query scalars; MAP@R over whole (N, R)
    # matrices (indices, relevance, running precision, as pytorch-metric-learning holds them)
    # would take several 64 MB matrices
    assert extra_bytes < 48 * 2**20, extra_bytes


def test_a_non_positive_or_fractional_memory_budget_is_refused(data):
    x, y = data
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        retrieval_metrics(x, y, memory_budget_bytes=0)
    with pytest.raises(TypeError, match="memory_budget_bytes"):
        retrieval_metrics(x, y, memory_budget_bytes=1e6)


def test_faiss_backend_gives_the_same_metrics(data):
    pytest.importorskip("faiss")
    x, y = data
    a = retrieval_metrics(x.float(), y, backend="faiss")
    b = retrieval_metrics(x.float(), y, backend="torch")
    for key in a:
        assert a[key] == pytest.approx(b[key], abs=1e-9)


def test_lone_queries_are_skipped_and_counted():
    x = torch.tensor([[0.0], [0.1], [5.0], [9.0]])
    y = torch.tensor([0, 0, 1, 2])
    m = retrieval_metrics(x, y, ks=(1,))
    assert m["n_queries"] == 2 and m["n_lone_queries"] == 2
    assert m["precision@1"] == 1.0 and m["map@r"] == 1.0


def test_map_at_k_equals_map_at_r_when_every_class_has_k_plus_one_members():
    g = torch.Generator().manual_seed(2)
    y = torch.arange(60) % 12  # 5 per class: R = 4 for everyone
    x = torch.randn(60, 3, generator=g, dtype=torch.float64)
    m = retrieval_metrics(x, y, ks=(4,))
    assert m["map@4"] == pytest.approx(m["map@r"])


def test_perfectly_separated_classes_score_one_everywhere():
    y = torch.arange(40) % 4
    x = 100.0 * torch.nn.functional.one_hot(y, 4).double() + 0.01 * torch.randn(40, 4, dtype=torch.float64)
    m = retrieval_metrics(x, y)
    assert all(v == pytest.approx(1.0) for k, v in m.items() if not k.startswith("n_"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(embeddings=torch.randn(5, 2), labels=torch.zeros(4, dtype=torch.long)), "mismatched"),
        (dict(embeddings=torch.randn(5, 2), labels=torch.zeros(5, dtype=torch.long), ks=(5,)), "ks"),
        (dict(embeddings=torch.randn(5, 2), labels=torch.zeros(5, dtype=torch.long), ks=(0,)), "ks"),
        (dict(embeddings=torch.randn(3, 2), labels=torch.arange(3), ks=(1,)), "labels"),
        (dict(embeddings=torch.full((3, 2), float("nan")), labels=torch.zeros(3, dtype=torch.long)), "embeddings"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        retrieval_metrics(**kwargs)


def test_every_backend_gives_the_same_metrics_and_an_unknown_one_is_refused():
    g = torch.Generator().manual_seed(3)
    centres = 4.0 * torch.randn(5, 16, generator=g)
    y = torch.arange(600) % 5
    emb = centres[y] + torch.randn(600, 16, generator=g) + 50.0  # off-centre, clustered
    ref = retrieval_metrics(emb, y, ks=(1, 5), memory_budget_bytes=64 * 1024)  # many query chunks
    backends = ["pruned"] + (["faiss"] if importlib.util.find_spec("faiss") else [])
    for backend in backends:
        assert retrieval_metrics(emb, y, ks=(1, 5), backend=backend, memory_budget_bytes=64 * 1024) == ref
    with pytest.raises(ValueError, match="backend"):
        retrieval_metrics(emb, y, backend="bogus")


@pytest.mark.parametrize("backend", ["pruned", "faiss"])
def test_one_search_index_is_built_for_all_query_chunks(monkeypatch, backend):
    if backend == "faiss":
        faiss = pytest.importorskip("faiss")
        owner, name = faiss, "IndexFlatL2"
    else:
        from shiftguard.neighbors import search

        owner, name = search, "PrunedKNNIndex"
    built = []
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    emb = torch.randn(400, 8, generator=torch.Generator().manual_seed(1))
    retrieval_metrics(emb, torch.arange(400) % 4, ks=(1,), backend=backend, memory_budget_bytes=16 * 1024)
    assert len(built) == 1  # the budget makes ~20 query chunks
