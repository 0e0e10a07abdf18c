"""What the Triton stages share."""

from __future__ import annotations

import struct

import triton
import triton.language as tl


def f64_bits(x: float) -> int:
    """The int64 bit pattern of the float64 ``x``: how a float64 constant reaches a kernel (a float
    argument of a Triton kernel is float32), read back there by :func:`constant`."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


@triton.jit
def constant(bits, dtype):
    # a float64 constant handed over as its int64 bit pattern (f64_bits), rounded to dtype as torch
    # rounds a Python number operating on a tensor of that dtype
    return tl.cast(bits, tl.int64).to(tl.float64, bitcast=True).to(dtype)


@triton.jit
def ieee_div(a, b):
    # a / b rounded to nearest, as torch divides: Triton's `/` on float32 is div.full.f32 on NVIDIA
    # GPUs (within 2 ulp, not correctly rounded), which would break the stages' bit-for-bit
    # agreement with the eager code; float64 `/` is already div.rn.f64 (and div_rn of float64 has
    # failed to compile in some Triton versions). The interpreter divides exactly either way, so
    # only a GPU run can tell the two apart.
    if a.dtype == tl.float32:
        return tl.math.div_rn(a, b)
    return a / b


@triton.jit
def ieee_sqrt(a):
    # the square root rounded to nearest (float32 tl.sqrt may be approximate; float64's is exact)
    if a.dtype == tl.float32:
        return tl.sqrt_rn(a)
    return tl.sqrt(a)
