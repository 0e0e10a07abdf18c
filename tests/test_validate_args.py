"""``validate_args``: the checks that read tensor values (and so wait for the device) run by default
and are skipped with ``validate_args=False`` -- in every loss (``shiftguard/losses/base.py``) and in
the classification metrics (``accuracy``, ``nll``, ``brier``, ``ece``)."""

from __future__ import annotations

import math

import pytest
import torch

from shiftguard.losses import LOSS_NAMES, SPCELoss, build_loss
from shiftguard.metrics import accuracy, brier, ece, nll

NAN = float("nan")
LABELS = torch.tensor([0, 0, 1, 1, 2, 2])
# Losses whose computation itself reads the embeddings' values and stops on NaN: the vMF sampler and
# ELK's range guard (on the concentrations ||e||), the watershed propagation (on the distances).
STOPS_INSIDE = {"elk", "hib", "mcinfonce", "nivmf_proxy", "watershed"}


def _nan_embeddings():
    emb = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    emb[2, 1] = NAN
    return emb


@pytest.mark.parametrize("name", sorted(set(LOSS_NAMES) - STOPS_INSIDE))
def test_nan_embeddings_raise_with_validate_args_and_flow_through_without(name):
    with pytest.raises(ValueError, match="embeddings: contains non-finite values"):
        build_loss(name, num_classes=3, embedding_dim=4)(_nan_embeddings(), LABELS)
    out = build_loss(name, num_classes=3, embedding_dim=4, validate_args=False)(_nan_embeddings(), LABELS)
    assert out.dim() == 0 and not torch.isfinite(out)


@pytest.mark.parametrize("name", sorted(STOPS_INSIDE))
def test_without_validate_args_the_boundary_check_does_not_run(name):
    with pytest.raises(ValueError, match="embeddings: contains non-finite values"):
        build_loss(name, num_classes=3, embedding_dim=4)(_nan_embeddings(), LABELS)
    with pytest.raises(ValueError) as raised:  # the loss's own guard, further in
        build_loss(name, num_classes=3, embedding_dim=4, validate_args=False)(_nan_embeddings(), LABELS)
    assert "embeddings: contains non-finite values" not in str(raised.value)


def test_negative_labels_are_refused_with_validate_args_and_taken_as_classes_without():
    emb = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="labels: labels must be >= 0"):
        build_loss("recall_at_k")(emb, LABELS - 1)
    # the loss depends on which samples share a label, not on the label values
    unchecked = build_loss("recall_at_k", validate_args=False)(emb, LABELS - 1)
    assert torch.equal(unchecked, build_loss("recall_at_k")(emb, LABELS))


@pytest.mark.parametrize("name", ["proxydr", "cross_entropy", "proxy_anchor", "normface", "spce", "nivmf_proxy"])
def test_labels_beyond_num_classes_are_named_only_with_validate_args(name):
    emb, labels = torch.randn(6, 4), torch.tensor([0, 0, 1, 1, 2, 3])
    with pytest.raises(ValueError, match="labels: .*num_classes=3"):
        build_loss(name, num_classes=3, embedding_dim=4)(emb, labels)
    try:  # unchecked, the label fails wherever it is used as an index, or not at all
        build_loss(name, num_classes=3, embedding_dim=4, validate_args=False)(emb, labels)
    except (IndexError, RuntimeError, ValueError) as exc:
        assert "num_classes=3" not in str(exc)


def test_a_non_finite_loss_is_refused_with_validate_args_and_returned_without():
    # SPCE's logits w_k^T z / tau overflow float32 for embeddings of 1e20: the loss is not finite
    emb, labels = torch.randn(6, 4, generator=torch.Generator().manual_seed(2)) * 1e20, LABELS
    with pytest.raises(ValueError, match="the loss is not finite"):
        SPCELoss(3, 4)(emb, labels)
    assert not torch.isfinite(SPCELoss(3, 4, validate_args=False)(emb, labels))


def test_a_tightness_base_built_by_name_follows_the_switch():
    assert (
        build_loss("tightness", num_classes=3, embedding_dim=4, base="supcon", validate_args=False).base.validate_args
        is False
    )
    assert build_loss("tightness", num_classes=3, embedding_dim=4, base="supcon").base.validate_args is True


@pytest.mark.parametrize("metric", [accuracy, nll, brier, ece])
def test_metric_value_checks_run_with_validate_args_and_are_skipped_without(metric):
    probs = torch.tensor([[0.6, 0.3], [0.2, 0.7], [0.5, 0.4]])  # rows sum to 0.9: not on the simplex
    labels = torch.tensor([0, 1, 1])
    with pytest.raises(ValueError, match="rows must sum to 1"):
        metric(probs, labels)
    assert math.isfinite(metric(probs, labels, validate_args=False))
    with pytest.raises(ValueError, match="probs"):  # the shape is still checked
        metric(probs[0], labels, validate_args=False)


def test_unchecked_metric_matches_the_checked_one_on_valid_input():
    probs = torch.softmax(torch.randn(20, 4, generator=torch.Generator().manual_seed(3)), dim=1)
    labels = torch.arange(20) % 4
    for metric in (accuracy, nll, brier, ece):
        assert metric(probs, labels, validate_args=False) == metric(probs, labels)
