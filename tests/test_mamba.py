"""kernels/mamba.py: a Mamba-2 mixer's one-token step in two Triton launches, against its plain-torch
reference and, through the engine's `fused_mamba`, against transformers' own step."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.errors import ConfigError
from sluice.kernels.mamba import mamba_step, mamba_step_ref
from tests.common import DEVICE, PROMPT, greedy_logits


def case(heads, head_dim, groups, state, K, norm_groups, dtype, state_dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    I = heads * head_dim
    conv_dim = I + 2 * groups * state
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        zx=r(I + conv_dim + heads).to(dtype), conv_state=r(conv_dim, K).to(dtype), conv_w=r(conv_dim, K).to(dtype) * 0.5,
        conv_b=r(conv_dim).to(dtype) if bias else None, dt_bias=r(heads) * 0.5, a_log=r(heads) * 0.5, d_skip=r(heads),
        ssm_state=r(heads, head_dim, state).to(state_dtype), norm_w=(1 + 0.1 * r(I)).to(dtype), eps=1e-5, heads=heads,
        head_dim=head_dim, groups=groups, state=state, norm_groups=norm_groups)


def on(device, args):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


SHAPES = [
    (4, 16, 2, 16, 4, 2, torch.float32, torch.float32, True),
    (6, 24, 3, 20, 4, 3, torch.float32, torch.float32, False),  # head_dim and state not powers of two
    (8, 16, 2, 32, 4, 1, torch.bfloat16, torch.float32, True),  # one norm group over all heads
    (4, 32, 1, 16, 3, 4, torch.bfloat16, torch.bfloat16, True),  # 3 taps; bf16 SSM state
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(str(v) for v in s[:6]) + f"-{str(s[6])[6:]}-{str(s[7])[6:]}")
def test_mamba_step_matches_its_reference(shape):
    args = case(*shape)
    ref_args = on("cpu", {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    dev_args = on(DEVICE, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    want = mamba_step_ref(**ref_args).float()
    got = mamba_step(**dev_args).cpu().float()
    tol = 1e-5 if shape[6] == torch.float32 else 2e-2  # bf16 output: one rounding apart at most
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    assert torch.allclose(dev_args["conv_state"].cpu(), ref_args["conv_state"])  # the same values, moved
    s_tol = 1e-5 if shape[7] == torch.float32 else 1e-2
    assert torch.allclose(dev_args["ssm_state"].cpu().float(), ref_args["ssm_state"].float(), rtol=s_tol, atol=s_tol)
    # the new input is the conv window's last entry and the oldest one is gone
    I = shape[0] * shape[1]
    conv_dim = args["conv_state"].shape[0]
    assert torch.equal(dev_args["conv_state"].cpu()[:, -1], args["zx"][I : I + conv_dim].to(args["conv_state"].dtype))
    assert torch.equal(dev_args["conv_state"].cpu()[:, 0], args["conv_state"][:, 1])


def test_swapped_b_and_c_or_a_stale_window_change_the_step():
    """The step tells B from C and uses the new input: a zx with B and C swapped, or the state not
    shifted in (the input left out), gives another output."""
    shape = SHAPES[0]
    heads, head_dim, groups, state = shape[:4]
    I, gn = heads * head_dim, groups * state
    args = case(*shape)
    want = mamba_step_ref(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    swapped = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    zx = swapped["zx"]
    zx[2 * I : 2 * I + gn], zx[2 * I + gn : 2 * I + 2 * gn] = args["zx"][2 * I + gn : 2 * I + 2 * gn], args["zx"][2 * I : 2 * I + gn]
    got = mamba_step(**on(DEVICE, swapped)).cpu()
    assert (got - want).abs().max().item() > 1e-2
    stale = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    stale["zx"][I : 2 * I] = 0  # x's new inputs lost: the window is the old state's alone
    assert (mamba_step(**on(DEVICE, stale)).cpu() - want).abs().max().item() > 1e-2


def test_fused_mamba_decode_follows_transformers(stores, refs, monkeypatch):
    """The engine with `fused_mamba`: a Nemotron-H's one-token steps through the kernels give the reference's
    greedy tokens and the unfused engine's logits within fp32 rounding, step after step (the states carried)."""
    variant = "nemotron_h_latent"
    ref_tokens = refs.greedy(variant, PROMPT, 10)

    def decode(engine):
        return greedy_logits(engine, PROMPT, 10)

    with sluice.load(stores[variant], device=DEVICE, fused_mamba=False) as engine:
        plain = decode(engine)
    from sluice.kernels import mamba

    calls = []
    step = mamba.mamba_step
    monkeypatch.setattr(mamba, "mamba_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    # without graphs, so that every step calls the kernels from Python and is counted (a graph runs them at capture)
    with sluice.load(stores[variant], device=DEVICE, fused_mamba=True, resident_graphs=False) as engine:
        mixers = sum(layer.decode_state is not None and type(layer).__name__ == "_MixerLayer"
                     and layer.block.block_type in ("mamba", "linear_attention") for layer in engine.model.layers)
        fused = decode(engine)
    assert mixers and len(calls) == 9 * mixers  # every one-token step of every Mamba-2 mixer went through the kernels
    assert [int(t) for t in fused.argmax(-1)] == ref_tokens
    assert (fused - plain).abs().max().item() < 1e-3 * plain.abs().max().item()
    if DEVICE.startswith("cuda"):  # the same steps replayed as CUDA graphs: the same kernels, the same logits
        with sluice.load(stores[variant], device=DEVICE, fused_mamba=True) as engine:
            assert torch.equal(decode(engine), fused)


def test_fused_mamba_needs_triton(stores, monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("the CPU's refusal")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="fused_mamba: its Triton kernels need CUDA"):
        sluice.load(stores["nemotron_h_latent"], device="cpu", fused_mamba=True)


def test_fused_mamba_is_the_default_on_cuda_only(stores):
    """Unset, fused_mamba is on with CUDA (where it is timed faster) and off on a CPU (Triton would be interpreted)."""
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE) as engine:
        assert {layer.fused_decode for layer in engine.model.layers} == {DEVICE.startswith("cuda")}
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE, fused_mamba=False) as engine:
        assert {layer.fused_decode for layer in engine.model.layers} == {False}
