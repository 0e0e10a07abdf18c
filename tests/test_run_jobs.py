"""``shiftguard run`` trains its models several at once (``[train] jobs``, ``--jobs``): each in a
process of its own, with the same weights as when trained one after the other at that thread count."""

from __future__ import annotations

import json

import pytest
import torch

from shiftguard.cli import main as cli
from shiftguard.commands import config as C
from shiftguard.commands.run import execute, load_data, training_jobs


def _config(jobs: int) -> C.RunConfig:
    return C.config_from_dict(
        {
            "data": {
                "dataset": "mnist-default",
                "train_subset": 300,
                "test_subset": 60,
                "corruptions": ["fog"],
                "severities": [3],
            },
            "train": {"epochs": 2, "batch_size": 50, "jobs": jobs},
            "eval": {"batch_size": 30, "n_boot": 10},
            "models": [
                {"name": "relu", "arch": "lenet", "activation": "relu", "loss": "cross_entropy", "heads": ["softmax"]},
                {"name": "qact", "arch": "lenet", "activation": "qact", "loss": "watershed", "heads": ["quantile"]},
            ],
        }
    )


def _weights(run_dir) -> dict:
    return {m: torch.load(run_dir / "models" / m / "model.pt", weights_only=True) for m in ("relu", "qact")}


def test_models_trained_in_parallel_processes_equal_those_trained_one_after_the_other(tmp_path):
    cfg = _config(jobs=2)
    data = load_data(cfg)
    parallel = execute(cfg, tmp_path / "parallel", torch.device("cpu"), progress=False, log=lambda s: None, data=data)
    assert parallel["timings"]["train_jobs"] == 2
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # each of the two processes trained with 1 thread (threads // jobs, at least 1)
    try:
        serial = execute(
            _config(jobs=1), tmp_path / "serial", torch.device("cpu"), progress=False, log=lambda s: None, data=data
        )
    finally:
        torch.set_num_threads(before)
    assert serial["timings"]["train_jobs"] == 1
    a, b = _weights(tmp_path / "parallel"), _weights(tmp_path / "serial")
    for m in a:
        assert a[m].keys() == b[m].keys() and all(torch.equal(a[m][k], b[m][k]) for k in a[m]), m
    # the training summaries are the workers' own (not those of a load), with their thread count
    for m in ("relu", "qact"):
        s = parallel["training"][m]
        assert "loaded_from_run_dir" not in s and s["threads"] == 1
        assert s["epochs_run"] == serial["training"][m]["epochs_run"]
    assert [r["accuracy"] for r in parallel["rows"]] == [r["accuracy"] for r in serial["rows"]]


def test_how_many_models_train_at_once():
    auto, two = _config(0), _config(2)
    assert training_jobs(auto, "cpu", False, n_models=3, threads=2) == 2
    assert training_jobs(auto, "cpu", False, n_models=3, threads=16) == 3
    assert training_jobs(auto, "cpu", False, n_models=3, threads=1) == 1
    assert training_jobs(auto, "cpu", False, n_models=0, threads=4) == 1
    assert training_jobs(auto, "cuda", False, n_models=3, threads=16) == 1
    assert training_jobs(auto, "cpu", True, n_models=3, threads=16) == 1
    assert training_jobs(two, "cpu", False, n_models=3, threads=1) == 2
    assert training_jobs(_config(1), "cpu", False, n_models=3, threads=16) == 1
    with pytest.raises(ValueError, match=r"train\.jobs = 2: .*CPU only; on device cuda"):
        training_jobs(two, "cuda", False, n_models=3, threads=16)
    with pytest.raises(ValueError, match=r"train\.jobs = 2: .*under torch\.distributed"):
        training_jobs(two, "cpu", True, n_models=3, threads=16)


def test_jobs_is_a_setting_of_the_whole_run_and_a_count():
    raw = _config(0).to_dict()
    raw["models"][0]["train"] = {"jobs": 2}
    with pytest.raises(ValueError, match=r"models\[0\]\.train\.jobs is unknown \(jobs is a setting of the whole run"):
        C.config_from_dict(raw)
    raw = _config(0).to_dict()
    raw["train"]["jobs"] = -1
    with pytest.raises(ValueError, match=r"train\.jobs"):
        C.config_from_dict(raw)


def test_jobs_on_the_command_line(tmp_path, capsys):
    assert cli(["run", "--quick", "--jobs", "-1", "--out", str(tmp_path)]) == 2
    assert "--jobs: expected >= 0" in capsys.readouterr().err


def test_a_run_resumes_with_another_number_of_jobs_but_not_another_configuration(tmp_path):
    from shiftguard.commands.run import _check_run_dir

    _check_run_dir(_config(1), tmp_path, resume=False)  # writes config.json
    assert json.loads((tmp_path / "config.json").read_text())["config"]["train"]["jobs"] == 1
    _check_run_dir(_config(2), tmp_path, resume=True)
    other = _config(2)
    other.train.epochs = 3
    with pytest.raises(ValueError, match=r"train\.epochs: 2 -> 3"):
        _check_run_dir(other, tmp_path, resume=True)
