"""commands.config: the strict TOML schema of ``shiftguard run --config``."""

from __future__ import annotations

import pytest

from shiftguard.commands.config import (
    HEAD_NAMES,
    config_from_dict,
    default_config,
    load_config,
    quick_config,
    shipped_configs,
)

MINIMAL = """
[[models]]
arch = "lenet"
activation = "qact"
loss = "watershed"
heads = ["quantile", "ned"]
"""


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_minimal_file_gets_the_documented_defaults(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.train.lr == 1e-3 and cfg.data.val_fraction == 0.2 and cfg.data.split_seed == 42  # [QACT, App. B]
    assert cfg.train.lr_patience == 50 and cfg.train.lr_cooldown == 10 and cfg.train.min_lr == 1e-6
    assert cfg.models[0].name == "lenet-qact-watershed"
    assert cfg.data.severities == [1, 2, 3, 4, 5]


def test_unknown_top_level_key_names_key_and_file(tmp_path):
    p = write(tmp_path, "epochz = 3\n" + MINIMAL)
    with pytest.raises(ValueError, match=r"c\.toml.*unknown key 'epochz'"):
        load_config(p)


@pytest.mark.parametrize("section, key", [("train", "learning_rate"), ("data", "datset"), ("eval", "kk")])
def test_unknown_key_in_a_table_names_table_key_and_file(tmp_path, section, key):
    p = write(tmp_path, f"[{section}]\n{key} = 1\n" + MINIMAL)
    with pytest.raises(ValueError, match=rf"c\.toml.*unknown key {section}\.'{key}'"):
        load_config(p)


def test_unknown_key_in_a_model_table(tmp_path):
    p = write(tmp_path, MINIMAL + "activaton = 'relu'\n")
    with pytest.raises(ValueError, match=r"unknown key models\[0\]\.'activaton'"):
        load_config(p)


def test_wrong_types_are_errors(tmp_path):
    with pytest.raises(ValueError, match="train.epochs must be int"):
        load_config(write(tmp_path, "[train]\nepochs = 'ten'\n" + MINIMAL))
    with pytest.raises(ValueError, match="train.class_balanced must be bool"):
        load_config(write(tmp_path, "[train]\nclass_balanced = 1\n" + MINIMAL))


def test_floats_accept_integers(tmp_path):
    assert load_config(write(tmp_path, "[train]\nlr = 1\n" + MINIMAL)).train.lr == 1.0


def test_bad_values_are_errors(tmp_path):
    with pytest.raises(ValueError, match="data.severities"):
        load_config(write(tmp_path, "[data]\nseverities = [0, 6]\n" + MINIMAL))
    with pytest.raises(ValueError, match="data.val_fraction"):
        load_config(write(tmp_path, "[data]\nval_fraction = 1.5\n" + MINIMAL))
    with pytest.raises(ValueError, match="unknown head 'bayes'"):
        load_config(write(tmp_path, MINIMAL.replace('"ned"', '"bayes"')))
    with pytest.raises(ValueError, match="softmax"):
        load_config(write(tmp_path, MINIMAL.replace('"ned"', '"softmax"')))


def test_per_model_train_overrides_are_checked(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL + "[models.train]\nepochs = 3\n"))
    assert cfg.model_train_config(cfg.models[0]).epochs == 3 and cfg.train.epochs == 10
    with pytest.raises(ValueError, match=r"models\[0\]\.train\.epoch"):
        load_config(write(tmp_path, MINIMAL + "[models.train]\nepoch = 3\n"))


def test_duplicate_model_names_are_errors(tmp_path):
    with pytest.raises(ValueError, match="used twice"):
        load_config(write(tmp_path, MINIMAL + MINIMAL))


def test_no_models_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no \\[\\[models\\]\\]"):
        load_config(write(tmp_path, "seed = 1\n"))


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(write(tmp_path, "[train\n"))
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_config(tmp_path / "nope.toml")


def test_default_and_quick_configs_compare_relu_ce_with_qact_watershed():
    for cfg in (default_config(), quick_config()):
        kinds = {(m.activation, m.loss) for m in cfg.models}
        assert {("relu", "cross_entropy"), ("qact", "watershed")} <= kinds
        assert all(set(m.heads) <= set(HEAD_NAMES) for m in cfg.models)
    assert default_config().data.corruptions == []  # all 15 corruptions


def test_every_shipped_config_is_valid():
    shipped = shipped_configs()
    assert {"mnist-c-lenet", "cifar10-c-resnet18", "cifar100-c-resnet18", "tinyimagenet-c-resnet18"} <= set(shipped)
    for name, path in shipped.items():
        cfg = load_config(path)
        assert cfg.models, name


def test_to_dict_roundtrips():
    cfg = default_config()
    again = config_from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


def test_two_views_go_with_instance_discrimination_only():
    ok = config_from_dict(
        {"models": [{"arch": "lenet", "loss": "infonce", "heads": ["knn"], "train": {"two_views": True}}]}
    )
    assert ok.model_train_config(ok.models[0]).two_views is True
    with pytest.raises(ValueError, match=r"key train\.two_views must be true .*'infonce'"):
        config_from_dict({"models": [{"arch": "lenet", "loss": "infonce", "heads": ["knn"]}]})
    with pytest.raises(ValueError, match=r"train\.two_views must be false .*not 'cross_entropy'"):
        config_from_dict({"train": {"two_views": True}, "models": [{"arch": "lenet"}]})


