"""commands.config under hostile values: every key of every table is checked for type,
finiteness and range when the config is read, and the refusal names the file, the table and the
key (``"<file>: key <table>.<key> must ..., got ..."``); keys that constrain each other (subset
sizes, split fraction, k, retrieval cut-offs, learning-rate floor, batch shapes) are checked together."""

from __future__ import annotations

import copy
import re

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shiftguard.commands.config import (
    config_from_dict,
    default_config,
    load_config,
    quick_config,
    shipped_configs,
)
from shiftguard.train import train_val_split

SRC = "hostile.toml"
# Derandomized, no example database, no shrinking (as in test_api_hardening.py).
FEW = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)

#: A valid config with known subset sizes: 500 training images -> 400 train / 100 validation.
BASE = {
    "data": {"train_subset": 500, "test_subset": 200, "val_fraction": 0.2},
    "train": {},
    "eval": {"retrieval_ks": [1, 5]},
    "models": [{"arch": "lenet", "activation": "qact", "loss": "watershed", "heads": ["quantile", "ned", "knn"]}],
}
NAN, INF = float("nan"), float("inf")


def patched(patch: dict) -> dict:
    """BASE with ``patch`` applied: ``{"eval.k": v}`` sets a table key, ``{"seed": v}`` a top-level key,
    ``{"models[0].train.lr": v}`` a key of the first model (nested tables are created)."""
    raw = copy.deepcopy(BASE)
    for path, value in patch.items():
        parts = path.replace("models[0]", "models.0").split(".")
        node = raw
        for p in parts[:-1]:
            node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
        node[parts[-1]] = value
    return raw


def refused(raw: dict, key: str) -> str:
    with pytest.raises(ValueError) as info:
        config_from_dict(raw, source=SRC)
    msg = str(info.value)
    assert re.match(rf"{re.escape(SRC)}: key {re.escape(key)} must .+, got ", msg), msg
    return msg


