"""Rounding to a narrower float inside a Triton kernel, the same on a GPU and in Triton's CPU interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes `rounded` rounds to as torch does


@triton.jit
def rounded(v, DT: tl.constexpr):
    """fp32 v rounded to dtype DT (nearest, ties to even) and back: bf16 by its bits (Triton's interpreter casts to
    bf16 by truncation), NaN kept (its bits would carry into the sign: a GPU's NaN is 0x7FFFFFFF), others by a cast."""
    if DT == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return tl.where(v != v, v, u.to(tl.float32, bitcast=True))
    elif DT == tl.float32:
        return v
    else:
        return v.to(DT).to(tl.float32)
