"""Each vectorised primitive of ``shiftguard.corruptions`` against a slow, obviously-correct
reference: scipy / PIL / colorsys calls, or a per-image Python loop written here from the
published generation code."""

from __future__ import annotations

import colorsys
import io
import math
import os

import numpy as np
import pytest
import scipy.ndimage as ndi
import torch
from PIL import Image

from shiftguard.corruptions import _ops, cifar_c
from shiftguard.corruptions._jpeg import jpeg_roundtrip
from shiftguard.corruptions.figures import synthetic_scene

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # conftest.py


@pytest.mark.parametrize("mode", ["nearest", "reflect", "mirror", "constant", "wrap"])
@pytest.mark.parametrize("size", [(30, 28), (80, 70)])  # matrix path and convolution path
def test_gaussian_blur_matches_scipy_gaussian_filter(mode, size):
    x = torch.rand(2, 3, *size, dtype=torch.float64)
    ours = _ops.gaussian_blur(x, 1.7, mode=mode)
    ref = ndi.gaussian_filter(x.numpy(), sigma=(0, 0, 1.7, 1.7), mode=mode, truncate=4.0)
    assert np.allclose(ours.numpy(), ref, atol=1e-12)


def _disk_reference(radius: float, alias_blur: float) -> np.ndarray:
    half = 8 if radius <= 8 else int(radius)
    ksize = 3 if radius <= 8 else 5
    L = np.arange(-half, half + 1)
    X, Y = np.meshgrid(L, L)
    d = ((X**2 + Y**2) <= radius**2).astype(np.float64)
    d /= d.sum()
    t = np.arange(ksize) - (ksize - 1) / 2
    g = np.exp(-(t**2) / (2 * alias_blur**2))
    g /= g.sum()
    return ndi.correlate(d, np.outer(g, g), mode="mirror")  # cv2 default border = reflect-101


@pytest.mark.parametrize("radius,alias", [(0.3, 0.4), (1, 0.2), (1.5, 0.1), (3, 0.5), (10, 0.5)])
def test_defocus_disk_kernel_matches_its_definition(radius, alias):
    assert np.allclose(_ops.disk_kernel(radius, alias).numpy(), _disk_reference(radius, alias), atol=1e-12)


def test_defocus_blur_is_a_mirror_padded_correlation_with_the_disk():
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    ours = cifar_c.defocus_blur(x, (1.5, 0.1), None, 1.0)
    k = _disk_reference(1.5, 0.1)
    ref = np.stack([[ndi.correlate(x[n, c].numpy(), k, mode="mirror") for c in range(3)] for n in range(2)])
    assert np.allclose(ours.numpy(), ref, atol=1e-12)


def _motion_reference(img: np.ndarray, radius: float, sigma: float, angle: float) -> np.ndarray:
    """Per-image loop, from the ImageMagick / imagecorruptions definition."""
    width = 2 * int(math.ceil(radius)) + 1
    k = np.exp(-(np.arange(width) ** 2) / (2 * sigma**2))
    k /= k.sum()
    H, W = img.shape[-2:]
    out = np.zeros_like(img)
    for i in range(width):
        oy = math.ceil(i * math.sin(math.radians(angle)) - 0.5)
        ox = math.ceil(i * math.cos(math.radians(angle)) - 0.5)
        if abs(oy) >= H or abs(ox) >= W:
            break
        for r in range(H):
            for c in range(W):
                out[..., r, c] += k[i] * img[..., min(max(r + oy, 0), H - 1), min(max(c + ox, 0), W - 1)]
    return out


def test_motion_blur_matches_a_per_pixel_loop():
    x = torch.rand(3, 2, 20, 24, dtype=torch.float64)
    angles = torch.tensor([-44.0, 10.0, 131.0], dtype=torch.float64)
    ours = _ops.motion_blur(x, 6, 2.0, angles)
    for n in range(3):
        ref = _motion_reference(x[n].numpy(), 6, 2.0, float(angles[n]))
        assert np.allclose(ours[n].numpy(), ref, atol=1e-6)  # taps below 1e-7 are skipped


def _clipped_zoom_reference(img: np.ndarray, zoom: float) -> np.ndarray:
    h = img.shape[0]
    ch = int(np.ceil(h / zoom))
    top = (h - ch) // 2
    z = ndi.zoom(img[top : top + ch, top : top + ch], (zoom, zoom), order=1)
    trim = (z.shape[0] - h) // 2
    return z[trim : trim + h, trim : trim + h]


@pytest.mark.parametrize("zoom", [1.0, 1.06, 1.13, 1.25, 1.75, 2.25])
def test_clipped_zoom_matches_scipy_zoom(zoom):
    img = np.random.default_rng(0).random((32, 32))
    A = _ops.clipped_zoom_matrix(32, zoom)
    ours = (A @ torch.tensor(img) @ A.T).numpy()
    assert np.allclose(ours, _clipped_zoom_reference(img, zoom), atol=1e-10)


