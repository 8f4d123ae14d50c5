"""Plain-torch routed-expert math: the reference every expert kernel is tested against.

Shape legend: n rows (tokens routed to this expert), Dx expert input size, I intermediate size.
Weights are dense, in the checkpoint's orientation ([out, in]); quantised blocks are dequantised
first with `dequant_expert_ref` (kernels/formats.py).

    relu2:  y = down @ act(up @ x)                     up [I, Dx], down [Dx, I]
    swiglu: y = down @ (act(gate @ x) * (up @ x))      gate, up [I, Dx], down [Dx, I]
            or down @ glu(gate @ x, up @ x) for a model's own gated unit (gpt-oss)
A projection's bias (w["<proj>.bias"], when present) is added after its product, as `x @ W + b`.
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


def swiglu_expert_ref(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: Callable,
                      glu: Callable | None = None, bias: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """x [n, Dx], gate/up [I, Dx], down [Dx, I] -> [n, Dx]; bias: proj -> [out] (optional)."""
    assert gate.shape == up.shape and down.shape == (up.shape[1], up.shape[0]), (gate.shape, up.shape, down.shape)
    bias = bias or {}

    def linear(v, w, proj):
        y = F.linear(v, w)
        return y + bias[proj] if proj in bias else y

    g, u = linear(x, gate, "gate"), linear(x, up, "up")
    return linear(glu(g, u) if glu is not None else act(g) * u, down, "down")


def expert_ref(kind: str, x: torch.Tensor, w: dict[str, torch.Tensor], act: Callable, glu: Callable | None = None) -> torch.Tensor:
    """One expert on x [n, Dx] from its dense weights `w` (proj -> [out, in], x's dtype; "<proj>.bias" -> [out])."""
    if kind == "relu2":
        return relu2_expert_ref(x, w["up"], w["down"], act)
    if kind == "swiglu":
        bias = {k.split(".")[0]: v for k, v in w.items() if k.endswith(".bias")}
        return swiglu_expert_ref(x, w["gate"], w["up"], w["down"], act, glu, bias)
    raise ValueError(f"unknown expert kind {kind!r}")


def dequant_expert_ref(formats: dict[str, WeightFormat], logical: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """proj -> dense [out, in] in dtype (and "<proj>.bias" -> [out] where there is one), from a block's
    tensors in checkpoint orientation."""
    out = {proj: fmt.dequant_ref(logical[proj], dtype) for proj, fmt in formats.items()}
    out.update({f"{proj}.bias": logical[proj][fmt.bias].to(dtype) for proj, fmt in formats.items() if fmt.bias})
    return out
