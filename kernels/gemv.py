"""One-token linears of the resident part in one Triton launch: y = x W^T (+ b) for a single row x.

A one-token step's resident linears are matrix-vector products that read the whole weight once; on an H100 cuBLAS
ran Nemotron-3-Nano's shared experts (20 MB) at two thirds of the memory's rate, a split-K kernel and its reduction
each. Here a program per BN outputs reads their rows along K in BK-wide tiles, fp32
products summed per output, rounded once to the output dtype (nearest, ties to even, as a GPU's cast). Results agree
with F.linear within the summation order's rounding, not bit for bit. `gemv_ref` is the plain-torch reference.

Epilogues in the same launch: relu(y)^2 (a Nemotron-H shared expert's activation: `Relu2MLP`) and a residual add
(`linear_add`), each rounded to the output dtype as torch's op on F.linear's output is, so bit for bit that op.

Shape legend: K in_features, N out_features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from sluice.kernels.decode import TL_DTYPES
from sluice.kernels.rounding import rounded


@triton.jit
def _gemv_kernel(x, w, b, r, y, N, K, W_N, HAS_B: tl.constexpr, RELU2: tl.constexpr, HAS_R: tl.constexpr, YDT: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr):
    if GDC:  # launched as a programmatic dependent (`pdl`): wait for the kernel before, and let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    rows = w + n.to(tl.int64)[:, None] * W_N  # 64-bit: an lm_head's N * K passes 2^31
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        xv = tl.load(x + k, mask=km, other=0.0).to(tl.float32)
        wv = tl.load(rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc += wv.to(tl.float32) * xv[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_B:
        out += tl.load(b + n, mask=nm, other=0.0).to(tl.float32)
    out = rounded(out, YDT)  # each epilogue op rounded to the output dtype, as torch's ops after F.linear round
    if RELU2:
        out = tl.maximum(out, 0.0)
        out = rounded(out * out, YDT)
    if HAS_R:
        out = rounded(out + tl.load(r + n, mask=nm, other=0.0).to(tl.float32), YDT)
    tl.store(y + n, out.to(YDT), mask=nm)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, bn: int = 0, bk: int = 0,
         num_warps: int = 4, relu2: bool = False, residual: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x [K] (contiguous), weight [N, K] (rows contiguous), bias [N] or None -> y [N] in x's dtype; then relu2: relu(y)^2,
    and residual [N] (contiguous, x's dtype): residual + y, in the same launch. bn, bk: the tile (0: `tile(N, K)`).
    pdl: launched as a programmatic dependent launch (Hopper; an experiment of `sluice bench gemv --pdl`)."""
    N, K = weight.shape
    assert x.shape == (K,) and x.stride(0) == 1 and weight.stride(1) == 1, (x.shape, x.stride(), weight.stride())
    assert residual is None or (residual.shape == (N,) and residual.stride(0) == 1 and residual.dtype == x.dtype), residual
    dbn, dbk = tile(N, K)
    bn, bk = bn or dbn, bk or dbk
    y = torch.empty(N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, bn),)](x, weight, bias if bias is not None else y, residual if residual is not None else y,
                                       y, N, K, weight.stride(0), HAS_B=bias is not None, RELU2=relu2,
                                       HAS_R=residual is not None, YDT=TL_DTYPES[x.dtype], BN=bn, BK=bk, GDC=pdl,
                                       num_warps=num_warps, **({"launch_pdl": True} if pdl else {}))
    return y


def tile(N: int, K: int) -> tuple[int, int]:
    """(BN, BK): 4 outputs a program over 512-wide tiles of K, 2 for narrow linears (the H100 sweep of `sluice bench
    gemv`, BENCHMARKS.md)."""
    return (4 if N >= 1024 else 2), min(512, triton.next_power_of_2(K))


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, relu2: bool = False,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """`gemv` in plain torch: fp32 products and sums, rounded once to x's dtype; then the epilogue's ops as torch runs them."""
    y = weight.float() @ x.float()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if relu2:
        y = torch.square(F.relu(y))
    return y if residual is None else residual + y


class Gemv(nn.Module):
    """Stands where an nn.Linear was: a one-row input through `gemv`, longer ones through F.linear; its weight and bias."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def one_row(self, x: torch.Tensor) -> bool:
        """Whether x is one row that `gemv` takes (of the weight's dtype, rows contiguous)."""
        return x.numel() == self.in_features and x.dtype == self.weight.dtype and self.weight.stride(1) == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.one_row(x):
            return F.linear(x, self.weight, self.bias)
        return gemv(x.reshape(-1).contiguous(), self.weight, self.bias).view(*x.shape[:-1], self.out_features)


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x); where linear is a `Gemv` and x one row of its dtype, the add in the GEMV's launch."""
    if isinstance(linear, Gemv) and linear.one_row(x) and residual.dtype == x.dtype and residual.numel() == linear.out_features:
        y = gemv(x.reshape(-1).contiguous(), linear.weight, linear.bias, residual=residual.reshape(-1).contiguous())
        return y.view(residual.shape)
    return residual + linear(x)


class Relu2MLP(nn.Module):
    """Stands where an up -> relu^2 -> down MLP was (a Nemotron-H shared expert): one row through two GEMV launches, the
    activation in the first's epilogue; longer inputs as the module ran them."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.up_proj, self.down_proj, self.act_fn = mlp.up_proj, mlp.down_proj, mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = self.up_proj, self.down_proj
        if isinstance(up, Gemv) and isinstance(down, Gemv) and up.one_row(x) and up.bias is None:
            h = gemv(x.reshape(-1).contiguous(), up.weight, relu2=True)
            return down(h.view(*x.shape[:-1], -1))
        return down(self.act_fn(up(x)))
