"""CIFAR-10 / CIFAR-100 python-version pickles: official layout, pixel order, restricted unpickling."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest
import torch

from shiftguard.data import load
from shiftguard.data.cifar import CIFAR100_CLASSES, CIFAR100_COARSE_CLASSES, safe_unpickle

CIFAR10_NAMES = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]


def _batch(n, seed, label_key=b"labels", num_classes=10, extra=None):
    rng = np.random.default_rng(seed)
    d = {
        b"batch_label": f"batch {seed}".encode(),
        label_key: [int(x) for x in rng.integers(0, num_classes, n)],
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        b"filenames": [f"img_{seed}_{i}.png".encode() for i in range(n)],
    }
    d.update(extra or {})
    return d


def _dump(path, obj, protocol=2):
    path.write_bytes(pickle.dumps(obj, protocol=protocol))


def write_cifar10(root, n=4, protocol=2):
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    batches = {}
    for i in range(1, 6):
        batches[f"data_batch_{i}"] = _batch(n, i)
    batches["test_batch"] = _batch(n, 99)
    for name, b in batches.items():
        _dump(d / name, b, protocol)
    _dump(d / "batches.meta", {b"label_names": CIFAR10_NAMES, b"num_cases_per_batch": n, b"num_vis": 3072}, protocol)
    return d, batches


def write_cifar100(root, n=6):
    d = root / "cifar-100-python"
    d.mkdir(parents=True)
    out = {}
    for split, seed in (("train", 1), ("test", 2)):
        rng = np.random.default_rng(seed + 10)
        b = _batch(n, seed, b"fine_labels", 100, {b"coarse_labels": [int(x) for x in rng.integers(0, 20, n)]})
        _dump(d / split, b)
        out[split] = b
    _dump(
        d / "meta",
        {
            b"fine_label_names": [c.encode() for c in CIFAR100_CLASSES],
            b"coarse_label_names": [c.encode() for c in CIFAR100_COARSE_CLASSES],
        },
    )
    return d, out


# -- a byte-level Python 2 pickle, as the official files are ------------------------------------


def _py2_str(b: bytes) -> bytes:  # SHORT_BINSTRING / BINSTRING: a Python 2 str
    return (b"U" + bytes([len(b)]) if len(b) < 256 else b"T" + struct.pack("<i", len(b))) + b


def _py2_int(v: int) -> bytes:
    return b"K" + bytes([v]) if 0 <= v < 256 else b"J" + struct.pack("<i", v)


def py2_cifar_pickle(data: np.ndarray, labels: list[int]) -> bytes:
    """Protocol-2 opcodes as Python 2's cPickle wrote the CIFAR batches (numpy.core path, str keys)."""
    n = data.shape[0]
    dtype = (
        b"cnumpy\ndtype\n"
        + _py2_str(b"u1")
        + _py2_int(0)
        + _py2_int(1)
        + b"\x87R"
        + b"("
        + _py2_int(3)
        + _py2_str(b"|")
        + b"NNN"
        + _py2_int(-1)
        + _py2_int(-1)
        + _py2_int(0)
        + b"tb"
    )
    array = (
        b"cnumpy.core.multiarray\n_reconstruct\n"
        + b"cnumpy\nndarray\n"
        + _py2_int(0)
        + b"\x85"
        + _py2_str(b"b")
        + b"\x87R"
        + b"("
        + _py2_int(1)
        + _py2_int(n)
        + b"M\x00\x0c"
        + b"\x86"
        + dtype
        + b"\x89"
        + _py2_str(data.tobytes())
        + b"tb"
    )
    labels_op = b"]" + b"(" + b"".join(_py2_int(v) for v in labels) + b"e"
    return (
        b"\x80\x02}("
        + _py2_str(b"data")
        + array
        + _py2_str(b"labels")
        + labels_op
        + _py2_str(b"batch_label")
        + _py2_str(b"testing batch 1 of 1")
        + b"u."
    )


# -- tests ----------------------------------------------------------------------------------------


def test_cifar10_train_concatenates_five_batches_in_order(tmp_path):
    _, batches = write_cifar10(tmp_path)
    ds = load("cifar10", "train", root=tmp_path)
    assert ds.images.shape == (20, 3, 32, 32) and ds.images.dtype == torch.uint8
    want = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    assert np.array_equal(ds.images.reshape(20, -1).numpy(), want)
    assert ds.labels.tolist() == sum((batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])
    assert ds.classes[0] == "airplane" and len(ds.classes) == 10


