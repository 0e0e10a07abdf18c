"""One naming rule and one list syntax at every entry point.

Corruption, suite, head and adaptation-arm names match ignoring case, ``-``, ``_`` and spaces in
``corrupt``, ``shiftguard.evaluate``, run configs and the command line, and every result carries
the registered name; every list option of every subcommand takes space- and comma-separated
values alike; ``gallery`` and ``corrupt`` find data as ``run`` does and say what to pass on the
command line; progress written to a log is whole lines, never a carriage return.
"""

from __future__ import annotations

import argparse
import importlib
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shiftguard
from shiftguard import corruptions as C
from shiftguard.cli import COMMANDS
from shiftguard.cli import main as cli
from shiftguard.commands.arguments import ListAction
from shiftguard.commands.config import config_from_dict, default_config
from shiftguard.evaluation.adaptation import AdaptSpec, adapt_specs
from shiftguard.heads.registry import canonical_head

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # conftest.py

SPELLINGS = ("motion_blur", "Motion-Blur", "motion blur", "MOTION_BLUR", "  Motion  Blur ")


# ----------------------------------------------------------------------------------------- the registry
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_of_a_corruption_resolves_to_its_registered_name(spelling):
    assert C.canonical_name(spelling) == "motion_blur"
    assert C.canonical_name(spelling, "CIFAR C") == "motion_blur"
    assert C.get(spelling, channels=1).suite == "mnist-c"


def test_suites_heads_and_arms_follow_the_same_rule():
    assert [C.canonical_suite(s) for s in ("MNIST_C", "mnist c", "Cifar-C-Extra")] == [
        "mnist-c",
        "mnist-c",
        "cifar-c-extra",
    ]
    assert C.names("CIFAR C") == C.names("cifar-c")
    assert [canonical_head(h) for h in ("Distance Ratio", "DISTANCE-RATIO", "1 NN", "Softmax")] == [
        "distance_ratio",
        "distance_ratio",
        "1nn",
        "softmax",
    ]
    assert [AdaptSpec.parse(a).label for a in ("BN_Batch", "bn batch", "Tent:steps=2")] == [
        "bn-batch",
        "bn-batch",
        "tent:steps=2",
    ]
    assert AdaptSpec("BN", prior=4).name == "bn"


def test_one_arm_in_two_spellings_is_listed_twice():
    with pytest.raises(ValueError, match="adapt: 'bn-batch' listed more than once"):
        adapt_specs(["bn-batch", "BN batch"])


@pytest.mark.parametrize(
    "lookup, argument",
    [
        (lambda: C.canonical_name("motion blr"), "name"),
        (lambda: C.canonical_name("zoom blur", "mnist-c", argument="corruptions"), "corruptions"),
        (lambda: C.canonical_suite("imagenet c"), "suite"),
        (lambda: canonical_head("distance ratios"), "heads"),
        (lambda: AdaptSpec.parse("bn batches"), "adapt"),
    ],
)
def test_an_unknown_name_is_one_line_naming_the_argument_and_the_valid_names(lookup, argument):
    with pytest.raises(ValueError) as info:
        lookup()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{argument}: unknown ") and "expected one of" in msg, msg


