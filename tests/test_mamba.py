"""kernels/mamba.py: a Mamba-2 mixer's one-token step in two Triton launches, against its plain-torch
reference and, through the engine's `fused_mamba`, against transformers' own step."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import sluice
from sluice.errors import ConfigError
from sluice.kernels.mamba import _softplus, mamba_step, mamba_step_ref, mamba_steps, mamba_steps_ref
from common import DEVICE, PROMPT, greedy_logits


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


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=["odd", "bf16"])
def test_mamba_steps_are_each_sequences_step(shape):
    """`mamba_steps` (and its reference) over three sequences, each on its own states: each one's output and states
    are its `mamba_step` alone; with the states in another order (a fault) they are not."""
    rows = [case(*shape, seed=seed) for seed in range(3)]
    shared = {k: v for k, v in rows[0].items() if k not in ("zx", "conv_state", "ssm_state")}
    alone = [on(DEVICE, {**shared, **{k: r[k].clone() for k in ("zx", "conv_state", "ssm_state")}}) for r in rows]
    want = torch.stack([mamba_step(**a) for a in alone]).cpu().float()
    stacked = lambda order: {k: torch.stack([rows[i][k] for i in order]).to(DEVICE) for k in ("zx", "conv_state", "ssm_state")}  # noqa: E731
    tol = 1e-5 if shape[6] == torch.float32 else 2e-2
    for steps, device in ((mamba_steps, DEVICE), (mamba_steps_ref, "cpu")):
        many = on(device, stacked(range(3)))  # the states the step updates in place, where it runs
        got = steps(**on(device, shared), **many).cpu().float()
        assert (got - want).abs().max().item() <= tol * want.abs().max().item(), steps.__name__
        assert torch.allclose(many["conv_state"].cpu(), torch.stack([a["conv_state"].cpu() for a in alone]))
        assert torch.allclose(many["ssm_state"].cpu().float(), torch.stack([a["ssm_state"].cpu().float() for a in alone]),
                              rtol=1e-2, atol=1e-2)
    wrong = stacked([0, 2, 1])
    wrong["zx"] = torch.stack([r["zx"] for r in rows]).to(DEVICE)  # each token on another sequence's states
    assert (mamba_steps(**on(DEVICE, shared), **wrong).cpu().float() - want).abs().max().item() > 1e-2


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
    steps = mamba.mamba_steps
    monkeypatch.setattr(mamba, "mamba_steps", lambda *a, **k: calls.append(1) or steps(*a, **k))
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


def test_fused_mamba_prefill_follows_transformers(stores, refs, monkeypatch):
    """The engine with `fused_mamba`: a prompt's Mamba-2 scans go through the one-launch kernel (in pieces of 4
    tokens too, the state carried from piece to piece): the reference's logits within the golden tolerance and the
    unfused engine's within fp32 rounding (this tiny model's heads decay fast: the two scans agree to the bit here;
    test_ssm_scan_matches_its_reference_and_transformers is where their histories differ)."""
    from sluice.kernels import mamba
    from common import assert_logits_close

    variant = "nemotron_h_latent"
    ref = refs.logits(variant, PROMPT)
    with sluice.load(stores[variant], device=DEVICE, fused_mamba=False) as engine:
        plain = engine.forward(PROMPT)
    calls = []
    scan = mamba.ssm_scan
    monkeypatch.setattr(mamba, "ssm_scan", lambda *a, **k: calls.append(a[0].shape[0]) or scan(*a, **k))
    for piece in (None, 4):
        calls.clear()
        with sluice.load(stores[variant], device=DEVICE, fused_mamba=True, mixer_chunk=piece) as engine:
            mixers = sum(type(layer).__name__ == "_MixerLayer" and layer.block.block_type in ("mamba", "linear_attention")
                         for layer in engine.model.layers)
            fused = engine.forward(PROMPT)
        n = -(-len(PROMPT) // (piece or len(PROMPT)))
        assert mixers and len(calls) == n * mixers and sum(calls) == len(PROMPT) * mixers
        assert_logits_close(variant, fused, ref, f"fused_mamba, pieces of {piece}")
        assert (fused - plain).abs().max().item() < 1e-3 * plain.abs().max().item()
    # what the kernel gives is what the layer uses: a scan of zeros changes the logits
    monkeypatch.setattr(mamba, "ssm_scan", lambda *a, **k: tuple(t.zero_() for t in scan(*a, **k)))
    with sluice.load(stores[variant], device=DEVICE, fused_mamba=True) as engine:
        assert (engine.forward(PROMPT) - plain).abs().max().item() > 1e-2


def test_a_scan_without_scratch_takes_a_prompt_piece_whole(stores):
    """With the fused scan (no chunk tensors: models/nemotron_h.py `prefill_scratch_bytes`) a Mamba-2 mixer takes the
    engine's prompt piece (2048 tokens) in one run, where each run is a call of host work; transformers' scan keeps
    runs of at most 512 tokens (its chunk tensors grow with the run); a run asked for (`mixer_chunk`) is kept."""
    from sluice.models import get_architecture
    from sluice.pipeline.budget import MAX_MIXER_CHUNK, MAX_PREFILL_CHUNK

    for fused, asked, want in ((True, None, MAX_PREFILL_CHUNK), (False, None, MAX_MIXER_CHUNK), (True, 64, 64)):
        with sluice.load(stores["nemotron_h_latent"], device=DEVICE, fused_mamba=fused, mixer_chunk=asked) as engine:
            assert {layer.prefill_piece for layer in engine.model.layers} == {want}, (fused, asked)
    config = engine.model.config
    arch = get_architecture("nemotron_h")
    assert arch.prefill_scratch_bytes(config, 512, broadcast=False, fused=True) == 0
    assert arch.prefill_scratch_bytes(config, 512, broadcast=True, fused=True) > 0  # no chunked scan to swap: its own


def test_a_cpus_one_token_steps_take_the_torch_step(stores, refs, monkeypatch):
    """Unset `fused_mamba` on a CPU: a Nemotron-H's one-token steps go through kernels/mamba.py's plain-torch step and
    its prompt's conv runs in fp32 (transformers' bf16 depthwise conv takes milliseconds a call there, ~10 x more off
    the main thread, as the server's worker runs it): every step of every Mamba-2 mixer through it, the reference's greedy tokens, transformers'
    step's logits within fp32 rounding. The must-fail side: a step whose mixer gives zeros changes the logits."""
    if DEVICE != "cpu":
        pytest.skip("a CPU's default")
    from sluice.kernels import mamba

    variant = "nemotron_h_latent"
    with sluice.load(stores[variant], device=DEVICE, fused_mamba=False) as engine:
        plain = greedy_logits(engine, PROMPT, 10)
    from sluice.models import nemotron_h

    calls, steps, convs, conv = [], mamba.mamba_steps_ref, [], nemotron_h.conv_in_fp32
    monkeypatch.setattr(mamba, "mamba_steps_ref", lambda *a, **k: calls.append(1) or steps(*a, **k))
    monkeypatch.setattr(nemotron_h, "conv_in_fp32", lambda mixer: convs.append(1) or conv(mixer))  # the prompt's
    with sluice.load(stores[variant], device=DEVICE) as engine:
        mixers = sum(layer.torch_mixer and type(layer).__name__ == "_MixerLayer"
                     and layer.block.block_type in ("mamba", "linear_attention") for layer in engine.model.layers)
        got = greedy_logits(engine, PROMPT, 10)
    assert mixers and len(calls) == 9 * mixers and len(convs) == mixers
    assert [int(t) for t in got.argmax(-1)] == refs.greedy(variant, PROMPT, 10)
    assert (got - plain).abs().max().item() < 1e-3 * plain.abs().max().item()
    monkeypatch.setattr(mamba, "mamba_steps_ref", lambda *a, **k: torch.zeros_like(steps(*a, **k)))
    with sluice.load(stores[variant], device=DEVICE) as engine:
        assert (greedy_logits(engine, PROMPT, 10) - plain).abs().max().item() > 1e-2


