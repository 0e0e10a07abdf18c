"""Where dataset files live, and fetching them from their official URLs with checksum checks.

Root resolution (first match wins):

1. ``root=`` given explicitly to :func:`shiftguard.data.load`;
2. ``$SHIFTGUARD_DATA/<name>/`` when the environment variable ``SHIFTGUARD_DATA`` is set;
3. the per-user cache ``$XDG_CACHE_HOME/shiftguard/<name>/`` (``~/.cache/shiftguard/<name>/``).

Inside that base folder each loader also looks in the sub-folders the official archives
extract to (``cifar-10-batches-py/``, ``CIFAR-10-C/``, ``mnist_c/``, ...) and in ``<base>/<name>/``,
so ``root=`` may point at the files themselves or at a folder holding several datasets.

``download=True`` fetches the official archives (URLs and checksums in :data:`RESOURCES`, each
with the source of its published checksum), verifies the checksum while streaming, moves the file
into place atomically and extracts archives safely (no absolute paths, no ``..``, no links out of
the target; existing files are never replaced or deleted, see :func:`extract_archive`). Without
network it fails after a short timeout and says where to put the files by hand.
Nothing is ever downloaded unless ``download=True`` is passed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from shiftguard.io import atomic_write

__all__ = [
    "Resource",
    "RESOURCES",
    "DownloadError",
    "default_root",
    "candidate_dirs",
    "locate",
    "download",
    "extract_archive",
    "file_md5",
    "DOWNLOAD_TIMEOUT_S",
]

#: Seconds to wait for a connection / a read before giving up (fail fast when offline).
DOWNLOAD_TIMEOUT_S = 15.0


class DownloadError(FileNotFoundError):
    """The dataset is not on disk and could not be fetched (offline, server error, bad checksum)."""


@dataclass(frozen=True)
class Resource:
    """One file to fetch: ``urls`` are mirrors tried in order; ``md5`` is the published checksum."""

    filename: str
    urls: tuple[str, ...]
    md5: str
    extract: bool = False  # a .tar / .tar.gz / .zip unpacked into the base folder
    checksum_source: str = ""


_MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",  # the PyTorch mirror (torchvision's first choice)
    "http://yann.lecun.com/exdb/mnist/",
)
_FASHION = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_MNIST_MD5 = "published with the files; the values torchvision.datasets.MNIST checks"
_FASHION_MD5 = "README of github.com/zalandoresearch/fashion-mnist ('Get the data')"

#: Official sources. The md5 values are the published ones (see ``checksum_source``).
RESOURCES: dict[str, tuple[Resource, ...]] = {
    "mnist": tuple(
        Resource(f, tuple(m + f for m in _MNIST_MIRRORS), md5, checksum_source=_MNIST_MD5)
        for f, md5 in (
            ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
            ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
            ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
            ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
        )
    ),
    "fashion-mnist": tuple(
        Resource(f, (_FASHION + f,), md5, checksum_source=_FASHION_MD5)
        for f, md5 in (
            ("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
            ("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
            ("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
            ("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310"),
        )
    ),
    "cifar10": (
        Resource(
            "cifar-10-python.tar.gz",
            ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
            "c58f30108f718f92721af3b95e74349a",
            extract=True,
            checksum_source="https://www.cs.toronto.edu/~kriz/cifar.html (also torchvision.datasets.CIFAR10)",
        ),
    ),
    "cifar100": (
        Resource(
            "cifar-100-python.tar.gz",
            ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",),
            "eb9058c3a382ffc7106e4002c42a8d85",
            extract=True,
            checksum_source="https://www.cs.toronto.edu/~kriz/cifar.html (also torchvision.datasets.CIFAR100)",
        ),
    ),
    "cifar10-c": (
        Resource(
            "CIFAR-10-C.tar",
            ("https://zenodo.org/records/2535967/files/CIFAR-10-C.tar",),
            "56bf5dcef84df0e2308c6dcbcbbd8499",
            extract=True,
            checksum_source="Zenodo record 2535967 (Hendrycks & Dietterich 2019)",
        ),
    ),
    "cifar100-c": (
        Resource(
            "CIFAR-100-C.tar",
            ("https://zenodo.org/records/3555552/files/CIFAR-100-C.tar",),
            "11f0ed0f1191edbf9fa23466ae6021d3",
            extract=True,
            checksum_source="Zenodo record 3555552 (Hendrycks & Dietterich 2019)",
        ),
    ),
    "mnist-c": (
        Resource(
            "mnist_c.zip",
            ("https://zenodo.org/records/3239543/files/mnist_c.zip",),
            "4b34b33045869ee6d424616cd3a65da3",
            extract=True,
            checksum_source="Zenodo record 3239543 (Mu & Gilmer 2019)",
        ),
    ),
    "tinyimagenet": (
        Resource(
            "tiny-imagenet-200.zip",
            ("http://cs231n.stanford.edu/tiny-imagenet-200.zip",),
            "90528d7ca1a48142e341f4ef8d21d0de",
            extract=True,
            checksum_source="the value torchvision-style Tiny-ImageNet loaders check (cs231n archive)",
        ),
    ),
    "tinyimagenet-c": (
        Resource(
            "Tiny-ImageNet-C.tar",
            ("https://zenodo.org/records/8206060/files/Tiny-ImageNet-C.tar",),
            "f9c9a9dbdc11469f0b850190f7ad8be1",
            extract=True,
            checksum_source="Zenodo record 8206060 (Hendrycks & Dietterich 2019); "
            "the 4 extra corruptions are in Tiny-ImageNet-C-extra.tar",
        ),
    ),
}

#: Sub-folders of the base folder that the official archives extract to, per dataset.
ARCHIVE_DIRS: dict[str, tuple[str, ...]] = {
    "mnist": ("MNIST/raw",),
    "fashion-mnist": ("FashionMNIST/raw",),
    "cifar10": ("cifar-10-batches-py",),
    "cifar100": ("cifar-100-python",),
    "cifar10-c": ("CIFAR-10-C",),
    "cifar100-c": ("CIFAR-100-C",),
    "mnist-c": ("mnist_c",),
    "tinyimagenet": ("tiny-imagenet-200",),
    "tinyimagenet-c": ("Tiny-ImageNet-C",),
}


def default_root(name: str) -> Path:
    """Base folder for ``name`` when no ``root=`` is given: ``$SHIFTGUARD_DATA/<name>`` or the cache."""
    env = os.environ.get("SHIFTGUARD_DATA")
    if env:
        return Path(env).expanduser() / name
    cache = os.environ.get("XDG_CACHE_HOME")
    base = Path(cache).expanduser() if cache else Path.home() / ".cache"
    return base / "shiftguard" / name


def base_dir(name: str, root: Optional[os.PathLike | str]) -> Path:
    return Path(root).expanduser() if root is not None else default_root(name)


def candidate_dirs(name: str, root: Optional[os.PathLike | str]) -> list[Path]:
    """Folders searched for ``name``'s files, in order (duplicates removed)."""
    base = base_dir(name, root)
    subs = ("",) + ARCHIVE_DIRS.get(name, ())
    out: list[Path] = []
    # <base>/<name>/ only matters for an explicit root; the default base already ends in <name>.
    for prefix in ("", name) if root is not None else ("",):
        for sub in subs:
            p = base / prefix / sub if prefix or sub else base
            if p not in out:
                out.append(p)
    return out