def test_corrupt_takes_any_spelling_and_gives_the_same_pixels():
    x = torch.randint(0, 256, (3, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ref = C.corrupt(x, "motion_blur", 3, seed=1)
    for spelling in SPELLINGS:
        assert torch.equal(C.corrupt(x, spelling, 3, seed=1, suite="MNIST C"), ref), spelling


# ----------------------------------------------------------------------------------------- evaluate()
class _TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten())
        self.out = nn.Linear(64, 3)

    def forward(self, x):
        return self.out(F.relu(self.features(x)))


def _data(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.rand(n, 1, 16, 16, generator=g) * 90
    x[:, :, :8] += (y == 1).view(-1, 1, 1, 1) * 120.0
    x[:, :, :, :8] += (y == 2).view(-1, 1, 1, 1) * 120.0
    return x.clamp(0, 255).to(torch.uint8), y


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return _TinyCNN().eval()


def test_evaluate_rows_are_identical_whatever_the_spelling(model):
    kw = dict(support=_data(60, seed=1), severities=[2], n_boot=10)
    ref = shiftguard.evaluate(
        model, _data(), suite="mnist-c", corruptions=["motion_blur", "fog"], heads=["softmax", "distance_ratio"], **kw
    )
    res = shiftguard.evaluate(
        model, _data(), suite="MNIST C", corruptions=["Motion-Blur", "FOG"], heads=["Softmax", "Distance Ratio"], **kw
    )
    assert res.rows == ref.rows
    assert {r["corruption"] for r in res.rows} == {"clean", "motion_blur", "fog"}
    assert {r["head"] for r in res.rows} == {"softmax", "distance_ratio"}
    assert res.results["data"]["suite"] == "mnist-c"
    assert res.results["data"]["corruptions"] == ["motion_blur", "fog"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(corruptions=["Fog", "fog"]), "corruptions: listed more than once: 'fog'"),
        (dict(heads=["softmax", "SOFTMAX"]), "heads: listed more than once: 'softmax'"),
    ],
)
def test_evaluate_finds_a_repeat_across_spellings(model, kwargs, match):
    kw = {**dict(heads=["softmax"], corruptions=["fog"], severities=[1]), **kwargs}
    with pytest.raises(ValueError, match=match):
        shiftguard.evaluate(model, _data(), **kw)


# ----------------------------------------------------------------------------------------- run configs
def _raw(**data):
    raw = default_config().to_dict()
    raw["data"].update(data)
    return raw


def test_a_config_records_registered_names():
    raw = _raw(suite="MNIST_C", corruptions=["Fog", "motion blur", "SHOT-NOISE"])
    raw["models"][0]["heads"] = ["Softmax", "Distance Ratio"]
    raw["train"]["augmix_suite"] = "Mnist C"
    cfg = config_from_dict(raw)
    assert cfg.data.suite == "mnist-c" and cfg.train.augmix_suite == "mnist-c"
    assert cfg.data.corruptions == ["fog", "motion_blur", "shot_noise"]
    assert cfg.models[0].heads == ["softmax", "distance_ratio"]


@pytest.mark.parametrize(
    "corruptions, match",
    [
        (["Fog", "fog"], r"key data\.corruptions must list each corruption once \('fog' repeated\)"),
        (["zoom blur"], r"key data\.corruptions has unknown corruption 'zoom blur' for suite 'mnist-c'"),
    ],
)
def test_a_config_refuses_repeats_and_unknown_names_in_one_line(corruptions, match):
    with pytest.raises(ValueError, match=match) as info:
        config_from_dict(_raw(corruptions=corruptions))
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------- the command line
def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"shiftguard {command}")
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return parser


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_list_option_of_every_subcommand_takes_spaces_and_commas(command):
    for action in _parser(command)._actions:
        if action.option_strings and action.nargs == "+":
            assert isinstance(action, ListAction), f"shiftguard {command} {action.option_strings[0]}"


@pytest.mark.parametrize(
    "command, flag",
    [
        ("evaluate", "--corruptions"),
        ("corrupt", "--corruptions"),
        ("evaluate", "--heads"),
        ("evaluate", "--conformal"),
        ("run", "--conformal"),
        ("corrupt", "--split"),
    ],
)
def test_space_and_comma_separated_values_give_the_same_list(command, flag):
    parser = _parser(command)
    required = {"evaluate": ["--model", "m:f", "--out", "o"], "corrupt": ["--out", "o"]}.get(command, [])
    dest = flag.lstrip("-").replace("-", "_")
    lists = [
        getattr(parser.parse_args([*required, flag, *values]), dest)
        for values in (["fog", "zoom-blur"], ["fog,zoom-blur"], ["fog,", "zoom-blur"], ["fog, zoom-blur"])
    ]
    assert lists == [["fog", "zoom-blur"]] * 4


def test_the_command_line_and_the_library_agree_on_corruption_names():
    parser = _parser("evaluate")
    a = parser.parse_args(["--model", "m:f", "--out", "o", "--corruptions", "fog,zoom-blur"]).corruptions
    b = parser.parse_args(["--model", "m:f", "--out", "o", "--corruptions", "fog", "zoom_blur"]).corruptions
    assert [C.canonical_name(c) for c in a] == [C.canonical_name(c) for c in b] == ["fog", "zoom_blur"]


