"""Test-time adaptation arms (shiftguard.evaluation.adaptation): each arm against a slow reference
written here, the caller's model untouched, skipped arms named, and the arms in evaluate()."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shiftguard
from shiftguard.evaluation import ModelOutputs
from shiftguard.evaluation.adaptation import (
    AdaptedModel,
    AdaptSpec,
    adapt_specs,
    arm_contexts,
    batchnorm_layers,
    skip_reason,
    softmax_entropy,
)
from shiftguard.evaluation.outputs import batch_order
from shiftguard.nn import QuantileActivation, convert_activations

EPS = 1e-5


class BNNet(nn.Module):
    """conv -> BN2d -> ReLU -> flatten -> linear -> BN1d -> ReLU -> linear."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 8 * 8, 6)
        self.bn2 = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, classes)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv(x))).flatten(1)
        return self.out(torch.relu(self.bn2(self.fc(h))))


def _trained_net(seed: int = 0) -> BNNet:
    """A BNNet whose BatchNorm statistics and affine parameters are not the defaults."""
    torch.manual_seed(seed)
    net = BNNet()
    with torch.no_grad():
        for bn in (net.bn1, net.bn2):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.3, 0.3)
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.num_batches_tracked.fill_(100)
    return net.eval()


def _images(n: int = 100, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=g)


def _batches(images: torch.Tensor, batch_size: int, seed=0):
    order, bounds = batch_order(images.shape[0], batch_size, seed)
    return [images[order[a:b]].float() / 255.0 for a, b in zip(bounds[:-1], bounds[1:])], order