# (patch, key named in the refusal): each case loaded and failed after training (or trained
# silently on something else) before values were checked at load time.
HOSTILE = [
    ({"data.severities": []}, "data.severities"),
    ({"data.severities": [3, 3, 5]}, "data.severities"),
    ({"data.severities": [0, 6]}, "data.severities"),
    ({"data.severities": [1.5]}, "data.severities"),
    ({"data.corruptions": ["fog", "fog", "fog", "rotate"]}, "data.corruptions"),
    ({"data.corruptions": [""]}, "data.corruptions"),
    ({"data.suite": "imagenet-c"}, "data.suite"),
    ({"data.dataset": ""}, "data.dataset"),
    ({"data.root": "a\0b"}, "data.root"),
    ({"data.corrupted_source": "both"}, "data.corrupted_source"),
    ({"eval.retrieval_ks": [0]}, "eval.retrieval_ks"),
    ({"eval.retrieval_ks": []}, "eval.retrieval_ks"),
    ({"eval.retrieval_ks": [1, 1, 5]}, "eval.retrieval_ks"),
    ({"eval.retrieval_ks": [1.7]}, "eval.retrieval_ks"),
    ({"eval.k": 401}, "eval.k"),  # the support is 500 - 100 validation images
    ({"eval.k": 60, "eval.max_support": 50}, "eval.k"),
    ({"eval.k": 0}, "eval.k"),
    ({"eval.knn_backend": "annoy"}, "eval.knn_backend"),
    ({"eval.knn_backend": 1}, "eval.knn_backend"),
    ({"data.test_subset": 1}, "data.test_subset"),
    ({"data.test_subset": 5}, "data.test_subset"),  # max(retrieval_ks) = 5 needs 5 others
    ({"data.test_subset": -1}, "data.test_subset"),
    ({"data.train_subset": 1}, "data.train_subset"),
    ({"data.train_subset": -1}, "data.train_subset"),
    ({"data.train_subset": 2**70}, "data.train_subset"),
    ({"data.val_fraction": 0.999}, "data.val_fraction"),
    ({"data.val_fraction": 0.0001}, "data.val_fraction"),  # round(500 * 1e-4) = 0 validation images
    ({"data.val_fraction": NAN}, "data.val_fraction"),
    ({"data.val_fraction": 1.0}, "data.val_fraction"),
    ({"models[0].model_kwargs.embedding_dim": 0}, "models[0].model_kwargs.embedding_dim"),
    ({"models[0].model_kwargs.embedding_dim": -8}, "models[0].model_kwargs.embedding_dim"),
    ({"models[0].model_kwargs.embedding_dim": 2.5}, "models[0].model_kwargs.embedding_dim"),
    ({"models[0].model_kwargs.embedding_dim": True}, "models[0].model_kwargs.embedding_dim"),
    ({"models[0].model_kwargs.num_classes": 3}, "models[0].model_kwargs.num_classes"),
    ({"models[0].model_kwargs.width": INF}, "models[0].model_kwargs.width"),
    ({"models[0].loss_kwargs.margin": NAN}, "models[0].loss_kwargs.margin"),
    ({"models[0].loss_kwargs.embedding_dim": 8}, "models[0].loss_kwargs.embedding_dim"),
    ({"models[0].heads": ["knn", "knn"]}, "models[0].heads"),
    ({"models[0].arch": ""}, "models[0].arch"),
    ({"models[0].name": "../elsewhere"}, "models[0].name"),
    ({"name": "a/b"}, "name"),
    ({"seed": 2**63 - 1}, "seed"),
    ({"seed": 2**32}, "seed"),
    ({"seed": -1}, "seed"),
    ({"data.split_seed": 2**40}, "data.split_seed"),
    ({"data.corruption_seed": -5}, "data.corruption_seed"),
    ({"train.lr": INF}, "train.lr"),
    ({"train.lr": NAN}, "train.lr"),
    ({"train.lr": -1e-3}, "train.lr"),
    ({"train.lr": 0}, "train.lr"),
    ({"train.lr": 10**400}, "train.lr"),
    ({"train.lr_factor": 2}, "train.lr_factor"),
    ({"train.lr_factor": 1}, "train.lr_factor"),
    ({"train.lr_factor": 0}, "train.lr_factor"),
    ({"train.weight_decay": -0.1}, "train.weight_decay"),
    ({"train.weight_decay": INF}, "train.weight_decay"),
    ({"train.chunk_size": -1}, "train.chunk_size"),
    ({"train.max_val": -1}, "train.max_val"),
    ({"eval.max_support": -1}, "eval.max_support"),
    ({"eval.ece_bins": 100_000_000}, "eval.ece_bins"),
    ({"eval.ece_bins": 0}, "eval.ece_bins"),
    ({"eval.ece_bins": True}, "eval.ece_bins"),
    ({"eval.n_boot": 5}, "eval.n_boot"),
    ({"eval.n_boot": 10**9}, "eval.n_boot"),
    ({"eval.batch_size": 1}, "eval.batch_size"),
    ({"train.epochs": 0}, "train.epochs"),
    ({"train.epochs": 10**7}, "train.epochs"),
    ({"train.batch_size": 1}, "train.batch_size"),  # the trainer drops batches of 1: no step at all
    ({"train.min_lr": 0.1}, "train.min_lr"),  # above lr = 1e-3: a "reduction" would raise the rate
    ({"train.min_lr": -1e-6}, "train.min_lr"),
    ({"train.lr_threshold": -0.01}, "train.lr_threshold"),
    ({"train.lr_patience": -1}, "train.lr_patience"),
    ({"train.lr_cooldown": -1}, "train.lr_cooldown"),
    ({"train.early_stopping_patience": -1}, "train.early_stopping_patience"),
    ({"train.early_stopping_min_delta": NAN}, "train.early_stopping_min_delta"),
    ({"train.samples_per_class": 0}, "train.samples_per_class"),
    ({"train.class_balanced": True, "train.batch_size": 30}, "train.batch_size"),  # 30 % 4 != 0
    ({"models[0].train.lr": NAN}, "models[0].train.lr"),
    ({"models[0].train.epochs": 0}, "models[0].train.epochs"),
    ({"models[0].train.min_lr": 0.5}, "models[0].train.min_lr"),
    ({"models[0].train.lr": 1e-7}, "train.min_lr"),  # the override puts lr below [train]'s min_lr
    ({"models[0].train.batch_size": 2**64}, "models[0].train.batch_size"),
]