def test_integer_lists_and_arm_options_split_the_same_way():
    evaluate = _parser("evaluate")
    assert evaluate.parse_args(["--model", "m:f", "--out", "o", "--severities", "1,3", "5"]).severities == [1, 3, 5]
    run = _parser("run")
    assert run.parse_args(["--adapt", "none,tent:lr=0.001,steps=2", "bn:prior=16"]).adapt == [
        "none",
        "tent:lr=0.001,steps=2",
        "bn:prior=16",
    ]
    assert run.parse_args(["--adapt", "none", "tent:lr=0.001,steps=2"]).adapt == ["none", "tent:lr=0.001,steps=2"]


def test_suite_choices_take_any_spelling():
    assert _parser("corrupt").parse_args(["--out", "o", "--suite", "CIFAR_C+Extra"]).suite == "cifar-c+extra"
    assert _parser("gallery").parse_args(["--suite", "Mnist C"]).suite == "mnist-c"


def test_corrupt_writes_registered_names_and_a_log_without_carriage_returns(tmp_path, capsys):
    rc = cli(
        [
            "corrupt",
            "--dataset",
            "mnist-embedded",
            "--out",
            str(tmp_path),
            "--limit",
            "8",
            "--threads",
            "1",
            "--corruptions",
            "Motion Blur,FOG",
            "--severities",
            "2",
            "4",
        ]
    )
    assert rc == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["corruptions"] == ["motion_blur", "fog"] and manifest["severities"] == [2, 4]
    assert (tmp_path / "severity-4" / "motion_blur" / "test_images.npy").is_file()
    captured = capsys.readouterr()
    assert "\r" not in captured.out + captured.err
    progress = [line for line in captured.err.splitlines() if line.startswith("corrupt: ")]
    assert len(progress) == 4 and progress[-1].startswith("corrupt: 4/4 file")  # one line per file


def test_toy_progress_in_a_log_is_whole_lines(capsys):
    assert cli(["toy", "--steps", "10", "--contexts", "2", "--batch-size", "8", "--hidden", "4", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.out + captured.err
    assert captured.err.splitlines()[-1].startswith("toy (relu, qact): 20/20 step")


def test_gallery_runs_offline_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("SHIFTGUARD_DATA", str(tmp_path / "empty"))
    out = tmp_path / "g.png"
    assert cli(["gallery", "--out", str(out), "--dpi", "20"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("command", ["gallery", "corrupt"])
def test_missing_data_is_one_line_of_command_line_advice(tmp_path, monkeypatch, capsys, command):
    monkeypatch.setenv("SHIFTGUARD_DATA", str(tmp_path / "empty"))
    assert cli([command, "--dataset", "fashion-mnist", "--out", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"shiftguard {command}: error: fashion-mnist: expected files"), err
    assert str(tmp_path / "empty" / "fashion-mnist") in err[0]
    assert "--root" in err[0] and "SHIFTGUARD_DATA" in err[0]
    assert "download=True" not in err[0] and "root=" not in err[0].replace("--root", "")


@pytest.mark.parametrize("command", ["gallery", "corrupt"])
def test_gallery_and_corrupt_read_shiftguard_data_as_run_does(mnist_dir, tmp_path, monkeypatch, capsys, command):
    monkeypatch.setenv("SHIFTGUARD_DATA", str(mnist_dir.parent))
    argv = (
        [command, "--dataset", "mnist", "--out", str(tmp_path / "g.png"), "--dpi", "20"]
        if command == "gallery"
        else [
            command,
            "--dataset",
            "mnist",
            "--out",
            str(tmp_path),
            "--limit",
            "4",
            "--corruptions",
            "fog",
            "--severities",
            "1",
            "--no-progress",
        ]
    )
    assert cli(argv) == 0, capsys.readouterr().err


def test_run_without_its_data_names_the_config_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHIFTGUARD_DATA", str(tmp_path / "empty"))
    cfg = tmp_path / "c.toml"
    cfg.write_text('[data]\ndataset = "fashion-mnist"\n[[models]]\narch = "lenet"\n', encoding="utf-8")
    assert cli(["run", "--config", str(cfg), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "fashion-mnist: expected files" in err[0], err
    assert "set data.root to the folder" in err[0] and "SHIFTGUARD_DATA" in err[0]
    assert "download=True" not in err[0] and "--root" not in err[0]
