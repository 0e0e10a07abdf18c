"""MNIST / Fashion-MNIST IDX loading: real files, the byte format, root resolution, bad files."""

from __future__ import annotations

import gzip
import shutil
import struct

import numpy as np
import pytest
import torch

from shiftguard.data import load
from shiftguard.data.idx import encode_idx, parse_idx

MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]  # shared/data/README.md
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


# -- real data ------------------------------------------------------------------------------------


def test_real_mnist_test_split_shapes_counts_and_mean(mnist_dir):
    ds = load("mnist", "test", root=mnist_dir)
    assert ds.images.shape == (10000, 1, 28, 28) and ds.images.dtype == torch.uint8
    assert ds.labels.shape == (10000,) and ds.labels.dtype == torch.int64
    assert ds.class_counts().tolist() == MNIST_TEST_COUNTS
    assert ds.images.double().mean().item() == pytest.approx(33.7912, abs=1e-4)
    assert ds.classes == [str(i) for i in range(10)] and ds.name == "mnist" and ds.split == "test"


def test_real_mnist_train_split_counts_and_mean(mnist_dir):
    ds = load("mnist", "train", root=mnist_dir)
    assert ds.images.shape == (60000, 1, 28, 28)
    assert ds.class_counts().tolist() == MNIST_TRAIN_COUNTS
    assert ds.images.double().mean().item() == pytest.approx(33.3184, abs=1e-4)


def test_real_fashion_mnist_test_split(fashion_mnist_dir):
    ds = load("fashion-mnist", "test", root=fashion_mnist_dir)
    assert ds.images.shape == (10000, 1, 28, 28)
    assert ds.class_counts().tolist() == [1000] * 10
    assert ds.images.double().mean().item() == pytest.approx(73.2945, abs=1e-4)
    assert ds.classes[0] == "T-shirt/top" and ds.classes[9] == "Ankle boot"


def test_root_may_be_the_parent_folder_holding_mnist(mnist_dir):
    ds = load("mnist", "test", root=mnist_dir.parent)  # finds <root>/mnist/
    assert len(ds) == 10000


def test_uncompressed_idx_files_load_identically(mnist_dir, tmp_path):
    for stem in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (tmp_path / stem).write_bytes(gzip.decompress((mnist_dir / f"{stem}.gz").read_bytes()))
    a = load("mnist", "test", root=tmp_path)
    b = load("mnist", "test", root=mnist_dir)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


# -- the byte format ------------------------------------------------------------------------------


def test_parse_idx_matches_a_hand_built_file():
    # magic 0x00000803 (uint8, 3 dims), dims 2 x 2 x 3, then 12 bytes row-major
    raw = struct.pack(">BBBBIII", 0, 0, 0x08, 3, 2, 2, 3) + bytes(range(12))
    arr = parse_idx(raw)
    assert arr.dtype == np.uint8 and arr.shape == (2, 2, 3)
    assert arr[1, 0, 2] == 1 * 6 + 0 * 3 + 2


def test_parse_idx_reads_big_endian_wider_types():
    raw = struct.pack(">BBBBI", 0, 0, 0x0C, 1, 3) + struct.pack(">iii", -1, 258, 2**30)
    assert parse_idx(raw).tolist() == [-1, 258, 2**30]


def test_encode_idx_round_trips():
    for arr in (np.arange(24, dtype=np.uint8).reshape(2, 3, 4), np.array([1.5, -2.0], dtype=np.float32)):
        out = parse_idx(encode_idx(arr))
        assert out.dtype == arr.dtype and np.array_equal(out, arr)


# -- root resolution ------------------------------------------------------------------------------


