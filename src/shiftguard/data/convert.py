"""One converter for the forms users keep their labelled images in: :func:`as_tensors`.

shiftguard works on *pixels*: ``uint8`` 0..255, or floating point in [0, 1] (``docs/architecture.md``).
Corruptions are defined on that scale (Hendrycks & Dietterich 2019, Sec. 3; Mu & Gilmer 2019), and
a model's own normalisation (mean/std, 0..255 scaling) is applied afterwards via ``preprocess``.
Input on any other scale is an error, never clipped or rescaled: a mean/std-normalised batch holds
negative values and values above 1, and clipping it to [0, 1] would silently destroy most pixels.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

__all__ = ["as_tensors", "check_pixels"]

_LAYOUTS = ("nchw", "nhwc")
_PIXEL_CONTRACT = (
    "shiftguard takes pixels (uint8 0..255, or float in [0, 1]) and applies your normalisation "
    "afterwards via `preprocess`"
)
# PIL modes whose array is already pixels; palette and bilevel images are expanded by PIL itself.
_PIL_MODES = {"L", "LA", "RGB", "RGBA", "I", "I;16", "F"}
_PIL_EXPAND = {"1": "L", "P": "RGB", "PA": "RGBA"}


def check_pixels(images: torch.Tensor, name: str = "images") -> torch.Tensor:
    """Raise unless floating-point ``images`` are finite and lie in [0, 1]; return ``images``.

    ``uint8`` (and any non-floating) tensors are returned without a pass over the data; a float
    tensor costs one ``aminmax`` pass (NaN propagates into its result, so a finite min and max
    prove every value finite; the NaN/inf count is computed only to report it).

    Raises:
        ValueError: non-finite values (message: how many NaN and inf), or values outside [0, 1]
            (message: the min and max found, the pixel contract and a hint at the likely scale).
    """
    if not images.is_floating_point() or images.numel() == 0:
        return images
    lo_t, hi_t = torch.aminmax(images)
    lo, hi = float(lo_t), float(hi_t)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        n_nan = int(torch.isnan(images).sum())
        n_inf = int(torch.isinf(images).sum())
        raise ValueError(
            f"{name}: {n_nan + n_inf} of {images.numel()} pixel values are not finite ({n_nan} NaN, {n_inf} inf); "
            f"{_PIXEL_CONTRACT}. Nothing is replaced or clipped."
        )
    if lo < 0.0 or hi > 1.0:
        if lo >= 0.0 and hi <= 255.0:
            hint = "the values look like the 0..255 scale: pass uint8 images, or divide by 255"
        elif lo < 0.0:
            hint = "the values look normalised (e.g. by mean and std): pass the images before normalisation"
        else:
            hint = "pass the images on the [0, 1] scale"
        raise ValueError(
            f"{name}: float pixels must lie in [0, 1], found min {lo:.6g}, max {hi:.6g}; {_PIXEL_CONTRACT}; "
            f"{hint}. Nothing is clipped."
        )
    return images


def as_tensors(
    data,
    *,
    layout: str = "nchw",
    name: str = "data",
    max_items: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labelled images in any of the usual forms as ``(images, labels)`` tensors.

    Accepted ``data``:

    - a :class:`shiftguard.data.ImageDataset`: its ``.images`` and ``.labels`` as they are (its
      per-item ``transform`` is not applied: it belongs to the model side);
    - any map-style torch ``Dataset`` (or ``IterableDataset``) whose items are ``(image, label)``:
      ``image`` a tensor, numpy array or PIL image, ``label`` an ``int``, numpy integer or 0-d
      integer tensor. Items are copied into one preallocated buffer;
    - a ``DataLoader`` yielding ``(images, labels)`` batches (its order is kept, so a shuffling
      loader gives a shuffled result);
    - a tuple or list ``(images, labels)`` of tensors or numpy arrays (labels may also be a list).

    Labels are required: a bare image tensor or array is a ``TypeError`` (pass ``(images, labels)``).

    Args:
        data: one of the forms above.
        layout: ``"nchw"`` (default) for ``(N, C, H, W)`` batches / ``(C, H, W)`` items, or
            ``"nhwc"`` for ``(N, H, W, C)`` / ``(H, W, C)``. Batches ``(N, H, W)`` and items
            ``(H, W)`` get ``C = 1`` under either layout. PIL images are ``(H, W, C)`` by nature and
            are read so whatever ``layout`` says.
        name: the name error messages start with (e.g. ``"test"``).
        max_items: keep only the first ``max_items`` images (a Dataset or DataLoader is read no
            further than needed); ``None`` keeps all.

    Returns:
        ``images``: ``(N, C, H, W)``, ``uint8``, or ``float32`` / ``float64`` in [0, 1] as given
        (float16 / bfloat16 are widened to float32, exactly; floats are never quantised).
        Integer dtypes other than uint8 holding values in 0..255 are converted to ``uint8``.
        ``labels``: ``int64 (N,)``. Tensors and numpy arrays passed as a batch may share memory
        with the result; the device of a tensor input is kept.

    Raises:
        TypeError: an unsupported form, a bare image batch without labels, an item that is not an
            ``(image, label)`` pair, a bool / complex / non-numeric image dtype, non-integer labels.
        ValueError: no images; float pixels outside [0, 1] (the min and max found) or non-finite
            (how many); integer pixels outside 0..255; negative labels; images and labels of
            different lengths; items or batches of different shapes or dtypes (the index named);
            a wrong number of dimensions; an NHWC batch given with ``layout="nchw"`` (or the
            reverse), detected when only the last (first) non-batch axis has 1 or 3 entries.

    Examples:
        >>> import numpy as np
        >>> images, labels = as_tensors((np.zeros((2, 28, 28, 1), dtype=np.uint8), np.array([3, 7])), layout="nhwc")
        >>> images.shape, images.dtype, labels.tolist()
        (torch.Size([2, 1, 28, 28]), torch.uint8, [3, 7])
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected a string, got {type(name).__name__}")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(_LAYOUTS)}, got {layout!r}")
    if max_items is not None and (isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1):
        raise ValueError(f"max_items: expected a positive int or None, got {max_items!r}")

    from shiftguard.data.base import ImageDataset

    if isinstance(data, ImageDataset):
        images, labels = data.images, data.labels
        if max_items is not None:
            images, labels = images[:max_items], labels[:max_items]
        if images.shape[0] == 0:
            raise ValueError(f"{name}: no images (the dataset is empty)")
        return images, labels
    if isinstance(data, DataLoader):
        return _from_loader(data, layout, name, max_items)
    if isinstance(data, Dataset):
        return _from_dataset(data, layout, name, max_items)
    if isinstance(data, (tuple, list)) and len(data) == 2 and _is_array(data[0]):
        images, labels = data
        if max_items is not None:
            images, labels = images[:max_items], labels[:max_items]
        images = _batch_pixels(images, layout, name, "images")
        labels = _batch_labels(labels, name)
        _check_lengths(images, labels, name)
        return images, labels
    if _is_array(data):
        raise TypeError(
            f"{name}: labels are required: pass (images, labels), a Dataset of (image, label) pairs or a "
            f"DataLoader of (images, labels) batches, got a bare {type(data).__name__} of images"
        )
    raise TypeError(
        f"{name}: expected an ImageDataset, a torch Dataset of (image, label) pairs, a DataLoader of "
        f"(images, labels) batches or a tuple (images, labels) of tensors / numpy arrays, got {type(data).__name__}"
    )


# --------------------------------------------------------------------------- pixels and labels


def _is_array(x) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


def _is_pil(x) -> bool:
    mod = sys.modules.get("PIL.Image")  # a PIL image exists only if PIL was imported already
    return mod is not None and isinstance(x, mod.Image)


def _numpy_to_tensor(a: np.ndarray, name: str) -> torch.Tensor:
    """Pixels from numpy: uint8 shared, other integers 0..255 to uint8, floats widened to >= float32."""
    kind = a.dtype.kind
    if kind == "b" or kind == "c" or kind not in "iuf":
        raise TypeError(f"{name}: expected uint8, integer or floating-point pixels, got dtype {a.dtype}")
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    if kind in "iu" and a.dtype != np.uint8:
        if a.size:
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi > 255:
                raise ValueError(
                    f"{name}: integer pixels must lie in 0..255, found min {lo}, max {hi} (dtype {a.dtype}); "
                    f"{_PIXEL_CONTRACT}"
                )
        a = a.astype(np.uint8)
    elif kind == "f" and a.itemsize < 4:
        a = a.astype(np.float32)
    if not a.flags.writeable or any(s < 0 for s in a.strides):
        a = np.array(a)  # torch cannot share read-only or negatively strided memory
    return torch.from_numpy(a)


def _tensor_pixels(t: torch.Tensor, name: str) -> torch.Tensor:
    """Pixels from a tensor: the same dtype rules as :func:`_numpy_to_tensor`, then the [0, 1] check."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name}: expected uint8, integer or floating-point pixels, got dtype {t.dtype}")
    if t.is_floating_point():
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.float()
        return check_pixels(t, name)
    wide = t if t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64) else t.to(torch.int64)
    if wide.numel():
        lo_t, hi_t = torch.aminmax(wide)
        lo, hi = int(lo_t), int(hi_t)
        if lo < 0 or hi > 255:
            raise ValueError(
                f"{name}: integer pixels must lie in 0..255, found min {lo}, max {hi} (dtype {t.dtype}); "
                f"{_PIXEL_CONTRACT}"
            )
    return wide.to(torch.uint8)