def locate(
    name: str,
    root: Optional[os.PathLike | str],
    is_complete: Callable[[Path], bool],
    expected: Sequence[str],
    download: bool = False,
) -> Path:
    """The first candidate folder for which ``is_complete(folder)`` holds.

    With ``download=True`` and nothing found, the official files are fetched into the base folder
    first. Raises ``FileNotFoundError`` listing the expected files and every folder looked in.
    """
    dirs = candidate_dirs(name, root)
    for d in dirs:
        if d.is_dir() and is_complete(d):
            return d
    if download:
        fetch_dataset(name, base_dir(name, root))
        for d in dirs:
            if d.is_dir() and is_complete(d):
                return d
    hint = _manual_hint(name, base_dir(name, root))
    from shiftguard.data._files import missing_files_error

    raise missing_files_error(name, expected, dirs, hint)


def _manual_hint(name: str, base: Path) -> str:
    res = RESOURCES.get(name)
    if not res:
        return "Pass root= pointing at the folder that holds them."
    urls = "; ".join(r.urls[0] for r in res)
    return (
        f"Get them with download=True, or fetch {urls} by hand and put the files (extracted) in {base} "
        f"(or pass root=, or set SHIFTGUARD_DATA to a folder holding {name}/)."
    )


def file_md5(path: os.PathLike | str, chunk: int = 1 << 20) -> str:
    h = hashlib.md5()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _open_url(url: str, timeout: float):
    """Open ``url`` (http, https or file). A module-level function so tests can replace it."""
    request = urllib.request.Request(url, headers={"User-Agent": "shiftguard-data/0.1"})
    return urllib.request.urlopen(request, timeout=timeout)


