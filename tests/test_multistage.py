"""multistage_step [Patel, Sec. 5.3.2]: chunked two-pass back-propagation equals the plain gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shiftguard.losses import LOSS_NAMES, DRLoss, ProxyDRLoss, RecallAtKSurrogate, SmoothAPLoss, build_loss
from shiftguard.train.multistage import multistage_step


def _mlp(dropout=0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 5)).double()


def _data(n=24):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.arange(4).repeat(n // 4)


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize(
    "make_loss",
    [
        lambda: RecallAtKSurrogate(k=(1, 2, 4), tau2=0.05),
        lambda: SmoothAPLoss(0.05),
        lambda: DRLoss().double(),
        lambda: ProxyDRLoss(4, 5).double(),
    ],
)
@pytest.mark.parametrize("chunk", [1, 5, 24])
def test_multistage_gradients_equal_full_batch_gradients(make_loss, chunk):
    x, y = _data()
    model, loss_fn = _mlp(), make_loss()
    full = loss_fn(model(x), y)
    full.backward()
    ref_model, ref_loss = _grads(model), _grads(loss_fn)
    model.zero_grad()
    loss_fn.zero_grad()
    val = multistage_step(model, loss_fn, x, y, chunk_size=chunk)
    assert torch.allclose(val, full.detach(), atol=1e-12, rtol=0)
    for a, b in zip(_grads(model), ref_model):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)
    for a, b in zip(_grads(loss_fn), ref_loss):  # the loss's own parameters (rho, proxies)
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_multistage_works_for_every_loss(name):
    """Every build_loss loss: multistage gradients equal the full-batch ones. Losses that draw random
    numbers (watershed seeds, vMF samples) see the same RNG state in both, since the loss is
    evaluated once and the no-grad pass of this dropout-free MLP draws nothing."""
    x, y = _data()
    model, loss_fn = _mlp(), build_loss(name, num_classes=4, embedding_dim=5).double()
    torch.manual_seed(7)
    full = loss_fn(model(x), y)
    full.backward()
    ref_model = _grads(model)
    model.zero_grad()
    loss_fn.zero_grad()
    torch.manual_seed(7)
    val = multistage_step(model, loss_fn, x, y, chunk_size=5)
    assert torch.allclose(val, full.detach(), atol=1e-12, rtol=0)
    for a, b in zip(_grads(model), ref_model):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


def test_multistage_dropout_masks_match_between_passes():
    x, y = _data()
    loss_fn = RecallAtKSurrogate(k=(1, 2), tau2=0.05)
    model = _mlp(dropout=0.5)
    # reference: an ordinary step that embeds the same chunks with gradients, from the same RNG state
    torch.manual_seed(123)
    emb = torch.cat([model(c) for c in x.split(7)])
    ref_val = loss_fn(emb, y)
    ref_val.backward()
    ref = _grads(model)
    after_ref = torch.rand(1)
    model.zero_grad()
    torch.manual_seed(123)
    val = multistage_step(model, loss_fn, x, y, chunk_size=7)
    assert torch.allclose(val, ref_val.detach(), atol=1e-12)
    for a, b in zip(_grads(model), ref):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)
    assert torch.equal(torch.rand(1), after_ref)  # RNG continues as after one forward pass


def test_multistage_updates_batchnorm_running_stats_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)).double()
    x, y = _data()
    twin = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)).double()
    twin.load_state_dict(model.state_dict())
    multistage_step(model, SmoothAPLoss(0.05), x, y, chunk_size=24)
    twin(x)  # a single ordinary forward over the same (single) chunk
    assert torch.allclose(model[1].running_mean, twin[1].running_mean)
    assert int(model[1].num_batches_tracked) == 1


def test_multistage_uses_model_embed_when_present():
    class WithEmbed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(6, 5).double()
            self.classifier = nn.Linear(5, 4).double()

        def embed(self, x):
            return self.body(x)

        def forward(self, x):
            return self.classifier(self.body(x))

    m = WithEmbed()
    x, y = _data()
    multistage_step(m, SmoothAPLoss(0.05), x, y, chunk_size=8)
    assert m.body.weight.grad is not None and m.classifier.weight.grad is None


def test_multistage_rejects_bad_arguments():
    x, y = _data()
    with pytest.raises(ValueError, match="chunk_size"):
        multistage_step(_mlp(), SmoothAPLoss(), x, y, chunk_size=0)
    with pytest.raises(ValueError, match="labels"):
        multistage_step(_mlp(), SmoothAPLoss(), x, y[:-1], chunk_size=4)