@pytest.mark.parametrize(
    "patch, key", HOSTILE, ids=[",".join(f"{k}={v!r}"[:40] for k, v in p.items()) for p, _ in HOSTILE]
)
def test_hostile_value_is_refused_at_load_naming_file_table_and_key(patch, key):
    refused(patched(patch), key)


def test_chunks_with_a_logit_loss_are_refused_naming_the_key_and_the_model():
    raw = patched({"train.chunk_size": 64})
    raw["models"].append({"name": "ce", "arch": "lenet", "loss": "cross_entropy", "heads": ["softmax"]})
    msg = refused(raw, "train.chunk_size")
    assert "'ce'" in msg and "embedding loss" in msg
    raw["models"][1]["train"] = {"chunk_size": 0}  # that model turns chunks off: accepted
    config_from_dict(raw, source=SRC)


def test_messages_say_why_and_what_the_bound_is():
    assert "(0, 1)" in refused(patched({"train.lr_factor": 2}), "train.lr_factor")
    assert "1..10000" in refused(patched({"eval.ece_bins": 100_000_000}), "eval.ece_bins")
    assert "re-weight" in refused(patched({"data.corruptions": ["fog", "fog"]}), "data.corruptions")
    assert "<= 400" in refused(patched({"eval.k": 401}), "eval.k")
    msg = refused(patched({"data.val_fraction": 0.999}), "data.val_fraction")
    assert "round(500 * val_fraction) = 500" in msg


def test_a_file_is_named_in_the_refusal_also_for_toml_inf_and_nan(tmp_path):
    models = '[[models]]\narch = "lenet"\nactivation = "qact"\nloss = "watershed"\nheads = ["quantile"]\n'
    for table, line, key in [
        ("train", "lr = inf", "train.lr"),
        ("train", "lr = nan", "train.lr"),
        ("train", "weight_decay = -inf", "train.weight_decay"),
        ("data", "val_fraction = nan", "data.val_fraction"),
    ]:
        p = tmp_path / "run.toml"
        p.write_text(f"[{table}]\n{line}\n{models}")
        with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}: key {re.escape(key)} must .*, got "):
            load_config(p)


def test_boundary_values_are_accepted():
    cfg = config_from_dict(
        patched(
            {
                "eval.k": 400,
                "data.test_subset": 6,
                "train.lr_factor": 0.999,
                "train.weight_decay": 0,
                "train.chunk_size": 0,
                "eval.max_support": 0,
                "train.max_val": 0,
                "eval.ece_bins": 10_000,
                "seed": 2**32 - 1,
                "data.split_seed": 0,
                "eval.n_boot": 10,
                "train.batch_size": 2,
                "train.min_lr": 1e-3,
                "models[0].model_kwargs.embedding_dim": 1,
                "train.early_stopping_patience": 0,
            }
        ),
        source=SRC,
    )
    assert cfg.eval.k == 400 and cfg.seed == 2**32 - 1
    # a per-model float override given as an integer is stored as a float, like [train]'s keys
    cfg = config_from_dict(patched({"models[0].train.lr": 1}), source=SRC)
    assert cfg.model_train_config(cfg.models[0]).lr == 1.0 and isinstance(cfg.models[0].train["lr"], float)


def test_k_is_not_bounded_by_the_support_when_no_model_searches_neighbours():
    raw = patched({"eval.k": 450})
    raw["models"][0]["heads"] = ["quantile", "logistic"]
    assert config_from_dict(raw, source=SRC).eval.k == 450


@pytest.mark.parametrize("name", ["<default>", "<quick>", *shipped_configs()])
def test_the_default_quick_and_shipped_configs_load(name):
    builders = {"<default>": default_config, "<quick>": quick_config}
    cfg = builders[name]() if name in builders else load_config(shipped_configs()[name])
    assert cfg.models


