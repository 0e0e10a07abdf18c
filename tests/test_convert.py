"""``convert_activations`` and the whole-model context helpers, on models written the way users write them.

QACT [QACT, Alg. 1-2] goes in as the BatchNorm -> QACT -> BatchNorm block [QACT, Remark after Alg. 2];
each call site of an activation gets its own block, channel counts are inferred from the first input,
and activations called as functions are named in one warning.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shiftguard.functional import QACTStatistics, channel_values, qact_apply, qact_statistics
from shiftguard.nn import (
    ConvertedActivation,
    QACTBlock,
    QuantileActivation,
    convert_activations,
    convert_sync_qact,
    fit_context,
    has_qact,
    qact_context,
    set_context,
)

QACT_KW = dict(n_tau=20, n_samples=200)  # small QACT: the behaviour tested does not depend on the sizes


# ----------------------------------------------------------------------------- user-style models
class PlainCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.fc = nn.Linear(16 * 2 * 2, 5)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


class ResidualBlock(nn.Module):
    """One ``self.relu`` used at two call sites, as in torchvision's BasicBlock."""

    def __init__(self, ch: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.conv1(x))
        return self.relu(self.conv2(out) + x)


class FunctionalReLUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 6)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x):
        return self.fc2(F.relu(self.act(self.fc1(x))))  # F.relu cannot be converted


