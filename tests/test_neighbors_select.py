"""``neighbors.select.smallest_k``: the k smallest entries of every row, sorted by value, equal values
in column order, NaN last, checked against a literal sort of each row."""

from __future__ import annotations

import math

import pytest
import torch

from shiftguard.neighbors.select import SCAN_MAX_K, scan_applies, smallest_k


def literal_smallest_k(block: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's columns sorted by (NaN last, value, column), the first k kept."""
    vals, cols = [], []
    for row in block.tolist():
        order = sorted(range(len(row)), key=lambda j: (math.isnan(row[j]), 0.0 if math.isnan(row[j]) else row[j], j))
        cols.append(order[:k])
        vals.append([row[j] for j in order[:k]])
    return torch.tensor(vals, dtype=block.dtype), torch.tensor(cols, dtype=torch.long)


def assert_same(got, want):
    assert torch.equal(got[1], want[1])
    assert torch.allclose(got[0], want[0], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 2, 10, SCAN_MAX_K])
def test_matches_a_literal_sort_of_every_row_with_many_ties(dtype, k):
    gen = torch.Generator().manual_seed(k)
    # values from a small set: most rows have ties at the k-th place; 37 rows (not a multiple of a part)
    block = torch.randint(0, 7, (37, 150), generator=gen).to(dtype)
    assert scan_applies(block, k)
    assert_same(smallest_k(block, k), literal_smallest_k(block, k))


def test_inf_and_nan_rank_last_nan_after_inf():
    block = torch.tensor(
        [
            [float("nan"), 3.0, float("inf"), float("nan"), 1.0, float("inf"), -2.0],
            [float("nan")] * 3 + [float("inf"), 5.0] + [float("nan")] * 2,
            [float("nan")] * 7,
        ]
    )
    for k in range(1, 8):
        assert_same(smallest_k(block, k), literal_smallest_k(block, k))
    assert smallest_k(block, 3)[1].tolist()[0] == [6, 4, 1]


def test_a_row_ranks_the_same_whatever_rows_it_is_chunked_with():
    gen = torch.Generator().manual_seed(3)
    block = torch.randint(0, 5, (70, 500), generator=gen).float()
    whole = smallest_k(block, 9)
    for lo, hi in [(0, 1), (5, 21), (21, 70)]:
        part = smallest_k(block[lo:hi], 9)
        assert torch.equal(part[1], whole[1][lo:hi]) and torch.equal(part[0], whole[0][lo:hi])


def test_wide_rows_continuous_values_equal_topk():
    gen = torch.Generator().manual_seed(4)
    block = torch.randn(40, 20_003, generator=gen)
    got = smallest_k(block, 10)
    want = torch.topk(block, 10, dim=1, largest=False, sorted=True)
    assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)


def test_non_contiguous_block():
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(0, 4, (60, 30), generator=gen).double()
    block = base.t()  # (30, 60), not contiguous
    assert_same(smallest_k(block, 5), literal_smallest_k(block.contiguous(), 5))


@pytest.mark.parametrize("k", [SCAN_MAX_K + 1, 100])
def test_large_k_falls_back_to_topk_with_ties_in_column_order(k):
    gen = torch.Generator().manual_seed(6)
    block = torch.randint(0, 1000, (8, 400), generator=gen).float()
    assert not scan_applies(block, k)
    vals, cols = smallest_k(block, k)
    want_vals, _ = literal_smallest_k(block, k)
    assert torch.equal(vals, want_vals)
    assert torch.equal(block.gather(1, cols), vals)
    for r in range(block.shape[0]):  # among equal values, columns increase
        v, c = vals[r].tolist(), cols[r].tolist()
        assert all(c[i] < c[i + 1] for i in range(k - 1) if v[i] == v[i + 1])


@pytest.mark.parametrize("k", [0, 6])
def test_k_outside_the_row_is_refused(k):
    with pytest.raises(ValueError, match="k: expected 1 <= k <= 5"):
        smallest_k(torch.zeros(3, 5), k)