@pytest.mark.parametrize("ratio", [0.95, 0.85, 0.65, 0.5])
def test_pixelate_matches_pil_box_resize(ratio):
    x = synthetic_scene(4, 32, seed=2)
    f = x.double() / 255
    ours = (cifar_c.pixelate(f, ratio, None, 1.0).clamp(0, 1) * 255).round()
    for n in range(4):
        im = Image.fromarray(x[n].permute(1, 2, 0).numpy())
        m = int(32 * ratio)
        ref = np.asarray(im.resize((m, m), Image.BOX).resize((32, 32), Image.BOX)).astype(np.float64)
        diff = np.abs(ours[n].permute(1, 2, 0).numpy() - ref)
        assert diff.max() <= 1.0  # PIL's fixed-point coefficients can move a value by one level


def _pil_jpeg(arr: np.ndarray, q: int) -> np.ndarray:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=q)
    return np.asarray(Image.open(buf)).astype(np.float64)


@pytest.mark.parametrize("quality", [80, 58, 40, 15, 7])
def test_jpeg_roundtrip_is_close_to_pil(quality):
    x = synthetic_scene(6, 32, seed=4)
    ours = jpeg_roundtrip(x.double(), quality)
    ref = np.stack([_pil_jpeg(x[n].permute(1, 2, 0).numpy(), quality) for n in range(6)]).transpose(0, 3, 1, 2)
    err = np.abs(ours.numpy() - ref)
    distortion = np.abs(x.double().numpy() - ref).mean()
    assert err.mean() < 1.5, err.mean()  # integer-DCT / fixed-point differences only
    assert err.mean() < 0.25 * distortion


def test_jpeg_roundtrip_grey_and_odd_sizes_are_close_to_pil():
    x = synthetic_scene(3, 40, seed=5)[:, :1, :37, :29].contiguous()
    ours = jpeg_roundtrip(x.double(), 30)
    ref = np.stack([_pil_jpeg(x[n, 0].numpy(), 30) for n in range(3)])[:, None]
    assert np.abs(ours.numpy() - ref).mean() < 1.0


def test_hsv_value_shift_matches_colorsys_round_trip():
    x = torch.rand(2, 3, 6, 6, dtype=torch.float64)
    x[0, :, 0, 0] = 0.0  # black pixel
    ours = _ops.hsv_value_shift(x, 0.3)
    for n in range(2):
        for i in range(6):
            for j in range(6):
                h, s, v = colorsys.rgb_to_hsv(*x[n, :, i, j].tolist())
                ref = colorsys.hsv_to_rgb(h, s, min(v + 0.3, 1.0))
                assert np.allclose(ours[n, :, i, j].numpy(), ref, atol=1e-12)


@pytest.mark.parametrize("gain,offset", [(0.1, 0.0), (2.0, 0.1), (2.5, 0.2)])
def test_hsv_saturation_matches_colorsys_round_trip(gain, offset):
    x = torch.rand(2, 3, 6, 6, dtype=torch.float64)
    x[0, :, 1, 1] = 0.4  # grey pixel: hue 0 in skimage and colorsys
    ours = _ops.hsv_saturation_affine(x, gain, offset)
    for n in range(2):
        for i in range(6):
            for j in range(6):
                h, s, v = colorsys.rgb_to_hsv(*x[n, :, i, j].tolist())
                ref = colorsys.hsv_to_rgb(h, min(max(s * gain + offset, 0.0), 1.0), v)
                assert np.allclose(ours[n, :, i, j].numpy(), ref, atol=1e-12)


@pytest.mark.parametrize("swap_prob", [1.0, 0.5])
def test_local_shuffle_matches_the_sequential_swap_loop(swap_prob):
    N, H, W, d, iters = 3, 12, 10, 2, 2
    x = torch.rand(N, 2, H, W, dtype=torch.float64)
    ours = cifar_c.local_shuffle(x, d, iters, torch.Generator().manual_seed(5), swap_prob=swap_prob)
    g = torch.Generator().manual_seed(5)  # replay the same draws, in the documented order
    hs, ws = list(range(H - d, d, -1)), list(range(W - d, d, -1))
    draws = torch.empty(iters, len(hs), len(ws), 2, N, dtype=torch.long)
    do = torch.ones(iters, len(hs), len(ws), N, dtype=torch.bool)
    for it in range(iters):
        for hi in range(len(hs)):
            draws[it, hi] = torch.randint(-d, d, (len(ws), 2, N), generator=g)
            if swap_prob < 1:
                do[it, hi] = torch.rand((len(ws), N), generator=g) < swap_prob
    for n in range(N):
        img = x[n].numpy().copy()
        for it in range(iters):
            for hi, h in enumerate(hs):
                for wi, w in enumerate(ws):
                    if not bool(do[it, hi, wi, n]):
                        continue
                    dx, dy = int(draws[it, hi, wi, 0, n]), int(draws[it, hi, wi, 1, n])
                    a = img[:, h, w].copy()
                    img[:, h, w] = img[:, h + dy, w + dx]
                    img[:, h + dy, w + dx] = a
        assert np.array_equal(ours[n].numpy(), img)


