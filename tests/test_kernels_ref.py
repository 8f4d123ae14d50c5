"""The plain-torch expert references against a naive per-row computation, with the shape legend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.kernels.experts_ref import expert_ref

relu2 = lambda x: torch.relu(x) ** 2  # noqa: E731


@pytest.mark.parametrize("n, Dx, I", [(1, 8, 16), (5, 64, 32), (3, 48, 96)])
def test_relu2_ref(n, Dx, I):
    x, up, down = (torch.randn(s, dtype=torch.float64) for s in ((n, Dx), (I, Dx), (Dx, I)))
    y = expert_ref("relu2", x, {"up": up, "down": down}, relu2)
    assert y.shape == (n, Dx)
    for r in range(n):
        h = relu2(up @ x[r])
        torch.testing.assert_close(y[r], down @ h, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n, Dx, I", [(1, 8, 16), (4, 64, 32)])
def test_swiglu_ref(n, Dx, I):
    x, g, u, d = (torch.randn(s, dtype=torch.float64) for s in ((n, Dx), (I, Dx), (I, Dx), (Dx, I)))
    y = expert_ref("swiglu", x, {"gate": g, "up": u, "down": d}, F.silu)
    assert y.shape == (n, Dx)
    torch.testing.assert_close(y, (F.silu(x @ g.t()) * (x @ u.t())) @ d.t(), rtol=1e-10, atol=1e-10)
    with pytest.raises(AssertionError):
        expert_ref("swiglu", x, {"gate": g, "up": u, "down": d.t()}, F.silu)
