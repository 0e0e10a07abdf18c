"""``shiftguard run`` usability: user architectures, re-runnable names, resume diffs, config-name
suggestions, progress output in logs, the QACT compile step."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from shiftguard._progress import progress
from shiftguard.cli import main as cli
from shiftguard.commands import config as C
from shiftguard.commands import run as R
from shiftguard.models import build_model

USER_MODULE = '''
import torch
from torch import nn


def plain(num_classes):
    """No embed(): usable with cross-entropy only."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8), nn.ReLU(), nn.Linear(8, num_classes))


class Small(nn.Module):
    """embed() / classifier split, no embedding_dim attribute."""

    def __init__(self, num_classes, in_channels, width=4):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_channels, width, 5, stride=4), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.classifier = nn.Linear(4 * width, num_classes)

    def embed(self, x):
        return self.features(x)

    def forward(self, x):
        return self.classifier(self.embed(x))


def with_activation(num_classes, activation="relu"):
    model = plain(num_classes)
    model.activation_seen = activation
    return model


def everything(**kwargs):
    model = plain(kwargs["num_classes"])
    model.kwargs_seen = kwargs
    return model


def not_a_module(num_classes):
    return {"num_classes": num_classes}


NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user module ``<name>.py`` written to ``tmp_path`` and importable (sys.path); its name."""
    name = f"usermodels_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


# --------------------------------------------------------------------------- build_model("pkg.mod:factory")
def test_user_factory_gets_the_arguments_its_signature_accepts(user_module):
    model = build_model(f"{user_module}:Small", num_classes=3, in_channels=2, width=6)
    assert model.features[0].in_channels == 2 and model.features[0].out_channels == 6
    assert model(torch.zeros(2, 2, 28, 28)).shape == (2, 3)
    plain = build_model(f"{user_module}:plain", num_classes=5, in_channels=7)  # takes num_classes only
    assert plain(torch.zeros(2, 1, 28, 28)).shape == (2, 5)


def test_user_factory_with_var_keywords_gets_every_argument(user_module):
    model = build_model(f"{user_module}:everything", activation="selu", num_classes=4, in_channels=3, extra=1)
    assert model.kwargs_seen == {"num_classes": 4, "in_channels": 3, "activation": "selu", "extra": 1}


def test_user_factory_taking_activation_builds_it_itself(user_module):
    model = build_model(f"{user_module}:with_activation", activation="qact", num_classes=3)
    assert model.activation_seen == "qact"
    assert not any(type(m).__name__ == "QuantileActivation" for m in model.modules())


def test_user_model_without_activation_argument_is_converted_to_qact(user_module):
    pytest.importorskip("shiftguard.nn.convert", reason="shiftguard.nn.convert_activations not available")
    example = torch.rand(4, 1, 28, 28) * 2 - 1
    model = build_model(f"{user_module}:Small", activation="qact", num_classes=3, in_channels=1, example_input=example)
    assert any(type(m).__name__ == "QuantileActivation" for m in model.modules())
    assert not any(isinstance(m, nn.ReLU) for m in model.modules())
    # the new layers exist before an optimizer is built: they are in model.parameters() now
    n_params = sum(p.numel() for p in model.parameters())
    model.train()
    model(example).sum().backward()
    assert sum(p.numel() for p in model.parameters()) == n_params


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{mod}", "arch: unknown model"),  # no colon: not a registered name either
        ("{mod}:", "arch '{mod}:': expected"),
        (":plain", "arch ':plain': expected"),
        ("no_such_module_xq:plain", "cannot import module 'no_such_module_xq'"),
        ("{mod}:missing", "has no attribute 'missing'"),
        ("{mod}:NOT_CALLABLE", "not a callable"),
        ("{mod}:not_a_module", "returned a dict, expected a torch.nn.Module"),
    ],
)
def test_bad_factory_specs_are_errors_naming_arch(user_module, spec, message):
    spec, message = spec.format(mod=user_module), message.format(mod=user_module)
    with pytest.raises(ValueError, match="arch") as info:
        build_model(spec, num_classes=3)
    assert message in str(info.value)


def test_factory_rejecting_model_kwargs_names_arch_and_the_arguments(user_module):
    with pytest.raises(ValueError, match=r"arch .*Small.*does not take.*depth"):
        build_model(f"{user_module}:Small", num_classes=3, depth=2)


def test_factory_module_is_found_in_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_models_zz.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert isinstance(build_model("cwd_models_zz:plain", num_classes=3), nn.Module)
        assert str(tmp_path) not in sys.path  # added for the import only
    finally:
        sys.modules.pop("cwd_models_zz", None)


def test_default_model_name_of_a_factory_is_a_valid_run_name(user_module):
    cfg = C.config_from_dict({"models": [{"arch": f"{user_module}:Small", "loss": "cross_entropy"}]})
    assert cfg.models[0].name == f"{user_module}.Small-relu-crossentropy"


# --------------------------------------------------------------------------- the CLI with a user architecture
def _tiny_config(path, arch, *, heads='["logistic"]', loss="cross_entropy", name="tiny"):
    path.write_text(
        textwrap.dedent(f"""
        name = "{name}"
        [data]
        train_subset = 120
        test_subset = 40
        corruptions = ["shot_noise"]
        severities = [1]
        [train]
        epochs = 2
        batch_size = 32
        early_stopping_patience = 0
        [eval]
        batch_size = 40
        frozen_context = false
        n_boot = 10
        [[models]]
        name = "user-ce"
        arch = "{arch}"
        loss = "cross_entropy"
        heads = {heads}
        [[models]]
        name = "user-emb"
        arch = "{arch}"
        loss = "{loss}"
        heads = ["knn"]
    """)
    )
    return path


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """One run of a user architecture (two tiny models, 2 epochs, 1 corruption x 1 severity) into a
    run directory left by a run that failed before its first checkpoint; stdout/stderr captured
    (not a terminal)."""
    tmp = tmp_path_factory.mktemp("user")
    (tmp / "tiny_user_models.py").write_text(USER_MODULE)
    cfg = _tiny_config(tmp / "tiny.toml", "tiny_user_models:Small", loss="watershed")
    out = tmp / "runs"
    (out / "tiny" / "models" / "user-ce" / "checkpoints").mkdir(parents=True)
    (out / "tiny" / "config.json").write_text('{"config": {}, "source": "earlier"}')
    sys.path.insert(0, str(tmp))
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = cli(["run", "--config", str(cfg), "--out", str(out), "--threads", "1", "--no-progress"])
    finally:
        sys.path.remove(str(tmp))
        sys.modules.pop("tiny_user_models", None)
    return {
        "rc": rc,
        "dir": out / "tiny",
        "config": cfg,
        "out": out,
        "tmp": tmp,
        "stdout": stdout.getvalue(),
        "stderr": stderr.getvalue(),
    }


@pytest.fixture
def in_user_dir(user_run, monkeypatch):
    """The working directory is the one holding the user module (found there, not on sys.path)."""
    monkeypatch.chdir(user_run["tmp"])
    yield user_run
    sys.modules.pop("tiny_user_models", None)


def test_a_user_architecture_runs_end_to_end(user_run):
    assert user_run["rc"] == 0, user_run["stderr"]
    assert (user_run["dir"] / "COMPLETE").is_file()
    results = json.loads((user_run["dir"] / "results.json").read_text())
    assert {"user-ce", "user-emb"} <= {r["model"] for r in results["rows"]}


def test_a_run_dir_holding_only_config_json_is_reused_with_one_line(user_run):
    lines = [ln for ln in user_run["stdout"].splitlines() if "reusing run directory" in ln]
    assert len(lines) == 1 and "before its first checkpoint" in lines[0]
    stored = json.loads((user_run["dir"] / "config.json").read_text())
    assert stored["config"]["models"][0]["arch"] == "tiny_user_models:Small"  # replaced by this run's


def test_training_prints_one_line_per_epoch_and_no_carriage_return_off_a_terminal(user_run):
    out = user_run["stdout"] + user_run["stderr"]
    assert "\r" not in out
    for model in ("user-ce", "user-emb"):
        epochs = [ln for ln in out.splitlines() if ln.startswith(f"{model} epoch ")]
        assert [ln.split()[2] for ln in epochs] == ["1/2:", "2/2:"], epochs
        assert all("loss=" in ln and "val_acc=" in ln and "lr=" in ln and ln.endswith(" s") for ln in epochs)


def test_a_run_dir_with_a_checkpoint_is_refused(in_user_dir, tmp_path, capsys):
    user_run = in_user_dir
    d = tmp_path / "runs" / "tiny"
    (d / "models" / "user-ce" / "checkpoints").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "models" / "user-ce" / "checkpoints" / "epoch-0001.pt").write_bytes(b"x")
    rc = cli(["run", "--config", str(user_run["config"]), "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "already exists" in err[0] and "--resume" in err[0]


def test_resume_with_a_changed_config_names_the_keys_that_differ(in_user_dir, tmp_path, capsys):
    user_run = in_user_dir
    changed = _tiny_config(
        tmp_path / "changed.toml", "tiny_user_models:Small", heads='["logistic", "knn"]', loss="watershed"
    )
    rc = cli(["run", "--config", str(changed), "--out", str(user_run["out"]), "--resume", "--epochs", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "train.epochs: 2 -> 3" in err[0]
    assert 'models[0].heads: ["logistic"] -> ["logistic", "knn"]' in err[0]


def test_user_model_without_embed_and_an_embedding_loss_is_refused_at_preflight(user_module, tmp_path, capsys):
    cfg = _tiny_config(tmp_path / "c.toml", f"{user_module}:plain", loss="watershed")
    rc = cli(["run", "--config", str(cfg), "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "'user-emb'" in err[0] and "'watershed'" in err[0] and "embed(x)" in err[0]
    assert not (tmp_path / "runs").exists()  # refused before anything was written


# --------------------------------------------------------------------------- config names, diffs
def test_a_mistyped_shipped_config_name_lists_the_names_and_suggests_the_closest(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(["run", "--config", "mnist-c-lenat"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'mnist-c-lenet'?" in err
    assert all(name in err for name in C.shipped_configs())


def test_config_diff_lists_dotted_paths_of_changed_added_and_removed_entries():
    old = {"seed": 0, "train": {"epochs": 8}, "models": [{"name": "a", "heads": ["knn"]}]}
    new = {"seed": 0, "train": {"epochs": 10}, "models": [{"name": "a", "heads": ["ned"]}, {"name": "b"}]}
    assert C.config_diff(old, new) == [
        "train.epochs: 8 -> 10",
        'models[0].heads: ["knn"] -> ["ned"]',
        'models[1]: (absent) -> {"name": "b"}',
    ]
    assert C.config_diff(new, new) == []


# --------------------------------------------------------------------------- progress, epoch lines
def test_progress_off_a_terminal_prints_about_ten_plain_lines():
    stream = io.StringIO()
    with progress(95, "evaluate", unit="cell", stream=stream) as bar:
        for _ in range(95):
            bar.update(1, info="m/batch")
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert 9 <= len(lines) <= 11 and lines[-1].startswith("evaluate: 95/95 cell (100%)")
    assert lines[0].startswith("evaluate: 10/95 cell") and lines[0].endswith("m/batch")


def test_progress_close_prints_a_count_not_yet_printed_and_disabled_prints_nothing():
    stream = io.StringIO()
    bar = progress(100, "x", stream=stream)
    bar.update(3)
    bar.close()
    assert stream.getvalue().splitlines() == [stream.getvalue().splitlines()[0]]
    assert stream.getvalue().startswith("x: 3/100 it (3%)")
    quiet = io.StringIO()
    with progress(10, "x", enabled=False, stream=quiet) as bar:
        bar.update(10)
    with progress(10, "x", lines=False, stream=quiet) as bar:
        bar.update(10)
    assert quiet.getvalue() == ""


def test_progress_validates_total_and_line_every():
    with pytest.raises(ValueError, match="total"):
        progress(-1)
    with pytest.raises(ValueError, match="line_every"):
        progress(5, line_every=0)


def _fit(capsys, **kw):
    from shiftguard.train import Trainer

    torch.manual_seed(0)
    x = torch.randint(0, 256, (64, 1, 4, 4), dtype=torch.uint8)
    y = torch.arange(64) % 2
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 2))
    Trainer(model, epochs=3, batch_size=16, early_stopping_patience=0, desc="m", **kw).fit(x, y, x, y, num_classes=2)
    return capsys.readouterr()


def test_trainer_log_prints_one_line_per_epoch_even_without_progress(capsys):
    out = _fit(capsys, progress=False, log=True)
    lines = out.out.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["m epoch 1/3", "m epoch 2/3", "m epoch 3/3"]
    assert "\r" not in out.out + out.err


def test_trainer_without_progress_and_log_is_silent_as_before(capsys):
    out = _fit(capsys, progress=False)
    assert out.out == "" and out.err == ""


def test_trainer_log_callable_receives_the_epoch_lines(capsys):
    got = []
    _fit(capsys, progress=False, log=got.append)
    assert len(got) == 3 and all("val_acc=" in ln for ln in got)
    with pytest.raises(ValueError, match="log"):
        _fit(capsys, log="yes")


# --------------------------------------------------------------------------- kernel compile step
def _cfg(activation, source="auto", suite="mnist-c", loss="cross_entropy"):
    return C.config_from_dict(
        {
            "models": [{"arch": "lenet", "activation": activation, "loss": loss}],
            "data": {"corrupted_source": source, "suite": suite},
        }
    )


def test_compile_step_is_announced_with_its_duration_when_slow(monkeypatch, capsys):
    import shiftguard.corruptions as K
    import shiftguard.functional as F
    import shiftguard.functional.pool as P
    import shiftguard.neighbors as NB

    monkeypatch.setattr(F, "warm_up", lambda: (time.sleep(1.3), 1.3)[1])
    monkeypatch.setattr(K, "warm_up", lambda **kw: 0.25)
    monkeypatch.setattr(NB, "warm_up", lambda: 0.05)
    monkeypatch.setattr(P, "warm_up", lambda: 0.1)
    assert R.compile_kernels(_cfg("qact"), "cpu") == pytest.approx(1.7)
    assert capsys.readouterr().out == "compiling kernels (first use) ... 1.7 s\n"


def test_compile_step_warms_what_the_run_calls_and_is_silent_when_fast(monkeypatch, capsys):
    import shiftguard.corruptions as K
    import shiftguard.functional as F
    import shiftguard.functional.pool as P
    import shiftguard.losses.watershed as W
    import shiftguard.neighbors as NB

    qact, corrupt, search, pools = [], [], [], []
    monkeypatch.setattr(F, "warm_up", lambda: qact.append(1) or 0.01)
    monkeypatch.setattr(K, "warm_up", lambda **kw: corrupt.append(kw) or 0.02)
    monkeypatch.setattr(NB, "warm_up", lambda: search.append(1) or 0.004)
    monkeypatch.setattr(P, "warm_up", lambda: pools.append(1) or 0.0005)
    assert R.compile_kernels(_cfg("qact"), "cpu") == pytest.approx(0.0345)
    # no QACT: the corruptions, the search and the pooling only
    assert R.compile_kernels(_cfg("relu", suite="cifar-c"), "cpu") == pytest.approx(0.0245)
    # corrupted sets read from disk: the search and the pooling only
    assert R.compile_kernels(_cfg("relu", source="official"), "cpu") == pytest.approx(0.0045)
    # on a GPU the pooling is torch's: its CPU pass is not compiled
    assert R.compile_kernels(_cfg("relu", source="official"), "cuda") == pytest.approx(0.004)
    assert qact == [1] and search == [1, 1, 1, 1] and pools == [1, 1, 1]
    forest = []
    monkeypatch.setattr(W, "warm_up", lambda: forest.append(1) or 0.001)
    assert R.compile_kernels(_cfg("qact", loss="watershed"), "cpu") == pytest.approx(0.0355)
    assert forest == [1] and qact == [1, 1]
    assert corrupt == [
        {"dtypes": (torch.uint8,), "suites": ("mnist-c",)},
        {"dtypes": (torch.uint8,), "suites": ("cifar-c",)},
        {"dtypes": (torch.uint8,), "suites": ("mnist-c",)},
    ]
    assert capsys.readouterr().out == ""


def test_corruption_warm_up_names_a_bad_suite():
    import shiftguard.corruptions as K

    with pytest.raises(ValueError, match="suites"):
        K.warm_up(suites=("imagenet-c",))


def test_warm_up_compiles_what_a_qact_model_then_uses():
    from shiftguard.functional import _qact_cpu, warm_up

    if not _qact_cpu.AVAILABLE:
        pytest.skip("numba is not installed: nothing to compile")
    assert warm_up() >= 0.0

    def signatures():  # of every compiled kernel, in each stage module of the package
        stages = (_qact_cpu.sort, _qact_cpu.quantiles, _qact_cpu.output, _qact_cpu.kde, _qact_cpu.fused)
        return {
            (m.__name__, n): set(getattr(m, n).signatures)
            for m in stages
            for n in dir(m)
            if hasattr(getattr(m, n), "signatures")
        }

    before = signatures()
    model = build_model("lenet", activation="qact", num_classes=3, in_channels=1)
    x = torch.randn(12, 1, 28, 28)
    model.train()
    model(x).sum().backward()
    model.eval()
    with torch.no_grad():
        model(x)
    assert signatures() == before  # nothing new was compiled
