"""Seeded, batched image augmentations in pure torch, and the two-view batches of InfoNCE.

The views of the InfoNCE baseline [Kirchhof, URL App. B.2] are "two random crops per input image"; SimCLR
(Chen et al. 2020) adds flips and colour jitter. This module gives the same operations for float images
``(N, C, H, W)`` in ``[0, 1]`` without torchvision: every random number comes from one optional
``torch.Generator`` (same seed, same output), images are transformed as a batch (one ``grid_sample`` for all
crops), and every image draws its own parameters.

* :func:`random_resized_crop` -- torchvision's ``RandomResizedCrop`` sampling (area fraction in ``scale``,
  log-uniform aspect ratio in ``ratio``, 10 tries, then the central crop of the nearest allowed ratio),
  with sub-pixel crop boxes resized back to ``(H, W)`` by bilinear interpolation.
* :func:`random_horizontal_flip` -- mirror each image with probability ``p``.
* :func:`brightness_contrast_jitter` -- torchvision's ``ColorJitter`` brightness and contrast.
* :class:`Augment` -- the composition crop -> flip -> brightness -> contrast; horizontal flips are off by
  default because a mirrored digit is not a digit (flip natural images with ``hflip=True``).
* :func:`two_views` -- ``(views (2N, C, H, W), ids (2N,))``: two independent augmentations of the batch,
  ``views[i]`` and ``views[i + N]`` from image ``i``, ``ids = [0..N-1, 0..N-1]`` -- the input of
  ``shiftguard.losses.InfoNCELoss``.

Range: outputs lie in ``[0, 1]`` for inputs in ``[0, 1]``. Cropping and flipping only move or convexly
interpolate pixel values (``padding_mode="border"``); brightness and contrast are affine maps followed by a
clamp to ``[0, 1]``, which is part of their definition (torchvision's ``adjust_brightness`` and
``adjust_contrast`` clamp the same way). Every operation ends with that clamp, so float rounding of the
interpolation weights cannot leave the range either; on values already in ``[0, 1]`` it changes nothing.
Half-precision images are transformed in float32 and returned in their dtype.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from shiftguard._validation import check_tensor

__all__ = [
    "Augment",
    "random_resized_crop",
    "random_horizontal_flip",
    "brightness_contrast_jitter",
    "two_views",
]

#: Tries of torchvision's ``RandomResizedCrop`` before falling back to the central crop.
CROP_TRIES = 10

#: ITU-R 601-2 luma weights (torchvision's ``rgb_to_grayscale``), for the contrast jitter's mean of RGB images.
_LUMA = (0.2989, 0.587, 0.114)


# ----------------------------------------------------------------------------------------------- validation


def _check_images(images) -> torch.Tensor:
    x = check_tensor(images, "images", ndim=4, floating=True, finite=True)
    if x.numel() and (float(x.min()) < 0.0 or float(x.max()) > 1.0):
        raise ValueError(f"images: expected values in [0, 1], got range [{float(x.min()):.4g}, {float(x.max()):.4g}]")
    return x


def _check_range(value, name: str, *, upper: Optional[float] = None) -> tuple[float, float]:
    """A pair ``(lo, hi)`` with ``0 < lo <= hi`` (``<= upper`` when given), finite."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"{name}: expected a pair (lo, hi), got {value!r}")
    try:
        lo, hi = float(value[0]), float(value[1])
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected a pair of numbers, got {value!r}") from exc
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 or lo > hi or (upper is not None and hi > upper):
        bound = f" <= {upper:g}" if upper is not None else ""
        raise ValueError(f"{name}: expected finite 0 < lo <= hi{bound}, got {value!r}")
    return lo, hi


def _check_unit(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name}: expected a probability in [0, 1], got {value!r}")
    return float(value)