def _manual_batch_stats(net: BNNet, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each BatchNorm's (mean, unbiased variance) on batch ``x`` with every BatchNorm normalising by
    the batch: the forward pass written out by hand."""
    h = net.conv(x)
    m1, v1 = h.mean((0, 2, 3)), h.var((0, 2, 3), unbiased=True)
    hb = (h - m1[None, :, None, None]) / torch.sqrt(h.var((0, 2, 3), unbiased=False)[None, :, None, None] + EPS)
    h = torch.relu(hb * net.bn1.weight[None, :, None, None] + net.bn1.bias[None, :, None, None]).flatten(1)
    z = net.fc(h)
    return [(m1, v1), (z.mean(0), z.var(0, unbiased=True))]


def _adapted(spec, net, **kw):
    return AdaptedModel(AdaptSpec.parse(spec) if isinstance(spec, str) else spec, ModelOutputs(net), **kw)


# --------------------------------------------------------------------------- bn: re-estimation
@torch.no_grad()
def test_bn_arm_equals_a_cumulative_average_of_the_cells_batch_statistics_computed_by_hand():
    net, x = _trained_net(), _images(100)
    arm = _adapted("bn", net)
    out = arm.outputs_on(x, 30, "cpu", "none")
    batches, _ = _batches(x, 30)
    assert [b.shape[0] for b in batches] == [30, 30, 40]  # the last short batch is merged
    stats = [_manual_batch_stats(net, b) for b in batches]
    for i, bn in enumerate((arm.model.bn1, arm.model.bn2)):
        mean = torch.stack([s[i][0] for s in stats]).mean(0)
        var = torch.stack([s[i][1] for s in stats]).mean(0)
        torch.testing.assert_close(bn.running_mean, mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn.running_var, var, rtol=1e-5, atol=1e-6)
    # the cell is then scored with those statistics, in eval mode
    ref = copy.deepcopy(net)
    ref.bn1.running_mean.copy_(arm.model.bn1.running_mean)
    ref.bn1.running_var.copy_(arm.model.bn1.running_var)
    ref.bn2.running_mean.copy_(arm.model.bn2.running_mean)
    ref.bn2.running_var.copy_(arm.model.bn2.running_var)
    torch.testing.assert_close(out["logits"], ref.eval()(x.float() / 255.0), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_bn_prior_mixes_source_and_cell_statistics_by_n_over_n_plus_cell_size():
    net, x = _trained_net(), _images(100)
    full = _adapted("bn", net)
    full.outputs_on(x, 50, "cpu", "none")
    prior = _adapted("bn:prior=300", net)
    prior.outputs_on(x, 50, "cpu", "none")
    w = 300.0 / (300.0 + 100.0)
    for name in ("bn1", "bn2"):
        src, cell, got = getattr(net, name), getattr(full.model, name), getattr(prior.model, name)
        torch.testing.assert_close(got.running_mean, w * src.running_mean + (1 - w) * cell.running_mean)
        torch.testing.assert_close(got.running_var, w * src.running_var + (1 - w) * cell.running_var)


# --------------------------------------------------------------------------- bn-batch
@torch.no_grad()
def test_bn_batch_arm_normalises_every_batch_by_its_own_statistics():
    net, x = _trained_net(), _images(100)
    out = _adapted("bn-batch", net).outputs_on(x, 30, "cpu", "none")
    batches, order = _batches(x, 30)
    ref = copy.deepcopy(net).train()  # train-mode BatchNorm normalises by the batch
    expected = torch.empty(100, 3)
    expected[order] = torch.cat([ref(b) for b in batches])
    torch.testing.assert_close(out["logits"], expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- tent
def test_tent_scores_each_batch_before_its_step_and_its_steps_equal_manual_entropy_steps():
    net, x = _trained_net(), _images(60)
    arm = _adapted("tent", net)
    out = arm.outputs_on(x, 30, "cpu", "none")
    batches, order = _batches(x, 30)
    assert len(batches) == 2
    ref = copy.deepcopy(net).train()
    ref.requires_grad_(False)
    params = [p for bn in (ref.bn1, ref.bn2) for p in (bn.weight, bn.bias)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999))
    logits = []
    for b in batches:
        z = ref(b)
        p = z.softmax(1)
        loss = -(p * torch.log(p)).sum(1).mean()  # the entropy of [Wang et al. 2021, eq. 2]
        opt.zero_grad()
        loss.backward()
        opt.step()
        logits.append(z.detach())
    expected = torch.empty(60, 3)
    expected[order] = torch.cat(logits)
    torch.testing.assert_close(out["logits"], expected, rtol=1e-5, atol=1e-6)
    for name in ("bn1", "bn2"):
        for field in ("weight", "bias"):
            torch.testing.assert_close(
                getattr(getattr(arm.model, name), field), getattr(getattr(ref, name), field), rtol=1e-5, atol=1e-7
            )
    # only the BatchNorm affine parameters moved
    for name in ("conv", "fc", "out"):
        for field in ("weight", "bias"):
            assert torch.equal(getattr(getattr(arm.model, name), field), getattr(getattr(net, name), field))


def test_tent_and_refresh_take_their_own_batch_size():
    net, x = _trained_net(), _images(60)
    own = _adapted("tent:batch_size=20", net).outputs_on(x, 30, "cpu", "none")
    same = _adapted("tent", net).outputs_on(x, 20, "cpu", "none")
    assert torch.equal(own["logits"], same["logits"])
    assert not torch.equal(own["logits"], _adapted("tent", net).outputs_on(x, 30, "cpu", "none")["logits"])
    arm = _adapted("refresh:passes=1,batch_size=20", net)
    arm.outputs_on(x, 30, "cpu", "none")
    assert int(arm.model.bn1.num_batches_tracked) == int(net.bn1.num_batches_tracked) + 3


def test_tent_sgd_option_takes_momentum_sgd_and_the_first_batch_is_scored_unadapted():
    net, x = _trained_net(), _images(60)
    out_adam = _adapted("tent", net).outputs_on(x, 30, "cpu", "none")
    out_sgd = _adapted("tent:lr=0.5,optimizer=sgd", net).outputs_on(x, 30, "cpu", "none")
    batches, order = _batches(x, 30)
    first = order[:30]
    # batch 1 is scored before any step: equal under both optimisers; batch 2 after one step each
    torch.testing.assert_close(out_adam["logits"][first], out_sgd["logits"][first])
    assert not torch.allclose(out_adam["logits"][order[30:]], out_sgd["logits"][order[30:]])


def test_softmax_entropy_matches_the_definition():
    z = torch.randn(5, 4, dtype=torch.float64)
    p = z.softmax(1)
    torch.testing.assert_close(softmax_entropy(z), -(p * p.log()).sum(1))


# --------------------------------------------------------------------------- refresh
@torch.no_grad()
def test_refresh_runs_training_mode_passes_in_the_documented_order_then_scores_with_running_statistics():
    net, x = _trained_net(), _images(100)
    arm = _adapted("refresh:passes=3", net, seed=5)
    out = arm.outputs_on(x, 40, "cpu", "none")
    ref = copy.deepcopy(net).train()
    for p in range(3):
        batches, _ = _batches(x, 40, seed=5 * 1_000_003 + p + 1)
        for b in batches:
            ref(b)
    for name in ("bn1", "bn2"):
        torch.testing.assert_close(getattr(arm.model, name).running_mean, getattr(ref, name).running_mean)
        torch.testing.assert_close(getattr(arm.model, name).running_var, getattr(ref, name).running_var)
    torch.testing.assert_close(out["logits"], ref.eval()(x.float() / 255.0), rtol=1e-5, atol=1e-6)


def test_refresh_moves_the_qact_context_and_scores_in_the_frozen_context():
    torch.manual_seed(0)
    net = convert_activations(
        nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3)), example_input=torch.zeros(4, 1, 8, 8)
    )
    q = [m for m in net.modules() if isinstance(m, QuantileActivation)]
    assert len(q) == 1
    arm = _adapted("refresh:passes=2", net)
    x = _images(80)
    arm.outputs_on(x, 40, "cpu", "batch")
    moved = [m for m in arm.model.modules() if isinstance(m, QuantileActivation)][0]
    assert int(moved.num_batches_tracked) == int(q[0].num_batches_tracked) + 2 * 2
    assert not torch.equal(moved.running_quantiles, q[0].running_quantiles)
    assert moved.context == q[0].context  # the scoring context was temporary
    assert arm_contexts(AdaptSpec("refresh"), ["batch", "frozen"]) == ["frozen"]
    assert arm_contexts(AdaptSpec("bn"), ["batch", "frozen"]) == ["batch", "frozen"]
    assert arm_contexts(AdaptSpec("refresh"), ["none"]) == ["none"]


# --------------------------------------------------------------------------- every arm
@pytest.mark.parametrize("spec", ["bn-batch", "bn", "bn:prior=16", "tent", "refresh:passes=2"])
def test_every_cell_starts_from_the_trained_state(spec):
    net, x, other = _trained_net(), _images(60), _images(60, seed=9)
    arm = _adapted(spec, net)
    first = arm.outputs_on(x, 30, "cpu", "none")
    arm.outputs_on(other, 30, "cpu", "none")
    again = arm.outputs_on(x, 30, "cpu", "none")
    assert torch.equal(first["logits"], again["logits"])


def test_the_callers_model_and_random_streams_are_unchanged_by_an_evaluation_with_every_arm(monkeypatch):
    # torch.manual_seed would also reseed every CUDA device, which fork_rng(devices=[]) does not
    # restore: the caller's CUDA random stream would change behind its back
    calls = []
    for mod in (torch.cuda, torch.xpu, torch.mtia):
        monkeypatch.setattr(mod, "manual_seed_all", lambda seed, _m=mod.__name__: calls.append(_m))
    net = _trained_net()
    net.train()
    net.bn2.eval()  # a mixed mode must come back as it was
    before = {k: v.clone() for k, v in net.state_dict().items()}
    grads = {n: p.requires_grad for n, p in net.named_parameters()}
    x = _images(90)
    y = torch.arange(90) % 3
    x28 = torch.nn.functional.interpolate(x.float(), size=8).to(torch.uint8)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    calls.clear()
    res = shiftguard.evaluate(
        net,
        (x28, y),
        support=(x28, y),
        validation=(x28, y),
        suite="mnist-c",
        corruptions=["fog"],
        severities=[3],
        heads=["softmax", "knn"],
        n_boot=20,
        batch_size=30,
        adapt=["none", "bn-batch", "bn", "tent", "refresh:passes=2"],
    )
    assert {r["adaptation"] for r in res.rows} == {"none", "bn-batch", "bn", "tent", "refresh:passes=2"}
    assert calls == []
    assert torch.equal(torch.rand(3), expected)
    after = net.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert net.training and not net.bn2.training and net.bn1.training
    assert {n: p.requires_grad for n, p in net.named_parameters()} == grads
    assert all(p.grad is None for p in net.parameters())
    assert net.bn1.running_mean is not None and net.bn1.track_running_stats


def test_seeded_seeds_and_restores_the_cpu_generator_only():
    from shiftguard._rng import seeded

    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    with seeded(7):
        inside = torch.rand(2)
    assert torch.equal(torch.rand(2), expected)
    torch.manual_seed(7)
    assert torch.equal(torch.rand(2), inside)


def test_arms_a_model_cannot_use_are_skipped_with_the_reason():
    plain = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3))
    outs = ModelOutputs(plain)
    assert skip_reason(AdaptSpec("none"), outs) is None
    for arm in ("bn-batch", "bn", "tent"):
        assert "BatchNorm" in skip_reason(AdaptSpec(arm), outs)
    assert "QACT" in skip_reason(AdaptSpec("refresh"), outs)
    emb = ModelOutputs(_trained_net(), output="embedding")
    assert "logits" in skip_reason(AdaptSpec("tent"), emb)
    bound = ModelOutputs(_trained_net(), embed=lambda x: x.flatten(1))
    assert "callable" in skip_reason(AdaptSpec("bn"), bound)
    x, y = _images(60), torch.arange(60) % 3
    res = shiftguard.evaluate(
        plain,
        (x, y),
        suite="mnist-c",
        corruptions=["fog"],
        severities=[3],
        heads=["softmax"],
        n_boot=20,
        batch_size=30,
        adapt=["none", "bn", "refresh"],
    )
    assert {r["adaptation"] for r in res.rows} == {"none"}
    assert [
        (s["adaptation"], "BatchNorm" in s["reason"] or "QACT" in s["reason"])
        for s in res.results["skipped_adaptations"]
    ] == [("bn", True), ("refresh", True)]
    assert res.results["models"][0]["adaptations"] == ["none"]


def test_specs_parse_label_and_refuse_what_they_do_not_take():
    assert AdaptSpec.parse("bn").label == "bn"
    assert AdaptSpec.parse(" BN : prior = 16 ").label == "bn:prior=16"
    assert AdaptSpec.parse("tent:lr=0.00025,optimizer=sgd").label == "tent:lr=0.00025,optimizer=sgd"
    assert AdaptSpec.parse("refresh:passes=2").passes == 2
    assert AdaptSpec.parse("bn-batch").transductive is False and AdaptSpec("bn").transductive
    with pytest.raises(ValueError, match="adapt: unknown arm 'bnn'"):
        AdaptSpec.parse("bnn")
    with pytest.raises(ValueError, match="does not take lr"):
        AdaptSpec.parse("bn:lr=0.1")
    with pytest.raises(ValueError, match="passes must be an integer >= 1"):
        AdaptSpec("refresh", passes=0)
    with pytest.raises(ValueError, match="not a number"):
        AdaptSpec.parse("bn:prior=many")
    with pytest.raises(ValueError, match="listed more than once"):
        adapt_specs(["bn", "bn:prior=0"])
    with pytest.raises(ValueError, match="at least one arm"):
        adapt_specs([])
    d = AdaptSpec.parse("refresh:passes=3").describe(200)
    assert d["transductive"] and d["passes"] == 3 and d["images"] == 200


def test_batchnorm_layers_finds_subclasses_and_filters_by_statistics():
    net = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm2d(3, track_running_stats=False), nn.SyncBatchNorm(3))
    assert len(batchnorm_layers(net)) == 3
    assert len(batchnorm_layers(net, with_statistics=True)) == 2


def test_qact_models_are_scored_in_each_context_with_each_arm_and_refresh_frozen_only():
    torch.manual_seed(0)
    net = convert_activations(
        nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3)), example_input=torch.zeros(4, 1, 8, 8)
    )
    x, y = _images(60), torch.arange(60) % 3
    res = shiftguard.evaluate(
        net,
        (x, y),
        suite="mnist-c",
        corruptions=["fog"],
        severities=[3],
        heads=["softmax"],
        n_boot=20,
        batch_size=30,
        adapt=["none", "bn", "refresh:passes=1"],
    )
    pairs = list(dict.fromkeys((r["context"], r["adaptation"]) for r in res.rows))
    assert pairs == [
        ("batch", "none"),
        ("frozen", "none"),
        ("batch", "bn"),
        ("frozen", "bn"),
        ("frozen", "refresh:passes=1"),
    ]
    marks = {a["name"]: a["transductive"] for a in res.results["adaptation"]}
    assert marks == {"none": False, "bn": True, "refresh:passes=1": True}
    assert "bn *" in res.summary() and "transductive" in res.summary()


def test_cached_arm_outputs_are_reused_and_kept_apart_from_the_static_ones(tmp_path):
    net, x = _trained_net(), _images(60)
    y = torch.arange(60) % 3
    kw = dict(
        suite="mnist-c",
        corruptions=["fog"],
        severities=[3],
        heads=["softmax"],
        n_boot=20,
        batch_size=30,
        adapt=["none", "tent"],
        cache_dir=tmp_path,
    )
    first = shiftguard.evaluate(net, (x, y), **kw)
    assert (tmp_path / "BNNet" / "none" / "adapt-tent" / "fog-s3.pt").is_file()
    assert (tmp_path / "BNNet" / "none" / "fog-s3.pt").is_file()
    again = shiftguard.evaluate(net, (x, y), **kw)
    assert first.rows == again.rows


def test_adversarial_cells_are_scored_for_the_static_arm_only():
    net, x = _trained_net(), _images(60)
    y = torch.arange(60) % 3
    res = shiftguard.evaluate(
        net,
        (x, y),
        suite="mnist-c",
        corruptions=["fog"],
        severities=[3],
        heads=["softmax"],
        n_boot=20,
        batch_size=30,
        adapt=["none", "bn"],
        attacks=["fgsm"],
        attack_eps=[0.1],
    )
    adv = [r for r in res.rows if r["group"] == "adversarial"]
    assert adv and {r["adaptation"] for r in adv} == {"none"}
    assert {r["adaptation"] for r in res.rows if r["group"] == "benchmark"} == {"none", "bn"}


def test_baseline_key_names_an_adapted_series():
    net, x = _trained_net(), _images(60)
    y = torch.arange(60) % 3
    kw = dict(suite="mnist-c", corruptions=["fog"], severities=[3], heads=["softmax"], n_boot=20, batch_size=30)
    base = shiftguard.evaluate(net, (x, y), adapt=["none", "bn"], **kw)
    res = shiftguard.evaluate(net, (x, y), adapt=["bn"], baseline=base, baseline_key="BNNet/none/bn/softmax", **kw)
    mce = [r["mce"] for r in res.robustness]
    assert mce == [pytest.approx(1.0)]  # the same series against itself
    with pytest.raises(ValueError, match="baseline_key: 'BNNet/none/tent/softmax' is not in the baseline"):
        shiftguard.evaluate(net, (x, y), baseline=base, baseline_key="BNNet/none/tent/softmax", **kw)


# --------------------------------------------------------------------------- configs and the command line
def test_run_configs_check_eval_adapt_when_read():
    from shiftguard.commands import config as C

    raw = {"models": [{"arch": "lenet"}], "eval": {"adapt": ["none", "bn:prior=8", "tent"]}}
    assert C.config_from_dict(raw).eval.adapt == ["none", "bn:prior=8", "tent"]
    assert C.default_config().eval.adapt != []
    for bad, match in (
        (["bn", "bn"], "eval.adapt must list each adaptation arm once"),
        ([], "eval.adapt must name at least one arm"),
        (["bn:lr=1"], "eval.adapt: bn: does not take lr"),
        (["warm"], "eval.adapt: unknown arm 'warm'"),
    ):
        with pytest.raises(ValueError, match=match):
            C.config_from_dict({**raw, "eval": {"adapt": bad}})


def test_adapt_on_the_command_line_overrides_the_config_and_survives_a_relaunch():
    import argparse

    from shiftguard.commands import run as R

    parser = argparse.ArgumentParser()
    R.add_arguments(parser)
    args = parser.parse_args(["--quick", "--adapt", "none", "refresh:passes=2"])
    assert R.resolve_config(args).eval.adapt == ["none", "refresh:passes=2"]
    back = parser.parse_args(R.relaunch_argv(args))
    assert back.adapt == ["none", "refresh:passes=2"]
    with pytest.raises(ValueError, match="after --quick/--epochs/--seed/--adapt"):
        R.resolve_config(parser.parse_args(["--quick", "--adapt", "bnn"]))
