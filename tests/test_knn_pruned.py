"""knn_search(backend="pruned"): the same neighbours as the brute-force torch back end, pruning
that really happens on clustered data, a lower bound that never exceeds the true distance, the
brute-force fallback on unclustered data, index reuse (also by NED), bad input."""

import pytest
import torch

from shiftguard.heads import NED
from shiftguard.neighbors import PrunedKNNIndex, default_chunk_size, knn_search
from shiftguard.neighbors.pruned import _topk_smallest


def clustered(n_support, n_query, dim, n_centres=10, spread=4.0, noise=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    centres = spread * torch.randn(n_centres, dim, generator=g, dtype=dtype)
    s = centres[torch.arange(n_support) % n_centres] + noise * torch.randn(n_support, dim, generator=g, dtype=dtype)
    q = centres[torch.randint(0, n_centres, (n_query,), generator=g)] + noise * torch.randn(
        n_query, dim, generator=g, dtype=dtype
    )
    return q, s


def canonical(d, i):
    """Rows ordered by (distance, index): two exact searches may order exact ties differently."""
    o = torch.argsort(i, dim=1, stable=True)
    d, i = d.gather(1, o), i.gather(1, o)
    o = torch.argsort(d, dim=1, stable=True)
    return d.gather(1, o), i.gather(1, o)


def assert_same(result, reference):
    """Same neighbours and bit-identical distances (up to the order of exactly tied distances)."""
    dp, ip = canonical(*result)
    dt, it = canonical(*reference)
    assert torch.equal(ip, it)
    assert torch.equal(dp, dt)


def assert_same_as_torch(query, support, k, exclude_self=False, **kwargs):
    ref = knn_search(query, support, k, backend="torch", exclude_self=exclude_self)
    res = knn_search(query, support, k, backend="pruned", exclude_self=exclude_self, **kwargs)
    assert_same(res, ref)
    assert torch.all(res[0][:, 1:] >= res[0][:, :-1])
    return res


def test_clustered_data_same_neighbours_and_pruning_happens():
    q, s = clustered(3000, 600, 32)
    assert_same_as_torch(q, s, 5)
    index = PrunedKNNIndex(s, n_clusters=24)
    assert_same(index.search(q, 5, fallback_min_queries=10**9), knn_search(q, s, 5))
    st = index.last_stats
    # 10 well separated centres: a query needs about its own centre's rows (~1/10 of them).
    assert st["fallback_queries"] == 0
    assert st["products"] < 0.3 * st["brute_products"]
    assert st["cluster_visits"] < 0.5 * st["block_cluster_pairs"]


def test_unclustered_data_same_neighbours_with_and_without_fallback():
    g = torch.Generator().manual_seed(3)
    s, q = torch.randn(2000, 24, generator=g), torch.randn(700, 24, generator=g)
    ref = knn_search(q, s, 7)
    index = PrunedKNNIndex(s, n_clusters=16)
    for min_queries in (10**9, 64):  # pruned path only / fallback rule allowed to fire
        assert_same(index.search(q, 7, fallback_min_queries=min_queries), ref)
    # isotropic data: nothing worth pruning, so the fallback to brute force fires
    assert index.last_stats["fallback_queries"] > 0


@pytest.mark.parametrize(
    "n_support, n_query, dim, k",
    [
        (7, 5, 3, 1),
        (7, 5, 3, 7),
        (257, 33, 5, 4),
        (1001, 200, 64, 10),
        (333, 100, 200, 3),
        (2, 9, 1, 2),
    ],
)
def test_random_shapes_same_neighbours(n_support, n_query, dim, k):
    g = torch.Generator().manual_seed(n_support + dim)
    s, q = torch.randn(n_support, dim, generator=g), torch.randn(n_query, dim, generator=g)
    assert_same_as_torch(q, s, k)


@pytest.mark.parametrize("k", [1, 250])
def test_k_of_one_and_k_larger_than_a_cluster(k):
    q, s = clustered(1537, 300, 16, n_centres=30)  # clusters of ~50 rows
    assert_same_as_torch(q, s, k)
    index = PrunedKNNIndex(s, n_clusters=30)
    assert max(b - a for a, b in zip(index.starts, index.starts[1:])) < 250
    assert_same(index.search(q, k), knn_search(q, s, k))


def test_queries_far_from_all_clusters():
    q, s = clustered(2000, 200, 20)
    far = q + 60.0 * torch.nn.functional.normalize(
        torch.randn(200, 20, generator=torch.Generator().manual_seed(5)), dim=1
    )
    assert_same_as_torch(far, s, 6)


@pytest.mark.parametrize("k", [1, 4, 60])
def test_exclude_self_leave_one_out(k):
    _, s = clustered(1500, 1, 24)
    d, i = assert_same_as_torch(s, s, k, exclude_self=True)
    assert not (i == torch.arange(1500)[:, None]).any()


def test_self_index_on_a_subset_of_support_rows_as_ned_fit_does():
    _, s = clustered(2500, 1, 24)
    rows = torch.randperm(2500, generator=torch.Generator().manual_seed(0))[:400]
    chunk = default_chunk_size(2500)
    assert_same(
        knn_search(s[rows], s, 8, backend="pruned", exclude=rows, chunk_size=chunk),
        knn_search(s[rows], s, 8, backend="torch", exclude=rows, chunk_size=chunk),
    )


def test_exclude_self_excludes_by_index_even_with_duplicates():
    x = torch.tensor([[0.0, 0.0], [0.0, 0.0], [5.0, 5.0]])
    d, i = knn_search(x, x, 1, exclude_self=True, backend="pruned")
    assert i[:, 0].tolist() == [1, 0, 0]
    assert d[0, 0] == 0.0


def test_float64_input():
    q, s = clustered(1200, 150, 12, dtype=torch.float64)
    q0, s0 = q.clone(), s.clone()
    d, _ = assert_same_as_torch(q, s, 5)
    assert d.dtype == torch.float64
    assert torch.equal(q, q0) and torch.equal(s, s0)  # the inputs are left untouched


def test_adversarially_close_clusters_little_pruned_still_exact():
    # centres much closer than the noise: the clusters overlap and few products can be skipped
    q, s = clustered(2000, 400, 16, n_centres=8, spread=0.05, noise=1.0)
    index = PrunedKNNIndex(s, n_clusters=8)
    res = index.search(q, 9, fallback_min_queries=10**9)
    assert index.last_stats["products"] > 0.5 * index.last_stats["brute_products"]
    assert_same(res, knn_search(q, s, 9))


def test_small_memory_budget_same_neighbours():
    q, s = clustered(2000, 300, 16)
    ref = knn_search(q, s, 5)
    assert_same(knn_search(q, s, 5, backend="pruned", memory_budget_bytes=4096), ref)
    assert_same(knn_search(q, s, 5, backend="pruned", chunk_size=3), ref)


def test_data_far_from_the_origin():
    # ||s||^2 ~ 1e7 here, so the float32 keys carry rounding errors of about one unit; the slack
    # keeps the pruning conservative and the nearest neighbours (gaps >> those errors) are found.
    # (Farther neighbours can be near-tied at that resolution, where any two searches may differ.)
    g = torch.Generator().manual_seed(2)
    s = 10.0 * torch.randn(800, 8, generator=g) + 1e3
    q = s[:50] + 0.01 * torch.randn(50, 8, generator=g)
    d, i = assert_same_as_torch(q, s, 1)
    assert torch.equal(i[:, 0], torch.arange(50))
    assert torch.all(d[:, 0] < 0.01)
    d, i = knn_search(s[:50], s, 1, backend="pruned")
    assert torch.equal(i[:, 0], torch.arange(50)) and torch.all(d[:, 0] == 0)


def test_lower_bound_never_exceeds_the_true_distance():
    # The bound itself, pair by pair (pruning would hide a wrong bound only on lucky data).
    q, s = clustered(1500, 200, 20, n_centres=6)
    q = torch.cat([q, 3.0 * torch.randn(50, 20)])  # and some queries between the clusters
    index = PrunedKNNIndex(s, n_clusters=20, proj_dim=6)
    zq, tq, _, _ = index._project(q)
    home = torch.cdist(zq, index.c).argmin(1)
    true = torch.cdist(q.double(), s[index.perm].double()).pow(2)  # (Nq, Ns) in storage order
    for j in range(q.shape[0]):
        lb = index._lower_bounds(int(home[j]), zq[j : j + 1], tq[j : j + 1])[0]
        for c in range(index.n_clusters):
            a, e = index.starts[c], index.starts[c + 1]
            assert lb[c] <= true[j, a:e].min() * (1 + 1e-9) + 1e-9


def test_index_reuse_through_knn_search_and_stale_index_rejected():
    q, s = clustered(1500, 100, 16)
    index = PrunedKNNIndex(s)
    assert_same(knn_search(q, s, 4, backend="pruned", index=index), knn_search(q, s, 4))
    with pytest.raises(ValueError, match="index"):
        knn_search(q, s.clone(), 4, backend="pruned", index=index)
    with pytest.raises(ValueError, match="index"):
        knn_search(q, s, 4, backend="torch", index=index)
    s.mul_(2.0)  # changed in place since the build
    with pytest.raises(ValueError, match="index"):
        knn_search(q, s, 4, backend="pruned", index=index)


def test_ned_pruned_equals_ned_torch_and_reuses_its_index():
    q, s = clustered(3000, 500, 24)
    y = torch.arange(3000) % 10
    ht = NED(k=10, backend="torch", max_fit_queries=800).fit(s, y)
    hp = NED(k=10, backend="pruned", max_fit_queries=800).fit(s, y)
    assert hp.temperature_ == ht.temperature_
    index = hp.knn_index_
    assert isinstance(index, PrunedKNNIndex) and index.matches(hp.support_embeddings_)
    assert torch.equal(hp.predict_proba(q), ht.predict_proba(q))
    assert hp.knn_index_ is index and index.last_stats["brute_products"] == 500 * 3000
    assert ht.knn_index_ is None


@pytest.mark.parametrize("with_val", [False, True])
def test_ned_pruned_holdout_mode_equals_torch(with_val):
    q, s = clustered(2000, 300, 16)
    y = torch.arange(2000) % 10
    val = dict(val_embeddings=s[:200] + 0.1, val_labels=y[:200]) if with_val else {}
    ht = NED(k=7, backend="torch", fit_mode="holdout").fit(s, y, **val)
    hp = NED(k=7, backend="pruned", fit_mode="holdout").fit(s, y, **val)
    assert hp.temperature_ == ht.temperature_
    assert torch.equal(hp.predict_proba(q), ht.predict_proba(q))
    assert torch.equal(hp.predict_proba(q.double()), ht.predict_proba(q.double()))  # other dtype: no reuse


def test_query_chunks_and_tuning_arguments_do_not_change_the_result():
    q, s = clustered(1500, 400, 16)
    ref = knn_search(q, s, 6)
    index = PrunedKNNIndex(s, n_clusters=12)
    for kwargs in (
        dict(query_chunk=70),
        dict(block_rows=16, group_cols=64),
        dict(core_fraction=1.0),
        dict(core_fraction=0.0, first_cols=10**6),
    ):
        assert_same(index.search(q, 6, **kwargs), ref)
    index.search(q, 6, query_chunk=70)
    assert index.last_stats["brute_products"] == 400 * 1500


@pytest.mark.parametrize("b, n, k", [(5, 3000, 10), (3, 64 * 25, 1), (4, 1000, 7), (2, 50, 5), (6, 130, 2)])
def test_grouped_topk_equals_torch_topk(b, n, k):
    key = torch.randn(b, n, generator=torch.Generator().manual_seed(n))
    key[0, : n // 2] = float("inf")  # like excluded rows
    val, col = _topk_smallest(key, k)
    ref_val, ref_col = torch.topk(key, k, dim=1, largest=False, sorted=True)
    order = torch.argsort(val, dim=1)
    assert torch.equal(val.gather(1, order), ref_val)
    assert torch.equal(col.gather(1, order), ref_col)


@pytest.mark.parametrize("n", [0, 3])
def test_grouped_topk_of_a_run_narrower_than_k_returns_what_there_is(n):
    key = torch.randn(4, n, generator=torch.Generator().manual_seed(1))
    val, col = _topk_smallest(key, 5)
    assert val.shape == col.shape == (4, n)
    assert torch.equal(val, key.sort(dim=1).values) and torch.equal(key.gather(1, col), val)