def _to_nchw(t: torch.Tensor, layout: str, name: str, what: str) -> torch.Tensor:
    """``(N, H, W)`` -> ``(N, 1, H, W)``; ``(N, H, W, C)`` -> ``(N, C, H, W)`` under ``"nhwc"``."""
    shape = tuple(t.shape)
    if t.dim() == 3:
        return t.unsqueeze(1)
    if t.dim() != 4:
        want = "(N, C, H, W)" if layout == "nchw" else "(N, H, W, C)"
        raise ValueError(f"{name}: expected {what} of shape {want} or (N, H, W), got shape {shape}")
    if layout == "nchw":
        if shape[1] not in (1, 3) and shape[3] in (1, 3):
            raise ValueError(f'{name}: {what} of shape {shape} look channels-last (N, H, W, C): pass layout="nhwc"')
        return t
    if shape[3] not in (1, 3) and shape[1] in (1, 3):
        raise ValueError(f'{name}: {what} of shape {shape} look channels-first (N, C, H, W): pass layout="nchw"')
    return t.permute(0, 3, 1, 2).contiguous()


def _batch_pixels(images, layout: str, name: str, what: str) -> torch.Tensor:
    t = _numpy_to_tensor(images, name) if isinstance(images, np.ndarray) else images
    if t.dim() in (3, 4) and t.shape[0] == 0:
        raise ValueError(f"{name}: no images (the {what} batch is empty)")
    # layout first, so a shape error is reported before a pass over the values
    return _tensor_pixels(_to_nchw(t, layout, name, what), name)


