"""Seeded corruption of every binary format: each damaged file loads validly or fails naming itself."""

from __future__ import annotations

import gzip
import pickle
import random

import numpy as np
import pytest
import torch

from shiftguard.data import load
from shiftguard.data.idx import encode_idx

CASES = 40


def _damage(blob: bytes, rng: random.Random) -> bytes:
    b = bytearray(blob)
    if rng.random() < 0.5:
        return bytes(b[: rng.randrange(len(b))])  # truncation
    head = rng.random() < 0.5  # half the flips hit the header, where they do the most harm
    for _ in range(rng.randint(1, 4)):
        b[rng.randrange(min(64, len(b)) if head else len(b))] = rng.randrange(256)
    return bytes(b)


def _mnist(folder, gz):
    folder.mkdir()
    rng = np.random.default_rng(0)
    files = {
        "t10k-images-idx3-ubyte": encode_idx(rng.integers(0, 256, (6, 28, 28), dtype=np.uint8)),
        "t10k-labels-idx1-ubyte": encode_idx(rng.integers(0, 10, 6).astype(np.uint8)),
    }
    for stem, data in files.items():
        (folder / (stem + (".gz" if gz else ""))).write_bytes(gzip.compress(data) if gz else data)
    return folder / ("t10k-images-idx3-ubyte" + (".gz" if gz else ""))


def _cifar(folder):
    d = folder / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    batch = {
        b"data": rng.integers(0, 256, (5, 3072), dtype=np.uint8),
        b"labels": [1, 2, 3, 4, 5],
        b"batch_label": b"t",
        b"filenames": [b"a"] * 5,
    }
    for name in ["test_batch"] + [f"data_batch_{i}" for i in range(1, 6)]:
        (d / name).write_bytes(pickle.dumps(batch, protocol=2))
    (d / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"x"] * 10}, protocol=2))
    return d / "test_batch"


def _cifar_c(folder):
    folder.mkdir()
    rng = np.random.default_rng(0)
    np.save(folder / "fog.npy", rng.integers(0, 256, (10, 32, 32, 3), dtype=np.uint8))
    np.save(folder / "labels.npy", rng.integers(0, 10, 10))
    return folder / "fog.npy"


FORMATS = {
    "idx-gz": (lambda d: _mnist(d, True), lambda root: load("mnist", "test", root=root)),
    "idx-raw": (lambda d: _mnist(d, False), lambda root: load("mnist", "test", root=root)),
    "cifar-pickle": (_cifar, lambda root: load("cifar10", "test", root=root)),
    "cifar-c-npy": (_cifar_c, lambda root: load("cifar10-c", "test", root=root, corruption="fog", severity=2)),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_damaged_files_fail_with_their_name_or_load_valid_data(tmp_path, fmt):
    make, read = FORMATS[fmt]
    target = make(tmp_path / "data")
    pristine = target.read_bytes()
    rng = random.Random(f"shiftguard-{fmt}")
    outcomes = {"error": 0, "loaded": 0}
    for _ in range(CASES):
        target.write_bytes(_damage(pristine, rng))
        try:
            ds = read(tmp_path / "data")
        except ValueError as exc:
            assert str(target) in str(exc), exc
            outcomes["error"] += 1
        else:  # a flip inside pixel data is legitimately invisible
            assert ds.images.dtype == torch.uint8 and ds.images.dim() == 4
            assert ds.labels.dtype == torch.int64 and len(ds.labels) == len(ds.images)
            assert int(ds.labels.min()) >= 0 and int(ds.labels.max()) < len(ds.classes)
            outcomes["loaded"] += 1
    assert outcomes["error"] >= CASES // 4, outcomes  # the damage is real, not a no-op