def test_a_prompts_conv_in_fp32_is_transformers_bf16_conv():
    """A CPU prompt's depthwise conv in fp32 (models/nemotron_h.py `conv_in_fp32`), rounded where transformers' bf16 conv
    rounds (before the activation), is that conv bit for bit, and the module's own is back after it. The must-fail
    side: rounded once after the activation, it is not (the bundled model's greedy text changed so)."""
    import transformers.models.nemotron_h.modeling_nemotron_h as tf
    from transformers.activations import ACT2FN

    from sluice.models.nemotron_h import conv_in_fp32

    g = torch.Generator().manual_seed(0)
    x, w, b = ((torch.randn(*s, generator=g) * 2).to(torch.bfloat16) for s in ((1, 96, 40), (96, 4), (96,)))
    want, original = tf.causal_conv1d_fn(x, w, b, activation="silu"), tf.causal_conv1d_fn

    class Mixer:
        __module__ = tf.__name__

    with conv_in_fp32(Mixer()):
        got = tf.causal_conv1d_fn(x, w, b, activation="silu")
    assert torch.equal(got, want) and tf.causal_conv1d_fn is original
    once = ACT2FN["silu"](original(x.float(), w.float(), b.float()))[:, :, :40].to(torch.bfloat16)
    assert not torch.equal(once, want)


