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
which resolves only the few globals needed to rebuild a numpy array; anything else (``os.system``,
``builtins.eval``, ...) is refused before it can be called.
"""

from __future__ import annotations

import io
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


def _allowed_globals() -> dict[tuple[str, str], Any]:
    # Resolve the objects ourselves (no import by name): numpy 2 moved numpy.core to numpy._core,
    # and official CIFAR pickles (numpy 1, Python 2) name the old path.
    from numpy._core import multiarray, numeric
    import codecs

    allowed = {}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(mod, "_reconstruct")] = multiarray._reconstruct
        allowed[(mod, "scalar")] = multiarray.scalar
    for mod in ("numpy.core.numeric", "numpy._core.numeric"):
        allowed[(mod, "_frombuffer")] = numeric._frombuffer
    allowed[("numpy", "ndarray")] = np.ndarray
    allowed[("numpy", "dtype")] = np.dtype
    # Python 3 pickles with protocol <= 2 store bytes as _codecs.encode(str, 'latin1').
    allowed[("_codecs", "encode")] = codecs.encode
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild dicts, lists, strings, numbers and numpy arrays, nothing else.

    ``find_class`` is the only way a pickle reaches a callable; refusing every global outside a
    fixed allow-list means a malicious ``__reduce__`` (``os.system``, ``subprocess.Popen``,
    ``builtins.exec``, ...) raises :class:`ForbiddenPickleGlobal` instead of running.
    """

    _ALLOWED: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str):
        if RestrictedUnpickler._ALLOWED is None:
            RestrictedUnpickler._ALLOWED = _allowed_globals()
        obj = RestrictedUnpickler._ALLOWED.get((module, name))
        if obj is None:
            raise ForbiddenPickleGlobal(
                f"refused global {module}.{name} (only numpy array reconstruction is allowed)"
            )
        return obj


def safe_unpickle(path: Path) -> Any:
    """Unpickle ``path`` with :class:`RestrictedUnpickler`; any failure is a ``ValueError`` naming it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
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


_LAYOUT = {
    "cifar10": {
        "train": [f"data_batch_{i}" for i in range(1, 6)],
        "test": ["test_batch"],
        "meta": "batches.meta",
    },
    "cifar100": {"train": ["train"], "test": ["test"], "meta": "meta"},
}


def load_cifar(name: str, split: str = "train", root=None, download: bool = False, label_mode: str = "fine") -> ImageDataset:
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
    images = np.concatenate([p[0] for p in parts])  # always a fresh, writable, contiguous copy
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
