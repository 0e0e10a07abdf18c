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

import torch
import torch.nn.functional as F

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


def _pad_to(x: Tensor, mh: int, mw: int) -> Tensor:
    H, W = x.shape[-2:]
    ph, pw = (-H) % mh, (-W) % mw
    if ph or pw:
        x = F.pad(x, (0, pw, 0, ph), mode="replicate")
    return x


def _code_plane(p: Tensor, table: Tensor) -> Tensor:
    """Quantise/dequantise one component plane ``(N, h, w)`` (h, w multiples of 8), 0..255 scale."""
    N, h, w = p.shape
    D = dct_matrix(torch.float64)
    K = torch.kron(D, D).to(dtype=p.dtype, device=p.device)  # 2-D DCT of a flattened 8x8 block
    blocks = (p - 128.0).reshape(N, h // 8, 8, w // 8, 8).permute(0, 1, 3, 2, 4).reshape(-1, 64)
    coef = blocks @ K.T
    q = table.reshape(64).to(dtype=p.dtype, device=p.device)
    coef = torch.round(coef / q) * q
    rec = coef @ K + 128.0
    rec = rec.reshape(N, h // 8, w // 8, 8, 8).permute(0, 1, 3, 2, 4).reshape(N, h, w)
    return rec.clamp(0, 255)


def _downsample2(p: Tensor) -> Tensor:
    N, h, w = p.shape
    return p.reshape(N, h // 2, 2, w // 2, 2).mean(dim=(2, 4))


def _fancy_upsample_axis(p: Tensor, dim: int) -> Tensor:
    n = p.shape[dim]
    idx = torch.arange(n, device=p.device)
    prev = p.index_select(dim, (idx - 1).clamp(min=0))
    nxt = p.index_select(dim, (idx + 1).clamp(max=n - 1))
    even = 0.75 * p + 0.25 * prev
    odd = 0.75 * p + 0.25 * nxt
    out = torch.stack([even, odd], dim=dim + 1)
    shape = list(p.shape)
    shape[dim] = 2 * n
    return out.reshape(shape)


def jpeg_roundtrip(x: Tensor, quality: int) -> Tensor:
    """JPEG encode/decode of ``x`` (N, C, H, W) with C in {1, 3}, values on the 0..255 scale.

    Returns the decoded images on the same scale, rounded to integers.
    """
    N, C, H, W = x.shape
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = x.to(dt).round().clamp(0, 255)
    qy = quant_table(LUMA_TABLE, quality)
    if C == 1:
        y = _pad_to(v[:, 0], 8, 8)
        out = _code_plane(y, qy)[:, :H, :W]
        return out.round().clamp(0, 255)[:, None].to(x.dtype)
    qc = quant_table(CHROMA_TABLE, quality)
    r, g, b = v[:, 0], v[:, 1], v[:, 2]
    Y = (0.299 * r + 0.587 * g + 0.114 * b).round()
    Cb = (-0.168735892 * r - 0.331264108 * g + 0.5 * b + 128.0).round()
    Cr = (0.5 * r - 0.418687589 * g - 0.081312411 * b + 128.0).round()
    Y = _pad_to(Y, 16, 16)
    Cb = _pad_to(Cb, 16, 16)
    Cr = _pad_to(Cr, 16, 16)
    Yr = _code_plane(Y, qy)
    Cbr = _code_plane(_downsample2(Cb), qc)
    Crr = _code_plane(_downsample2(Cr), qc)
    Cbu = _fancy_upsample_axis(_fancy_upsample_axis(Cbr, 1), 2)
    Cru = _fancy_upsample_axis(_fancy_upsample_axis(Crr, 1), 2)
    Yr, Cbu, Cru = (t[:, :H, :W] for t in (Yr.round(), Cbu.round(), Cru.round()))
    R = Yr + 1.402 * (Cru - 128)
    G = Yr - 0.344136286 * (Cbu - 128) - 0.714136286 * (Cru - 128)
    B = Yr + 1.772 * (Cbu - 128)
    out = torch.stack([R, G, B], dim=1).round().clamp(0, 255)
    return out.to(x.dtype)