def test_fused_mamba_needs_triton(stores, monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("the CPU's refusal")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="fused_mamba: its Triton kernels need CUDA"):
        sluice.load(stores["nemotron_h_latent"], device="cpu", fused_mamba=True)


def test_fused_mamba_is_the_default_on_cuda_only(stores):
    """Unset, fused_mamba is on with CUDA (where it is timed faster) and off on a CPU (Triton would be interpreted),
    which takes kernels/mamba.py's torch step; `fused_mamba=False` keeps transformers' step."""
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE) as engine:
        assert {layer.fused_decode for layer in engine.model.layers} == {DEVICE.startswith("cuda")}
        assert {layer.torch_mixer for layer in engine.model.layers} == {DEVICE == "cpu"}  # the torch step there
    with sluice.load(stores["nemotron_h_latent"], device=DEVICE, fused_mamba=False) as engine:  # transformers' step
        assert {(layer.fused_decode, layer.torch_mixer) for layer in engine.model.layers} == {(False, False)}


def scan_case(T, heads, head_dim, groups, state, dtype, initial, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(T, heads, head_dim).to(dtype), dt=(r(T, heads) - 1).to(dtype), A=-torch.exp(r(heads) * 0.5),
                B=r(T, groups, state).to(dtype), C=r(T, groups, state).to(dtype), D=r(heads), dt_bias=r(heads) * 0.5,
                initial_states=r(heads, head_dim, state) if initial else None, dt_softplus=True, dt_limit=(0.001, float("inf")))


CPU = DEVICE == "cpu"  # interpreted there, a scan costs its tokens: shorter scans, over transformers' chunks of 32
SCAN_CHUNK = 32 if CPU else 128  # the chunk of transformers' chunked scan (the models' 128)
SCAN_SHAPES = [
    (37, 4, 16, 2, 16, torch.float32, False),
    (24 if CPU else 64, 6, 24, 3, 20, torch.float32, True),  # head_dim and state not powers of two; a state carried in
    (40 if CPU else 140, 4, 16, 2, 16, torch.bfloat16, True),  # longer than transformers' chunks, the last partial
    (5, 4, 32, 1, 16, torch.bfloat16, False),
]


