"""BatchNorm twins of QACT models: ``bn-relu-bn`` (``bn-prelu-bn``, ``bn-selu-bn``) is the QACT model
with ReLU (PReLU, SELU) in place of QACT inside the same BatchNorm -> act -> BatchNorm blocks
[QACT, Remark after Alg. 2], so the two differ in the activation only.

Every comparison is between two models built in the same test: the QACT model and its twin.
"""

from __future__ import annotations

import io
import types

import pytest
import torch
from test_convert import PlainCNN  # the user-style CNN of the conversion tests
from test_models import SMALL
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from shiftguard.models import DenseNet, build_model
from shiftguard.models._base import norm_activation
from shiftguard.nn import (
    ACTIVATION_NAMES,
    BN_BLOCK_ACTIVATIONS,
    BNActBlock,
    ConvertedActivation,
    QACTBlock,
    QuantileActivation,
    convert_activations,
    make_activation,
    twin_activation,
)
from shiftguard.nn.qact import ACTIVATION_REGISTRY

TWINS = ["bn-relu-bn", "bn-prelu-bn", "bn-selu-bn"]
BASE = {"bn-relu-bn": nn.ReLU, "bn-prelu-bn": nn.PReLU, "bn-selu-bn": nn.SELU}
ARCHS = sorted(SMALL)  # the small constructors of tests/test_models.py keep every architecture fast
QACT_KW = dict(n_tau=20, n_samples=200)


def small_model(arch: str, activation: str, **kw) -> nn.Module:
    kw = {**SMALL[arch], **kw}
    if arch == "densenet121":
        return DenseNet(blocks=(1, 1, 1, 1), activation=activation, **kw)
    return build_model(arch, activation=activation, **kw)


def is_qact_state(key: str, model: nn.Module) -> bool:
    """Whether state-dict entry ``key`` belongs to a QuantileActivation (QACT's own buffers)."""
    owner = model.get_submodule(key.rsplit(".", 1)[0]) if "." in key else model
    return isinstance(owner, QuantileActivation)


def batchnorm_layout(model: nn.Module) -> dict:
    """``name -> (class, num_features)`` of every BatchNorm layer."""
    return {n: (type(m), m.num_features) for n, m in model.named_modules() if isinstance(m, _BatchNorm)}


def twin_structure(qact_model: nn.Module, twin: str) -> list:
    """The QACT model's ``(name, class)`` list with each QACT block turned into the twin block."""
    swap = {QACTBlock: BNActBlock, QuantileActivation: BASE[twin]}
    return [(n, swap.get(type(m), type(m))) for n, m in qact_model.named_modules()]


# ----------------------------------------------------------------------------- names and blocks
def test_twin_names_are_registered_with_canonical_names():
    for twin in TWINS:
        assert twin in ACTIVATION_NAMES and twin in BN_BLOCK_ACTIVATIONS
        assert ACTIVATION_REGISTRY.canonical(twin.upper().replace("-", "_")) == twin
    assert "qact" in BN_BLOCK_ACTIVATIONS and not {"relu", "prelu", "selu"} & set(BN_BLOCK_ACTIVATIONS)
    block = make_activation("BN_ReLU_BN", 6)
    assert isinstance(block, BNActBlock) and isinstance(block.act, nn.ReLU) and block.num_features == 6
    assert isinstance(make_activation("bn-prelu-bn", 6).act, nn.PReLU)
    assert make_activation("bn-prelu-bn", 6).act.weight.shape == (6,)
    assert isinstance(make_activation("bnselubn", 6).act, nn.SELU)
    with pytest.raises(ValueError, match="^num_features:"):
        make_activation("bn-relu-bn", 0)


def test_twin_activation_maps_qact_to_its_twin():
    assert twin_activation("qact") == "bn-relu-bn" == twin_activation("Q_ACT")
    assert twin_activation("qact", "PReLU") == "bn-prelu-bn"
    assert twin_activation("qact", "selu") == "bn-selu-bn"
    with pytest.raises(ValueError, match="^name: only 'qact'"):
        twin_activation("relu")
    with pytest.raises(ValueError, match="^base:"):
        twin_activation("qact", "gelu")
    with pytest.raises(ValueError, match="^name: unknown activation"):
        twin_activation("qcat")


@pytest.mark.parametrize("dim", [None, 1, 2])
def test_twin_block_has_the_qact_blocks_batchnorm_layers(dim):
    q, t = QACTBlock(5, dim=dim), BNActBlock(5, dim=dim)
    assert batchnorm_layout(q) == batchnorm_layout(t) and set(batchnorm_layout(t)) == {"bn_in", "bn_out"}
    assert {k: v.shape for k, v in q.state_dict().items() if not k.startswith("act.")} == {
        k: v.shape for k, v in t.state_dict().items()
    }
    x = torch.randn(8, 5, 3, 3) if dim in (None, 2) else torch.randn(8, 5)
    assert t(x).shape == x.shape


