"""Resident linears the checkpoint stores quantised (NVFP4, FP8): weights stay in their format.

A `QuantLinear` replaces transformers' nn.Linear where the checkpoint holds scales next to the
weight. Its tensors are packed into one byte buffer laid out like a one-projection expert block,
so the expert kernels serve it: the matvec kernel for one-token steps, the grouped GEMM for longer
ones (epilogue `plain`). On a CPU it dequantises once with the plain-torch reference.

Shape legend: M rows (tokens), K in_features, N out_features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels.formats import WeightFormat
from sluice.kernels.layout import proj_layouts
from sluice.storage.safetensors_io import TORCH_TO_ST
from sluice.storage.store import pack_block, plan_layout

BM = 16


class QuantLinear(nn.Module):
    def __init__(self, fmt: WeightFormat, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None, out_features: int, in_features: int):
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        entries = [("w", sfx, tuple(t.shape), TORCH_TO_ST[t.dtype], t.numel() * t.element_size(), False) for sfx, t in tensors.items()]
        slots, nbytes = plan_layout(entries)
        self.layout = proj_layouts({"w": fmt}, slots)["w"]
        if (self.layout.n, self.layout.k) != (out_features, in_features):
            raise ValueError(f"quantised weight is {self.layout.n}x{self.layout.k}, the module expects {out_features}x{in_features}")
        packed = pack_block(slots, {f"w.{sfx}": t for sfx, t in tensors.items()}, torch.zeros(nbytes, dtype=torch.uint8))
        self._tensors = tensors  # checkpoint tensors (CPU), for the reference path
        self.register_buffer("packed", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dense: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda:
            y = self._kernel(x2.contiguous())
        else:
            if self._dense is None or self._dense.dtype != x.dtype:
                self._dense = self.fmt.dequant_ref(self._tensors, x.dtype)
            y = F.linear(x2, self._dense)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        from sluice.kernels.decode import matvec
        from sluice.kernels.prefill import grouped_gemm, tile_items

        M = x.shape[0]
        out = torch.empty(M, self.out_features, dtype=x.dtype, device=x.device)
        offs = torch.zeros(1, dtype=torch.int64, device=x.device)
        if M == 1:
            return matvec(self.packed, offs, x[0], self.layout, "plain", x.dtype, out)
        items = torch.tensor(tile_items([M], BM), dtype=torch.int32).to(x.device, non_blocking=True)
        rows = torch.arange(M, device=x.device)
        return grouped_gemm(self.packed, offs, x, rows, items, self.layout, "plain", x.dtype, out, bm=BM)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, format={self.fmt.kind}, bias={self.bias is not None}"


class GroupedQuantLinear(nn.Module):
    """A block-diagonal linear stored quantised (DeepSeek-V4's grouped output projection `wo_a`).

    The weight [groups * r, in] holds one [r, in] matrix per group; input [..., groups, in] gives
    [..., groups, r], group i through matrix i. Each group is a QuantLinear over its rows of the
    checkpoint's tensors (scales cut with them; FP8 128-blocks must not straddle two groups)."""

    def __init__(self, fmt: WeightFormat, tensors: dict[str, torch.Tensor], groups: int, out_features: int, in_features: int, where: str):
        super().__init__()
        if out_features % groups:
            raise ValueError(f"{where}: {out_features} output features do not split into {groups} groups")
        r = out_features // groups
        if fmt.kind == "fp8_block" and r % fmt.block:
            raise ValueError(f"{where}: groups of {r} rows cut FP8 {fmt.block}-blocks in two")

        def rows(sfx: str, t: torch.Tensor, i: int) -> torch.Tensor:
            if t.dim() == 0 or t.numel() == 1:
                return t  # a per-tensor scale serves every group
            per = r // fmt.block if fmt.kind == "fp8_block" and sfx == fmt.scale else r
            return t[i * per : (i + 1) * per].contiguous()

        self.groups = nn.ModuleList(
            QuantLinear(fmt, {sfx: rows(sfx, t, i) for sfx, t in tensors.items()}, None, r, in_features) for i in range(groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([g(x[..., i, :]) for i, g in enumerate(self.groups)], dim=-2)
