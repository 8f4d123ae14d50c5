"""A MoE layer's last two adds in one launch: h = residual + (out + shared), its shared term then the residual.

Each add is rounded to the tensors' dtype as torch rounds it (the sum in fp32, one rounding an add), so the launch is
bit for bit torch's two; in a one-token step replayed as a CUDA graph (pipeline/whole.py) it is one small kernel a
MoE layer fewer. `residual_add_ref` is the plain-torch form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.decode import TL_DTYPES
from sluice.kernels.rounding import FLOATS, rounded

BLOCK = 1024


@triton.jit
def _add3_kernel(r, a, b, y, N, DT: tl.constexpr, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    m = i < N
    t = rounded(tl.load(a + i, mask=m, other=0.0).to(tl.float32) + tl.load(b + i, mask=m, other=0.0).to(tl.float32), DT)
    h = rounded(tl.load(r + i, mask=m, other=0.0).to(tl.float32) + t, DT)  # each add rounded as torch rounds it
    tl.store(y + i, h.to(DT), mask=m)


def add3(residual: torch.Tensor, out: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """residual + (out + shared) in one Triton launch; three contiguous tensors of one dtype and size."""
    y = torch.empty_like(residual)
    n = residual.numel()
    _add3_kernel[(triton.cdiv(n, BLOCK),)](residual, out, shared, y, n, DT=TL_DTYPES[y.dtype], B=BLOCK, num_warps=4)
    return y


def residual_add_ref(residual: torch.Tensor, out: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    return residual + (out if shared is None else out + shared).view_as(residual)


def residual_add(residual: torch.Tensor, out: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """residual [..., D] + (out + shared): one launch on a GPU where the three are alike, else torch's adds."""
    if (shared is not None and residual.is_cuda and residual.dtype == out.dtype == shared.dtype in FLOATS
            and residual.numel() == out.numel() == shared.numel()
            and residual.is_contiguous() and out.is_contiguous() and shared.is_contiguous()):
        return add3(residual, out, shared)
    return residual_add_ref(residual, out, shared)
