"""Batched, deterministic image corruptions: MNIST-C and CIFAR-10-C on CPU or GPU.

>>> from shiftguard import corruptions
>>> corruptions.names("mnist-c")[:3]
['shot_noise', 'impulse_noise', 'glass_blur']
>>> corruptions.canonical_name("Motion Blur"), corruptions.canonical_suite("CIFAR_C")
('motion_blur', 'cifar-c')
>>> x_shifted = corruptions.corrupt(x, "fog", severity=3, seed=0)  # doctest: +SKIP

Suites (the QACT and NED papers [QACT], [NED] evaluate on "MNISTC" and "CIFAR10C"):

- ``"mnist-c"``: the 15 corruptions of Mu & Gilmer (2019), five severities each, severity 3 =
  the published MNIST-C setting (:mod:`.mnist_c`).
- ``"cifar-c"``: the 15 benchmark corruptions of Hendrycks & Dietterich (2019) with the
  CIFAR-10-C constants (:mod:`.cifar_c`); ``"cifar-c-extra"``: its 4 extra corruptions.

Images are ``(N, C, H, W)``: ``uint8`` in 0..255 or floating point in [0, 1]. Float input outside
[0, 1] or not finite is a ``ValueError`` (never clipped: a mean/std-normalised batch must be
corrupted before its normalisation). The output has the input's shape, dtype and device and is
clipped to the valid range, as the reference scripts clip theirs; ``uint8`` results are rounded to
the nearest level (the published scripts truncate, a bias of half a level). Besides a tensor,
``corrupt`` takes an ``ImageDataset`` (and returns one) or any other labelled form
:func:`shiftguard.data.as_tensors` reads (and returns ``(images, labels)``). All randomness comes
from one ``torch.Generator`` seeded with ``seed`` on the images' device, so the same call gives
the same output; the random stream is consumed in chunks of ``CHUNK`` images, so an image's noise
depends on its position in the batch.

The AugMix training augmentation (:mod:`.augmix`: :class:`AugMix`, :func:`augmix_ops`,
:func:`jensen_shannon_consistency`) lives here too: it reuses the engine's warps, and its operation
set depends on the suite the model is tested on.
"""

from __future__ import annotations

from typing import Optional

from shiftguard.corruptions.augmix import AugMix, augmix_ops, jensen_shannon_consistency
from shiftguard.corruptions.engine import (
    CHUNK,
    CORRUPTION_REGISTRIES,
    SUITE_REGISTRY,
    SUITES,
    CorruptionSpec,
    canonical_name,
    canonical_suite,
    corrupt,
    get,
    names,
    warm_up,
)

__all__ = [
    "SUITES",
    "SUITE_REGISTRY",
    "CORRUPTION_REGISTRIES",
    "CorruptionSpec",
    "names",
    "get",
    "canonical_name",
    "canonical_suite",
    "corrupt",
    "warm_up",
    "gallery",
    "CHUNK",
    "AugMix",
    "augmix_ops",
    "jensen_shannon_consistency",
]


def gallery(images, suite: Optional[str] = None, **kwargs):
    """Figure of corruptions (rows) x severities 0-5 (columns); see :func:`.figures.gallery`."""
    from .figures import gallery as _gallery

    return _gallery(images, suite, **kwargs)