def test_twin_block_applies_bn_act_bn():
    torch.manual_seed(0)
    block = BNActBlock(4, "selu")
    block(torch.randn(16, 4, 3, 3))  # training mode: moves the BatchNorm statistics
    block.eval()
    x = torch.randn(16, 4, 3, 3)
    assert torch.equal(block(x), block.bn_out(torch.selu(block.bn_in(x))))
    with pytest.raises(ValueError, match="^activation:"):
        BNActBlock(4, "qact")
    with pytest.raises(ValueError, match="^dim:"):
        BNActBlock(4, dim=4)


def test_norm_activation_prepends_no_batchnorm_to_a_twin():
    for name in ["qact"] + TWINS:
        assert not isinstance(norm_activation(name, 4), nn.Sequential), name
    plain = norm_activation("relu", 4)
    assert isinstance(plain, nn.Sequential) and isinstance(plain[0], nn.BatchNorm2d)


# ----------------------------------------------------------------------------- architectures
@pytest.mark.parametrize("arch", ARCHS)
def test_twin_model_is_the_qact_model_with_each_qact_block_replaced(arch):
    q = small_model(arch, "qact")
    t = small_model(arch, "bn-relu-bn")
    assert t.activation == "bn-relu-bn"
    assert [(n, type(m)) for n, m in t.named_modules()] == twin_structure(q, "bn-relu-bn")
    q_blocks = {n: m.num_features for n, m in q.named_modules() if isinstance(m, QACTBlock)}
    t_blocks = {n: m.num_features for n, m in t.named_modules() if isinstance(m, BNActBlock)}
    assert q_blocks and q_blocks == t_blocks
    assert batchnorm_layout(q) == batchnorm_layout(t)
    # every parameter and buffer of the twin is the QACT model's, with the same shape
    q_state = {k: v.shape for k, v in q.state_dict().items() if not is_qact_state(k, q)}
    assert q_state == {k: v.shape for k, v in t.state_dict().items()}
    assert {k: p.shape for k, p in q.named_parameters()} == {k: p.shape for k, p in t.named_parameters()}


@pytest.mark.parametrize("twin", ["bn-prelu-bn", "bn-selu-bn"])
@pytest.mark.parametrize("arch", ["lenet", "resnet18"])
def test_prelu_and_selu_twins_have_the_same_layout(arch, twin):
    q = small_model(arch, "qact")
    t = small_model(arch, twin)
    assert [(n, type(m)) for n, m in t.named_modules()] == twin_structure(q, twin)
    assert batchnorm_layout(q) == batchnorm_layout(t)
    # apart from PReLU's slopes (one per channel of its block), the parameters are the QACT model's
    slopes = {f"{n}.weight": (m.num_parameters,) for n, m in t.named_modules() if isinstance(m, nn.PReLU)}
    assert bool(slopes) == (twin == "bn-prelu-bn")
    shapes = {k: tuple(p.shape) for k, p in t.named_parameters() if k not in slopes}
    assert shapes == {k: tuple(p.shape) for k, p in q.named_parameters()}


@pytest.mark.parametrize("arch", ARCHS)
def test_twin_model_runs_forward_and_backward(arch):
    torch.manual_seed(0)
    m = small_model(arch, "bn-relu-bn", in_channels=1)
    x = torch.randn(4, 1, 28, 28)
    out = m(x)
    assert out.shape == (4, 10) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    assert torch.isfinite(m.eval()(x)).all()


def test_qact_models_batchnorm_state_loads_into_its_twin():
    torch.manual_seed(0)
    q = small_model("resnet18", "qact").train()
    q(torch.randn(4, 1, 16, 16))  # moves the BatchNorm statistics away from their start
    t = small_model("resnet18", "bn-relu-bn")
    t.load_state_dict({k: v for k, v in q.state_dict().items() if not is_qact_state(k, q)})  # strict
    for name, bn in batchnorm_layout(q).items():
        assert torch.equal(q.get_submodule(name).running_mean, t.get_submodule(name).running_mean), (name, bn)


def test_twin_model_state_dict_round_trip():
    torch.manual_seed(2)
    m = small_model("lenet", "bn-prelu-bn").train()
    m(torch.randn(8, 1, 28, 28)).sum().backward()
    buffer = io.BytesIO()
    torch.save(m.state_dict(), buffer)
    buffer.seek(0)
    fresh = small_model("lenet", "bn-prelu-bn")
    fresh.load_state_dict(torch.load(buffer))
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(m.eval()(x), fresh.eval()(x))


