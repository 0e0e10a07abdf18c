"""download=True: official URLs replaced by local file:// URLs; checksums, atomicity, extraction, offline."""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import tarfile

import numpy as np
import pytest

import shiftguard.data.download as dl
from shiftguard.data import load
from shiftguard.data.download import DownloadError, Resource
from shiftguard.data.idx import encode_idx


def _md5(b: bytes) -> str:
    return hashlib.md5(b).hexdigest()


def _serve_mnist_test(src):
    """Write a tiny MNIST test pair into ``src``; return Resources pointing at it by file:// URL."""
    src.mkdir()
    files = {
        "t10k-images-idx3-ubyte.gz": gzip.compress(encode_idx(np.full((3, 28, 28), 7, np.uint8))),
        "t10k-labels-idx1-ubyte.gz": gzip.compress(encode_idx(np.array([1, 2, 3], np.uint8))),
    }
    res = []
    for name, data in files.items():
        (src / name).write_bytes(data)
        res.append(Resource(name, ((src / name).as_uri(),), _md5(data)))
    return tuple(res)


def test_download_fetches_verifies_and_loads(tmp_path, monkeypatch):
    monkeypatch.setitem(dl.RESOURCES, "mnist", _serve_mnist_test(tmp_path / "server"))
    dest = tmp_path / "data"
    ds = load("mnist", "test", root=dest, download=True)
    assert ds.labels.tolist() == [1, 2, 3]
    assert sorted(p.name for p in dest.iterdir()) == ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]


def test_download_into_env_root(tmp_path, monkeypatch):
    monkeypatch.setitem(dl.RESOURCES, "mnist", _serve_mnist_test(tmp_path / "server"))
    monkeypatch.setenv("SHIFTGUARD_DATA", str(tmp_path / "env"))
    assert len(load("mnist", "test", download=True)) == 3
    assert (tmp_path / "env" / "mnist" / "t10k-labels-idx1-ubyte.gz").is_file()


def test_checksum_mismatch_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    good = _serve_mnist_test(tmp_path / "server")
    bad = (Resource(good[0].filename, good[0].urls, "0" * 32),) + good[1:]
    monkeypatch.setitem(dl.RESOURCES, "mnist", bad)
    dest = tmp_path / "data"
    with pytest.raises(
        ValueError,
        match=r"t10k-images-idx3-ubyte\.gz: checksum mismatch "
        r".* expected the published 0{32}",
    ):
        load("mnist", "test", root=dest, download=True)
    assert [p.name for p in dest.iterdir()] == []  # no partial or temporary file left behind


def test_second_mirror_is_tried_when_the_first_fails(tmp_path, monkeypatch):
    good = _serve_mnist_test(tmp_path / "server")
    missing = (tmp_path / "nowhere" / "x.gz").as_uri()
    monkeypatch.setitem(dl.RESOURCES, "mnist", tuple(Resource(r.filename, (missing,) + r.urls, r.md5) for r in good))
    assert len(load("mnist", "test", root=tmp_path / "data", download=True)) == 3


def test_offline_fails_fast_and_says_where_to_put_the_files(tmp_path, monkeypatch):
    def offline(url, timeout):
        import urllib.error

        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(dl, "_open_url", offline)
    dest = tmp_path / "data"
    with pytest.raises(DownloadError) as err:
        load("mnist", "test", root=dest, download=True)
    msg = str(err.value)
    assert "ossci-datasets" in msg and "name resolution" in msg and str(dest) in msg
    assert isinstance(err.value, FileNotFoundError)  # the CLI reports it as one clear line


def test_verified_file_already_present_is_not_fetched_again(tmp_path, monkeypatch):
    res = _serve_mnist_test(tmp_path / "server")
    monkeypatch.setitem(dl.RESOURCES, "mnist", res)
    dest = tmp_path / "data"
    dl.fetch_dataset("mnist", dest)
    monkeypatch.setattr(dl, "_open_url", lambda url, timeout: (_ for _ in ()).throw(AssertionError("refetched")))
    dl.fetch_dataset("mnist", dest)


def _cifar_tarball(path):
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:

        def add(name, obj):
            data = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))

        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            add(
                name,
                {
                    b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8),
                    b"labels": [3, 4],
                    b"batch_label": b"b",
                    b"filenames": [b"a", b"b"],
                },
            )
        add("batches.meta", {b"label_names": [f"c{i}".encode() for i in range(10)]})
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def test_cifar_archive_is_downloaded_and_extracted(tmp_path, monkeypatch):
    tarball = tmp_path / "cifar-10-python.tar.gz"
    data = _cifar_tarball(tarball)
    monkeypatch.setitem(
        dl.RESOURCES, "cifar10", (Resource("cifar-10-python.tar.gz", (tarball.as_uri(),), _md5(data), extract=True),)
    )
    ds = load("cifar10", "train", root=tmp_path / "data", download=True)
    assert len(ds) == 10 and ds.labels.tolist() == [3, 4] * 5
    assert (tmp_path / "data" / "cifar-10-batches-py" / "test_batch").is_file()


def test_archive_member_escaping_the_target_is_refused(tmp_path):
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tf:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(ValueError, match=r"evil\.tar: unsafe archive member refused"):
        dl.extract_archive(evil, tmp_path / "out")
    assert not (tmp_path / "escaped.txt").exists()


def test_zip_member_escaping_the_target_is_refused(tmp_path):
    import zipfile

    evil = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("../escaped.txt", "hi")
    with pytest.raises(ValueError, match=r"evil\.zip: unsafe archive member refused"):
        dl.extract_archive(evil, tmp_path / "out")
    assert not (tmp_path / "escaped.txt").exists()


def test_corrupt_archive_names_the_file(tmp_path):
    bad = tmp_path / "broken.tar.gz"
    bad.write_bytes(gzip.compress(b"not a tar archive" * 100)[:50])
    with pytest.raises(ValueError, match=r"broken\.tar\.gz: corrupt or unreadable archive"):
        dl.extract_archive(bad, tmp_path / "out")


def test_every_official_resource_has_a_published_md5():
    for name, resources in dl.RESOURCES.items():
        for r in resources:
            assert len(r.md5) == 32 and all(c in "0123456789abcdef" for c in r.md5), name
            assert r.urls and all(u.startswith(("http://", "https://")) for u in r.urls), name
