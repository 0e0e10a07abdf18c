"""Hostile data files: a file can cost no more memory than it holds or declares, and extraction
never deletes or replaces what was already on disk.

* CIFAR pickles: the restricted unpickler accepts only the calls numpy writes for an array, and every
  array is built from bytes present in the file (declared ``shape x itemsize`` == payload length).
  A few bytes can neither claim a large array nor expose uninitialised memory.
* gzip IDX files are streamed: the header's declared size is checked first (against ``max_bytes``
  and against what deflate can expand the file to), exactly that many bytes are read, and data
  beyond them is refused without decompressing it (memory bounded by the declared size).
* ``extract_archive`` merges the unpacked archive into an existing folder: new files move in,
  identical files are kept, a differing file is a conflict that changes nothing.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import tarfile
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shiftguard.data import download as dl
from shiftguard.data import load
from shiftguard.data.cifar import safe_unpickle
from shiftguard.data.idx import encode_idx, parse_idx, read_idx

_COMMON = dict(
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FEW = settings(max_examples=15, **_COMMON)

MiB = 1 << 20


def peak_bytes(fn):
    """``(result or raised exception, peak traced bytes)`` of ``fn()``; numpy reports its buffers to
    tracemalloc, so a large array or bytes object shows here."""
    tracemalloc.start()
    try:
        try:
            out = fn()
        except Exception as exc:  # returned, so the caller can assert on it after measuring
            out = exc
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------------------------------------------
# CIFAR pickles, written opcode by opcode as Python 2's cPickle wrote the official files (protocol 2)


def _s(b: bytes) -> bytes:  # a Python 2 str: SHORT_BINSTRING / BINSTRING
    return (b"U" + bytes([len(b)]) if len(b) < 256 else b"T" + struct.pack("<i", len(b))) + b


def _i(v: int) -> bytes:  # BININT1 / BININT
    return b"K" + bytes([v]) if 0 <= v < 256 else b"J" + struct.pack("<i", v)


def _tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


DTYPE_STATE_U1 = _tuple([_i(3), _s(b"|"), b"NNN", _i(-1), _i(-1), _i(0)])


def _dtype(code: bytes = b"u1", state: bytes | None = DTYPE_STATE_U1) -> bytes:
    return b"cnumpy\ndtype\n" + _s(code) + _i(0) + _i(1) + b"\x87R" + (state + b"b" if state is not None else b"")


def _array(shape: tuple[int, ...], payload: bytes | None, dtype: bytes | None = None) -> bytes:
    """``numpy.core.multiarray._reconstruct(ndarray, (0,), 'b')`` + BUILD with the state numpy writes;
    ``payload=None`` leaves out the BUILD (an array that never receives data)."""
    head = b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + _i(0) + b"\x85" + _s(b"b") + b"\x87R"
    if payload is None:
        return head
    state = _tuple([_i(1), _tuple([_i(d) for d in shape]), dtype or _dtype(), b"\x89", _s(payload)])
    return head + state + b"b"


def batch_pickle(data_ops: bytes, labels: list[int]) -> bytes:
    return (
        b"\x80\x02}("
        + _s(b"data")
        + data_ops
        + _s(b"labels")
        + b"]("
        + b"".join(_i(v) for v in labels)
        + b"e"
        + _s(b"batch_label")
        + _s(b"testing batch 1 of 1")
        + b"u."
    )


def write_cifar10(root, test_batch: bytes):
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    (d / "test_batch").write_bytes(test_batch)
    (d / "batches.meta").write_bytes(pickle.dumps({b"label_names": [f"c{i}".encode() for i in range(10)]}, 2))
    return d


def test_faithful_python2_batch_loads_exactly(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, (3, 3072), dtype=np.uint8)
    write_cifar10(tmp_path, batch_pickle(_array((3, 3072), data.tobytes()), [4, 0, 9]))
    ds = load("cifar10", "test", root=tmp_path)
    assert np.array_equal(ds.images.reshape(3, -1).numpy(), data) and ds.labels.tolist() == [4, 0, 9]


# Every opcode that calls a class: a 49-byte file asking numpy.ndarray for 300,000 images (921 MB
# of uninitialised memory when numpy.ndarray itself is reachable).
BIG = _tuple([_i(300_000), _i(3072)])
NDARRAY_CALLS = {
    "REDUCE": b"\x80\x02cnumpy\nndarray\n" + b"(" + BIG + b"tR.",
    "NEWOBJ": b"\x80\x02cnumpy\nndarray\n" + BIG + b"\x85\x81.",
    "NEWOBJ_EX": b"\x80\x04cnumpy\nndarray\n" + BIG + b"\x85}\x92.",
    "INST": b"(" + BIG + b"inumpy\nndarray\n.",
    "OBJ": b"(cnumpy\nndarray\n" + BIG + b"o.",
}


@pytest.mark.parametrize("opcode", sorted(NDARRAY_CALLS))
def test_calling_numpy_ndarray_directly_is_refused_without_allocating(tmp_path, opcode):
    p = tmp_path / "test_batch"
    p.write_bytes(NDARRAY_CALLS[opcode])
    out, peak = peak_bytes(lambda: safe_unpickle(p))
    assert isinstance(out, ValueError) and str(out).startswith(f"{p}: ")
    assert peak < 4 * MiB


def test_tiny_batch_claiming_many_images_is_refused(tmp_path):
    # A well-formed _reconstruct + BUILD whose shape claims 300,000 images but carries one.
    d = write_cifar10(tmp_path, batch_pickle(_array((300_000, 3072), bytes(3072)), [0]))
    out, peak = peak_bytes(lambda: load("cifar10", "test", root=tmp_path))
    assert isinstance(out, ValueError), out
    assert str(out).startswith(
        f"{d / 'test_batch'}: refused array: array declares uint8 (300000, 3072) "
        f"(921600000 bytes) but the pickle holds 3072 bytes"
    )
    assert peak < 8 * MiB


def test_array_without_payload_is_refused(tmp_path):
    d = write_cifar10(tmp_path, batch_pickle(_array((16, 3072), None), []))
    with pytest.raises(ValueError, match=r"test_batch: refused array: array without data"):
        load("cifar10", "test", root=tmp_path)
    assert d.is_dir()


def test_payload_longer_than_declared_is_refused(tmp_path):
    write_cifar10(tmp_path, batch_pickle(_array((1, 3072), bytes(2 * 3072)), [0]))
    with pytest.raises(ValueError, match=r"test_batch: refused array: .* \(3072 bytes\) but the pickle holds 6144"):
        load("cifar10", "test", root=tmp_path)


@FEW
@given(declared=st.integers(0, 6), present=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_batch_loads_exactly_when_declared_rows_match_the_payload(tmp_path_factory, declared, present, seed):
    data = np.random.default_rng(seed).integers(0, 256, (present, 3072), dtype=np.uint8)
    root = tmp_path_factory.mktemp("c")
    write_cifar10(root, batch_pickle(_array((declared, 3072), data.tobytes()), [1] * declared))
    if declared == present:
        ds = load("cifar10", "test", root=root)
        assert np.array_equal(ds.images.reshape(present, 3072).numpy(), data)
    else:
        with pytest.raises(ValueError, match=r"test_batch: refused array: array declares uint8"):
            load("cifar10", "test", root=root)


HOSTILE_DTYPES = {
    "object": _dtype(b"O8", _tuple([_i(3), _s(b"|"), b"NNN", _i(-1), _i(-1), _i(63)])),
    "void of 1 GB": _dtype(b"V1000000000"),
    "bytes string": _dtype(b"S16"),
    "float": _dtype(b"f8"),
    "u1 with a changed item size": _dtype(b"u1", _tuple([_i(3), _s(b"|"), b"NNN", _i(1 << 30), _i(1), _i(0)])),
    "u1 with object flags": _dtype(b"u1", _tuple([_i(3), _s(b"|"), b"NNN", _i(-1), _i(-1), _i(63)])),
    "u1 with fields": _dtype(
        b"u1", _tuple([_i(3), _s(b"|"), b"N", b"(" + _s(b"a") + b"t", b"N", _i(-1), _i(-1), _i(0)])
    ),
    "u1 without its state": _dtype(b"u1", None),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_DTYPES))
def test_only_plain_integer_dtypes_in_numpy_s_own_form_are_accepted(tmp_path, case):
    write_cifar10(tmp_path, batch_pickle(_array((1, 3072), bytes(3072), HOSTILE_DTYPES[case]), [0]))
    with pytest.raises(ValueError, match=r"test_batch: refused array: .*dtype"):
        load("cifar10", "test", root=tmp_path)


def test_numpy_scalars_are_not_on_the_allow_list(tmp_path):
    # The official files hold plain ints; numpy.core.multiarray.scalar is not needed to read them.
    p = tmp_path / "meta"
    p.write_bytes(pickle.dumps({"n": np.int64(3)}, protocol=2))
    refused = r"meta: unsafe pickle refused: refused global numpy\._core\.multiarray\.scalar "
    with pytest.raises(ValueError, match=refused):
        safe_unpickle(p)


@FEW
@given(
    dtype=st.sampled_from(["u1", "i1", "<u2", ">i2", "<i4", ">u4", "<i8", ">u8"]),
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple),
    protocol=st.integers(2, 5),
    fortran=st.booleans(),
)
def test_python3_pickles_of_integer_arrays_round_trip_as_plain_writable_arrays(
    tmp_path_factory, dtype, shape, protocol, fortran
):
    arr = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape, order="F" if fortran else "C")
    if protocol < 3 and arr.size == 0:  # empty bytes pickle as __builtin__.bytes() below protocol 3
        return
    p = tmp_path_factory.mktemp("p") / "batch"
    p.write_bytes(pickle.dumps({"a": arr, "same": [arr, arr]}, protocol=protocol))
    got = safe_unpickle(p)
    a = got["a"]
    assert type(a) is np.ndarray and a.dtype == arr.dtype and a.shape == arr.shape and np.array_equal(a, arr)
    assert a.flags.writeable and got["same"][0] is got["same"][1] is a


# ---------------------------------------------------------------------------------------------------
# gzip IDX: decompression bombs


@pytest.fixture(scope="module")
def zeros_member():
    """One gzip member of 64 MiB of zeros (about 65 KB): 16 of them make 1 GiB in about 1 MB."""
    return gzip.compress(bytes(64 * MiB), compresslevel=9, mtime=0)


def _header(dims: tuple[int, ...], code: int = 0x08) -> bytes:
    return bytes([0, 0, code, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)


def test_bomb_with_a_valid_header_fails_fast_without_decompressing_the_rest(tmp_path, zeros_member):
    # The header of the MNIST test images (10,000 x 28 x 28 = 7.8 MB), followed by 1 GiB of zeros.
    p = tmp_path / "t10k-images-idx3-ubyte.gz"
    p.write_bytes(gzip.compress(_header((10_000, 28, 28)), mtime=0) + zeros_member * 16)
    assert p.stat().st_size < 1.2 * MiB
    start = time.perf_counter()
    out, peak = peak_bytes(lambda: read_idx(p, expect_magic=0x00000803))
    elapsed = time.perf_counter() - start
    assert isinstance(out, ValueError), out
    assert str(out) == (
        f"{p}: has trailing bytes: header declares shape (10000, 28, 28) (7840016 bytes in all), file holds more"
    )
    assert peak < 7_840_000 + 4 * MiB  # the declared images plus a chunk, never the 1 GiB
    assert elapsed < 3.0


def test_bomb_through_load_names_the_file(tmp_path, zeros_member):
    d = tmp_path / "mnist"
    d.mkdir()
    (d / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(_header((4, 28, 28)) + bytes(4 * 784)) + zeros_member)
    (d / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(encode_idx(np.zeros(4, np.uint8))))
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz: has trailing bytes"):
        load("mnist", "test", root=d)


def test_header_claiming_more_than_deflate_can_expand_is_refused_before_reading(tmp_path):
    p = tmp_path / "train-images-idx3-ubyte.gz"
    p.write_bytes(gzip.compress(_header((1 << 20, 32, 32)) + bytes(100_000)))  # claims 1 GiB, holds 100 kB
    out, peak = peak_bytes(lambda: read_idx(p))
    assert isinstance(out, ValueError)
    assert str(out).startswith(f"{p}: truncated: header declares shape (1048576, 32, 32)")
    assert "deflate expands at most 1032:1" in str(out) and peak < 2 * MiB


def test_declared_size_above_max_bytes_is_refused_before_reading(tmp_path):
    p = tmp_path / "images.gz"
    p.write_bytes(gzip.compress(encode_idx(np.zeros((10, 28, 28), np.uint8))))
    with pytest.raises(
        ValueError,
        match=r"images\.gz: header declares shape \(10, 28, 28\) \(7856 bytes in all\): "
        r"more than max_bytes=7000",
    ):
        read_idx(p, max_bytes=7000)
    assert read_idx(p, max_bytes=7840).shape == (10, 28, 28)
    with pytest.raises(ValueError, match=r"<bytes>: header declares .* more than max_bytes=100"):
        parse_idx(encode_idx(np.zeros((10, 28, 28), np.uint8)), max_bytes=100)


def test_corrupt_gzip_trailer_is_detected(tmp_path):
    # The CRC sits after the payload: reading the one byte past the declared size checks it.
    p = tmp_path / "labels.gz"
    blob = bytearray(gzip.compress(encode_idx(np.arange(10, dtype=np.uint8))))
    blob[-6] ^= 0xFF
    p.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=r"labels\.gz: corrupt or truncated gzip data"):
        read_idx(p)


IDX_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64]


@FEW
@given(
    dtype=st.sampled_from(IDX_DTYPES),
    dims=st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
    extra=st.integers(-3, 3),
    gz=st.booleans(),
)
def test_idx_reads_exactly_the_declared_size(tmp_path_factory, dtype, dims, extra, gz):
    arr = (np.arange(int(np.prod(dims))) * 7 - 5).astype(dtype).reshape(dims)
    raw = encode_idx(arr)
    if extra < 0 and len(raw) + extra <= len(_header(dims)):  # nothing of the payload to cut
        extra = 0
    blob = raw[: len(raw) + extra] if extra < 0 else raw + b"\x01" * extra
    p = tmp_path_factory.mktemp("idx") / ("f.gz" if gz else "f")
    p.write_bytes(gzip.compress(blob) if gz else blob)
    if extra == 0:
        got = read_idx(p)
        assert got.dtype == np.dtype(dtype) and got.dtype.isnative and got.flags.writeable
        assert np.array_equal(got, arr)
    else:
        kind = "truncated" if extra < 0 else "has trailing bytes"
        with pytest.raises(ValueError, match=rf"{p.name}: {kind}: header declares shape"):
            read_idx(p)


# ---------------------------------------------------------------------------------------------------
# extract_archive: never delete or replace what the archive did not create


def _tarball(path, members: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _snapshot(root):
    return {
        str(p.relative_to(root)): (
            p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p) if p.is_symlink() else None
        )
        for p in sorted(root.rglob("*"))
    }


MEMBERS = {"cifar-10-batches-py/test_batch": b"batch", "cifar-10-batches-py/batches.meta": b"meta"}


def test_user_file_inside_the_extracted_folder_survives(tmp_path):
    archive = _tarball(tmp_path / "cifar-10-python.tar.gz", MEMBERS)
    dest = tmp_path / "data"
    (dest / "cifar-10-batches-py").mkdir(parents=True)
    (dest / "cifar-10-batches-py" / "my_notes.txt").write_text("keep me")
    created = dl.extract_archive(archive, dest)
    folder = dest / "cifar-10-batches-py"
    assert (folder / "my_notes.txt").read_text() == "keep me"
    assert (folder / "test_batch").read_bytes() == b"batch" and (folder / "batches.meta").read_bytes() == b"meta"
    assert sorted(created) == [folder / "batches.meta", folder / "test_batch"]
    assert sorted(p.name for p in dest.iterdir()) == ["cifar-10-batches-py"]  # no temporary folder left


def test_re_extracting_over_identical_files_changes_nothing(tmp_path):
    archive = _tarball(tmp_path / "a.tar.gz", MEMBERS)
    dest = tmp_path / "data"
    dl.extract_archive(archive, dest)
    (dest / "cifar-10-batches-py" / "test_batch").unlink()  # a file lost since: restored, the rest kept
    before = (dest / "cifar-10-batches-py" / "batches.meta").stat().st_ino
    assert dl.extract_archive(archive, dest) == [dest / "cifar-10-batches-py" / "test_batch"]
    assert (dest / "cifar-10-batches-py" / "batches.meta").stat().st_ino == before
    assert dl.extract_archive(archive, dest) == []


def test_differing_existing_file_is_a_conflict_that_changes_nothing(tmp_path):
    archive = _tarball(tmp_path / "a.tar.gz", {**MEMBERS, "cifar-10-batches-py/data_batch_1": b"new"})
    dest = tmp_path / "data"
    folder = dest / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    (folder / "test_batch").write_bytes(b"edited by the user")
    (folder / "batches.meta").mkdir()  # a folder where the archive has a file
    (folder / "mine").write_text("x")
    before = _snapshot(dest)
    with pytest.raises(ValueError) as err:
        dl.extract_archive(archive, dest)
    msg = str(err.value)
    assert msg.startswith(f"{archive}: not extracted: 2 existing path(s) in {dest} differ from the archive")
    assert str(folder / "test_batch") in msg and str(folder / "batches.meta") in msg and "mine" not in msg
    assert _snapshot(dest) == before  # data_batch_1 was not moved in either: all or nothing


def test_link_in_the_destination_is_never_replaced(tmp_path):
    archive = _tarball(tmp_path / "a.tar.gz", MEMBERS)
    dest = tmp_path / "data"
    (dest / "cifar-10-batches-py").mkdir(parents=True)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"batch")
    os.symlink(target, dest / "cifar-10-batches-py" / "test_batch")
    with pytest.raises(ValueError, match=r"1 existing path\(s\)"):
        dl.extract_archive(archive, dest)
    assert os.readlink(dest / "cifar-10-batches-py" / "test_batch") == str(target)


def test_download_keeps_a_users_file_in_a_partial_folder(tmp_path, monkeypatch):
    import hashlib

    from shiftguard.data.download import Resource

    rng = np.random.default_rng(0)
    batch = {b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), b"labels": [3, 4]}
    members = {
        f"cifar-10-batches-py/{n}": pickle.dumps(batch, 2)
        for n in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    }
    members["cifar-10-batches-py/batches.meta"] = pickle.dumps({b"label_names": [b"c"] * 10}, 2)
    tarball = _tarball(tmp_path / "cifar-10-python.tar.gz", members)
    md5 = hashlib.md5(tarball.read_bytes()).hexdigest()
    monkeypatch.setitem(dl.RESOURCES, "cifar10", (Resource(tarball.name, (tarball.as_uri(),), md5, extract=True),))
    folder = tmp_path / "data" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    (folder / "README.mine").write_text("my annotations")
    ds = load("cifar10", "test", root=tmp_path / "data", download=True)
    assert ds.labels.tolist() == [3, 4] and (folder / "README.mine").read_text() == "my annotations"