class VariableDepth(nn.Module):
    """Calls its activation a data-dependent number of times: no static call order."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x, steps: int = 1):
        for _ in range(steps):
            x = self.act(self.fc(x))
        return x


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def qact_layers(model: nn.Module) -> list[QuantileActivation]:
    return [m for m in model.modules() if isinstance(m, QuantileActivation)]


def convert_quietly(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these models have nothing to warn about
        return convert_activations(model, **kwargs)


# ----------------------------------------------------------------------------- conversion
def test_plain_cnn_gets_one_qact_block_per_activation_with_inferred_channels():
    model = convert_quietly(PlainCNN(), example_input=torch.randn(2, 3, 8, 8), **QACT_KW)
    blocks = [m for m in model.modules() if isinstance(m, QACTBlock)]
    assert [b.num_features for b in blocks] == [8, 16]
    assert not any(isinstance(m, nn.ReLU) for m in model.modules())
    assert all(b.act.n_tau == 20 and b.act.n_samples == 200 for b in blocks)


def test_converts_in_place_and_returns_the_model():
    model = PlainCNN()
    assert convert_quietly(model) is model
    assert isinstance(model.features[1], ConvertedActivation)


def test_blocks_are_created_at_the_first_forward_without_example_input():
    model = convert_quietly(PlainCNN(), **QACT_KW)
    assert qact_layers(model) == []
    model(torch.randn(4, 3, 8, 8))
    assert len(qact_layers(model)) == 2


def test_example_input_forward_moves_no_state_and_restores_training_flags_and_rng():
    model = PlainCNN().train()
    model.fc.eval()  # a mixed-mode model: every flag must come back as it was
    torch.manual_seed(3)
    convert_quietly(model, example_input=torch.randn(4, 3, 8, 8), **QACT_KW)
    after_conversion = torch.rand(3)
    torch.manual_seed(3)
    torch.randn(4, 3, 8, 8)
    assert torch.equal(after_conversion, torch.rand(3))  # the conversion drew nothing from the global RNG
    assert model.training and model.features.training and not model.fc.training
    for block in (m for m in model.modules() if isinstance(m, QACTBlock)):
        assert block.training
        for bn in (block.bn_in, block.bn_out):
            assert torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
            assert torch.equal(bn.running_var, torch.ones_like(bn.running_var))
            assert int(bn.num_batches_tracked) == 0
        assert int(block.act.num_batches_tracked) == 0


def test_an_activation_called_at_two_sites_gets_two_independent_qact_states():
    torch.manual_seed(0)
    model = convert_quietly(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), ResidualBlock(4)), **QACT_KW)
    model.train()
    model(torch.randn(8, 3, 6, 6))
    first, second = qact_layers(model)
    assert len(qact_layers(model)) == 2  # one per call site of the shared self.relu
    assert int(first.num_batches_tracked) == int(second.num_batches_tracked) == 1  # each saw one batch
    assert not torch.allclose(first.running_quantiles, second.running_quantiles)
    model(torch.randn(8, 3, 6, 6))
    assert len(qact_layers(model)) == 2 and int(first.num_batches_tracked) == 2


def test_one_activation_object_registered_twice_becomes_one_converted_module():
    relu = nn.ReLU()
    model = convert_quietly(nn.Sequential(nn.Linear(3, 4), relu, nn.Linear(4, 5), relu))
    assert model[1] is model[3]
    model(torch.randn(6, 3))
    assert [s.num_features for s in model[1].sites] == [4, 5]


def test_more_calls_than_the_first_forward_fixed_is_an_error():
    model = convert_quietly(VariableDepth())
    model(torch.randn(5, 4), steps=2)
    model(torch.randn(5, 4), steps=1)  # fewer calls: the first site is used
    with pytest.raises(RuntimeError, match="static call order"):
        model(torch.randn(5, 4), steps=3)


def test_calling_forward_directly_bypasses_call_site_counting_and_is_an_error():
    model = convert_quietly(mlp())
    with pytest.raises(RuntimeError, match=r"call model\(x\)"):
        model.forward(torch.randn(5, 3))


def test_a_converted_submodule_can_be_called_on_its_own():
    model = convert_quietly(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), ResidualBlock(4)), **QACT_KW)
    model(torch.randn(4, 3, 6, 6))
    out = model[1](torch.randn(4, 4, 6, 6))  # counts its calls from the start: sites 0 and 1
    assert out.shape == (4, 4, 6, 6) and len(qact_layers(model)) == 2


def test_bare_quantile_activation_with_block_false():
    model = convert_quietly(mlp(), block=False, example_input=torch.randn(5, 3), **QACT_KW)
    site = model[1].sites[0]
    assert type(site) is QuantileActivation and site.num_features == 4


@pytest.mark.parametrize("to, cls", [("selu", nn.SELU), ("relu", nn.ReLU)])
def test_to_a_stateless_activation_replaces_each_module(to, cls):
    model = convert_quietly(nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 2), nn.GELU()), to=to)
    assert isinstance(model[1], cls) and isinstance(model[3], cls)
    x = torch.randn(5, 3)
    act = getattr(F, to)
    assert torch.equal(model(x), act(model[2](act(model[0](x)))))


def test_to_prelu_gets_one_slope_per_channel_and_call_site():
    model = convert_quietly(
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), ResidualBlock(4)),
        to="prelu",
        example_input=torch.randn(2, 3, 6, 6),
    )
    sites = model[1].relu.sites
    assert [type(s) for s in sites] == [nn.PReLU, nn.PReLU] and all(s.weight.shape == (4,) for s in sites)


def test_model_dtype_and_device_moves_reach_blocks_created_later():
    model = convert_quietly(mlp(), **QACT_KW).double()
    model(torch.randn(5, 3, dtype=torch.float64))
    assert model[1].sites[0].bn_in.weight.dtype == torch.float64
    assert model[1].sites[0].act.running_quantiles.dtype == torch.float64


def test_a_converted_model_trains_one_step_after_materialisation():
    torch.manual_seed(0)
    model = convert_quietly(PlainCNN(), example_input=torch.randn(2, 3, 8, 8), **QACT_KW)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # after materialisation: holds the new parameters
    lazy = [p for m in model.modules() if isinstance(m, QACTBlock) for p in m.parameters()]
    assert {id(p) for p in lazy} <= {id(p) for g in optimizer.param_groups for p in g["params"]}
    before = [p.detach().clone() for p in lazy]
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lazy)
    optimizer.step()
    assert any(not torch.equal(p, b) for p, b in zip(lazy, before))


def test_state_dict_round_trip_into_a_freshly_converted_model_gives_identical_frozen_outputs():
    torch.manual_seed(1)
    model = convert_quietly(
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), ResidualBlock(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)), **QACT_KW
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # built before the blocks exist: lr irrelevant
    for _ in range(3):  # moves every running statistic away from its start
        model(torch.randn(8, 3, 6, 6)).sum().backward()
    del optimizer
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)

    fresh = convert_quietly(
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), ResidualBlock(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)), **QACT_KW
    )
    fresh.load_state_dict(torch.load(buffer))  # strict: every key has a place
    x = torch.randn(5, 3, 6, 6)
    model.eval(), fresh.eval()
    set_context(model, "frozen"), set_context(fresh, "frozen")
    assert len(qact_layers(fresh)) == 2
    assert torch.equal(model(x), fresh(x))
    assert torch.equal(model(x[:1]), fresh(x[:1]))  # frozen: one sample is classified on its own


# ----------------------------------------------------------------------------- warnings
def test_functional_activation_is_named_in_one_warning():
    with pytest.warns(UserWarning, match="torch.nn.functional.relu at .*test_convert.py") as record:
        convert_activations(FunctionalReLUNet(), example_input=torch.randn(4, 3))
    assert len(record) == 1 and "FunctionalReLUNet" not in str(record[0].message)
    assert "(in forward)" in str(record[0].message)


def test_functional_activation_without_example_input_is_named_once_at_the_first_forward():
    model = convert_quietly(FunctionalReLUNet())  # nothing to say before the model runs
    with pytest.warns(UserWarning, match="torch.nn.functional.relu") as record:
        model(torch.randn(4, 3))
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(4, 3))


def test_tensor_method_and_torch_function_are_named_too():
    class Methods(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.act = nn.ReLU()

        def forward(self, x):
            return torch.selu(self.act(self.fc(x)).relu())

    with pytest.warns(UserWarning) as record:
        convert_activations(Methods(), example_input=torch.randn(4, 3))
    message = str(record[0].message)
    assert len(record) == 1 and "Tensor.relu" in message and "torch.selu" in message


def test_activation_module_created_in_forward_is_named_with_its_caller():
    class Inline(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.act = nn.ReLU()

        def forward(self, x):
            return nn.ReLU()(self.act(self.fc(x)))  # not in the module tree: cannot be replaced

    with pytest.warns(UserWarning, match=r"nn.ReLU \(not a registered submodule\) at .*test_convert.py") as record:
        convert_activations(Inline(), example_input=torch.randn(4, 3))
    assert len(record) == 1


def test_model_without_activation_modules_warns_nothing_converted():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="nothing converted"):
        out = convert_activations(model)
    assert out is model and not has_qact(model)


def test_convert_sync_qact_on_a_model_without_qact_warns_and_points_to_convert_activations():
    with pytest.warns(UserWarning, match="convert_activations"):
        convert_sync_qact(mlp())


# ----------------------------------------------------------------------------- argument errors
@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(to="tanh"), ValueError, "to"),
        (dict(to="relu", block=False), ValueError, "block"),
        (dict(types=int), TypeError, "types"),
        (dict(types=()), ValueError, "types"),
        (dict(to="selu", n_tau=10), TypeError, "kwargs"),
        (dict(n_tau=0), ValueError, "n_tau"),
        (dict(to="bn-relu-bn", block=False), ValueError, "block"),
        (dict(to="bn-relu-bn", bandwidth=0.5), TypeError, "kwargs"),
        (dict(bandwidth=0), ValueError, "bandwidth"),
    ],
)
def test_bad_arguments_raise_errors_naming_them(kwargs, exc, name):
    with pytest.raises(exc, match=f"^{name}:"):
        convert_activations(mlp(), **kwargs)


def test_types_restricts_what_is_converted():
    model = convert_quietly(
        nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.GELU()),
        types=nn.GELU,
        example_input=torch.randn(2, 3),
    )  # the ReLU left is no warning
    assert isinstance(model[1], nn.ReLU) and isinstance(model[3], ConvertedActivation)


# ----------------------------------------------------------------------------- context helpers
def test_set_context_reaches_existing_layers_and_blocks_created_later():
    model = convert_quietly(PlainCNN(), **QACT_KW)
    assert has_qact(model)  # blocks to come count
    set_context(model, "frozen")
    model(torch.randn(4, 3, 8, 8))
    assert [str(m.context) for m in qact_layers(model)] == ["frozen", "frozen"]
    set_context(model, "batch")
    assert [str(m.context) for m in qact_layers(model)] == ["batch", "batch"]
    with pytest.raises(ValueError, match="^mode:"):
        set_context(model, "eval")


def test_qact_context_restores_each_layers_own_mode():
    model = convert_quietly(PlainCNN(), example_input=torch.randn(2, 3, 8, 8), **QACT_KW)
    first, second = qact_layers(model)
    first.context = "frozen"
    with qact_context(model, "batch"):
        assert [str(m.context) for m in qact_layers(model)] == ["batch", "batch"]
    assert (str(first.context), str(second.context)) == ("frozen", "batch")
    with pytest.raises(ValueError, match="^mode:"):
        with qact_context(model, "none"):
            pass


def test_qact_context_leaves_a_model_without_qact_alone():
    model = mlp()
    with qact_context(model, "frozen") as inside:
        assert inside is model
    assert not has_qact(model)


def test_fit_context_stores_the_average_of_the_batch_quantiles_and_freezes():
    torch.manual_seed(2)
    model = convert_quietly(mlp(), example_input=torch.randn(2, 3), **QACT_KW)
    model.train()
    block = model[1].sites[0]
    bn_before = [
        t.clone()
        for t in (
            block.bn_in.running_mean,
            block.bn_in.running_var,
            block.bn_out.running_mean,
            block.bn_out.running_var,
        )
    ]
    data = torch.randn(40, 3) * 2 + 1

    fit_context(model, data, batch_size=10)

    assert model.training and block.training and block.act.momentum == 0.1  # restored
    assert str(block.act.context) == "frozen" and int(block.act.num_batches_tracked) == 4
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            bn_before,
            (block.bn_in.running_mean, block.bn_in.running_var, block.bn_out.running_mean, block.bn_out.running_var),
        )
    )
    # What the docs promise: the mean over batches of each batch's quantiles [QACT, Alg. 1] at the
    # QACT input, which BatchNorm in eval mode (its unchanged running statistics) produces.
    with torch.no_grad():
        block.bn_in.eval()
        per_batch = [
            qact_statistics(channel_values(block.bn_in(model[0](xb))), n_tau=20, c=100.0, n_samples=1).quantiles
            for xb in data.split(10)
        ]
        expected_q = torch.stack(per_batch).mean(0)
        torch.testing.assert_close(block.act.running_quantiles, expected_q, rtol=1e-5, atol=1e-5)

        model.eval()
        x = torch.randn(7, 3)
        h = block.bn_in(model[0](x))
        stats = QACTStatistics(expected_q, block.act.running_samples, block.act.running_bandwidth)
        expected = model[2](block.bn_out(qact_apply(h, stats)))
        torch.testing.assert_close(model(x), expected)
        torch.testing.assert_close(model(x[:1]), expected[:1])  # frozen: independent of the batch


def test_fit_context_accepts_input_label_pairs_like_a_dataloader():
    torch.manual_seed(4)
    data = torch.randn(30, 3)
    a = convert_quietly(mlp(), example_input=torch.randn(2, 3), **QACT_KW)
    b = convert_quietly(mlp(), **QACT_KW)
    b.load_state_dict(a.state_dict())
    fit_context(a, data, batch_size=10)
    c = copy.deepcopy(b)
    fit_context(b, [(xb, torch.zeros(len(xb))) for xb in data.split(10)])
    fit_context(c, torch.utils.data.TensorDataset(data), batch_size=10)
    assert torch.equal(qact_layers(a)[0].running_quantiles, qact_layers(b)[0].running_quantiles)
    assert torch.equal(qact_layers(a)[0].running_quantiles, qact_layers(c)[0].running_quantiles)


def test_fit_context_errors_name_the_argument():
    with pytest.raises(ValueError, match="^model:"):
        fit_context(mlp(), torch.randn(4, 3))
    model = convert_quietly(mlp(), example_input=torch.randn(2, 3), **QACT_KW)
    with pytest.raises(ValueError, match="^batch_size:"):
        fit_context(model, [torch.randn(4, 3)], batch_size=2)
    with pytest.raises(ValueError, match="^data:"):
        fit_context(model, [])


def test_an_optimizer_built_before_the_blocks_exist_is_refused_at_its_first_step():
    net = convert_activations(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    early = torch.optim.SGD(net.parameters(), lr=0.1)
    part = torch.optim.SGD(net[2].parameters(), lr=0.1)  # a deliberate subset is not this mistake
    net(torch.randn(16, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="optimizer: .* not the 32 parameters that its converted activations"):
        early.step()
    part.step()
    late = torch.optim.SGD(net.parameters(), lr=0.1)
    late.step()


def test_with_example_input_the_blocks_exist_before_any_optimizer():
    net = convert_activations(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), example_input=torch.randn(2, 4)
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.randn(16, 4)).sum().backward()
    opt.step()
    assert all(p.grad is not None for p in net.parameters())
