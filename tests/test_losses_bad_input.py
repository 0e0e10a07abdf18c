"""Bad input: each loss handles it as documented (shiftguard/losses/base.py) or raises a clear error."""

from __future__ import annotations

import pytest
import torch

from shiftguard.losses import LOSS_NAMES, build_loss

NAMES = list(LOSS_NAMES)


def _make(name):
    return build_loss(name, num_classes=3, embedding_dim=4)


def _finite_scalar_with_finite_grad(loss, emb, y):
    emb = emb.clone().requires_grad_(True)
    out = loss(emb, y)
    assert out.dim() == 0
    assert torch.isfinite(out), f"non-finite loss {out}"
    out.backward()
    assert emb.grad is not None and torch.isfinite(emb.grad).all()
    return out


@pytest.mark.parametrize("name", NAMES)
def test_nan_embeddings_raise_naming_the_argument(name):
    emb = torch.randn(6, 4)
    emb[2, 1] = float("nan")
    with pytest.raises(ValueError, match="embeddings"):
        _make(name)(emb, torch.tensor([0, 0, 1, 1, 2, 2]))


@pytest.mark.parametrize("name", NAMES)
def test_label_length_mismatch_and_float_labels_raise(name):
    with pytest.raises(ValueError, match="labels"):
        _make(name)(torch.randn(6, 4), torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="labels"):
        _make(name)(torch.randn(6, 4), torch.tensor([0.5, 1, 2, 0, 1, 2]))
    with pytest.raises(ValueError, match="embeddings"):
        _make(name)(torch.randn(6), torch.tensor([0, 1, 2, 0, 1, 2]))


@pytest.mark.parametrize("name", NAMES)
def test_single_class_batch_gives_a_finite_loss(name):
    _finite_scalar_with_finite_grad(_make(name), torch.randn(6, 4), torch.zeros(6, dtype=torch.long))


@pytest.mark.parametrize("name", NAMES)
def test_class_with_a_single_sample_is_handled(name):
    _finite_scalar_with_finite_grad(_make(name), torch.randn(7, 4), torch.tensor([0, 0, 0, 1, 1, 1, 2]))


@pytest.mark.parametrize("name", NAMES)
def test_all_singletons_gives_a_finite_loss(name):
    _finite_scalar_with_finite_grad(_make(name), torch.randn(3, 4), torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("name", NAMES)
def test_zero_norm_embeddings_give_finite_loss_and_gradient(name):
    emb = torch.randn(6, 4)
    emb[0] = 0.0
    emb[3] = 0.0
    _finite_scalar_with_finite_grad(_make(name), emb, torch.tensor([0, 0, 1, 1, 2, 2]))


@pytest.mark.parametrize("name", NAMES)
def test_all_zero_embeddings_give_finite_loss_and_gradient(name):
    _finite_scalar_with_finite_grad(_make(name), torch.zeros(6, 4), torch.tensor([0, 0, 1, 1, 2, 2]))


@pytest.mark.parametrize("name", ["watershed", "recall_at_k", "smooth_ap", "dr"])
def test_pair_losses_are_exactly_zero_without_pairs(name):
    out = _finite_scalar_with_finite_grad(_make(name), torch.randn(3, 4), torch.tensor([0, 1, 2]))
    assert out.item() == 0.0


@pytest.mark.parametrize("name", ["proxydr", "cross_entropy", "proxy_anchor", "normface", "proxy_nca"])
def test_proxy_losses_reject_labels_beyond_num_classes(name):
    with pytest.raises(ValueError, match="labels"):
        _make(name)(torch.randn(4, 4), torch.tensor([0, 1, 2, 3]))