def _batch_labels(labels, name: str) -> torch.Tensor:
    if isinstance(labels, np.ndarray):
        if labels.dtype.kind not in "iu":
            raise TypeError(f"{name}: labels must be integers, got dtype {labels.dtype}")
        labels = torch.from_numpy(labels.astype(np.int64))
    elif isinstance(labels, (list, tuple)):
        if not all(_is_int(v) for v in labels):
            bad = next(v for v in labels if not _is_int(v))
            raise TypeError(f"{name}: labels must be integers, got {bad!r} ({type(bad).__name__})")
        labels = torch.tensor([int(v) for v in labels], dtype=torch.int64)
    elif not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name}: labels must be a tensor, numpy array or list of ints, got {type(labels).__name__}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"{name}: labels must be integers, got dtype {labels.dtype}")
    if labels.dim() != 1:
        raise ValueError(f"{name}: labels must have shape (N,), got {tuple(labels.shape)}")
    labels = labels.to(torch.int64)
    if labels.numel() and int(labels.min()) < 0:
        raise ValueError(f"{name}: labels must be >= 0, found minimum {int(labels.min())}")
    return labels


def _is_int(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and not (v.dtype == torch.bool or v.is_floating_point() or v.is_complex())
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_lengths(images: torch.Tensor, labels: torch.Tensor, name: str) -> None:
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{name}: mismatched lengths: {images.shape[0]} images, {labels.shape[0]} labels")


# --------------------------------------------------------------------------- Dataset and DataLoader


def _item_image(image, name: str, index: int):
    """A Dataset item's image as a tensor or numpy array (PIL images: their ``(H, W[, C])`` array)."""
    if isinstance(image, (torch.Tensor, np.ndarray)):
        return image
    if _is_pil(image):
        mode = image.mode
        if mode in _PIL_EXPAND:
            image = image.convert(_PIL_EXPAND[mode])
        elif mode not in _PIL_MODES:
            raise ValueError(
                f"{name}: item {index}: PIL image mode {mode!r} is not one of the pixel modes "
                f"{sorted(_PIL_MODES)}; convert the image (e.g. image.convert('RGB')) first"
            )
        return np.asarray(image)
    raise TypeError(
        f"{name}: item {index}: the image must be a tensor, numpy array or PIL image, got {type(image).__name__}"
    )


def _like(image, tensor_items: bool):
    """An item's image in the kind of the first item's (tensor or numpy), so that dtypes compare."""
    if tensor_items and isinstance(image, np.ndarray):
        return torch.from_numpy(np.array(image))  # a private copy: the item may be read-only
    if not tensor_items and isinstance(image, torch.Tensor):
        return image.detach().cpu().numpy()
    return image


def _item_pair(item, name: str, index: int):
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        got = type(item).__name__
        if isinstance(item, (tuple, list)):
            got = f"a {got} of length {len(item)}"
        raise TypeError(f"{name}: item {index}: expected an (image, label) pair, got {got}")
    image, label = item
    if not _is_int(label):
        raise TypeError(
            f"{name}: item {index}: the label must be an int or a 0-d integer tensor, got {label!r} "
            f"({type(label).__name__})"
        )
    return image, int(label)


def _physical_memory() -> Optional[int]:
    """Bytes of physical memory, or None where the system does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _check_fits_in_memory(n: int, shape: tuple, itemsize: int, name: str) -> None:
    """``len(dataset)`` images are gathered into one array: refuse a length whose array would not
    fit in this machine's memory before allocating it (a ``__len__`` of 1e12 asked for 784 TB)."""
    need = n * itemsize * int(np.prod(shape))
    have = _physical_memory()
    if have is not None and need > have:
        raise ValueError(
            f"{name}: len(dataset) is {n:,}: {n:,} images of shape {shape} take {need / 1e9:,.1f} GB, "
            f"more than this machine's {have / 1e9:.1f} GB of memory; pass fewer images (e.g. a "
            "torch.utils.data.Subset)"
        )


@torch.no_grad()
def _from_dataset(ds: Dataset, layout: str, name: str, max_items: Optional[int]):
    if isinstance(ds, IterableDataset) or not hasattr(ds, "__len__"):
        items = iter(ds)
        n = None
    else:
        n = len(ds)
        if max_items is not None:
            n = min(n, max_items)
        items = (ds[i] for i in range(n))
    # Lists while the length is unknown, else a tensor or array (buf) and a tensor (labels) filled in place.
    buf: Any = None
    labels: Any = []
    pil = tensor_items = False
    count = 0
    for index, item in enumerate(items):
        if max_items is not None and index >= max_items:
            break
        raw, label = _item_pair(item, name, index)
        image = _item_image(raw, name, index)
        if buf is not None:
            image = _like(image, tensor_items)
        else:
            pil = _is_pil(raw)
            tensor_items = isinstance(image, torch.Tensor)
            shape, dtype = tuple(image.shape), image.dtype
            if len(shape) not in (2, 3):
                want = "(C, H, W)" if layout == "nchw" and not pil else "(H, W, C)"
                raise ValueError(f"{name}: item 0: expected an image of shape {want} or (H, W), got shape {shape}")
            if n is not None:
                _check_fits_in_memory(n, shape, image.element_size() if tensor_items else image.itemsize, name)
            if n is None:  # unknown length: grow a list of items, stacked once at the end
                buf = []
            elif tensor_items:
                buf = torch.empty((n,) + shape, dtype=dtype, device=image.device)
            else:
                buf = np.empty((n,) + shape, dtype=dtype)
            labels = torch.empty(n, dtype=torch.int64) if n is not None else []
        if tuple(image.shape) != shape or image.dtype != dtype:
            raise ValueError(
                f"{name}: item {index}: image of shape {tuple(image.shape)} and dtype {image.dtype} differs from "
                f"item 0 (shape {shape}, dtype {dtype}); all images must share one shape and dtype"
            )
        if isinstance(buf, list):
            buf.append(image)
            labels.append(label)
        else:
            buf[index] = image
            labels[index] = label
        count += 1
    if count == 0:
        raise ValueError(f"{name}: no images (the dataset is empty)")
    if isinstance(buf, list):
        buf = torch.stack(buf) if tensor_items else np.stack(buf)
        labels = torch.tensor(labels, dtype=torch.int64)
    if labels.numel() and int(labels.min()) < 0:
        index = int(torch.argmin(labels))
        raise ValueError(f"{name}: labels must be >= 0, item {index} has label {int(labels[index])}")
    images = _batch_pixels(buf, "nhwc" if pil else layout, name, "images")
    return images, labels


@torch.no_grad()
def _from_loader(loader: DataLoader, layout: str, name: str, max_items: Optional[int]):
    images_parts: list[torch.Tensor] = []
    label_parts: list[torch.Tensor] = []
    count = 0
    first_shape = None
    for index, batch in enumerate(loader):
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(f"{name}: batch {index}: expected an (images, labels) pair, got {type(batch).__name__}")
        images, labels = batch
        if not _is_array(images):
            raise TypeError(
                f"{name}: batch {index}: images must be a tensor or numpy array, got {type(images).__name__}"
            )
        images = _batch_pixels(images, layout, f"{name}: batch {index}", "images")
        labels = _batch_labels(labels, f"{name}: batch {index}")
        _check_lengths(images, labels, f"{name}: batch {index}")
        if first_shape is None:
            first_shape = (tuple(images.shape[1:]), images.dtype)
        elif (tuple(images.shape[1:]), images.dtype) != first_shape:
            raise ValueError(
                f"{name}: batch {index}: images of shape {tuple(images.shape[1:])} and dtype {images.dtype} differ "
                f"from batch 0 (shape {first_shape[0]}, dtype {first_shape[1]})"
            )
        if max_items is not None and count + images.shape[0] > max_items:
            images, labels = images[: max_items - count], labels[: max_items - count]
        images_parts.append(images)
        label_parts.append(labels)
        count += images.shape[0]
        if max_items is not None and count >= max_items:
            break
    if count == 0:
        raise ValueError(f"{name}: no images (the DataLoader yielded no batches)")
    if len(images_parts) == 1:
        return images_parts[0], label_parts[0]
    return torch.cat(images_parts), torch.cat(label_parts)