def _tiny_mnist(folder, n=5, labels=None, gz=True):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = np.arange(n, dtype=np.uint8) % 10 if labels is None else np.asarray(labels, dtype=np.uint8)
    for stem, arr in (("t10k-images-idx3-ubyte", images), ("t10k-labels-idx1-ubyte", labels)):
        data = encode_idx(arr)
        if gz:
            (folder / f"{stem}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / stem).write_bytes(data)
    return images, labels


def test_env_var_root_is_used_with_dataset_subfolder(tmp_path, monkeypatch):
    images, _ = _tiny_mnist(tmp_path / "mnist")
    monkeypatch.setenv("SHIFTGUARD_DATA", str(tmp_path))
    ds = load("mnist", "test")
    assert torch.equal(ds.images[:, 0], torch.from_numpy(images))


def test_explicit_root_beats_env_var(tmp_path, monkeypatch):
    _tiny_mnist(tmp_path / "env" / "mnist", n=3)
    _tiny_mnist(tmp_path / "explicit", n=4)
    monkeypatch.setenv("SHIFTGUARD_DATA", str(tmp_path / "env"))
    assert len(load("mnist", "test", root=tmp_path / "explicit")) == 4


def test_cache_dir_is_the_fallback(tmp_path, monkeypatch):
    _tiny_mnist(tmp_path / "shiftguard" / "fashion-mnist", n=6)
    monkeypatch.delenv("SHIFTGUARD_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert len(load("fashion-mnist", "test")) == 6


def test_missing_files_error_lists_expected_files_and_folders(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load("mnist", "test", root=tmp_path)
    msg = str(err.value)
    assert "t10k-images-idx3-ubyte.gz" in msg and "t10k-labels-idx1-ubyte.gz" in msg
    assert str(tmp_path) in msg and str(tmp_path / "mnist") in msg and "download=True" in msg


# -- bad files ------------------------------------------------------------------------------------


def test_truncated_gzip_names_the_file(mnist_dir, tmp_path):
    shutil.copy(mnist_dir / "t10k-labels-idx1-ubyte.gz", tmp_path)
    data = (mnist_dir / "t10k-images-idx3-ubyte.gz").read_bytes()
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz.*(corrupt|truncated)"):
        load("mnist", "test", root=tmp_path)


def test_gzip_with_flipped_payload_byte_names_the_file(tmp_path):
    _tiny_mnist(tmp_path)
    p = tmp_path / "t10k-images-idx3-ubyte.gz"
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz"):
        load("mnist", "test", root=tmp_path)


def test_wrong_magic_number_names_the_file(tmp_path):
    _tiny_mnist(tmp_path, gz=False)
    # a labels file where the images file should be
    shutil.copy(tmp_path / "t10k-labels-idx1-ubyte", tmp_path / "t10k-images-idx3-ubyte")
    with pytest.raises(
        ValueError,
        match=r"t10k-images-idx3-ubyte: wrong IDX magic number 0x00000801, "
        r"expected 0x00000803",
    ):
        load("mnist", "test", root=tmp_path)


def test_truncated_raw_idx_names_the_file(tmp_path):
    _tiny_mnist(tmp_path, gz=False)
    p = tmp_path / "t10k-images-idx3-ubyte"
    p.write_bytes(p.read_bytes()[:-7])
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte: truncated"):
        load("mnist", "test", root=tmp_path)


def test_image_label_count_mismatch_names_the_file(tmp_path):
    _tiny_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(encode_idx(np.zeros(4, np.uint8))))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: holds 4 labels but .* 5 images"):
        load("mnist", "test", root=tmp_path)


def test_label_out_of_range_names_the_file(tmp_path):
    _tiny_mnist(tmp_path, labels=[0, 1, 10, 3, 4])
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: label 10 at index 2 is out of range"):
        load("mnist", "test", root=tmp_path)


def test_gz_name_without_gzip_content_is_refused(tmp_path):
    _tiny_mnist(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz: named \.gz but is not a gzip file"):
        load("mnist", "test", root=tmp_path)


def test_unknown_split_is_refused(mnist_dir):
    with pytest.raises(ValueError, match="split"):
        load("mnist", "val", root=mnist_dir)