def test_augmix_keys_are_checked_with_the_model_they_train():
    base = {"models": [{"arch": "lenet"}]}
    cfg = config_from_dict({**base, "train": {"augmix": True, "jsd_weight": 12.0}})
    assert cfg.train.augmix and cfg.train.jsd_weight == 12.0 and cfg.train.augmix_suite == ""
    for train, match in (
        ({"jsd_weight": 1.0}, "train.jsd_weight must be 0 without augmix"),
        ({"augmix": True, "augmix_suite": "imagenet-c"}, "train.augmix_suite must be one of"),
        ({"augmix": True, "jsd_weight": -1.0}, "train.jsd_weight must be a finite number >= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            config_from_dict({**base, "train": train})
    embedding_model = [{"arch": "lenet", "loss": "watershed", "heads": ["quantile"]}]
    with pytest.raises(ValueError, match="train.augmix must not be combined with two_views"):
        config_from_dict({"train": {"augmix": True, "two_views": True}, "models": embedding_model})
    with pytest.raises(ValueError, match="the Jensen-Shannon term needs class logits"):
        config_from_dict(
            {
                "train": {"augmix": True, "jsd_weight": 1.0},
                "models": [{"arch": "lenet", "loss": "watershed", "heads": ["quantile"]}],
            }
        )


def test_the_mce_baseline_is_the_relu_softmax_unless_eval_baseline_names_another():
    from shiftguard.commands.config import baseline_key

    assert baseline_key(default_config()) == "lenet-relu-ce/none/softmax"
    two = {
        "models": [
            {"arch": "lenet", "name": "a", "activation": "qact", "loss": "watershed", "heads": ["quantile"]},
            {"arch": "lenet", "name": "b", "heads": ["softmax", "knn"]},
        ]
    }
    assert baseline_key(config_from_dict(two)) == "b/none/softmax"
    assert baseline_key(config_from_dict({**two, "eval": {"baseline": "b/none/knn"}})) == "b/none/knn"
    assert baseline_key(config_from_dict({**two, "eval": {"baseline": "none"}})) is None
    assert baseline_key(config_from_dict({"models": two["models"][:1]})) is None
    for bad, match in (
        ("b/softmax", "eval.baseline must be 'model/context/head'"),
        ("c/none/softmax", "eval.baseline must name a model of this run"),
        ("b/none/quantile", "eval.baseline must name a head of model 'b'"),
    ):
        with pytest.raises(ValueError, match=match):
            config_from_dict({**two, "eval": {"baseline": bad}})


def test_every_train_key_reaches_the_trainer_under_its_own_name():
    """``[train]`` is handed to ``Trainer`` as a whole (``TrainConfig.trainer_kwargs``): a new key is
    a Trainer argument of the same name or one of the run's own settings, never dropped on the way."""
    import dataclasses
    import inspect

    from shiftguard.commands.config import _RUN_SETTINGS, TrainConfig
    from shiftguard.train import Trainer

    cfg = TrainConfig(epochs=3, lr=0.5, augmix=True, jsd_weight=12.0)
    kw = cfg.trainer_kwargs("mnist-c")
    assert set(kw) <= set(inspect.signature(Trainer).parameters)
    assert set(kw) | set(_RUN_SETTINGS) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert (kw["epochs"], kw["lr"], kw["jsd_weight"], kw["augmix_suite"]) == (3, 0.5, 12.0, "mnist-c")
    assert TrainConfig(augmix_suite="cifar-c").trainer_kwargs("mnist-c")["augmix_suite"] is None  # no AugMix
    assert TrainConfig(augmix=True, augmix_suite="cifar-c").trainer_kwargs("mnist-c")["augmix_suite"] == "cifar-c"


def test_every_eval_key_reaches_evaluate_or_is_the_runs_own():
    """``[eval]`` is handed to ``shiftguard.evaluate`` as a whole (``EvalConfig.evaluate_kwargs``):
    each key is an argument of ``evaluate`` (two under their own names there) or one the run
    resolves itself, never dropped on the way."""
    import dataclasses
    import inspect

    import shiftguard
    from shiftguard.commands.config import _RUN_EVAL_SETTINGS, EvalConfig

    kw = EvalConfig(frozen_context=False, conformal_alpha=0.2, k=7).evaluate_kwargs()
    assert set(kw) <= set(inspect.signature(shiftguard.evaluate).parameters)
    renamed = {"frozen_context": "contexts", "conformal_alpha": "alpha"}
    fields = {f.name for f in dataclasses.fields(EvalConfig)}
    assert {renamed.get(f, f) for f in fields} - set(_RUN_EVAL_SETTINGS) == set(kw)
    assert (kw["contexts"], kw["alpha"], kw["k"]) == (("batch",), 0.2, 7)
    assert EvalConfig().evaluate_kwargs()["contexts"] == ("batch", "frozen")
