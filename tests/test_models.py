"""shiftguard.models: shapes, the embed()/classifier contract, activations, parameter counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shiftguard.models import DenseNet, EmbeddingClassifier, build_model, model_names

ACTS = ["relu", "prelu", "selu", "qact", "bn-relu-bn", "bn-prelu-bn", "bn-selu-bn"]
# Small constructors keep the big architectures fast enough to run every activation.
SMALL = {
    "lenet": {},
    "mlp": {"hidden": (32, 16)},
    "resnet18": {"base_width": 4},
    "vgg11": {},
    "densenet121": {"growth_rate": 2},
}


def small_model(arch, **kw):
    """The architecture at test size; DenseNet-121's 58 dense layers are cut to one per block
    (same code path: dense layers, transitions, final norm-activation)."""
    kw = {**SMALL[arch], **kw}
    if arch == "densenet121":
        return DenseNet(blocks=(1, 1, 1, 1), **kw)
    return build_model(arch, **kw)


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("arch", sorted(SMALL))
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_forward_is_classifier_of_embed(arch, shape):
    c, h, w = shape
    kw = {"input_size": h} if arch == "mlp" else {}
    m = small_model(arch, in_channels=c, num_classes=7, **kw).eval()
    x = torch.randn(4, c, h, w)
    emb = m.embed(x)
    assert emb.shape == (4, m.embedding_dim)
    assert isinstance(m.classifier, nn.Linear) and m.classifier.out_features == 7
    torch.testing.assert_close(m(x), m.classifier(emb))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("arch", ["lenet", "mlp", "resnet18", "densenet121"])
def test_every_activation_builds_and_backpropagates(arch, act):
    m = small_model(arch, activation=act, in_channels=1)
    x = torch.randn(8, 1, 28, 28)
    m(x).sum().backward()
    assert all(p.grad is not None for p in m.classifier.parameters())


def test_qact_models_contain_quantile_activation():
    from shiftguard.nn import QuantileActivation

    m = build_model("lenet", activation="qact")
    assert sum(isinstance(mod, QuantileActivation) for mod in m.modules()) == 4


@pytest.mark.parametrize("act", ["relu", "prelu", "selu"])
def test_activation_appears_in_model(act):
    cls = {"relu": nn.ReLU, "prelu": nn.PReLU, "selu": nn.SELU}[act]
    assert any(isinstance(mod, cls) for mod in build_model("lenet", activation=act).modules())


@pytest.mark.parametrize(
    "arch, kw, lo, hi",
    [
        ("resnet18", {}, 11.1e6, 11.3e6),  # [QACT, Sec. 4]: "ResNet18 (11M parameters)"
        ("vgg16", {}, 14.6e6, 14.8e6),  # [QACT, Sec. 4]: "VGG (15M parameters)"
        ("densenet121", {"growth_rate": 12}, 0.95e6, 1.05e6),  # [QACT, Sec. 4]: "DenseNet (1M parameters)"
        ("densenet121", {}, 6.9e6, 7.0e6),
        ("lenet", {}, 55e3, 70e3),
    ],
)
def test_parameter_counts_match_the_papers(arch, kw, lo, hi):
    assert lo < n_params(build_model(arch, in_channels=3, num_classes=10, **kw)) < hi


def test_embedding_dim_projection():
    m = build_model("resnet18", in_channels=3, base_width=4, embedding_dim=16)
    assert m.embedding_dim == 16 and m.embed(torch.randn(2, 3, 32, 32)).shape == (2, 16)
    assert build_model("lenet", embedding_dim=32).embed(torch.randn(2, 1, 28, 28)).shape == (2, 32)


def test_all_models_are_embedding_classifiers():
    for name in model_names():
        assert isinstance(build_model(name, **SMALL.get(name, {})), EmbeddingClassifier)


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="arch: unknown model 'alexnet'; expected one of .*lenet"):
        build_model("alexnet")


def test_unknown_activation_and_keyword_are_errors():
    with pytest.raises(ValueError, match="activation"):
        build_model("lenet", activation="gelu")
    with pytest.raises(ValueError, match="lenet"):
        build_model("lenet", depth=3)
    with pytest.raises(ValueError, match="in_channels"):
        build_model("resnet18", in_channels=0)


def test_aliases_resolve():
    assert isinstance(build_model("LeNet-5"), type(build_model("lenet")))