@pytest.mark.parametrize("shape", SCAN_SHAPES, ids=lambda s: "x".join(str(v) for v in s[:5]) + f"-{str(s[5])[6:]}-{s[6]}")
def test_ssm_scan_matches_its_reference_and_transformers(shape):
    """The one-launch scan against its token-by-token reference, and against transformers' chunked scan (code we did
    not write: the same recurrence as chunks of SCAN_CHUNK tokens, exp of segment sums), output and final state."""
    from transformers.models.nemotron_h import modeling_nemotron_h as tf

    from sluice.kernels.mamba import chunk_scan, ssm_scan, ssm_scan_ref

    args = scan_case(*shape)
    y, s = ssm_scan(**on(DEVICE, args))
    y_ref, s_ref = ssm_scan_ref(**args)
    # as transformers passes them: views of one [channels, T] tensor, T innermost
    T, H, P = args["x"].shape
    G, N = args["B"].shape[1:]
    xbc = torch.cat([args["x"].reshape(T, -1), args["B"].reshape(T, -1), args["C"].reshape(T, -1)], 1).t().contiguous().t()
    x, b, c = xbc.split([H * P, G * N, G * N], dim=1)
    strided = dict(args, x=x.view(T, H, P), B=b.view(T, G, N), C=c.view(T, G, N), dt=args["dt"].t().contiguous().t())
    assert strided["x"].stride(-1) == T
    y2, s2 = ssm_scan(**on(DEVICE, strided))
    assert torch.equal(y2, y) and torch.equal(s2, s)
    scale = y_ref.abs().max().item()
    assert (y.cpu() - y_ref).abs().max().item() <= 1e-5 * scale
    assert (s.cpu() - s_ref).abs().max().item() <= 1e-5 * s_ref.abs().max().item()
    hf = {k: (v[None] if isinstance(v, torch.Tensor) and k in ("x", "dt", "B", "C", "initial_states") else v) for k, v in args.items()}
    hf["hidden_states"] = hf.pop("x")
    want, want_s = tf.mamba2_chunk_scan(**hf, chunk_size=SCAN_CHUNK, return_final_states=True)
    got, got_s = chunk_scan(**on(DEVICE, hf), chunk_size=SCAN_CHUNK, return_final_states=True)
    assert got.shape == want.shape and got_s.shape == want_s.shape
    assert (got.cpu() - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert (got_s.cpu() - want_s).abs().max().item() <= 1e-4 * want_s.abs().max().item()


def test_ssm_scan_wrong_groups_or_a_lost_state_change_the_scan():
    """The scan reads each head's group's B and C and starts from the state given: B and C of another group, or no
    initial state, give another output."""
    args = scan_case(*SCAN_SHAPES[1])
    from sluice.kernels.mamba import ssm_scan, ssm_scan_ref

    want, _ = ssm_scan_ref(**args)
    rolled = dict(args, B=args["B"].roll(1, dims=1), C=args["C"].roll(1, dims=1))
    assert (ssm_scan(**on(DEVICE, rolled))[0].cpu() - want).abs().max().item() > 1e-2 * want.abs().max().item()
    lost = dict(args, initial_states=None)
    assert (ssm_scan(**on(DEVICE, lost))[0].cpu() - want).abs().max().item() > 1e-2 * want.abs().max().item()



@triton.jit
def _softplus_kernel(x, y, N, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(y + i, _softplus(tl.load(x + i, mask=i < N)), mask=i < N)


def test_softplus_matches_torch_where_one_plus_exp_rounds():
    """The kernels' softplus against torch's in float64 from -30 to 30: log(1 + exp(v)) in fp32 is 0 below about -17
    (its error grows from about -9, where 1 + exp(v) starts to round); Kahan's log1p keeps every value within a few ulps
    (on a GPU tens: Triton's exp and log there are the hardware's approximations; 1.7e-6 seen on an H100)."""
    x = torch.linspace(-30, 30, 1000, device=DEVICE)
    y = torch.empty_like(x)
    _softplus_kernel[(1,)](x, y, 1000, B=1024)
    ref = torch.nn.functional.softplus(x.double())
    assert float(((y.double() - ref).abs() / ref).max()) < (1e-6 if DEVICE == "cpu" else 4e-6)
    plain = torch.where(x > 20, x, torch.log(1 + torch.exp(x))).double()
    assert float(((plain - ref).abs() / ref).max()) > 0.5  # the formula it replaces
