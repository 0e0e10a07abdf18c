"""What can be checked before any work starts is checked then, in one line naming the option, key
or file: devices, normalisation values, seeds, test sets too small to rank, weights with NaN, a
dataset whose length cannot fit in memory, decompression bombs, output paths and report files of
``shiftguard transfer``, learning rates, loss keywords and missing dataset files of a run."""

from __future__ import annotations

import _cli_helpers
import pytest
import torch
from torch import nn

import shiftguard
from shiftguard.cli import main as cli

FACTORY = (
    _cli_helpers.FACTORY
    + """
def make_any(num_classes):
    torch.manual_seed(0)
    return nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, num_classes))
"""
)


@pytest.fixture
def argv(tmp_path, monkeypatch):
    return _cli_helpers.evaluate_argv(tmp_path, monkeypatch, "errnets", "--out", str(tmp_path / "o"), source=FACTORY)


def _one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"shiftguard {command}: error: "), err
    return err[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--random-weights", "--device", "cuda:7"], "--device: 'cuda:7'"),
        (["--random-weights", "--device", "foo"], "--device: not a torch device: 'foo'"),
        (["--random-weights", "--normalize", "nan", "nan"], "--normalize: expected finite numbers"),
        (["--random-weights", "--seed", str(10**20)], "--seed: expected an integer in 0..2**63-1"),
        (["--random-weights", "--test-subset", "3"], "--test-subset: expected more than 5 test images"),
    ],
)
def test_evaluate_options_are_checked_before_any_work(argv, tmp_path, capsys, extra, message):
    assert cli([*argv, *extra]) == 2
    assert message in _one_line(capsys, "evaluate")
    assert not (tmp_path / "o").exists()  # refused before the output folder was made


def test_normalize_given_once_per_channel_or_once(argv, tmp_path, capsys):
    argv[2] = "errnets:make_any"
    pairs = ["--normalize", "0.1", "0.3"] * 3
    assert cli([*argv, "--random-weights", *pairs]) == 2
    assert "--normalize: given 3 times for images of 1 channel(s)" in _one_line(capsys, "evaluate")
    assert not (tmp_path / "o").exists()


def test_weights_holding_nan_are_refused_naming_the_file_and_tensor(argv, tmp_path, capsys):
    import errnets

    net = errnets.make_net(10)
    state = net.state_dict()
    state["1.weight"][0, 0] = float("nan")
    torch.save(state, tmp_path / "w.pt")
    assert cli([*argv, "--weights", str(tmp_path / "w.pt")]) == 2
    assert f"--weights: {tmp_path / 'w.pt'} holds non-finite values (NaN or inf) in '1.weight'" in _one_line(
        capsys, "evaluate"
    )


def test_evaluate_checks_its_device_argument():
    x, y = torch.randint(0, 256, (30, 1, 8, 8), dtype=torch.uint8), torch.arange(30) % 3
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    with pytest.raises(ValueError, match="device: not a torch device: 'gpu0'"):
        shiftguard.evaluate(net, (x, y), heads=["softmax"], device="gpu0")


# --------------------------------------------------------------------------- data
def test_a_dataset_claiming_more_images_than_memory_holds_is_refused_before_allocating():
    from torch.utils.data import Dataset

    from shiftguard.data import as_tensors

    class Huge(Dataset):
        def __len__(self):
            return 10**12

        def __getitem__(self, i):
            return torch.zeros(1, 28, 28, dtype=torch.uint8), 0

    with pytest.raises(ValueError, match=r"test: len\(dataset\) is 1,000,000,000,000: .* more than this machine's"):
        as_tensors(Huge(), name="test")


def test_a_decompression_bomb_in_an_image_folder_names_the_file(tmp_path):
    from PIL import Image

    from shiftguard.data.imagefolder import load_imagefolder

    for c in ("a", "b"):
        (tmp_path / c).mkdir()
    Image.new("L", (8, 8)).save(tmp_path / "a" / "x.png")
    Image.new("1", (20000, 20000)).save(tmp_path / "b" / "bomb.png")  # 400 megapixels, a few kB on disk
    with pytest.raises(ValueError, match=r"bomb\.png: unreadable image \(DecompressionBombError"):
        load_imagefolder(root=tmp_path)