def fetch_file(resource: Resource, dest: Path, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Download ``resource`` to ``dest`` (atomically), verifying its md5 while streaming.

    Tries each mirror in turn (a failed or mismatching mirror leaves no file behind). If no
    mirror delivers the published checksum, raises ``ValueError`` naming the file and both
    checksums when some mirror answered with wrong content, else :class:`DownloadError`.
    """
    errors: list[str] = []
    mismatch: Optional[ValueError] = None
    for url in resource.urls:
        digest = hashlib.md5()

        def writer(fh, url=url):
            with _open_url(url, timeout) as response:
                for block in iter(lambda: response.read(1 << 20), b""):
                    digest.update(block)
                    fh.write(block)
            got = digest.hexdigest()
            if got != resource.md5:
                raise ValueError(
                    f"{dest}: checksum mismatch for {url}: md5 {got}, expected the published {resource.md5}"
                )

        try:
            return atomic_write(dest, writer)
        except ValueError as exc:  # checksum mismatch: a bad mirror; try the next one
            mismatch = exc
            errors.append(str(exc))
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            errors.append(f"{url}: {getattr(exc, 'reason', exc)}")
    if mismatch is not None:
        raise ValueError("; ".join(errors)) from None
    raise DownloadError(
        f"could not download {resource.filename}: "
        + "; ".join(errors)
        + f". Put the file (or its extracted content) in {dest.parent} by hand."
    )


def fetch_dataset(name: str, base: Path, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Fetch (and extract) every official file of ``name`` into ``base``; skip verified files."""
    if name not in RESOURCES:
        raise DownloadError(f"{name}: no official download is known; put the files in {base} or pass root=")
    base.mkdir(parents=True, exist_ok=True)
    for res in RESOURCES[name]:
        target = base / res.filename
        if not (target.is_file() and file_md5(target) == res.md5):
            fetch_file(res, target, timeout)
        if res.extract:
            extract_archive(target, base)
    return base


download = fetch_dataset  # public alias: ``shiftguard.data.download.download("cifar10", path)``


def _safe_member(dest: Path, member_name: str) -> Path:
    target = (dest / member_name).resolve()
    if not str(target).startswith(str(dest.resolve()) + os.sep) and target != dest.resolve():
        raise ValueError(f"archive member {member_name!r} would be written outside {dest}")
    return target


def extract_archive(archive: Path, dest: Path) -> list[Path]:
    """Unpack a .tar/.tar.gz/.zip into ``dest`` without deleting or changing anything already there.

    The archive is unpacked into a temporary folder inside ``dest`` first (same filesystem, so the
    moves below are renames); members with absolute paths, ``..`` components, links pointing
    outside or device files are refused (``tarfile``'s ``data`` filter; an explicit check for zip).
    Then the unpacked tree is merged into ``dest``, with this policy (nothing is ever lost):

    - a path that does not exist in ``dest`` is moved in (a new folder as a whole);
    - a folder that exists is merged into, member by member; files in it that the archive does not
      hold are left alone;
    - a file that exists with the same bytes is kept as it is (re-extracting is a no-op);
    - a file that exists with different bytes, or an entry whose kind differs (file vs folder vs
      link), is a conflict: ``ValueError`` naming the archive and every conflicting path, raised
      before anything is moved, so ``dest`` is left exactly as it was.

    Returns the paths in ``dest`` that were created (files and folders moved in). Raises
    ``ValueError`` naming ``archive`` for an unsafe member, a corrupt archive or a conflict.
    """
    archive = Path(archive)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest))
    try:
        try:
            if zipfile.is_zipfile(archive):
                with zipfile.ZipFile(archive) as zf:
                    for info in zf.infolist():
                        try:
                            _safe_member(tmp, info.filename)
                        except ValueError as exc:
                            raise ValueError(f"{archive}: unsafe archive member refused ({exc})") from None
                    zf.extractall(tmp)
            else:
                with tarfile.open(archive) as tf:
                    tf.extractall(tmp, filter="data")
        except tarfile.FilterError as exc:  # absolute path, '..', link out of the target, device file
            raise ValueError(f"{archive}: unsafe archive member refused ({exc})") from None
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
            raise ValueError(f"{archive}: corrupt or unreadable archive ({type(exc).__name__}: {exc})") from None
        moves, conflicts = _plan_merge(tmp, dest)
        if conflicts:
            shown = "\n  ".join(str(c) for c in conflicts[:20])
            more = f"\n  ... and {len(conflicts) - 20} more" if len(conflicts) > 20 else ""
            raise ValueError(
                f"{archive}: not extracted: {len(conflicts)} existing path(s) in {dest} differ from the archive "
                f"(nothing was changed; move them away to extract):\n  {shown}{more}"
            )
        return [_move_no_clobber(src, dst, archive) for src, dst in moves]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _same_file(a: Path, b: Path, chunk: int = 1 << 20) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def _plan_merge(src_root: Path, dst_root: Path) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """``(moves, conflicts)`` for merging the unpacked tree ``src_root`` into ``dst_root``.

    Existing entries are inspected without following a link at the entry itself (``lstat``): a
    link in ``dest`` is a conflict unless the archive holds the same link, never silently replaced.
    """
    moves: list[tuple[Path, Path]] = []
    conflicts: list[Path] = []
    stack = [(src_root, dst_root)]
    while stack:
        src_dir, dst_dir = stack.pop()
        for src in sorted(src_dir.iterdir()):
            dst = dst_dir / src.name
            if not os.path.lexists(dst):
                moves.append((src, dst))
            elif src.is_symlink() or dst.is_symlink():
                if not (src.is_symlink() and dst.is_symlink() and os.readlink(src) == os.readlink(dst)):
                    conflicts.append(dst)
            elif src.is_dir() and dst.is_dir():
                stack.append((src, dst))
            elif src.is_file() and dst.is_file():
                if not _same_file(src, dst):
                    conflicts.append(dst)
            else:
                conflicts.append(dst)
    return moves, sorted(conflicts)


def _move_no_clobber(src: Path, dst: Path, archive: Path) -> Path:
    """Rename ``src`` to ``dst`` only while ``dst`` does not exist (checked by the rename itself where
    the platform allows: a hard link fails on an existing name; folders and links use a rename that
    POSIX lets replace only an empty folder, so nothing with content is ever replaced)."""
    if src.is_file() and not src.is_symlink():
        try:
            os.link(src, dst)
        except FileExistsError:
            raise ValueError(f"{archive}: {dst} appeared during extraction; left as it is") from None
        except OSError:  # no hard links on this filesystem: the check is a separate step
            if os.path.lexists(dst):
                raise ValueError(f"{archive}: {dst} appeared during extraction; left as it is") from None
            os.replace(src, dst)
        else:
            os.unlink(src)
        return dst
    if os.path.lexists(dst) and not (dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir())):
        raise ValueError(f"{archive}: {dst} appeared during extraction; left as it is")
    os.rename(src, dst)
    return dst
