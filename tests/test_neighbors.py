"""shiftguard.neighbors: leave-one-out on a subset of the support (``exclude``), the prepared
``KNNIndex`` giving exactly ``knn_search``'s answer, and the errors of both."""

import pytest
import torch

from shiftguard.neighbors import BACKENDS, KNNIndex, PrunedKNNIndex, default_chunk_size, knn_search

EXACT_BACKENDS = ["torch", "pruned", "faiss"]


def data(n=600, dim=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = 5 * torch.randn(6, dim, generator=g)
    return centres[torch.arange(n) % 6] + torch.randn(n, dim, generator=g)


def need(backend):
    if backend == "faiss":
        pytest.importorskip("faiss")


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_exclude_on_a_subset_equals_exclude_self_on_the_whole_support(backend):
    need(backend)
    s = data()
    rows = torch.randperm(600, generator=torch.Generator().manual_seed(1))[:150]
    d_all, i_all = knn_search(s, s, 5, backend=backend, exclude_self=True)
    d, i = knn_search(s[rows], s, 5, backend=backend, exclude=rows)
    assert torch.equal(i, i_all[rows]) and torch.equal(d, d_all[rows])
    assert not (i == rows[:, None]).any()


def test_exclude_leaves_out_the_named_row_even_when_it_is_not_the_query():
    s = torch.tensor([[0.0], [1.0], [3.0]])
    _, i = knn_search(torch.tensor([[0.1], [2.9]]), s, 1, exclude=torch.tensor([0, 2]))
    assert i[:, 0].tolist() == [1, 1]


@pytest.mark.parametrize("backend", EXACT_BACKENDS + ["auto"])
def test_index_search_returns_exactly_what_knn_search_returns(backend):
    need(backend)
    s, q = data(), data(n=90, seed=3)
    index = KNNIndex(s, backend)
    for chunk in (None, 7):
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                index.search(q, 4, chunk_size=chunk), knn_search(q, s, 4, backend=backend, chunk_size=chunk)
            )
        )
    rows = torch.arange(100, 160)
    got = index.search(s[rows], 3, exclude=rows, chunk_size=default_chunk_size(600))
    want = knn_search(s[rows], s, 3, backend=backend, exclude=rows)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_index_search_of_an_empty_query_is_empty():
    d, i = KNNIndex(data()).search(torch.empty(0, 12), 2)
    assert d.shape == i.shape == (0, 2) and i.dtype == torch.int64


@pytest.mark.parametrize(
    "exclude, exc, text",
    [
        (torch.tensor([0, 1]), ValueError, "one support row per query"),
        (torch.tensor([0, 1, 600]), ValueError, "[0, 600)"),
        (torch.tensor([0, -1, 2]), ValueError, "[0, 600)"),
        (torch.tensor([0.0, 1.0, 2.0]), TypeError, "integer"),
        (torch.tensor([[0, 1, 2]]), ValueError, "dimensions"),
    ],
)
def test_bad_exclude_is_refused_naming_it(exclude, exc, text):
    s = data()
    with pytest.raises(exc, match="^exclude") as info:
        knn_search(s[:3], s, 2, exclude=exclude)
    assert text in str(info.value)
    with pytest.raises(exc, match="^exclude"):
        KNNIndex(s).search(s[:3], 2, exclude=exclude)


def test_exclude_and_exclude_self_together_are_refused():
    s = data()
    with pytest.raises(ValueError, match="^exclude: give exclude_self=True or exclude, not both"):
        knn_search(s, s, 2, exclude_self=True, exclude=torch.arange(600))


def test_k_counts_the_excluded_row():
    s = data(n=5)
    with pytest.raises(ValueError, match="^k: 5 neighbours requested but the support has only 4 candidate rows"):
        knn_search(s[:2], s, 5, exclude=torch.tensor([0, 1]))


def test_index_refuses_a_query_of_another_dtype_or_width_and_a_bad_backend():
    index = KNNIndex(data())
    with pytest.raises(ValueError, match="^query: dtype torch.float64"):
        index.search(data(n=4).double(), 2)
    with pytest.raises(ValueError, match="embedding dimensions differ"):
        index.search(torch.randn(4, 3), 2)
    with pytest.raises(ValueError, match="^backend: expected one of"):
        KNNIndex(data(), "annoy")
    with pytest.raises(ValueError, match="^support: contains non-finite"):
        KNNIndex(torch.tensor([[0.0, float("nan")]]))
    assert set(BACKENDS) == {"torch", "faiss", "pruned", "auto"}


def test_index_argument_must_be_a_pruned_index_of_this_support():
    s = data()
    with pytest.raises(TypeError, match="^index: expected a PrunedKNNIndex"):
        knn_search(s[:3], s, 2, backend="pruned", index=KNNIndex(s, "pruned"))
    with pytest.raises(ValueError, match="^index: built for a different support"):
        knn_search(s[:3], s.clone(), 2, backend="pruned", index=PrunedKNNIndex(s))
