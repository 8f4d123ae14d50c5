"""Plain-torch routed-expert math: the reference every expert kernel is tested against.

Shape legend: n rows (tokens routed to this expert), Dx expert input size, I intermediate size.
Weights are the block's tensors as stored (storage/store.py): ReLU^2 `down` is re-laid [I, Dx].

    relu2:  y = act(x @ up.T) @ down_relaid                up [I, Dx], down_relaid [I, Dx]
    swiglu: y = (act(x @ gate.T) * (x @ up.T)) @ down.T    gate, up [I, Dx], down [Dx, I]
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def relu2_expert_ref(x: torch.Tensor, up: torch.Tensor, down_relaid: torch.Tensor, act: Callable) -> torch.Tensor:
    """x [n, Dx], up [I, Dx], down_relaid [I, Dx] -> [n, Dx]."""
    assert x.shape[1] == up.shape[1] and up.shape == down_relaid.shape, (x.shape, up.shape, down_relaid.shape)
    return F.linear(act(F.linear(x, up.to(x.dtype))), down_relaid.to(x.dtype).t())


def swiglu_expert_ref(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: Callable) -> torch.Tensor:
    """x [n, Dx], gate/up [I, Dx], down [Dx, I] -> [n, Dx]."""
    assert gate.shape == up.shape and down.shape == (up.shape[1], up.shape[0]), (gate.shape, up.shape, down.shape)
    dt = x.dtype
    return F.linear(act(F.linear(x, gate.to(dt))) * F.linear(x, up.to(dt)), down.to(dt))


def expert_ref(kind: str, x: torch.Tensor, t: dict[str, torch.Tensor], act: Callable) -> torch.Tensor:
    """One expert on x [n, Dx] from its block tensors `t` (slot name -> tensor)."""
    if kind == "relu2":
        return relu2_expert_ref(x, t["up.weight"], t["down.weight"], act)
    if kind == "swiglu":
        return swiglu_expert_ref(x, t["gate.weight"], t["up.weight"], t["down.weight"], act)
    raise ValueError(f"unknown expert kind {kind!r}")
