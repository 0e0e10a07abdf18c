"""CIFAR-10 and CIFAR-100, "python version" (Krizhevsky 2009, https://www.cs.toronto.edu/~kriz/cifar.html).

Layout of the official archives:

- ``cifar-10-batches-py/``: ``data_batch_1`` .. ``data_batch_5`` (train, 10,000 each), ``test_batch``,
  ``batches.meta`` (``label_names``, 10 names);
- ``cifar-100-python/``: ``train`` (50,000), ``test`` (10,000), ``meta`` (``fine_label_names``,
  ``coarse_label_names``).

Each batch is a pickled dict: ``data`` = ``uint8`` array ``(N, 3072)`` (1024 red, then 1024 green,
then 1024 blue values, each a row-major 32x32 plane), ``labels`` (CIFAR-10) or ``fine_labels`` /
``coarse_labels`` (CIFAR-100) = list of N ints, ``batch_label``, ``filenames``. The official files
are Python 2 pickles, so keys arrive as ``bytes`` (``b'data'``); files written by Python 3 have
``str`` keys. Both are accepted.

Pickles can run arbitrary code when loaded. These files are read with :class:`RestrictedUnpickler`,
which resolves only the globals the official files name (``numpy.core.multiarray._reconstruct``,
``numpy.ndarray``, ``numpy.dtype``, written by cPickle at protocol 2) and their Python 3 / numpy 2
spellings; anything else (``os.system``, ``builtins.eval``, ...) is refused before it can be called.
Each allowed name resolves to a wrapper that accepts only the exact call numpy writes, and every
array must be built from bytes present in the file (declared ``shape x itemsize`` equal to the
payload's length), so a small file can neither claim a large array nor expose uninitialised memory.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shiftguard.data._files import check_split, file_error
from shiftguard.data.base import ImageDataset
from shiftguard.data.download import locate

__all__ = [
    "RestrictedUnpickler",
    "ForbiddenPickleGlobal",
    "RefusedPickleArray",
    "safe_unpickle",
    "load_cifar",
    "read_cifar_batch",
    "CIFAR10_CLASSES",
    "CIFAR100_CLASSES",
    "CIFAR100_COARSE_CLASSES",
]

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

# The CIFAR-100 ``fine_label_names`` / ``coarse_label_names`` of the official meta file (alphabetical),
# used where the meta file is not at hand (CIFAR-100-C ships none).
CIFAR100_CLASSES = (
    "apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus butterfly "
    "camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch crab crocodile cup "
    "dinosaur dolphin elephant flatfish forest fox girl hamster house kangaroo keyboard lamp lawn_mower "
    "leopard lion lizard lobster man maple_tree motorcycle mountain mouse mushroom oak_tree orange orchid "
    "otter palm_tree pear pickup_truck pine_tree plain plate poppy porcupine possum rabbit raccoon ray road "
    "rocket rose sea seal shark shrew skunk skyscraper snail snake spider squirrel streetcar sunflower "
    "sweet_pepper table tank telephone television tiger tractor train trout tulip turtle wardrobe whale "
    "willow_tree wolf woman worm"
).split()
CIFAR100_COARSE_CLASSES = (
    "aquatic_mammals fish flowers food_containers fruit_and_vegetables household_electrical_devices "
    "household_furniture insects large_carnivores large_man-made_outdoor_things "
    "large_natural_outdoor_scenes large_omnivores_and_herbivores medium_mammals "
    "non-insect_invertebrates people reptiles small_mammals trees vehicles_1 vehicles_2"
).split()


class ForbiddenPickleGlobal(pickle.UnpicklingError):
    """A pickle referenced a global outside the allow-list (it would have run foreign code)."""


class RefusedPickleArray(pickle.UnpicklingError):
    """A pickled numpy array (or dtype) did not have the exact form numpy writes, or declared more
    data than the pickle holds for it."""


# The only dtypes a CIFAR pickle needs: ``uint8`` pixels (Krizhevsky 2009), plus the fixed-size
# integers a Python 3 writer produces for label arrays. No object, string, void or structured dtype:
# those are how a pickle would make numpy interpret bytes as pointers or allocate by a declared size.
_DTYPE_CODES = frozenset({"u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8"})
_BYTE_ORDERS = frozenset({"|", "<", ">", "="})


def _text_arg(x) -> str | None:
    """``str`` or latin-1 ``bytes`` (a Python 2 ``str`` read with ``encoding="bytes"``) as text."""
    if isinstance(x, str):
        return x
    if isinstance(x, bytes):
        return x.decode("latin1")
    return None


class _NdarrayToken:
    """What ``numpy.ndarray`` resolves to: a name accepted only as ``_reconstruct``'s first argument.

    Called directly (``ndarray(shape, dtype)``), numpy would hand back uninitialised memory of any
    declared size; the token is not a type (so ``NEWOBJ`` refuses it) and refuses to be called.
    """

    def __call__(self, *args, **kwargs):
        raise ForbiddenPickleGlobal("numpy.ndarray may only be named as _reconstruct's subtype, never called")


_NDARRAY = _NdarrayToken()


class _PendingDtype:
    """``numpy.dtype(code, align, copy)`` as numpy pickles it; its ``BUILD`` state is checked here.

    numpy's own ``dtype.__setstate__`` would let the pickle set the item size, fields and flags of
    the new dtype; only the state numpy writes for a plain integer dtype is accepted:
    ``(3, byte_order, None, None, None, -1, -1, 0)``.
    """

    # never a dict key or set member: it must stay where the resolver finds it
    __hash__ = None  # type: ignore[assignment]  # the data model's way to make a class unhashable

    def __init__(self, code: str):
        self.code = code
        self.dtype: np.dtype | None = None

    def __setstate__(self, state) -> None:
        if self.dtype is not None:
            raise RefusedPickleArray(f"dtype {self.code!r} given a state twice")
        ok = isinstance(state, tuple) and len(state) == 8 and state[0] == 3
        ok = ok and state[2:] == (None, None, None, -1, -1, 0)
        order = _text_arg(state[1]) if ok else None
        if order not in _BYTE_ORDERS:
            raise RefusedPickleArray(f"dtype {self.code!r} with a state numpy does not write for it: {state!r:.200}")
        dtype = np.dtype(self.code)
        # order is one of _BYTE_ORDERS (checked above), all of which newbyteorder accepts
        self.dtype = dtype if order == "|" or dtype.itemsize == 1 else dtype.newbyteorder(order)  # type: ignore[arg-type]

    def resolve(self) -> np.dtype:
        if self.dtype is None:
            raise RefusedPickleArray(f"dtype {self.code!r} used before its state was set")
        return self.dtype


def _dtype(code, align=False, copy=True) -> _PendingDtype:
    text = _text_arg(code)
    if text not in _DTYPE_CODES or align not in (0, False) or copy not in (1, True):
        raise RefusedPickleArray(
            f"dtype{(code, align, copy)!r:.200} refused (allowed: unaligned {', '.join(sorted(_DTYPE_CODES))})"
        )
    return _PendingDtype(text)


def _check_shape(shape) -> tuple[int, ...]:
    if not (isinstance(shape, tuple) and all(type(d) is int and d >= 0 for d in shape)):
        raise RefusedPickleArray(f"array shape must be a tuple of non-negative ints, got {shape!r:.200}")
    return shape


def _from_payload(payload, shape: tuple[int, ...], dtype: np.dtype, order: str) -> np.ndarray:
    """The array whose bytes are exactly ``payload``: its length must equal ``prod(shape) * itemsize``.

    This is the bound on every array: each element comes from bytes present in the pickle stream.
    """
    if not isinstance(payload, (bytes, bytearray)):
        raise RefusedPickleArray(f"array data must be bytes from the file, got {type(payload).__name__}")
    need = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if len(payload) != need:
        raise RefusedPickleArray(
            f"array declares {dtype} {shape} ({need} bytes) but the pickle holds {len(payload)} bytes for it"
        )
    # A copy: every array owns writable memory, never a view of the stream's (possibly shared) bytes.
    return np.frombuffer(payload, dtype=dtype).copy().reshape(shape, order=order)


class _PendingArray:
    """What ``_reconstruct(ndarray, (0,), b'b')`` returns; ``BUILD`` gives it numpy's array state.

    numpy writes the state ``(1, shape, dtype, is_fortran, data_bytes)``; anything else is refused,
    and an array that never receives a state (no payload) is refused where it appears in the result.
    """

    __hash__ = None  # type: ignore[assignment]  # unhashable, as above

    def __init__(self):
        self.array: np.ndarray | None = None

    def __setstate__(self, state) -> None:
        if self.array is not None:
            raise RefusedPickleArray("array given a state twice")
        if not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1):
            raise RefusedPickleArray(f"array state must be (1, shape, dtype, is_fortran, data), got {state!r:.200}")
        _, shape, dtype, fortran, payload = state
        if not isinstance(dtype, _PendingDtype) or fortran not in (0, 1):  # False/True compare equal to 0/1
            raise RefusedPickleArray(f"array state must be (1, shape, dtype, is_fortran, data), got {state!r:.200}")
        self.array = _from_payload(payload, _check_shape(shape), dtype.resolve(), "F" if fortran else "C")

    def resolve(self) -> np.ndarray:
        if self.array is None:
            raise RefusedPickleArray("array without data (reconstructed but never given its state)")
        return self.array


def _reconstruct(subtype, shape, typecode) -> _PendingArray:
    if subtype is not _NDARRAY or shape != (0,) or _text_arg(typecode) != "b":
        raise RefusedPickleArray(
            f"_reconstruct{(subtype, shape, typecode)!r:.200} refused (numpy writes (numpy.ndarray, (0,), b'b'))"
        )
    return _PendingArray()


def _frombuffer(buffer, dtype, shape, order) -> np.ndarray:
    # numpy's protocol-5 form: (buffer, dtype, shape, order) with the buffer in-band in the stream.
    order_text = _text_arg(order)
    if not isinstance(dtype, _PendingDtype) or order_text not in ("C", "F"):
        raise RefusedPickleArray(f"_frombuffer(..., {dtype!r:.100}, {shape!r:.100}, {order!r:.20}) refused")
    return _from_payload(buffer, _check_shape(shape), dtype.resolve(), order_text)


def _codecs_encode(obj, encoding) -> bytes:
    # How Python 3 writes ``bytes`` at protocol <= 2: _codecs.encode(text, 'latin1'), one byte per character.
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1"):
        raise RefusedPickleArray(f"_codecs.encode{(obj, encoding)!r:.200} refused (only (str, 'latin1'))")
    return obj.encode("latin1")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    # The official CIFAR pickles (cPickle, Python 2, numpy 1) name exactly numpy.core.multiarray
    # ._reconstruct, numpy.ndarray and numpy.dtype. The same arrays written by Python 3 / numpy 2 use
    # the numpy._core path, _codecs.encode (bytes at protocol <= 2) and numpy._core.numeric._frombuffer
    # (protocol 5). Each name resolves to a checking wrapper, never to the numpy callable itself.
    allowed: dict[tuple[str, str], Any] = {}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(mod, "_reconstruct")] = _reconstruct
    for mod in ("numpy.core.numeric", "numpy._core.numeric"):
        allowed[(mod, "_frombuffer")] = _frombuffer
    allowed[("numpy", "ndarray")] = _NDARRAY
    allowed[("numpy", "dtype")] = _dtype
    allowed[("_codecs", "encode")] = _codecs_encode
    return allowed


_ALLOWED = _allowed_globals()


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild dicts, lists, strings, numbers and numpy integer arrays, nothing else.

    ``find_class`` is the only way a pickle reaches a callable; refusing every global outside a
    fixed allow-list means a malicious ``__reduce__`` (``os.system``, ``subprocess.Popen``,
    ``builtins.exec``, ...) raises :class:`ForbiddenPickleGlobal` instead of running. The allowed
    names resolve to wrappers that accept only the exact calls numpy writes, and every array is
    built from bytes present in the stream (its declared ``shape x itemsize`` must equal their
    length; :class:`RefusedPickleArray` otherwise), so memory is bounded by the file's size.

    Use :meth:`load`: it returns the unpickled object with every array resolved to a plain
    ``numpy.ndarray``.
    """

    def find_class(self, module: str, name: str):
        obj = _ALLOWED.get((module, name))
        if obj is None:
            raise ForbiddenPickleGlobal(f"refused global {module}.{name} (only numpy array reconstruction is allowed)")
        return obj

    def load(self):
        return _resolve(super().load(), {}, 0)