def _plasma_reference(mapsize: int, decay: float, gen: torch.Generator) -> np.ndarray:
    """make_cifar_c.py ``plasma_fractal`` for one map, drawing the same numbers in the same order."""
    m = np.zeros((mapsize, mapsize))
    step, wibble = mapsize, 100.0

    def wibbled(a):
        u = torch.rand((1,) + a.shape, generator=gen, dtype=torch.float64)[0].numpy() * 2 - 1
        return a / 4 + wibble * wibble * u

    while step >= 2:
        h = step // 2
        c = m[0::step, 0::step]
        sq = c + np.roll(c, -1, axis=0)
        sq += np.roll(sq, -1, axis=1)
        m[h::step, h::step] = wibbled(sq)
        dr, ul = m[h::step, h::step], m[0::step, 0::step]
        m[0::step, h::step] = wibbled(dr + np.roll(dr, 1, axis=0) + ul + np.roll(ul, -1, axis=1))
        m[h::step, 0::step] = wibbled(dr + np.roll(dr, 1, axis=1) + ul + np.roll(ul, -1, axis=0))
        step //= 2
        wibble /= decay
    m -= m.min()
    return m / m.max()


def test_plasma_fractal_matches_the_published_recursion():
    like = torch.empty(0, dtype=torch.float64)
    ours = _ops.plasma_fractal(1, 32, 1.75, torch.Generator().manual_seed(3), like)[0]
    ref = _plasma_reference(32, 1.75, torch.Generator().manual_seed(3))
    assert np.allclose(ours.numpy(), ref, atol=1e-9)


def test_plasma_corner_has_the_statistics_of_the_full_map_corner():
    like = torch.empty(0)
    g = torch.Generator().manual_seed(0)
    corner = _ops.plasma_fractal_corner(192, 256, 1.4, 28, g, like)
    full = _ops.plasma_fractal(192, 256, 1.4, g, like)[:, :28, :28]

    def stats(z):
        span = z.flatten(1).amax(1) - z.flatten(1).amin(1)
        step = (z[:, 1:] - z[:, :-1]).abs().mean()
        return torch.stack([z.mean(), z.std(), span.mean(), step * 10])

    a, b = stats(corner), stats(full)
    assert torch.allclose(a, b, atol=0.04), (a, b)


def test_canny_matches_skimage_on_digits(mnist_dir):
    # scikit-image is a test extra: skipped without it, except in CI (``CI`` set), where it must run
    if os.environ.get("CI"):
        import skimage.feature as feature
    else:
        feature = pytest.importorskip("skimage.feature")
    from shiftguard.data import load

    x = load("mnist", "test", root=mnist_dir).images[:16].double() / 255
    ours = _ops.canny(x, 1.0, 0.1, 0.2)
    ref = np.stack(
        [feature.canny(x[n, 0].numpy(), sigma=1.0, low_threshold=0.1, high_threshold=0.2) for n in range(16)]
    )
    agree = (ours[:, 0].numpy() == ref).mean()
    assert agree > 0.99, agree


def test_distance_to_edges_matches_scipy_edt():
    rng = np.random.default_rng(1)
    e = rng.random((4, 1, 20, 24)) < 0.03
    e[3] = False
    ours = _ops.distance_to_edges(torch.tensor(e), 20.0).numpy()
    for n in range(3):
        ref = np.minimum(ndi.distance_transform_edt(~e[n, 0]), 20.0)
        assert np.allclose(ours[n, 0], ref, atol=1e-5)
    assert np.all(ours[3] == 20.0)


def test_equalize_hist_matches_the_opencv_formula():
    rng = np.random.default_rng(2)
    v = rng.integers(3, 40, size=(2, 1, 16, 16)).astype(np.float64)
    ours = _ops.equalize_hist_u8(torch.tensor(v)).numpy()
    for n in range(2):
        hist = np.bincount(v[n].astype(int).ravel(), minlength=256)
        cdf = np.cumsum(hist)
        first = hist[hist > 0][0]
        lut = np.clip(np.round((cdf - first) * 255.0 / (cdf[-1] - first)), 0, 255)
        assert np.array_equal(ours[n], lut[v[n].astype(int)])


def test_filter_matrix_is_the_padded_correlation():
    k = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    for mode in ("nearest", "reflect", "mirror", "constant"):
        M = _ops.filter_matrix(7, k, mode)
        sig = np.arange(7.0) ** 2
        ref = ndi.correlate1d(sig, k.numpy(), mode=mode)
        assert np.allclose(M.numpy() @ sig, ref)
