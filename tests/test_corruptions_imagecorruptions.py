"""Statistical agreement with the ``imagecorruptions`` package (a ``bench`` extra; skipped when it
is absent) where it implements the same corruption: same images, same (ImageNet-C) constants
via ``corrupt(..., params=...)``. Its output is truncated to uint8, so ours is too here."""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from shiftguard import corruptions as C
from shiftguard.corruptions.cifar_c import IMAGECORRUPTIONS_PARAMS
from shiftguard.corruptions.figures import synthetic_scene


def _import_imagecorruptions():
    pytest.importorskip("cv2")
    pytest.importorskip("skimage")
    try:
        import pkg_resources  # noqa: F401
    except ImportError:  # setuptools >= 81 dropped it; imagecorruptions 1.1.2 only needs this
        shim = types.ModuleType("pkg_resources")
        shim.resource_filename = lambda pkg, path: str(Path(sys.modules[pkg].__file__).parent / path)
        sys.modules["pkg_resources"] = shim
    warnings.filterwarnings("ignore")
    try:
        import imagecorruptions
    except Exception as exc:  # absent (a bench extra), or unusable with this numpy / OpenCV
        pytest.skip(f"imagecorruptions not importable: {type(exc).__name__}: {exc}")
    return imagecorruptions


@pytest.fixture(scope="module")
def ic():
    return _import_imagecorruptions()


@pytest.fixture(scope="module")
def images():
    return synthetic_scene(48, 32, seed=21)


pytestmark = pytest.mark.usefixtures("torch_one_thread")  # conftest.py


def _theirs(ic, x: torch.Tensor, name: str, severity: int) -> np.ndarray:
    np.random.seed(0)
    arr = x.permute(0, 2, 3, 1).numpy()
    return np.stack([ic.corrupt(im, corruption_name=name, severity=severity) for im in arr]).astype(np.float64)


def _ours(x: torch.Tensor, name: str, severity: int) -> np.ndarray:
    suite = "cifar-c-extra" if name in C.names("cifar-c-extra") else "cifar-c"
    y = C.corrupt(x.double() / 255, name, severity, seed=4, suite=suite, params=IMAGECORRUPTIONS_PARAMS[name][severity - 1])
    return np.floor(y.permute(0, 2, 3, 1).numpy() * 255 + 1e-6)


@pytest.mark.parametrize("name", ["contrast", "brightness", "saturate", "defocus_blur", "zoom_blur"])
@pytest.mark.parametrize("severity", [1, 3, 5])
def test_deterministic_corruptions_match_pixel_for_pixel(ic, images, name, severity):
    diff = np.abs(_ours(images, name, severity) - _theirs(ic, images, name, severity))
    assert diff.mean() < 0.1 and diff.max() <= 1.0, (diff.mean(), diff.max())


@pytest.mark.parametrize("severity", [1, 3, 5])
def test_jpeg_matches_pil_within_a_level_on_average(ic, images, severity):
    diff = np.abs(_ours(images, "jpeg_compression", severity) - _theirs(ic, images, "jpeg_compression", severity))
    assert diff.mean() < 1.0


@pytest.mark.parametrize("name", ["gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "motion_blur", "snow"])
@pytest.mark.parametrize("severity", [1, 3, 5])
def test_random_corruptions_move_images_as_far_as_imagecorruptions(ic, images, name, severity):
    clean = images.permute(0, 2, 3, 1).numpy().astype(np.float64)
    ours = np.abs(_ours(images, name, severity) - clean).mean()
    theirs = np.abs(_theirs(ic, images, name, severity) - clean).mean()
    tol = 0.05 if name != "snow" else 0.08
    assert abs(ours - theirs) / theirs < tol, (ours, theirs)


def test_the_noise_is_unbiased_like_theirs(ic, images):
    clean = images.permute(0, 2, 3, 1).numpy().astype(np.float64)
    for name in ("gaussian_noise", "speckle_noise"):
        ours = (_ours(images, name, 2) - clean).mean()
        theirs = (_theirs(ic, images, name, 2) - clean).mean()
        assert abs(ours - theirs) < 1.0, (name, ours, theirs)
