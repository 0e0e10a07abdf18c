"""shiftguard.registry.Registry, and the six families of named things looked up through it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftguard.registry import Registry, normalize


def colours() -> Registry:
    reg = Registry("colour", argument="paint")
    reg.register("dark-red", "#8b0000", aliases=("maroon",))
    reg.register("light_blue", "#add8e6")
    reg.register("green", "#008000")
    return reg


# ---------------------------------------------------------------- the registry itself


def test_names_match_ignoring_case_dashes_underscores_and_surrounding_whitespace():
    reg = colours()
    for spelling in ("dark-red", "dark_red", "DarkRed", "DARK--RED", " Dark-Red\t"):
        assert reg.get(spelling) == "#8b0000", spelling
        assert reg.canonical(spelling) == "dark-red"
    assert reg.get("Light-Blue") == "#add8e6" and reg.canonical("lightblue") == "light_blue"
    assert "GREEN" in reg and "green " in reg
    assert "dark red" not in reg  # an inner space is part of the name
    assert reg.canonical("Dark  Red", words=True) == "dark-red"  # unless words are asked for
    with pytest.raises(ValueError, match="unknown colour 'dark blue'"):
        reg.canonical("dark blue", words=True)


def test_aliases_resolve_to_the_canonical_name_and_are_not_listed():
    reg = colours()
    assert reg.get("Maroon") == "#8b0000" and reg.canonical("MAROON") == "dark-red"
    assert reg.names() == ["dark-red", "green", "light_blue"]  # sorted, canonical spellings, no alias
    assert list(reg) == ["dark-red", "light_blue", "green"]  # iteration: registration order
    assert reg.aliases() == {"maroon": "dark-red"}
    assert len(reg) == 3 and reg.as_dict() == {"dark-red": "#8b0000", "light_blue": "#add8e6", "green": "#008000"}


def test_register_works_as_a_decorator_and_returns_the_object():
    reg = Registry("shape")

    @reg.register("unit-square", aliases=("square",))
    def unit_square():
        return 4

    assert unit_square() == 4 and reg.get("Square") is unit_square
    assert reg.register("circle", len) is len


@pytest.mark.parametrize(
    "name, aliases",
    [
        ("Dark_Red", ()),  # the same name in another spelling
        ("crimson", ("maroon",)),  # an alias taken by another entry
        ("maroon", ()),  # a name that is another entry's alias
        ("lightblue", ()),
    ],
)
def test_a_name_or_alias_already_taken_is_refused_and_nothing_is_registered(name, aliases):
    reg = colours()
    before = (reg.as_dict(), reg.aliases())
    with pytest.raises(ValueError, match=r"already registered as the colour '(dark-red|light_blue)'"):
        reg.register(name, "#000000", aliases=aliases)
    assert (reg.as_dict(), reg.aliases()) == before
    assert "crimson" not in reg


def test_bad_registrations_are_refused():
    reg = Registry("colour")
    with pytest.raises(ValueError, match="aliases: .* repeat the colour name 'red'"):
        reg.register("red", 1, aliases=("RED",))
    with pytest.raises(ValueError, match="aliases: .* repeat"):
        reg.register("red", 1, aliases=("scarlet", "Scarlet"))
    with pytest.raises(ValueError, match="name: '-_' is empty"):
        reg.register("-_", 1)
    with pytest.raises(TypeError, match="name: expected a str, got int"):
        reg.register(3, 1)
    with pytest.raises(TypeError, match="aliases: expected a sequence of str"):
        reg.register("red", 1, aliases="scarlet")
    with pytest.raises(ValueError, match="kind: expected a non-empty str"):
        Registry("")
    assert len(reg) == 0


def test_a_decorator_whose_name_was_taken_meanwhile_is_refused():
    reg = Registry("colour")
    decorate = reg.register("red")
    reg.register("RED", 2)
    with pytest.raises(ValueError, match="already registered"):
        decorate(1)
    assert reg.get("red") == 2


def test_unknown_name_error_names_the_argument_lists_the_names_and_suggests_the_closest():
    reg = colours()
    with pytest.raises(ValueError) as info:
        reg.get("dark-rde")
    assert str(info.value) == (
        "paint: unknown colour 'dark-rde'; expected one of dark-red, green, light_blue (did you mean 'dark-red'?)"
    )
    with pytest.raises(ValueError) as info:
        reg.get("marone", argument="colour_of_wall")  # the caller names its own argument; aliases match too
    assert str(info.value).startswith("colour_of_wall: unknown colour 'marone'")
    assert str(info.value).endswith("(did you mean 'dark-red'?)")
    with pytest.raises(ValueError) as info:
        reg.get("purple")
    assert "did you mean" not in str(info.value)  # nothing close: no suggestion


def test_the_hint_follows_the_list_of_names():
    reg = Registry("model", argument="arch", hint="or a factory 'package.module:function'")
    reg.register("lenet", 1)
    with pytest.raises(ValueError, match=r"^arch: unknown model 'x'; expected one of lenet or a factory 'package"):
        reg.get("x")


def test_a_non_str_name_is_a_type_error_naming_the_argument_and_is_not_contained():
    reg = colours()
    for bad in (None, 3, ["green"], b"green"):
        with pytest.raises(TypeError, match=r"^paint: expected a colour name \(str\), got"):
            reg.get(bad)
        assert bad not in reg


@settings(max_examples=40, derandomize=True, deadline=None)
@given(st.text(alphabet="abcAB-_ 1", max_size=8))
def test_lookup_is_exactly_membership_of_the_normalised_name(name):
    reg = Registry("thing")
    reg.register("ab-1", "x", aliases=("c_a",))
    if normalize(name) in ("ab1", "ca"):
        assert name in reg and reg.get(name) == "x"
    else:
        assert name not in reg
        with pytest.raises(ValueError, match=r"^name: unknown thing .*; expected one of ab-1"):
            reg.get(name)


# ---------------------------------------------------------------- the six families


def test_models_are_built_and_listed_through_the_registry():
    from shiftguard.models import MODEL_REGISTRY, MODELS, LeNet5, build_model, model_names

    assert model_names() == MODEL_REGISTRY.names() == sorted(MODELS)
    assert MODELS == MODEL_REGISTRY.as_dict() and isinstance(MODELS, dict)
    assert MODEL_REGISTRY.get("LeNet-5") is LeNet5  # alias lenet5
    assert {"resnet": "resnet18", "densenet": "densenet121"}.items() <= MODEL_REGISTRY.aliases().items()
    assert isinstance(build_model("LeNet_5", num_classes=3), LeNet5)
    with pytest.raises(
        ValueError,
        match=r"^arch: unknown model 'lenett'; expected one of densenet121, lenet, "
        r".* or a factory 'package.module:function' \(did you mean 'lenet'\?\)",
    ):
        build_model("lenett")
    with pytest.raises(TypeError, match="^arch: expected a model name"):
        build_model(5)


def test_losses_are_built_and_listed_through_the_registry():
    from shiftguard.losses import LOSS_NAMES, LOSS_REGISTRY, RecallAtKSurrogate, SmoothAPLoss, build_loss

    assert LOSS_NAMES == tuple(LOSS_REGISTRY.names()) and len(set(LOSS_NAMES)) == len(LOSS_NAMES)
    assert {"watershed", "proxydr", "recall_at_k", "mcinfonce", "spce", "esupcon", "infonce"} <= set(LOSS_NAMES)
    assert isinstance(build_loss("Smooth-AP"), SmoothAPLoss)
    assert isinstance(build_loss("recall@k"), RecallAtKSurrogate)
    with pytest.raises(ValueError, match=r"^name: unknown loss 'smoothap2'; .*\(did you mean 'smooth_ap'\?\)"):
        build_loss("smoothap2")
    with pytest.raises(TypeError, match="^name: expected a loss name"):
        build_loss(None)


def test_activations_are_built_and_listed_through_the_registry():
    from shiftguard.nn import ACTIVATION_NAMES, QACTBlock, make_activation
    from shiftguard.nn.qact import ACTIVATION_REGISTRY

    assert (
        ACTIVATION_NAMES
        == ("relu", "prelu", "selu", "qact", "bn-relu-bn", "bn-prelu-bn", "bn-selu-bn")
        == tuple(ACTIVATION_REGISTRY)
    )
    assert isinstance(make_activation("Q-ACT", 4), QACTBlock)
    assert isinstance(make_activation("PReLU", 3), torch.nn.PReLU)
    listed = "bn-prelu-bn, bn-relu-bn, bn-selu-bn, prelu, qact, relu, selu"
    with pytest.raises(ValueError, match=rf"^name: unknown activation 'gelu'; expected one of {listed}"):
        make_activation("gelu", 4)
    with pytest.raises(ValueError, match="^num_features: expected a positive value"):
        make_activation("prelu", 0)


def test_heads_are_built_and_listed_through_the_registry():
    from shiftguard.heads import EMBEDDING_HEADS, HEAD_NAMES, LOGIT_HEADS, WeightedKNN, build_head, head_input
    from shiftguard.heads.registry import HEAD_REGISTRY

    assert HEAD_NAMES == tuple(HEAD_REGISTRY) == LOGIT_HEADS + EMBEDDING_HEADS
    assert set(HEAD_REGISTRY.names()) == set(HEAD_NAMES)
    head = build_head("WKNN", num_classes=3, k=2)
    assert isinstance(head, WeightedKNN) and head.k == 2
    assert head_input("Temperature") == "logits" and head_input("distance-ratio") == "embeddings"
    with pytest.raises(ValueError, match=r"^heads: unknown head 'softmx'; expected one of 1nn, .*'softmax'\?\)$"):
        build_head("softmx", 3)


def test_datasets_are_loaded_and_listed_through_the_registry():
    from shiftguard.data import describe, load, names
    from shiftguard.data.registry import DATASET_REGISTRY, DatasetInfo

    assert names() == list(DATASET_REGISTRY) and sorted(names()) == DATASET_REGISTRY.names()
    assert set(describe()) == set(names())
    assert isinstance(DATASET_REGISTRY.get("FMNIST"), DatasetInfo)
    for spelling in ("Tiny-ImageNet-C", "mnistc", "default"):
        assert spelling in DATASET_REGISTRY
    assert load("Default", "test").name == "mnist-embedded"
    with pytest.raises(ValueError, match=r"^name: unknown dataset 'cifar1O'; .*\(did you mean 'cifar10'\?\)"):
        load("cifar1O")


def test_corruptions_and_suites_are_looked_up_and_listed_through_the_registry():
    from shiftguard import corruptions as C

    assert C.SUITES == C.SUITE_REGISTRY.as_dict() and list(C.SUITES) == ["mnist-c", "cifar-c", "cifar-c-extra"]
    for suite, table in C.SUITES.items():
        assert list(C.CORRUPTION_REGISTRIES[suite]) == list(table) == C.names(suite)  # benchmark order
    assert C.get("Shot-Noise", channels=1).suite == "mnist-c" and C.get("shot_noise", channels=3).suite == "cifar-c"
    assert C.get("fog", "CIFAR_C").suite == "cifar-c" and C.get("MNIST-C/Dotted-Line").name == "dotted_line"
    assert C.names("CIFAR-C", extra=True)[-4:] == list(C.SUITES["cifar-c-extra"])
    with pytest.raises(ValueError, match=r"^suite: unknown suite 'cifar-d'; expected one of cifar-c, "):
        C.names("cifar-d")
    with pytest.raises(ValueError, match=r"^name: unknown cifar-c corruption 'zigzag'; expected one of brightness"):
        C.get("zigzag", "cifar-c")
    with pytest.raises(ValueError, match=r"^name: unknown corruption 'fgo'; .*zigzag.*\(did you mean 'fog'\?\)"):
        C.corrupt(torch.zeros(1, 1, 8, 8, dtype=torch.uint8), "fgo", 1)