_MAX_DEPTH = 100  # CIFAR pickles nest 3 deep (dict -> list -> str)


def _resolve(obj, seen: dict[int, Any], depth: int):
    """``obj`` with every pending array or dtype replaced by the real one (in place for lists and
    dicts, so shared references stay shared); an unbuilt array is refused."""
    kind = type(obj)
    if kind is _PendingArray or kind is _PendingDtype:
        return obj.resolve()
    if kind not in (list, dict, tuple):
        return obj  # str, bytes, numbers, None, sets (which cannot hold pending objects: unhashable)
    if id(obj) in seen:
        return seen[id(obj)]
    if depth > _MAX_DEPTH:
        raise pickle.UnpicklingError(f"containers nested more than {_MAX_DEPTH} deep")
    if kind is tuple:
        out = tuple(_resolve(v, seen, depth + 1) for v in obj)
        seen[id(obj)] = out
        return out
    seen[id(obj)] = obj
    items = obj.items() if kind is dict else enumerate(obj)
    for key, value in list(items):
        obj[key] = _resolve(value, seen, depth + 1)
    return obj


def safe_unpickle(path: Path) -> Any:
    """Unpickle ``path`` with :class:`RestrictedUnpickler`.

    Returns dicts, lists, tuples, ``bytes`` (Python 2 ``str``), ``str``, numbers and writable
    ``numpy.ndarray`` s of integer dtype. Raises ``FileNotFoundError`` when ``path`` does not exist
    and ``ValueError`` naming ``path`` for anything else: a global outside the allow-list ("unsafe
    pickle refused"), an array that declares more (or less) data than the pickle holds for it
    ("refused array"), containers nested more than 100 deep, or a corrupt or truncated stream.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise file_error(path, "expected a file, found a directory") from None
    try:
        # Walk the opcodes first (pure Python, reads lazily): a corrupt length field then fails
        # here with a clear message instead of making the C unpickler allocate that many bytes.
        for _ in pickletools.genops(data):
            pass
    except Exception as exc:
        raise file_error(path, f"corrupt or truncated pickle ({type(exc).__name__}: {exc})") from None
    try:
        return RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
    except ForbiddenPickleGlobal as exc:
        raise file_error(path, f"unsafe pickle refused: {exc}") from None
    except RefusedPickleArray as exc:
        raise file_error(path, f"refused array: {exc}") from None
    except RecursionError:
        raise file_error(path, "corrupt pickle (nested too deeply)") from None
    except Exception as exc:  # truncated/corrupt pickles raise many types (EOFError, KeyError, ...)
        raise file_error(path, f"corrupt or truncated pickle ({type(exc).__name__}: {exc})") from None


def _text(x) -> str:
    return x.decode("latin1") if isinstance(x, (bytes, bytearray)) else str(x)


def _as_str_dict(obj, path: Path) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise file_error(path, f"expected a pickled dict, got {type(obj).__name__}")
    return {_text(k): v for k, v in obj.items()}


def read_cifar_batch(path: Path, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Images ``uint8 (N, 3, 32, 32)`` and labels ``int64 (N,)`` from one batch file, checked."""
    d = _as_str_dict(safe_unpickle(path), path)
    if "data" not in d or label_key not in d:
        raise file_error(path, f"missing key(s): expected 'data' and {label_key!r}, found {sorted(d)}")
    data = d["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        desc = f"{getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')}"
        raise file_error(path, f"'data' must be a uint8 array (N, 3072), got {desc}")
    try:
        labels = np.asarray(d[label_key])
        if labels.shape == (0,):  # an empty list has no element type (numpy says float64)
            labels = labels.astype(np.int64)
    except Exception as exc:
        raise file_error(path, f"{label_key!r} is not a list of ints ({exc})") from None
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise file_error(path, f"{label_key!r} must be a list of ints, got {labels.dtype} {labels.shape}")
    if labels.shape[0] != data.shape[0]:
        raise file_error(path, f"{labels.shape[0]} labels for {data.shape[0]} images")
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        bad = int(np.argmax((labels < 0) | (labels >= num_classes)))
        raise file_error(path, f"label {int(labels[bad])} at index {bad} is out of range 0..{num_classes - 1}")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _read_names(path: Path, key: str, n: int) -> list[str]:
    d = _as_str_dict(safe_unpickle(path), path)
    if key not in d:
        raise file_error(path, f"missing key {key!r}, found {sorted(d)}")
    names = [_text(x) for x in d[key]]
    if len(names) != n:
        raise file_error(path, f"{key!r} holds {len(names)} names, expected {n}")
    return names


_LAYOUT: dict[str, dict[str, Any]] = {
    "cifar10": {
        "train": [f"data_batch_{i}" for i in range(1, 6)],
        "test": ["test_batch"],
        "meta": "batches.meta",
    },
    "cifar100": {"train": ["train"], "test": ["test"], "meta": "meta"},
}


def load_cifar(
    name: str, split: str = "train", root=None, download: bool = False, label_mode: str = "fine"
) -> ImageDataset:
    """``cifar10`` or ``cifar100`` (``label_mode`` ``"fine"`` (100 classes) or ``"coarse"`` (20))."""
    check_split(name, split, ("train", "test"))
    layout = _LAYOUT[name]
    if name == "cifar10":
        label_key, names_key, n_classes = "labels", "label_names", 10
    elif label_mode == "fine":
        label_key, names_key, n_classes = "fine_labels", "fine_label_names", 100
    elif label_mode == "coarse":
        label_key, names_key, n_classes = "coarse_labels", "coarse_label_names", 20
    else:
        raise ValueError(f"label_mode: expected 'fine' or 'coarse', got {label_mode!r}")
    files = layout[split] + [layout["meta"]]
    folder = locate(name, root, lambda d: all((d / f).is_file() for f in files), files, download)
    parts = [read_cifar_batch(folder / f, label_key, n_classes) for f in layout[split]]
    # Each part already owns fresh, writable memory (safe_unpickle copies every array out of the
    # stream), so a single part is used as it is instead of being copied once more.
    if len(parts) == 1:
        images, labels = np.ascontiguousarray(parts[0][0]), parts[0][1]
    else:
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
    classes = _read_names(folder / layout["meta"], names_key, n_classes)
    return ImageDataset(
        torch.from_numpy(images),
        torch.from_numpy(labels),
        classes,
        name,
        split,
        meta={"root": str(folder), "label_mode": label_mode if name == "cifar100" else None},
    )