def _check_strength(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a finite value >= 0, got {value!r}")
    return float(value)


def _check_generator(generator) -> Optional[torch.Generator]:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    return generator


def _rand(generator: Optional[torch.Generator], *shape: int) -> torch.Tensor:
    """``U[0, 1)`` float64 numbers on the CPU or the generator's device (moved to the images' later)."""
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(*shape, generator=generator, device=device, dtype=torch.float64)


def _working(images: torch.Tensor) -> torch.Tensor:
    return images.float() if images.dtype in (torch.float16, torch.bfloat16) else images


# ------------------------------------------------------------------------------------------------ operations


def _crop_boxes(n: int, height: int, width: int, scale, ratio, generator):
    """``(x0, y0, w, h)`` float64 ``(N,)`` each, in pixels, sampled as torchvision's ``RandomResizedCrop``."""
    area = float(height * width)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    target = area * (scale[0] + (scale[1] - scale[0]) * _rand(generator, n, CROP_TRIES))
    aspect = torch.exp(log_lo + (log_hi - log_lo) * _rand(generator, n, CROP_TRIES))
    w_try, h_try = torch.sqrt(target * aspect), torch.sqrt(target / aspect)
    ok = (w_try <= width) & (h_try <= height)
    first = torch.where(ok.any(1), ok.to(torch.int64).argmax(1), torch.zeros(n, dtype=torch.int64, device=ok.device))
    w = w_try.gather(1, first.unsqueeze(1)).squeeze(1)
    h = h_try.gather(1, first.unsqueeze(1)).squeeze(1)
    # No try fits: the central crop whose aspect ratio is the allowed one nearest to the image's.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        fb_w, fb_h = float(width), width / ratio[0]
    elif in_ratio > ratio[1]:
        fb_w, fb_h = height * ratio[1], float(height)
    else:
        fb_w, fb_h = float(width), float(height)
    fits = ok.any(1)
    w = torch.where(fits, w, torch.full_like(w, fb_w))
    h = torch.where(fits, h, torch.full_like(h, fb_h))
    u, v = _rand(generator, n), _rand(generator, n)
    x0 = torch.where(fits, u.to(w.device) * (width - w), (width - w) / 2)
    y0 = torch.where(fits, v.to(h.device) * (height - h), (height - h) / 2)
    return x0, y0, w, h


def _crop(x: torch.Tensor, scale, ratio, generator) -> torch.Tensor:
    n, _, height, width = x.shape
    x0, y0, w, h = (t.to(x.device) for t in _crop_boxes(n, height, width, scale, ratio, generator))
    full = (w == width) & (h == height)
    if bool(full.all()):
        return x  # the full-image crop resized to the image's own size is the identity
    # Output pixel centre u maps to x0 + (u + 1/2) w / W: in grid_sample's normalised coordinates
    # (align_corners=False) that is x_in = (w / W) x_out + (2 x0 + w) / W - 1.
    theta = torch.zeros(n, 2, 3, dtype=torch.float64, device=x.device)
    theta[:, 0, 0] = w / width
    theta[:, 0, 2] = (2 * x0 + w) / width - 1
    theta[:, 1, 1] = h / height
    theta[:, 1, 2] = (2 * y0 + h) / height - 1
    grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return torch.where(full.view(n, 1, 1, 1), x, out.clamp(0.0, 1.0))


def _flip(x: torch.Tensor, p: float, generator) -> torch.Tensor:
    mask = (_rand(generator, x.shape[0]) < p).to(x.device)
    return torch.where(mask.view(-1, 1, 1, 1), x.flip(-1), x)


def _factors(n: int, strength: float, generator, like: torch.Tensor) -> torch.Tensor:
    """``(N, 1, 1, 1)`` factors ``U[max(0, 1 - s), 1 + s]`` (exactly 1 for ``s = 0``)."""
    lo, hi = max(0.0, 1.0 - strength), 1.0 + strength
    return (lo + (hi - lo) * _rand(generator, n)).to(device=like.device, dtype=like.dtype).view(n, 1, 1, 1)


def _jitter(x: torch.Tensor, brightness: float, contrast: float, generator) -> torch.Tensor:
    n, c = x.shape[:2]
    b = _factors(n, brightness, generator, x)
    k = _factors(n, contrast, generator, x)
    x = (x * b).clamp(0.0, 1.0)  # adjust_brightness: blend with black
    if c == 3:
        gray = x[:, 0] * _LUMA[0] + x[:, 1] * _LUMA[1] + x[:, 2] * _LUMA[2]
        mean = gray.mean(dim=(1, 2)).view(n, 1, 1, 1)
    else:
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
    return (k * x + (1 - k) * mean).clamp(0.0, 1.0)  # adjust_contrast: blend with the mean grey


# ------------------------------------------------------------------------------------------------ public API


def random_resized_crop(
    images,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Crop a random box from each image and resize it back to ``(H, W)`` (bilinear).

    ``images``: float ``(N, C, H, W)`` in ``[0, 1]``. The box covers a fraction ``U(scale)`` of the area
    with aspect ratio (width / height) log-uniform in ``ratio``; as in torchvision's ``RandomResizedCrop``,
    10 draws are tried per image and, if none fits inside the image, the central crop with the allowed
    aspect ratio nearest to the image's is used. Boxes are continuous (sub-pixel), not rounded to
    pixels. An image whose box is the whole image is returned unchanged (exactly), so ``scale=(1, 1)``
    is the identity for images whose aspect ratio lies in ``ratio``.

    Returns a tensor of the input's shape, dtype and device. Raises ``TypeError`` / ``ValueError``
    naming ``images``, ``scale``, ``ratio`` or ``generator`` (scale needs ``0 < lo <= hi <= 1``, ratio
    ``0 < lo <= hi``).
    """
    x = _check_images(images)
    scale_ = _check_range(scale, "scale", upper=1.0)
    ratio_ = _check_range(ratio, "ratio")
    gen = _check_generator(generator)
    if x.shape[0] == 0:
        return x.clone()
    return _crop(_working(x), scale_, ratio_, gen).to(x.dtype)


def random_horizontal_flip(images, p: float = 0.5, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Mirror each image (along ``W``) with probability ``p``; ``images`` float ``(N, C, H, W)`` in ``[0, 1]``."""
    x = _check_images(images)
    p_ = _check_unit(p, "p")
    gen = _check_generator(generator)
    if x.shape[0] == 0:
        return x.clone()
    return _flip(x, p_, gen)


def brightness_contrast_jitter(
    images, brightness: float = 0.4, contrast: float = 0.4, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """torchvision's ``ColorJitter`` brightness then contrast, one factor pair per image.

    Brightness: ``clamp(b x, 0, 1)`` with ``b ~ U[max(0, 1 - brightness), 1 + brightness]``. Contrast:
    ``clamp(k x + (1 - k) m, 0, 1)`` with ``k ~ U[max(0, 1 - contrast), 1 + contrast]`` and ``m`` the
    image's mean grey level (ITU-R 601-2 luma for 3 channels, the plain mean otherwise). The clamps are
    part of the transform (as in torchvision). ``0`` disables a jitter exactly. The order is fixed
    (torchvision draws a random order of its four jitters per call; hue and saturation are not offered).

    ``images``: float ``(N, C, H, W)`` in ``[0, 1]``; returns the same shape, dtype and device. Raises
    ``TypeError`` / ``ValueError`` naming ``images``, ``brightness``, ``contrast`` or ``generator``.
    """
    x = _check_images(images)
    b = _check_strength(brightness, "brightness")
    c = _check_strength(contrast, "contrast")
    gen = _check_generator(generator)
    if x.shape[0] == 0:
        return x.clone()
    return _jitter(_working(x), b, c, gen).to(x.dtype)


class Augment:
    """The composed augmentation: random resized crop -> horizontal flip -> brightness -> contrast.

    Args:
        crop_scale: area fraction range of the crop, ``0 < lo <= hi <= 1``; ``(0.2, 1.0)`` by default
            (milder than SimCLR's ``(0.08, 1.0)``, which on 28 x 28 digits often cuts the digit away);
            ``(1.0, 1.0)`` disables cropping (the identity for images of an allowed aspect ratio).
        crop_ratio: aspect-ratio range of the crop, ``(3/4, 4/3)`` as torchvision.
        hflip: flip horizontally; off by default because mirrored digits are not digits.
        flip_p: flip probability when ``hflip`` is on.
        brightness, contrast: jitter strengths (``>= 0``; 0 disables); 0.4 by default (SimCLR's colour
            jitter at strength 0.5, without its hue and saturation, applied always rather than with
            probability 0.8).

    ``augment(images, generator=None)`` returns augmented float ``(N, C, H, W)`` images in ``[0, 1]``;
    each image draws its own parameters, in a fixed order from ``generator`` (or the global RNG).
    Constructor arguments are validated (errors name them); so are ``images`` and ``generator``.

    Example:
        >>> import torch
        >>> from shiftguard.data.augment import Augment
        >>> x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
        >>> a = Augment()(x, torch.Generator().manual_seed(1))
        >>> torch.equal(a, Augment()(x, torch.Generator().manual_seed(1))), a.shape
        (True, torch.Size([4, 1, 28, 28]))
    """

    def __init__(
        self,
        crop_scale: Sequence[float] = (0.2, 1.0),
        crop_ratio: Sequence[float] = (3 / 4, 4 / 3),
        hflip: bool = False,
        flip_p: float = 0.5,
        brightness: float = 0.4,
        contrast: float = 0.4,
    ):
        self.crop_scale = _check_range(crop_scale, "crop_scale", upper=1.0)
        self.crop_ratio = _check_range(crop_ratio, "crop_ratio")
        if not isinstance(hflip, bool):
            raise TypeError(f"hflip: expected a bool, got {type(hflip).__name__}")
        self.hflip = hflip
        self.flip_p = _check_unit(flip_p, "flip_p")
        self.brightness = _check_strength(brightness, "brightness")
        self.contrast = _check_strength(contrast, "contrast")

    def __repr__(self) -> str:
        return (
            f"Augment(crop_scale={self.crop_scale}, crop_ratio={self.crop_ratio}, hflip={self.hflip}, "
            f"flip_p={self.flip_p}, brightness={self.brightness}, contrast={self.contrast})"
        )

    def __call__(self, images, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        x = _check_images(images)
        gen = _check_generator(generator)
        if x.shape[0] == 0:
            return x.clone()
        out = _crop(_working(x), self.crop_scale, self.crop_ratio, gen)
        if self.hflip:
            out = _flip(out, self.flip_p, gen)
        return _jitter(out, self.brightness, self.contrast, gen).to(x.dtype)


def two_views(
    images, generator: Optional[torch.Generator] = None, augment: Optional[Augment] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent augmentations of a batch, stacked, with their instance ids.

    ``images``: float ``(N, C, H, W)`` in ``[0, 1]``. Returns ``(views, ids)``: ``views`` float
    ``(2N, C, H, W)`` with ``views[:N] = augment(images)`` and ``views[N:]`` a second, independent draw;
    ``ids`` int64 ``(2N,)`` equal to ``[0, ..., N-1, 0, ..., N-1]`` on the images' device, so
    ``InfoNCELoss()(model(views), ids)`` is the SimCLR / InfoNCE objective. ``augment`` defaults to
    :class:`Augment` ``()``. Raises as :class:`Augment`, and ``TypeError`` naming ``augment`` for a
    non-callable.
    """
    if augment is None:
        augment = Augment()
    elif not callable(augment):
        raise TypeError(
            f"augment: expected an Augment (or a callable (images, generator) -> images), got {type(augment).__name__}"
        )
    x = _check_images(images)
    gen = _check_generator(generator)
    first, second = augment(x, gen), augment(x, gen)
    ids = torch.arange(x.shape[0], device=x.device).repeat(2)
    return torch.cat([first, second]), ids
