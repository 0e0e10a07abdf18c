"""``evaluate(device=...)`` keeps what the model computes on the device, checked on a fake accelerator.

:mod:`_fake_device` makes ``torch.device("meta")`` behave like a GPU whose memory is the CPU's: an
operation mixing it with a CPU tensor fails as on CUDA, ``.numpy()`` of it fails, and every copy or
scalar read back to the host is recorded. An evaluation on it must give the CPU evaluation's numbers
(with the CPU-only fast paths switched off on the CPU side, so both sides run the same arithmetic),
and the only per-image data that comes back is each head's per-image results; the outputs
(logits, embeddings), which heads are fitted and scored on, never do. ``tests/test_cuda.py`` runs
the same evaluation on a real GPU where there is one.
"""

from __future__ import annotations

import pytest
import torch
from _fake_device import DEVICE, DeviceTensor, FakeDevice

import shiftguard
from shiftguard.heads.registry import HEAD_NAMES
from shiftguard.models import build_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")

N = 60  # test images


@pytest.fixture
def same_arithmetic(monkeypatch):
    """The CPU takes the device's code paths: QACT's eager torch code instead of its compiled CPU
    kernels, ``torch.topk`` instead of the compiled kNN selection (they differ among tied distances,
    which QACT's quantised embeddings have), and a seed's KDE draws as off the CPU (the comb offsets
    from the seed itself instead of from a CPU generator seeded with it)."""
    import shiftguard.functional.quantile as quantile
    import shiftguard.neighbors.select as select

    monkeypatch.setattr(quantile, "USE_COMPILED", False)
    monkeypatch.setattr(select, "scan_applies", lambda block, k: False)
    monkeypatch.setattr(quantile, "_draws_of_seed", lambda seed, device: seed.to(device))


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (N + 80, 1, 28, 28), dtype=torch.uint8, generator=g)
    y = torch.arange(N + 80) % 4
    return (x[:N], y[:N]), (x[N : N + 40], y[N : N + 40]), (x[N + 40 :], y[N + 40 :])


def _models():
    torch.manual_seed(0)
    return {
        "qact": build_model("lenet", num_classes=4, activation="qact"),
        "twin": build_model("lenet", num_classes=4, activation="bn-relu-bn"),
    }


def _per_image_matrices(reads) -> list:
    """Copies to the host of a tensor with one row per image (or per batch of images): outputs,
    embeddings, images. The per-image results come back as one ``(3, N)`` block per head and cell."""
    return [r for r in reads if r.kind == "copy" and len(r.shape) >= 2 and r.shape[0] > 3]


def test_the_fake_device_refuses_what_a_gpu_refuses_and_records_what_comes_back():
    with FakeDevice() as fd:
        a = torch.ones(3, 2).to(DEVICE)
        assert isinstance(a, DeviceTensor) and a.device == DEVICE
        with pytest.raises(RuntimeError, match="same device"):
            a + torch.ones(3, 2)
        assert (a + torch.tensor(1.0)).device == DEVICE  # a 0-dim CPU scalar is allowed, as on CUDA
        with pytest.raises((RuntimeError, TypeError)):
            a.numpy()
        r = torch.rand(2, generator=torch.Generator(device=DEVICE).manual_seed(0), device=DEVICE)
        assert r.device == DEVICE and torch.tensor([1.0], device=DEVICE).device == DEVICE
        assert float(a.sum()) == 6.0
        assert torch.equal(a.cpu(), torch.ones(3, 2)) and a.tolist() == [[1.0, 1.0]] * 3
    assert [(h.kind, h.shape) for h in fd.host_reads] == [("scalar", ()), ("copy", (3, 2)), ("copy", (3, 2))]
    # the rule the evaluation is held to sees a batch of outputs copied back
    with FakeDevice() as fd:
        torch.ones(20, 84).to(DEVICE).cpu()
    assert _per_image_matrices(fd.host_reads)


