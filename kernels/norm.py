"""RMSNorm in one Triton launch: a row's mean square, its scaling and the weight's in one program per row.

transformers' NemotronHRMSNorm is nine kernels a call on a GPU (to fp32, square, mean, add, rsqrt, multiply, the
weight to fp32, multiply, back to the input's dtype); a one-token step of Nemotron-3-Nano calls it 53 times, so in a
step replayed as one graph (pipeline/whole.py) those small kernels are a large share of the GPU's time. Here the
same arithmetic, in fp32 as transformers does it: y = (w * (x * rsqrt(mean(x^2) + eps))) rounded to x's dtype. The
sum over the row adds in another order than torch's, so results agree within fp32 rounding, not bit for bit.
`rms_norm_ref` is the plain-torch reference (transformers' formula). Llama's form, which Qwen3-MoE, Mixtral and
DeepSeek-V3 use (`round_first`), rounds the normalised row to x's dtype before the weight multiplies it, and returns the
two dtypes' promotion: w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype).

Shape legend: R rows (tokens), D the normalised width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn


@triton.jit
def _rms_norm_kernel(x, w, y, D, eps, X_R, Y_R, B: tl.constexpr, ROUND_FIRST: tl.constexpr):
    r = tl.program_id(0)
    d = tl.arange(0, B)
    m = d < D
    v = tl.load(x + r * X_R + d, mask=m, other=0.0)
    xv = v.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / D + eps)
    n = xv * scale
    if ROUND_FIRST:
        n = n.to(v.dtype).to(tl.float32)
    out = tl.load(w + d, mask=m, other=0.0).to(tl.float32) * n
    tl.store(y + r * Y_R + d, out.to(y.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = False) -> torch.Tensor:
    """x [..., D] -> the same shape, normalised per row and scaled by weight [D]; x's dtype, or with `round_first`
    (Llama's form) the promotion of x's and the weight's."""
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=norm_dtype(x.dtype, weight.dtype, round_first), device=x.device)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, y, D, eps, rows.stride(0), y.stride(0), B=triton.next_power_of_2(D),
                                       ROUND_FIRST=round_first)
    return y.view(x.shape)


def norm_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype | None, round_first: bool) -> torch.dtype:
    """The normed rows' dtype: x's, or in Llama's form (`round_first`) the promotion of x's and the weight's."""
    return torch.promote_types(x_dtype, w_dtype) if w_dtype is not None and round_first else x_dtype


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = False) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if round_first:
        return weight * h.to(x.dtype)
    return (weight.to(torch.float32) * h).to(x.dtype)


class RMSNorm(nn.Module):
    """Stands where a model's RMSNorm of transformers' formula was (`rms_norm_ref`; `round_first`: Llama's form), with
    its weight and epsilon."""

    def __init__(self, norm: nn.Module, round_first: bool = False) -> None:
        super().__init__()
        self.weight, self.variance_epsilon, self.round_first = norm.weight, norm.variance_epsilon, round_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon, self.round_first)
