"""What the Triton stages share."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ieee_div(a, b):
    # a / b rounded to nearest, as torch divides: Triton's `/` on float32 is div.full.f32 on NVIDIA
    # GPUs (within 2 ulp, not correctly rounded), which would break the stages' bit-for-bit
    # agreement with the eager code; float64 `/` is already div.rn.f64. (The interpreter divides
    # exactly either way, so only a GPU run can tell the two apart.)
    if a.dtype == tl.float32:
        return tl.math.div_rn(a, b)
    return a / b


@triton.jit
def ieee_sqrt(a):
    # the square root rounded to nearest (float32 tl.sqrt may be approximate; float64's is exact)
    if a.dtype == tl.float32:
        return tl.sqrt_rn(a)
    return tl.sqrt(a)
