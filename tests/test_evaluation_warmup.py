"""``shiftguard.evaluate`` compiles its kernels in a step of its own (``evaluation.warmup``): recorded
as ``timings["compile_s"]``, announced with ``progress`` when slow, and covering what the grid then
calls (nothing new is compiled after it)."""

from __future__ import annotations

import importlib
import time

import pytest
import torch

import shiftguard
from shiftguard.corruptions import _kernels as corruption_kernels
from shiftguard.evaluation import warmup as W
from shiftguard.functional import _qact_cpu
from shiftguard.models import build_model
from shiftguard.neighbors import select


def _signatures():
    out = {}
    qact_stages = (_qact_cpu.sort, _qact_cpu.quantiles, _qact_cpu.output, _qact_cpu.kde, _qact_cpu.fused)
    for module in (*qact_stages, corruption_kernels, select):
        for name in dir(module):
            sigs = getattr(getattr(module, name), "signatures", None)
            if sigs is not None:
                out[(module.__name__, name)] = set(sigs)
    return out


def _data(n=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=gen), torch.arange(n) % 3


def test_the_compile_step_covers_what_an_evaluation_of_a_qact_model_calls():
    if not _qact_cpu.AVAILABLE:
        pytest.skip("numba is not installed: nothing to compile")
    torch.manual_seed(0)
    model = build_model("lenet", activation="qact", num_classes=3, in_channels=1).eval()
    x, y = _data()
    corruptions = [("motion_blur", 2, "mnist-c"), ("canny_edges", 2, "mnist-c")]
    for step in W.evaluation_steps([model], torch.device("cpu"), corruptions, x):
        assert step() >= 0.0
    before = _signatures()
    res = shiftguard.evaluate(
        model,
        (x, y),
        support=_data(seed=1),
        corruptions=["motion_blur", "canny_edges"],
        severities=[2, 5],
        heads=["softmax", "knn"],
        n_boot=10,
        batch_size=12,
    )
    assert _signatures() == before  # nothing new was compiled in the timed phases
    assert res.results["timings"]["compile_s"] >= 0.0


def test_the_steps_follow_the_models_the_device_and_the_corruptions(monkeypatch):
    import shiftguard.functional as F
    import shiftguard.neighbors as NB

    calls = []
    monkeypatch.setattr(
        F, "warm_up", lambda dtype, evaluation_only=False: calls.append((dtype, evaluation_only)) or 0.0
    )
    monkeypatch.setattr(NB, "warm_up", lambda: calls.append("search") or 0.0)
    qact = build_model("lenet", activation="qact", num_classes=3, in_channels=1)
    relu = build_model("lenet", activation="relu", num_classes=3, in_channels=1)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert len(W.evaluation_steps([relu], cpu)) == 1  # the search only
    assert len(W.evaluation_steps([relu, qact], cpu)) == 2
    assert len(W.evaluation_steps([qact.double()], cpu, [("fog", 1, "mnist-c")], _data()[0])) == 3
    assert len(W.evaluation_steps([qact], cuda)) == 1  # QACT on a GPU runs torch's code
    for step in W.evaluation_steps([relu, qact.float()], cpu):
        step()
    assert calls == [(torch.float32, True), "search"]


def test_compile_announced_prints_a_slow_step_list_once_with_its_duration(capsys):
    assert W.compile_announced([lambda: (time.sleep(1.2), 1.2)[1], lambda: 0.1]) == pytest.approx(1.3)
    assert capsys.readouterr().out == "compiling kernels (first use) ... 1.3 s\n"
    assert W.compile_announced([lambda: 0.01]) == pytest.approx(0.01)
    assert W.compile_announced([lambda: (time.sleep(1.2), 1.2)[1]], announce=False) == pytest.approx(1.2)
    assert capsys.readouterr().out == ""


def test_a_failing_step_ends_the_announcement_and_raises(capsys):
    def fail():
        time.sleep(1.2)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        W.compile_announced([fail])
    assert capsys.readouterr().out == "compiling kernels (first use) ... failed\n"


def test_evaluate_announces_its_compile_step_with_progress(monkeypatch, capsys):
    evaluate_module = importlib.import_module("shiftguard.evaluation.evaluate")
    monkeypatch.setattr(evaluate_module, "evaluation_steps", lambda *a, **k: [lambda: (time.sleep(1.1), 1.1)[1]])
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 3))
    x, y = _data()
    res = shiftguard.evaluate(
        net, (x, y), corruptions=["fog"], severities=[1], heads=["softmax"], n_boot=10, progress=True
    )
    assert "compiling kernels (first use) ... 1.1 s" in capsys.readouterr().out
    assert res.results["timings"]["compile_s"] == pytest.approx(1.1)
