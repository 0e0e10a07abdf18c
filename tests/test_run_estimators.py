"""``[[models]] estimator = ...``: a run config trains an uncertainty estimator with its own
objective and evaluates it like any model; bad estimator keys are one clear error."""

from __future__ import annotations

import json

import pytest

from shiftguard.cli import main as cli
from shiftguard.commands import config as C

TOML = """
name = "est"
seed = 0
[data]
dataset = "mnist-default"
train_subset = 400
test_subset = 100
corruptions = ["shot_noise"]
severities = [2]
[train]
epochs = 1
batch_size = 64
[eval]
batch_size = 100
k = 5
n_boot = 10
[[models]]
arch = "lenet"
model_kwargs = {width = 1}
estimator = "sngp"
estimator_kwargs = {num_features = 64}
heads = ["softmax", "knn"]
[[models]]
arch = "lenet"
model_kwargs = {width = 1}
estimator = "Deep-Ensemble"
estimator_kwargs = {num_members = 3}
heads = ["softmax"]
"""


def test_a_config_trains_and_evaluates_estimators(tmp_path):
    cfg = tmp_path / "est.toml"
    cfg.write_text(TOML)
    assert cli(["run", "--config", str(cfg), "--out", str(tmp_path), "--no-progress"]) == 0
    res = json.loads((tmp_path / "est" / "results.json").read_text())
    names = {r["model"] for r in res["rows"]}
    assert names == {"lenet-relu-sngp", "lenet-relu-ensemble"}
    sngp_rows = [r for r in res["rows"] if r["model"] == "lenet-relu-sngp"]
    assert {r["head"] for r in sngp_rows} == {"softmax", "knn"}
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in res["rows"])
    summary = json.loads((tmp_path / "est" / "models" / "lenet-relu-sngp" / "model.json").read_text())
    assert summary["loss_on"] == "model"
    # the SNGP posterior was fitted on the training data after training (saved with the weights)
    import torch

    state = torch.load(tmp_path / "est" / "models" / "lenet-relu-sngp" / "model.pt", weights_only=True)
    counts = [v for k, v in state.items() if k.endswith("num_covariance_samples")]
    assert counts and int(counts[0]) == 320  # 80% of the 400 training images


@pytest.mark.parametrize(
    "models, message",
    [
        ({"estimator": "sngpp"}, r"models\[0\]\.estimator: unknown estimator 'sngpp'.*sngp"),
        ({"estimator": "sngp", "loss": "watershed"}, r"models\[0\]\.loss: an estimator \('sngp'\)"),
        ({"estimator_kwargs": {"rate": 0.1}}, r"models\[0\]\.estimator_kwargs is set but"),
    ],
)
def test_bad_estimator_keys_are_named(models, message):
    with pytest.raises(ValueError, match=message):
        C.config_from_dict({"models": [{"arch": "lenet", **models}]})


def test_an_unknown_estimator_keyword_is_caught_before_training(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(TOML.replace("num_members = 3", "num_member = 3"))
    assert cli(["run", "--config", str(cfg), "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "num_member" in err and "ensemble" in err
    assert not (tmp_path / "est").exists()