# --------------------------------------------------------------------------- properties
FLOAT_KEYS = [
    "train.lr",
    "train.weight_decay",
    "train.lr_factor",
    "train.lr_threshold",
    "train.min_lr",
    "train.early_stopping_min_delta",
    "data.val_fraction",
]
INT_KEYS = [
    "data.train_subset",
    "data.test_subset",
    "data.split_seed",
    "data.corruption_seed",
    "seed",
    "train.epochs",
    "train.batch_size",
    "train.lr_patience",
    "train.lr_cooldown",
    "train.early_stopping_patience",
    "train.samples_per_class",
    "train.chunk_size",
    "train.max_val",
    "eval.batch_size",
    "eval.k",
    "eval.ece_bins",
    "eval.max_support",
    "eval.n_boot",
]


@FEW
@given(key=st.sampled_from(FLOAT_KEYS), value=st.sampled_from([NAN, INF, -INF]), per_model=st.booleans())
def test_non_finite_numbers_are_refused_for_every_float_key(key, value, per_model):
    if per_model and key.startswith("train."):
        key = "models[0]." + key
    refused(patched({key: value}), key)


@FEW
@given(
    key=st.sampled_from(INT_KEYS),
    value=st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=2**63, max_value=2**80),
        st.floats(allow_nan=False, allow_infinity=False),
        st.booleans(),
    ),
)
def test_negative_huge_fractional_or_boolean_values_are_refused_for_every_integer_key(key, value):
    refused(patched({key: value}), key)


@FEW
@given(n=st.integers(3, 5000), vf=st.floats(0.0, 1.0, exclude_min=True, exclude_max=True))
def test_an_accepted_split_holds_out_exactly_val_fraction_without_clamping(n, vf):
    raw = patched({"data.train_subset": n, "data.val_fraction": vf})
    raw["models"][0]["heads"] = ["quantile"]
    try:
        config_from_dict(raw, source=SRC)
    except ValueError as exc:
        assert re.match(rf"{SRC}: key data.val_fraction must ", str(exc)), exc
        assert round(n * vf) < 1 or n - round(n * vf) < 2
        return
    tr, va = train_val_split(n, vf, 42)
    assert len(va) == round(n * vf) >= 1 and len(tr) >= 2  # the split applies no silent clamp


@FEW
@given(n=st.integers(3, 3000), k=st.integers(1, 3000), max_support=st.integers(0, 3000))
def test_an_accepted_k_fits_the_support_the_heads_search(n, k, max_support):
    raw = patched({"data.train_subset": n, "eval.k": k, "eval.max_support": max_support})
    try:
        cfg = config_from_dict(raw, source=SRC)
    except ValueError as exc:
        assert re.match(rf"{SRC}: key (eval.k|data.val_fraction) must ", str(exc)), exc
        return
    support = n - round(n * cfg.data.val_fraction)
    assert cfg.eval.k <= (min(support, max_support) if max_support else support)


@FEW
@given(test_subset=st.integers(0, 50), ks=st.lists(st.integers(1, 60), min_size=1, max_size=4, unique=True))
def test_an_accepted_test_subset_leaves_every_query_its_largest_cut_off(test_subset, ks):
    raw = patched({"data.test_subset": test_subset, "eval.retrieval_ks": ks})
    try:
        cfg = config_from_dict(raw, source=SRC)
    except ValueError as exc:
        assert re.match(rf"{SRC}: key data.test_subset must ", str(exc)), exc
        return
    assert cfg.data.test_subset == 0 or cfg.data.test_subset - 1 >= max(ks)


def test_accepted_values_are_stored_as_given():
    """Nothing is clipped: an accepted value is stored as given (floats given as integers become floats)."""
    cfg = config_from_dict(patched({"train.lr": 0.37, "eval.max_support": 123, "train.max_val": 7}), source=SRC)
    assert (cfg.train.lr, cfg.eval.max_support, cfg.train.max_val) == (0.37, 123, 7)