# --------------------------------------------------------------------------- shiftguard transfer
def test_transfer_refuses_a_folder_as_out_before_the_benchmark(tmp_path, capsys, monkeypatch):
    import shiftguard.commands.transfer as T

    monkeypatch.setattr(T, "run_benchmark", lambda *a, **k: pytest.fail("ran although --out cannot be written"))
    assert cli(["transfer", "--out", str(tmp_path)]) == 2
    assert f"--out: {tmp_path} is a folder" in _one_line(capsys, "transfer")


def test_transfer_report_of_a_malformed_file_names_it(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": 5')
    assert cli(["transfer", "--report", str(bad)]) == 2
    assert f"--report: {bad} is not a shiftguard transfer results file" in _one_line(capsys, "transfer")


# --------------------------------------------------------------------------- shiftguard run
BASE = """
[data]
train_subset = 300
test_subset = 100
corruptions = ["fog"]
severities = [1]
[train]
epochs = 1
"""


def test_an_absurd_learning_rate_is_refused_when_the_config_is_read(tmp_path, capsys):
    config = BASE.replace("epochs = 1", "epochs = 1\nlr = 1e30") + '[[models]]\narch = "lenet"\n'
    (tmp_path / "c.toml").write_text(config)
    assert cli(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "runs")]) == 2
    assert "key train.lr must be a finite number in (0, 10], got 1e+30" in _one_line(capsys, "run")


def test_a_training_that_diverges_is_one_line():
    from shiftguard.cli import is_user_error
    from shiftguard.train import Trainer

    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    x, y = torch.randint(0, 256, (32, 1, 8, 8), dtype=torch.uint8), torch.arange(32) % 3

    def nan_loss(out, target):
        return out.sum() * float("nan")

    with pytest.raises(FloatingPointError, match="the training diverged .* lower the learning rate") as info:
        Trainer(net, nan_loss, loss_on="logits", epochs=1, batch_size=16, progress=False).fit(x, y, x, y)
    assert is_user_error(info.value)


@pytest.mark.parametrize(
    "models, message",
    [
        (
            '[[models]]\narch = "lenet"\nloss = "watershed"\nloss_kwargs = {bogus = 1}\nheads = ["quantile"]\n',
            "loss 'watershed': .*bogus",
        ),
    ],
)
def test_model_tables_are_checked_before_the_run_directory_exists(tmp_path, capsys, models, message):
    import re

    (tmp_path / "c.toml").write_text(BASE + models)
    assert cli(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "runs"), "--name", "x"]) == 2
    assert re.search(message, _one_line(capsys, "run"))
    assert not (tmp_path / "runs" / "x").exists()


def test_missing_dataset_files_end_the_run_before_its_directory_exists(tmp_path, capsys):
    config = BASE.replace("[data]", f'[data]\ndataset = "fashion-mnist"\nroot = "{tmp_path / "nowhere"}"')
    (tmp_path / "c.toml").write_text(config + '[[models]]\narch = "lenet"\n')
    assert cli(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "runs"), "--name", "x"]) == 2
    assert "fashion-mnist: expected files" in _one_line(capsys, "run")
    assert not (tmp_path / "runs" / "x").exists()


def test_official_corrupted_sets_asked_for_but_absent_end_the_run_before_its_directory_exists(
    tmp_path, capsys, mnist_dir
):
    config = BASE.replace("[data]", f'[data]\ndataset = "mnist"\nroot = "{mnist_dir}"\ncorrupted_source = "official"')
    (tmp_path / "c.toml").write_text(config + '[[models]]\narch = "lenet"\n')
    assert cli(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "runs"), "--name", "x"]) == 2
    assert "mnist-c: expected files" in _one_line(capsys, "run")
    assert not (tmp_path / "runs" / "x").exists()
