"""Vectorised baseline-JPEG round trip (encode + decode) in torch.

Stands for ``PIL.Image.save(buf, "JPEG", quality=q)`` followed by ``Image.open(buf)`` as used by
``jpeg_compression`` in make_cifar_c.py, but for a whole batch at once. It follows the libjpeg
pipeline that PIL drives with its defaults:

1. RGB -> YCbCr (JFIF, ITU-R BT.601 full range, rounded to 8 bit);
2. 4:2:0 chroma subsampling by 2x2 averaging (libjpeg ``h2v2_downsample``) for RGB input;
   single-channel input is coded as one luma component;
3. edge replication to whole 8x8 blocks (16x16 MCUs with subsampling);
4. level shift by -128, orthonormal 8x8 DCT-II (ITU-T T.81, A.3.3), division by the quality-scaled
   standard tables of T.81 Annex K (libjpeg ``jpeg_quality_scaling``: ``5000 / q`` below 50,
   ``200 - 2 q`` above; entries ``floor((t * s + 50) / 100)`` clamped to 1..255) and rounding;
5. dequantisation, inverse DCT, +128, clamping to 0..255;
6. "fancy" triangle-filter chroma upsampling (libjpeg ``h2v2_fancy_upsample``: weights 3/4, 1/4
   per axis, edges replicated) and YCbCr -> RGB, rounded to 8 bit.

Entropy coding is lossless, so it is skipped. The differences from libjpeg are its integer
(``islow``) DCT and fixed-point colour arithmetic; ``tests/test_corruptions_cifar.py`` measures
the distance to PIL at the CIFAR-10-C qualities.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from . import _kernels
from ._ops import lmul

Tensor = torch.Tensor

LUMA_TABLE = [
    16, 11, 10, 16, 24, 40, 51, 61,
    12, 12, 14, 19, 26, 58, 60, 55,
    14, 13, 16, 24, 40, 57, 69, 56,
    14, 17, 22, 29, 51, 87, 80, 62,
    18, 22, 37, 56, 68, 109, 103, 77,
    24, 35, 55, 64, 81, 104, 113, 92,
    49, 64, 78, 87, 103, 121, 120, 101,
    72, 92, 95, 98, 112, 100, 103, 99,
]  # fmt: skip
CHROMA_TABLE = [
    17, 18, 24, 47, 99, 99, 99, 99,
    18, 21, 26, 66, 99, 99, 99, 99,
    24, 26, 56, 99, 99, 99, 99, 99,
    47, 66, 99, 99, 99, 99, 99, 99,
] + [99] * 32  # fmt: skip


def quant_table(base: list[int], quality: int) -> Tensor:
    """libjpeg ``jpeg_set_quality``: the standard table scaled for ``quality`` in 1..100 (8x8)."""
    q = min(max(int(quality), 1), 100)
    scale = 5000 // q if q < 50 else 200 - 2 * q
    t = torch.tensor(base, dtype=torch.float64)
    t = torch.floor((t * scale + 50) / 100).clamp(1, 255)
    return t.view(8, 8)


def dct_matrix(dtype=torch.float64, device=None) -> Tensor:
    """Orthonormal 8-point DCT-II matrix ``D`` (``D @ x`` transforms a column)."""
    k = torch.arange(8, dtype=torch.float64)
    D = torch.cos((2 * k[None, :] + 1) * k[:, None] * math.pi / 16) * math.sqrt(2 / 8)
    D[0] /= math.sqrt(2)
    return D.to(dtype=dtype, device=device)


def _block_dct(n: int) -> Tensor:
    """``(n, n)`` block-diagonal matrix of 8-point DCTs (n a multiple of 8): the 8x8 block DCT
    of a plane ``p`` is ``B p B^T``."""
    return torch.block_diag(*([dct_matrix(torch.float64)] * (n // 8)))


def _replicate_pad(n: int, n_pad: int) -> Tensor:
    """``(n_pad, n)``: edge replication of a length-``n`` signal to ``n_pad`` samples."""
    P = torch.zeros(n_pad, n, dtype=torch.float64)
    P[torch.arange(n_pad), torch.arange(n_pad).clamp(max=n - 1)] = 1.0
    return P


def _mean2(n: int) -> Tensor:
    """``(n / 2, n)``: mean of sample pairs (libjpeg ``h2v2_downsample`` along one axis)."""
    return torch.kron(torch.eye(n // 2, dtype=torch.float64), torch.full((1, 2), 0.5, dtype=torch.float64))


def _fancy_up(m: int) -> Tensor:
    """``(2m, m)``: libjpeg ``h2v2_fancy_upsample`` along one axis (weights 3/4, 1/4, edges
    replicated)."""
    U = torch.zeros(2 * m, m, dtype=torch.float64)
    i = torch.arange(m)
    U[2 * i, i] += 0.75
    U[2 * i, (i - 1).clamp(min=0)] += 0.25
    U[2 * i + 1, i] += 0.75
    U[2 * i + 1, (i + 1).clamp(max=m - 1)] += 0.25
    return U


@lru_cache(maxsize=64)
def _axis_maps(n: int, colour: bool, dtype: torch.dtype, device: str) -> tuple[Tensor, ...]:
    """Per-axis linear maps of a side of ``n`` pixels: luma forward ``(n_pad, n)`` (edge padding
    then block DCT) and inverse ``(n, n_pad)`` (inverse block DCT then crop); for colour images
    also chroma forward ``(n_pad / 2, n)`` (padding, 2:1 mean, block DCT), inverse ``(m, m)`` and
    the fancy upsampling with crop ``(n, m)``. Luma is padded to whole MCUs (16) with chroma
    subsampling, to whole blocks (8) otherwise."""
    n_pad = -(-n // 16) * 16 if colour else -(-n // 8) * 8
    P = _replicate_pad(n, n_pad)
    D = _block_dct(n_pad)
    maps = [D @ P, D.T[:n]]
    if colour:
        m = n_pad // 2
        Dc = _block_dct(m)
        maps += [Dc @ _mean2(n_pad) @ P, Dc.T, _fancy_up(m)[:n]]
    return tuple(t.to(dtype=dtype, device=device).contiguous() for t in maps)


@lru_cache(maxsize=64)
def _tiled_table(base: tuple, quality: int, h: int, w: int, dtype: torch.dtype, device: str) -> Tensor:
    return quant_table(list(base), quality).repeat(h // 8, w // 8).to(dtype=dtype, device=device)


def _code(p: Tensor, Fr: Tensor, Fc: Tensor, Ir: Tensor, Ic: Tensor, q: Tensor) -> Tensor:
    """Level-shifted planes ``p`` (M, h, w) (values - 128) through block DCT (``Fr``/``Fc``
    include padding and chroma averaging), quantisation with the tiled table ``q``,
    dequantisation and inverse DCT (``Ir``/``Ic``), clamped to -128..127 (0..255 before the
    level shift)."""
    coef = torch.matmul(lmul(Fr, p), Fc.transpose(0, 1))
    coef = coef.div_(q).round_().mul_(q)
    return torch.matmul(lmul(Ir, coef), Ic.transpose(0, 1)).clamp_(-128.0, 127.0)


# JFIF colour conversion (ITU-R BT.601 full range)
_RGB2YCC = (
    (0.299, 0.587, 0.114),
    (-0.168735892, -0.331264108, 0.5),
    (0.5, -0.418687589, -0.081312411),
)
_YCC2RGB = ((1.0, 0.0, 1.402), (1.0, -0.344136286, -0.714136286), (1.0, 1.772, 0.0))

#: Images per step: a block's intermediates stay in cache.
BLOCK = 128


def jpeg_roundtrip(x: Tensor, quality: int) -> Tensor:
    """JPEG encode/decode of ``x`` (N, C, H, W) with C in {1, 3}: ``uint8`` or float on the 0..255
    scale. Returns the decoded images (integers) with the dtype of ``x``.

    Every linear step (padding, 2:1 chroma averaging, block DCT, inverse DCT, chroma upsampling,
    cropping) is a matrix along each image axis and the colour conversions are 3x3 matrices, so a
    block of images costs a few small matmuls and element-wise passes that stay in cache. The
    level shift by 128 is carried in the colour conversion (Y - 128, Cb - 128, Cr - 128).
    """
    N, C, H, W = x.shape
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    dev = str(x.device)
    out = torch.empty_like(x)
    if C == 1:
        Fr, Ir = _axis_maps(H, False, dt, dev)
        Fc, Ic = _axis_maps(W, False, dt, dev)
        q = _tiled_table(tuple(LUMA_TABLE), quality, Fr.shape[0], Fc.shape[0], dt, dev)
        for i in range(0, N, BLOCK):
            v = x[i : i + BLOCK, 0].to(dt)
            v = v - 128.0 if x.dtype == torch.uint8 else v.round().clamp_(0, 255).sub_(128.0)
            out[i : i + BLOCK, 0] = _code(v, Fr, Fc, Ir, Ic, q).round_().add_(128.0)
        return out
    Fr, Ir, Fcr, Icr, Ur = _axis_maps(H, True, dt, dev)
    Fc, Ic, Fcc, Icc, Uc = _axis_maps(W, True, dt, dev)
    qy = _tiled_table(tuple(LUMA_TABLE), quality, Fr.shape[0], Fc.shape[0], dt, dev)
    qc = _tiled_table(tuple(CHROMA_TABLE), quality, Fcr.shape[0], Fcc.shape[0], dt, dev)
    fwd = torch.tensor(_RGB2YCC, dtype=dt, device=x.device)
    inv = torch.tensor(_YCC2RGB, dtype=dt, device=x.device)[:, 1:].contiguous()  # the Y column is 1
    compiled = _kernels.serves(x)
    for i in range(0, N, BLOCK):
        v = x[i : i + BLOCK]
        B = v.shape[0]
        if x.dtype != torch.uint8:
            v = v.to(dt).round().clamp_(0, 255)
        # Y - 128 and (Cb, Cr) - 128 (the +128 of Cb and Cr cancels), rounded to 8 bit
        if compiled:  # one pass from the 8-bit values, no float copy of the block first
            y, cc = _kernels.jpeg_rgb_to_ycc(v.reshape(B, 3, H * W).contiguous().numpy(), fwd.numpy())
            y, cc = torch.from_numpy(y).view(B, H, W), torch.from_numpy(cc).view(2 * B, H, W)
        else:
            v = v.to(dt).view(B, 3, H * W)
            y = torch.bmm(fwd[:1].expand(B, 1, 3), v).sub_(128.0).round_().view(B, H, W)
            cc = torch.bmm(fwd[1:].expand(B, 2, 3), v).round_().view(2 * B, H, W)
        y = _code(y, Fr, Fc, Ir, Ic, qy).round_().add_(128.0)
        cc = _code(cc, Fcr, Fcc, Icr, Icc, qc)
        cc = torch.matmul(lmul(Ur, cc), Uc.transpose(0, 1)).round_()  # fancy upsampling, cropped
        rgb = torch.bmm(inv.expand(B, 3, 2), cc.view(B, 2, H * W)).add_(y.view(B, 1, H * W))
        out[i : i + BLOCK] = rgb.round_().clamp_(0, 255).view(B, 3, H, W)
    return out