# ----------------------------------------------------------------------------- user models
class TwiceCalled(nn.Module):
    """One ``self.relu`` called at two sites, as in torchvision's BasicBlock."""

    def __init__(self, ch: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(ch * 8 * 8, 2)

    def forward(self, x):
        out = self.relu(self.conv1(x))
        return self.head(self.relu(self.conv2(out) + out).flatten(1))


def converted_layout(model: nn.Module) -> dict:
    """``name -> shape`` of the converted model's state without QACT's own buffers."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not is_qact_state(k, model)}


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize(
    "build, sites", [(PlainCNN, {"features.1": [8], "features.4": [16]}), (TwiceCalled, {"relu": [4, 4]})]
)
def test_converted_user_model_gets_one_twin_block_per_call_site(build, sites, twin):
    x = torch.randn(2, 3, 8, 8)
    q = convert_activations(build(), example_input=x, **QACT_KW)
    t = convert_activations(build(), to=twin.upper().replace("-", "_"), example_input=x)
    converted = {n: m for n, m in t.named_modules() if isinstance(m, ConvertedActivation)}
    assert {n: [s.num_features for s in m.sites] for n, m in converted.items()} == sites
    assert all(
        m.to_name == twin and all(type(s) is BNActBlock and isinstance(s.act, BASE[twin]) for s in m.sites)
        for m in converted.values()
    )
    assert not any(isinstance(m, QuantileActivation) for m in t.modules())
    assert [(n, type(m)) for n, m in t.named_modules()] == twin_structure(q, twin)
    assert batchnorm_layout(q) == batchnorm_layout(t)
    q_layout, t_layout = converted_layout(q), converted_layout(t)
    if twin == "bn-prelu-bn":  # the slopes, one per channel of each site
        t_layout = {k: v for k, v in t_layout.items() if not k.endswith(".act.weight")}
    assert q_layout == t_layout
    out = t(torch.randn(4, 3, 8, 8))
    out.sum().backward()
    assert torch.isfinite(out).all()


def test_two_call_sites_of_one_activation_get_independent_twin_blocks():
    torch.manual_seed(0)
    t = convert_activations(TwiceCalled(), to="bn-relu-bn", example_input=torch.randn(2, 3, 8, 8)).train()
    t(torch.randn(4, 3, 8, 8))
    first, second = t.relu.sites
    assert first is not second
    # both sites saw their own input: each running mean moved away from its start, and differently
    assert (first.bn_in.running_mean != 0).all() and (second.bn_in.running_mean != 0).all()
    assert not torch.equal(first.bn_in.running_mean, second.bn_in.running_mean)


def test_converted_twin_state_dict_round_trip_into_a_fresh_conversion():
    torch.manual_seed(1)
    model = convert_activations(TwiceCalled(), to="bn-relu-bn").train()  # sites created at the first forward
    for _ in range(2):
        model(torch.randn(4, 3, 8, 8)).sum().backward()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = convert_activations(TwiceCalled(), to="bn-relu-bn")  # no sites yet: sized by the stored tensors
    fresh.load_state_dict(torch.load(buffer))  # strict
    assert [s.num_features for s in fresh.relu.sites] == [4, 4]
    x = torch.randn(3, 3, 8, 8)
    assert torch.equal(model.eval()(x), fresh.eval()(x))


def test_convert_to_a_twin_refuses_qact_arguments():
    with pytest.raises(TypeError, match="^kwargs:"):
        convert_activations(PlainCNN(), to="bn-relu-bn", n_tau=10)
    with pytest.raises(ValueError, match="^block:"):
        convert_activations(PlainCNN(), to="bn-relu-bn", block=False)
    with pytest.raises(ValueError, match="^to:"):
        convert_activations(PlainCNN(), to="bn-gelu-bn")


def test_user_factory_is_converted_to_the_twin(monkeypatch):
    module = types.ModuleType("twin_factories")
    module.plain = lambda: PlainCNN()
    monkeypatch.setitem(__import__("sys").modules, "twin_factories", module)
    x = torch.randn(2, 3, 8, 8)
    q = build_model("twin_factories:plain", activation="qact", example_input=x)
    t = build_model("twin_factories:plain", activation="bn-relu-bn", example_input=x)
    assert batchnorm_layout(q) == batchnorm_layout(t) and len(batchnorm_layout(t)) == 4
    assert [(n, type(m)) for n, m in t.named_modules()] == twin_structure(q, "bn-relu-bn")