def test_cifar10_pixel_layout_is_rgb_planes_row_major(tmp_path):
    _, batches = write_cifar10(tmp_path)
    ds = load("cifar10", "test", root=tmp_path)
    row = batches["test_batch"][b"data"][2]
    for c, y, x in [(0, 0, 0), (1, 5, 7), (2, 31, 30)]:
        assert int(ds.images[2, c, y, x]) == int(row[c * 1024 + y * 32 + x])


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_loads_pickles_of_every_protocol(tmp_path, protocol):
    _, batches = write_cifar10(tmp_path, protocol=protocol)
    ds = load("cifar10", "test", root=tmp_path)
    assert ds.labels.tolist() == batches["test_batch"][b"labels"]


def test_cifar10_loads_a_python2_style_pickle(tmp_path):
    d, _ = write_cifar10(tmp_path)
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, size=(3, 3072), dtype=np.uint8)
    (d / "test_batch").write_bytes(py2_cifar_pickle(data, [7, 0, 9]))
    ds = load("cifar10", "test", root=tmp_path)
    assert ds.labels.tolist() == [7, 0, 9]
    assert np.array_equal(ds.images.reshape(3, -1).numpy(), data)


def test_cifar10_root_may_be_the_batches_folder_itself(tmp_path):
    d, _ = write_cifar10(tmp_path)
    assert len(load("cifar10", "test", root=d)) == 4


def test_cifar100_fine_and_coarse_labels(tmp_path):
    _, b = write_cifar100(tmp_path)
    fine = load("cifar100", "test", root=tmp_path)
    coarse = load("cifar100", "test", root=tmp_path, label_mode="coarse")
    assert fine.labels.tolist() == b["test"][b"fine_labels"] and len(fine.classes) == 100
    assert coarse.labels.tolist() == b["test"][b"coarse_labels"] and len(coarse.classes) == 20
    assert fine.classes == CIFAR100_CLASSES and coarse.classes == CIFAR100_COARSE_CLASSES
    assert len(set(CIFAR100_CLASSES)) == 100 and CIFAR100_CLASSES == sorted(CIFAR100_CLASSES)


def test_cifar100_rejects_unknown_label_mode(tmp_path):
    write_cifar100(tmp_path)
    with pytest.raises(ValueError, match="label_mode"):
        load("cifar100", "test", root=tmp_path, label_mode="medium")


class _Evil:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


class _EvalEvil:
    def __reduce__(self):
        return (eval, ("__import__('os').getcwd()",))


def test_malicious_pickle_is_refused_and_never_executed(tmp_path):
    d, _ = write_cifar10(tmp_path)
    marker = tmp_path / "pwned"
    evil = _batch(4, 99)
    evil[b"filenames"] = _Evil(f"touch {marker}")
    _dump(d / "test_batch", evil)
    with pytest.raises(ValueError) as err:
        load("cifar10", "test", root=tmp_path)
    msg = str(err.value)
    assert str(d / "test_batch") in msg and "unsafe pickle refused" in msg and "system" in msg
    assert not marker.exists()


def test_pickle_calling_builtins_eval_is_refused(tmp_path):
    p = tmp_path / "batch"
    _dump(p, {b"data": _EvalEvil()})
    with pytest.raises(ValueError, match=r"batch: unsafe pickle refused: refused global (__builtin__|builtins)\.eval"):
        safe_unpickle(p)


def test_truncated_pickle_names_the_file(tmp_path):
    d, _ = write_cifar10(tmp_path)
    p = d / "data_batch_3"
    p.write_bytes(p.read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"data_batch_3: corrupt or truncated pickle"):
        load("cifar10", "train", root=tmp_path)


def test_label_out_of_range_names_the_file(tmp_path):
    d, batches = write_cifar10(tmp_path)
    b = batches["test_batch"]
    b[b"labels"][1] = 10
    _dump(d / "test_batch", b)
    with pytest.raises(ValueError, match=r"test_batch: label 10 at index 1 is out of range 0\.\.9"):
        load("cifar10", "test", root=tmp_path)


def test_label_count_mismatch_names_the_file(tmp_path):
    d, batches = write_cifar10(tmp_path)
    b = batches["test_batch"]
    b[b"labels"] = b[b"labels"][:3]
    _dump(d / "test_batch", b)
    with pytest.raises(ValueError, match=r"test_batch: 3 labels for 4 images"):
        load("cifar10", "test", root=tmp_path)


def test_wrong_data_shape_names_the_file(tmp_path):
    d, batches = write_cifar10(tmp_path)
    b = batches["test_batch"]
    b[b"data"] = b[b"data"][:, :100]
    _dump(d / "test_batch", b)
    with pytest.raises(ValueError, match=r"test_batch: 'data' must be a uint8 array \(N, 3072\)"):
        load("cifar10", "test", root=tmp_path)


def test_missing_batch_lists_the_expected_files(tmp_path):
    d, _ = write_cifar10(tmp_path)
    (d / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_4"):
        load("cifar10", "train", root=tmp_path)
    assert len(load("cifar10", "test", root=tmp_path)) == 4  # the test split does not need it
