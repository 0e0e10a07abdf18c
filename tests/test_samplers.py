"""ClassBalancedBatchSampler: m samples from each of batch_size // m classes [Patel, Sec. 5.3.2]."""

from __future__ import annotations

import pytest
import torch

from shiftguard.train.samplers import ClassBalancedBatchSampler


def _labels():
    return torch.tensor([0] * 10 + [1] * 6 + [2] * 5 + [3] * 8 + [4] * 2)  # class 4 too small for m=4


def test_every_batch_has_m_distinct_samples_of_each_of_its_classes():
    lab = _labels()
    sampler = ClassBalancedBatchSampler(lab, m=4, batch_size=8, num_batches=20, seed=0)
    assert len(sampler) == 20
    for batch in sampler:
        assert len(batch) == 8 and len(set(batch)) == 8
        counts = torch.bincount(lab[batch], minlength=5)
        assert sorted(counts[counts > 0].tolist()) == [4, 4]
        assert counts[4] == 0  # classes with fewer than m samples are not used


def test_sampler_is_deterministic_per_seed_and_epoch():
    lab = _labels()
    a = list(ClassBalancedBatchSampler(lab, m=2, batch_size=6, seed=3))
    b = list(ClassBalancedBatchSampler(lab, m=2, batch_size=6, seed=3))
    assert a == b
    s = ClassBalancedBatchSampler(lab, m=2, batch_size=6, seed=3)
    s.set_epoch(1)
    assert list(s) != a


def test_sampler_rejects_impossible_configurations():
    with pytest.raises(ValueError, match="batch_size"):
        ClassBalancedBatchSampler(_labels(), m=4, batch_size=10)
    with pytest.raises(ValueError, match="labels"):
        ClassBalancedBatchSampler(_labels(), m=4, batch_size=20)


def test_sampler_works_with_a_dataloader():
    from torch.utils.data import DataLoader, TensorDataset

    lab = _labels()
    ds = TensorDataset(torch.arange(len(lab)), lab)
    loader = DataLoader(ds, batch_sampler=ClassBalancedBatchSampler(lab, m=2, batch_size=4, num_batches=3))
    batches = list(loader)
    assert len(batches) == 3 and all(b[1].shape == (4,) for b in batches)
