"""Plain-torch routed-expert math: the reference every expert kernel is tested against.

Shape legend: n rows (tokens routed to this expert), Dx expert input size, I intermediate size.
Weights are dense, in the checkpoint's orientation ([out, in]); quantised blocks are dequantised
first with `dequant_expert_ref` (kernels/formats.py).

    relu2:  y = down @ act(up @ x)                     up [I, Dx], down [Dx, I]
    swiglu: y = down @ (act(gate @ x) * (up @ x))      gate, up [I, Dx], down [Dx, I]
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from sluice.kernels.formats import WeightFormat


def relu2_expert_ref(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: Callable) -> torch.Tensor:
    """x [n, Dx], up [I, Dx], down [Dx, I] -> [n, Dx]."""
    assert x.shape[1] == up.shape[1] and down.shape == (up.shape[1], up.shape[0]), (x.shape, up.shape, down.shape)
    return F.linear(act(F.linear(x, up)), down)


def swiglu_expert_ref(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: Callable) -> torch.Tensor:
    """x [n, Dx], gate/up [I, Dx], down [Dx, I] -> [n, Dx]."""
    assert gate.shape == up.shape and down.shape == (up.shape[1], up.shape[0]), (gate.shape, up.shape, down.shape)
    return F.linear(act(F.linear(x, gate)) * F.linear(x, up), down)


def expert_ref(kind: str, x: torch.Tensor, w: dict[str, torch.Tensor], act: Callable) -> torch.Tensor:
    """One expert on x [n, Dx] from its dense weights `w` (proj -> [out, in], x's dtype)."""
    if kind == "relu2":
        return relu2_expert_ref(x, w["up"], w["down"], act)
    if kind == "swiglu":
        return swiglu_expert_ref(x, w["gate"], w["up"], w["down"], act)
    raise ValueError(f"unknown expert kind {kind!r}")


def dequant_expert_ref(formats: dict[str, WeightFormat], logical: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """proj -> dense [out, in] in dtype, from a block's tensors in checkpoint orientation."""
    return {proj: fmt.dequant_ref(logical[proj], dtype) for proj, fmt in formats.items()}
