"""``shiftguard corrupt`` / ``shiftguard gallery`` and the writer behind them: the files land in the
official layouts, read back through ``shiftguard.data.load`` to exactly what ``corrupt`` gives,
and the manifest's checksums match."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shiftguard import corruptions as C
from shiftguard.cli import main as cli
from shiftguard.commands.corrupt import sub_seed, write_corrupted
from shiftguard.corruptions.figures import synthetic_scene
from shiftguard.io import sha256_file

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # conftest.py


def _digits(n=24):
    x = synthetic_scene(n, 28, seed=1)[:, :1]
    y = torch.arange(n) % 10
    return x, y


def test_mnist_layout_reads_back_through_the_loader(tmp_path):
    from shiftguard.data import load

    x, y = _digits()
    xt, yt = _digits(12)
    write_corrupted(
        {"test": (x, y), "train": (xt, yt)}, tmp_path, "mnist-c", [1, 3], 5, ["fog", "stripe"], progress=False
    )
    for sev in (1, 3):
        for name in ("fog", "stripe"):
            ds = load("mnist-c", "test", root=tmp_path / f"severity-{sev}", corruption=name)
            want = C.corrupt(x, name, sev, seed=sub_seed(5, "mnist-c", name, sev), suite="mnist-c")
            assert torch.equal(ds.images, want)
            assert torch.equal(ds.labels, y)
            tr = np.load(tmp_path / f"severity-{sev}" / name / "train_images.npy")
            assert tr.shape == (12, 28, 28, 1) and tr.dtype == np.uint8


def test_cifar_layout_is_the_cifar10c_release_format(tmp_path):
    from shiftguard.data import load

    x = synthetic_scene(10, 32, seed=2)
    y = torch.arange(10)
    write_corrupted({"test": (x, y)}, tmp_path, "cifar-c", [1, 2, 3, 4, 5], 0, ["contrast", "snow"], progress=False)
    arr = np.load(tmp_path / "snow.npy")
    assert arr.shape == (50, 32, 32, 3) and arr.dtype == np.uint8
    assert np.load(tmp_path / "labels.npy").shape == (50,)
    ds = load("cifar10-c", "test", root=tmp_path, corruption="snow", severity=4)
    assert torch.equal(ds.images, C.corrupt(x, "snow", 4, seed=sub_seed(0, "cifar-c", "snow", 4), suite="cifar-c"))
    assert torch.equal(ds.labels, y)


def test_manifest_lists_every_file_with_its_sha256(tmp_path):
    x, y = _digits(8)
    m = write_corrupted({"test": (x, y)}, tmp_path, "mnist-c", [2], 0, ["rotate"], progress=False)
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk["files"] == m["files"] and len(m["files"]) == 2
    for rel, digest in m["files"].items():
        assert sha256_file(tmp_path / rel) == digest
    assert on_disk["seed"] == 0 and on_disk["severities"] == [2] and "shiftguard_version" in on_disk


def test_a_second_seed_changes_the_random_corruptions_only(tmp_path):
    x, y = _digits(8)
    a = write_corrupted({"test": (x, y)}, tmp_path / "a", "mnist-c", [3], 0, ["shot_noise", "scale"], progress=False)
    b = write_corrupted({"test": (x, y)}, tmp_path / "b", "mnist-c", [3], 1, ["shot_noise", "scale"], progress=False)
    assert a["files"]["severity-3/shot_noise/test_images.npy"] != b["files"]["severity-3/shot_noise/test_images.npy"]
    assert a["files"]["severity-3/scale/test_images.npy"] == b["files"]["severity-3/scale/test_images.npy"]


def test_cifar_layout_refuses_two_splits(tmp_path):
    x, y = _digits(4)
    with pytest.raises(ValueError, match="one split"):
        write_corrupted({"test": (x, y), "train": (x, y)}, tmp_path, "cifar-c", [1], 0, ["fog"], progress=False)


def test_unknown_corruption_subset_is_rejected(tmp_path):
    x, y = _digits(4)
    with pytest.raises(ValueError, match="--corruptions.*frost"):
        write_corrupted({"test": (x, y)}, tmp_path, "mnist-c", [1], 0, ["frost"], progress=False)


def test_cli_corrupt_on_the_embedded_mnist(tmp_path, capsys):
    rc = cli(["corrupt", "--dataset", "mnist-embedded", "--out", str(tmp_path), "--limit", "16",
              "--corruptions", "zigzag,canny_edges", "--severities", "3", "--threads", "1"])  # fmt: skip
    assert rc == 0
    arr = np.load(tmp_path / "severity-3" / "zigzag" / "test_images.npy")
    assert arr.shape == (16, 28, 28, 1)
    assert "wrote 4 files" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["0", "1,7", "1,1", "a"])
def test_cli_rejects_bad_severities_with_exit_code_2(tmp_path, bad, capsys):
    rc = cli(["corrupt", "--dataset", "mnist-embedded", "--out", str(tmp_path), "--severities", bad])
    assert rc == 2
    assert "--severities" in capsys.readouterr().err


def test_cli_gallery_writes_a_png(tmp_path):
    out = tmp_path / "g.png"
    rc = cli(["gallery", "--dataset", "synthetic", "--suite", "cifar-c-extra", "--out", str(out), "--dpi", "40"])
    assert rc == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _grid(fig) -> tuple[list[str], list[str]]:
    """The gallery's row (corruption) and column (severity) labels."""
    (ax,) = fig.axes
    return [t.get_text() for t in ax.get_yticklabels()], [t.get_text() for t in ax.get_xticklabels()]


def test_gallery_function_returns_one_row_per_corruption_and_six_columns():
    import matplotlib.pyplot as plt

    from shiftguard.corruptions import corrupt

    scene = synthetic_scene(2, 32)
    fig = C.gallery(scene, "cifar-c-extra", index=1)
    rows, cols = _grid(fig)
    assert rows == list(C.names("cifar-c-extra")) and cols == ["clean"] + [f"severity {s}" for s in range(1, 6)]
    # every cell shows the image at that corruption and severity
    mosaic = fig.axes[0].get_images()[0].get_array()
    gap = 32 // 8
    for i, name in enumerate(rows):
        for j, sev in enumerate(range(6)):
            want = corrupt(scene[1:2], name, sev, seed=0, suite="cifar-c-extra")[0].float() / 255
            top, left = gap + i * (32 + gap), gap + j * (32 + gap)
            got = torch.as_tensor(mosaic[top : top + 32, left : left + 32]).permute(2, 0, 1).float()
            assert torch.allclose(got, want, atol=1e-6), (name, sev)
    plt.close(fig)


def test_gallery_without_suite_resolves_names_by_channel_count():
    import matplotlib.pyplot as plt

    fig = C.gallery(synthetic_scene(1, 32), names=["zoom_blur", "fog"], severities=(0, 3))
    assert _grid(fig) == (["zoom_blur", "fog"], ["clean", "severity 3"])
    plt.close(fig)
    fig = C.gallery(synthetic_scene(1, 28)[:, :1], severities=(0, 5))  # grey: the MNIST-C suite
    assert len(_grid(fig)[0]) == 15 and _grid(fig)[1] == ["clean", "severity 5"]
    plt.close(fig)