@pytest.mark.parametrize(
    "name, heads, adapt",
    [
        # every head, and TENT: a backward pass and an optimiser step on the device
        ("twin", list(HEAD_NAMES), ["none", "tent:steps=1"]),
        # QACT in its batch and frozen contexts; its eager path (its device path) is slow on the
        # fake device, so one head and the static arm
        ("qact", ["knn"], ["none"]),
    ],
)
def test_evaluate_on_a_device_gives_the_cpu_numbers_and_brings_back_only_per_image_results(
    same_arithmetic, name, heads, adapt
):
    test, support, validation = _data()
    model = _models()[name]
    kw = dict(
        support=support,
        validation=validation,
        corruptions=["shot_noise"],
        severities=[5],
        heads=heads,
        adapt=adapt,
        conformal=["lac", "aps"],
        n_boot=10,
        batch_size=20,
        k=3,
    )
    cpu = shiftguard.evaluate(model, test, **kw)
    with FakeDevice() as fd:
        dev = shiftguard.evaluate(model, test, device=DEVICE, **kw)
    assert len(dev.rows) == len(cpu.rows) > 0
    assert dev.rows == cpu.rows
    assert dev.results["aggregates"] == cpu.results["aggregates"]
    assert {(r["head"], r["adaptation"]) for r in dev.rows} == {(h, a.split(":")[0]) for h in heads for a in adapt}
    if name == "qact":
        assert {r["context"] for r in dev.rows} == {"batch", "frozen"}
    assert not _per_image_matrices(fd.host_reads)
    # the caller's model stays where it was
    assert all(p.device.type == "cpu" and not isinstance(p, DeviceTensor) for p in model.parameters())


def test_device_data_attacks_weighted_sets_and_the_cache_on_a_device(same_arithmetic, tmp_path):
    """Test images on the device: corrupted and attacked there. The weighted sets' likelihood ratio
    is scikit-learn's, on the host (the features are copied); the cache holds host copies, and a
    resumed evaluation reads them back onto the device."""
    test, support, validation = _data()
    model = _models()["twin"]
    kw = dict(
        corruptions=["fog"],
        severities=[2],
        heads=["softmax", "knn", "temperature"],
        conformal=["lac"],
        conformal_weighted=True,
        attacks=["fgsm"],
        attack_eps=[2 / 255],
        n_boot=10,
        batch_size=20,
        k=3,
    )
    cpu = shiftguard.evaluate(model, test, support=support, validation=validation, **kw)
    with FakeDevice() as fd:
        on = [tuple(t.to(DEVICE) for t in part) for part in (test, support, validation)]
        first = shiftguard.evaluate(
            model, on[0], support=on[1], validation=on[2], device=DEVICE, cache_dir=tmp_path / "c", **kw
        )
        computed = len(fd.host_reads)
        again = shiftguard.evaluate(
            model, on[0], support=on[1], validation=on[2], device=DEVICE, cache_dir=tmp_path / "c", **kw
        )
    assert first.rows == again.rows
    assert [(r["corruption"], r["head"]) for r in first.rows] == [(r["corruption"], r["head"]) for r in cpu.rows]
    for a, b in zip(cpu.rows, first.rows):
        # corruption noise and the attack's start are drawn from the images' device generator
        if a["corruption"] == "clean":
            assert a == b
    assert {r.where.split(":")[0] for r in _per_image_matrices(fd.host_reads[:computed])} <= {
        "evaluation/cache.py",  # the data's digests (the cache's fingerprint) and the files it writes
        "conformal/weighted.py",  # the likelihood-ratio regression (scikit-learn)
    }
    files = sorted((tmp_path / "c").rglob("*.pt"))
    assert files and all(
        t.device.type == "cpu" for f in files for t in torch.load(f, weights_only=True).values() if t is not None
    )


def test_the_grid_waits_for_a_gpu_before_reading_the_clock(monkeypatch):
    """The steps' seconds (``timings``) are read after the device's queued kernels are done, so
    that a step's GPU time is not counted in the next step that reads a result back."""
    from shiftguard.evaluation import grid

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    grid._clock(torch.device("cuda", 0))
    grid._clock(torch.device("cpu"))
    assert calls == [torch.device("cuda", 0)]
