"""A Mamba-2 mixer's one-token step between its two projections, in two Triton launches; a prompt's selective scan
in one.

transformers' PyTorch step (no mamba_ssm / causal_conv1d installed) runs ~40 small kernels per layer:
the depthwise conv update, the selective state update with its broadcasts and a batched matmul, the
gated RMSNorm. Here, after `in_proj` gives zxbcdt = [z (I) | x B C (conv_dim) | dt (H)]:

  `_ssm_step_kernel`, one program per (head, block of head channels): the conv window (the state's last
      K-1 inputs and the new one) of its x channels and of its group's B and C, SiLU; dt = softplus(dt +
      dt_bias); the SSM state [P, N] updated in place, state = state * exp(dt * A) + dt * B x; y = state C + D x.
  `_gate_norm_kernel`, one program per norm group: y * SiLU(z), RMS-normalised over the group, rounded
      to the model's dtype and scaled by the norm weight (as transformers' NemotronHRMSNormGated); then the
      conv state shifted by one with the new input appended (after every program of the first read it).

Arithmetic in fp32 throughout (transformers rounds some intermediates to the model's dtype: the results
agree within that rounding). `mamba_step_ref` is the plain-torch reference.

Prompts: transformers' chunked scan (`mamba2_chunk_scan`, PyTorch without mamba_ssm) is ~95 small kernels a call,
host-bound. `ssm_scan` runs the same recurrence token by token, one program per (head, block of head channels)
holding its block of the state in registers: one launch. `ssm_scan_ref` is
its plain-torch reference; models/nemotron_h.py puts it in transformers' mixer for the duration of a prompt's call.

Shape legend: H heads, P head_dim, N state size, G groups (heads share B and C per group), I = H * P,
K conv taps, conv_dim = I + 2 G N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sluice.kernels.decode import TL_DTYPES
from sluice.kernels.rounding import rounded


@triton.jit
def _conv_silu(zx, cs, cw, cb, c, cm, k, I, CS_C, CS_K, K: tl.constexpr, HAS_CB: tl.constexpr):
    """SiLU of conv channels c [BC]: the window is the state's inputs 1..K-1 and the new input zx[I + c]."""
    km = k < K
    old = tl.load(cs + c[:, None] * CS_C + (k[None, :] + 1) * CS_K, mask=cm[:, None] & (k[None, :] + 1 < K), other=0.0).to(tl.float32)
    new = tl.load(zx + I + c, mask=cm, other=0.0).to(tl.float32)
    win = tl.where(k[None, :] == K - 1, new[:, None], old)
    w = tl.load(cw + c[:, None] * K + k[None, :], mask=cm[:, None] & km[None, :], other=0.0).to(tl.float32)
    out = tl.sum(win * w, axis=1)
    if HAS_CB:
        out += tl.load(cb + c, mask=cm, other=0.0).to(tl.float32)
    return out / (1.0 + tl.exp(-out))


@triton.jit
def _softplus(v):
    """torch's softplus (threshold 20): log1p(exp(v)), log1p by Kahan's trick (log(w) * u / (w - 1), w = 1 + u), which
    stays accurate where 1 + exp(v) rounds (v below about -9), with plain operations the interpreter runs too."""
    u = tl.exp(tl.minimum(v, 20.0))
    w = 1.0 + u
    d = w - 1.0
    return tl.where(v > 20.0, v, tl.where(d == 0.0, u, tl.log(w) * (u / tl.where(d == 0.0, 1.0, d))))


@triton.jit
def _head_tile(HPG, P, N, BP: tl.constexpr, BN: tl.constexpr):
    """A (head, block of head channels) program's head, its B/C group, channels p and state columns n, with masks."""
    h, pb = tl.program_id(0), tl.program_id(1)
    p = pb * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    return h, h // HPG, p, p < P, n, n < N


@triton.jit
def _ssm_step_kernel(zx, cs, cw, cb, dt_bias, a_log, d_skip, st, y, I, CONV_DIM, H, P, N, HPG, G, CS_C, CS_K, ZX_B,
                     CS_B, ST_B, K: tl.constexpr, HAS_CB: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):
    h, g, p, pm, n, nm = _head_tile(HPG, P, N, BP, BN)
    r = tl.program_id(2)  # the sequence
    zx, cs, st, y = zx + r * ZX_B, cs + r * CS_B, st + r * ST_B, y + r * I
    k = tl.arange(0, BK)
    x = _conv_silu(zx, cs, cw, cb, h * P + p, pm, k, I, CS_C, CS_K, K, HAS_CB)
    b = _conv_silu(zx, cs, cw, cb, I + g * N + n, nm, k, I, CS_C, CS_K, K, HAS_CB)
    c = _conv_silu(zx, cs, cw, cb, I + G * N + g * N + n, nm, k, I, CS_C, CS_K, K, HAS_CB)
    dt = tl.load(zx + I + CONV_DIM + h).to(tl.float32) + tl.load(dt_bias + h).to(tl.float32)
    dt = _softplus(dt)
    decay = tl.exp(-dt * tl.exp(tl.load(a_log + h).to(tl.float32)))  # exp(dt * A), A = -exp(A_log)
    ptr = st + h * P * N + p[:, None] * N + n[None, :]
    m = pm[:, None] & nm[None, :]
    s = tl.load(ptr, mask=m, other=0.0).to(tl.float32) * decay + (dt * b)[None, :] * x[:, None]
    tl.store(ptr, s.to(st.dtype.element_ty), mask=m)
    out = tl.sum(s * c[None, :], axis=1) + x * tl.load(d_skip + h).to(tl.float32)
    tl.store(y + h * P + p, out, mask=pm)


@triton.jit
def _gate_norm_kernel(zx, y, nw, out, cs, I, CONV_DIM, GS, CS_C, CS_K, CPP, eps, ZX_B, CS_B, OUT_DT: tl.constexpr,
                      K: tl.constexpr, BG: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    gi, r = tl.program_id(0), tl.program_id(1)  # norm group, sequence
    zx, y, out, cs = zx + r * ZX_B, y + r * I, out + r * I, cs + r * CS_B
    j = tl.arange(0, BG)
    jm = j < GS
    i = gi * GS + j
    v = tl.load(y + i, mask=jm, other=0.0)
    z = tl.load(zx + i, mask=jm, other=0.0).to(tl.float32)
    v = v * (z / (1.0 + tl.exp(-z)))
    v = v * tl.rsqrt(tl.sum(v * v, axis=0) / GS + eps)
    w = tl.load(nw + i, mask=jm, other=0.0).to(tl.float32)
    tl.store(out + i, (w * v.to(OUT_DT).to(tl.float32)).to(OUT_DT), mask=jm)
    # this program's run of conv channels: shifted one input left, the new input last
    k = tl.arange(0, BK)
    km = k < K
    for c0 in range(0, CPP, BC):
        cr = c0 + tl.arange(0, BC)  # a name of its own: Triton keeps a name's type through a loop
        c = gi * CPP + cr
        cm = (c < CONV_DIM) & (cr < CPP)
        old = tl.load(cs + c[:, None] * CS_C + (k[None, :] + 1) * CS_K, mask=cm[:, None] & (k[None, :] + 1 < K), other=0.0)
        new = tl.load(zx + I + c, mask=cm, other=0.0).to(old.dtype)
        tl.store(cs + c[:, None] * CS_C + k[None, :] * CS_K, tl.where(k[None, :] == K - 1, new[:, None], old),
                 mask=cm[:, None] & km[None, :])


def mamba_step(zx: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None,
               dt_bias: torch.Tensor, a_log: torch.Tensor, d_skip: torch.Tensor, ssm_state: torch.Tensor,
               norm_w: torch.Tensor, eps: float, heads: int, head_dim: int, groups: int, state: int,
               norm_groups: int) -> torch.Tensor:
    """zxbcdt [I + conv_dim + H] of one token -> the gated, normalised scan output [I] in zx's dtype, ready for
    out_proj; conv_state [conv_dim, K] and ssm_state [H, P, N] (batch 1, any dtype) updated in place."""
    return mamba_steps(zx[None], conv_state[None], conv_w, conv_b, dt_bias, a_log, d_skip, ssm_state[None], norm_w, eps,
                       heads, head_dim, groups, state, norm_groups)[0]


def mamba_steps(zx: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None,
                dt_bias: torch.Tensor, a_log: torch.Tensor, d_skip: torch.Tensor, ssm_state: torch.Tensor,
                norm_w: torch.Tensor, eps: float, heads: int, head_dim: int, groups: int, state: int,
                norm_groups: int) -> torch.Tensor:
    """`mamba_step` of R sequences' tokens at once, each on its own states: zx [R, Z], conv_state [R, conv_dim, K],
    ssm_state [R, H, P, N] -> [R, I]; the same two launches, a sequence per program column."""
    I = heads * head_dim
    R, conv_dim, K = conv_state.shape
    assert zx.shape == (R, I + conv_dim + heads) and conv_dim == I + 2 * groups * state and zx.is_contiguous()
    assert ssm_state.is_contiguous() and ssm_state.shape[1:].numel() == heads * head_dim * state
    y = torch.empty(R, I, dtype=torch.float32, device=zx.device)
    out = torch.empty(R, I, dtype=zx.dtype, device=zx.device)
    BP, BK = min(16, triton.next_power_of_2(head_dim)), triton.next_power_of_2(K)
    cb = conv_b if conv_b is not None else dt_bias
    strides = (zx.stride(0), conv_state.stride(0))
    _ssm_step_kernel[(heads, triton.cdiv(head_dim, BP), R)](
        zx, conv_state, conv_w, cb, dt_bias, a_log, d_skip, ssm_state, y, I, conv_dim, heads, head_dim, state,
        heads // groups, groups, conv_state.stride(1), conv_state.stride(2), *strides, ssm_state.stride(0), K=K,
        HAS_CB=conv_b is not None, BP=BP, BN=triton.next_power_of_2(state), BK=BK)
    gs = I // norm_groups
    _gate_norm_kernel[(norm_groups, R)](
        zx, y, norm_w, out, conv_state, I, conv_dim, gs, conv_state.stride(1), conv_state.stride(2),
        triton.cdiv(conv_dim, norm_groups), eps, *strides, OUT_DT=TL_DTYPES[zx.dtype], K=K,
        BG=triton.next_power_of_2(gs), BC=256, BK=BK)  # a group's conv channels (768 in Nano) in few rounds
    return out


def mamba_step_ref(zx, conv_state, conv_w, conv_b, dt_bias, a_log, d_skip, ssm_state, norm_w, eps, heads, head_dim,
                   groups, state, norm_groups) -> torch.Tensor:
    """The plain-torch reference of `mamba_step` (fp32; the same in-place state updates)."""
    return mamba_steps_ref(zx[None], conv_state[None], conv_w, conv_b, dt_bias, a_log, d_skip, ssm_state[None], norm_w,
                           eps, heads, head_dim, groups, state, norm_groups)[0]


def mamba_steps_ref(zx, conv_state, conv_w, conv_b, dt_bias, a_log, d_skip, ssm_state, norm_w, eps, heads, head_dim,
                    groups, state, norm_groups) -> torch.Tensor:
    """The plain-torch reference of `mamba_steps` (fp32; the same in-place state updates), R sequences at once."""
    R, I = zx.shape[0], heads * head_dim
    conv_dim, K = conv_state.shape[1:]
    z, xbc, dt = zx.float().split([I, conv_dim, heads], dim=-1)
    window = torch.cat([conv_state[:, :, 1:].float(), xbc[:, :, None]], dim=2)
    conv = (window * conv_w.float()).sum(-1) + (conv_b.float() if conv_b is not None else 0)
    conv_state.copy_(window.to(conv_state.dtype))
    x, b, c = F.silu(conv).split([I, groups * state, groups * state], dim=-1)
    dt = F.softplus(dt + dt_bias.float())  # [R, H]
    x = x.view(R, heads, head_dim)
    b = b.reshape(R, groups, state).repeat_interleave(heads // groups, 1)  # [R, H, N]
    c = c.reshape(R, groups, state).repeat_interleave(heads // groups, 1)
    decay = torch.exp(-dt * torch.exp(a_log.float()))
    s = ssm_state.float() * decay[:, :, None, None] + (dt[:, :, None] * b)[:, :, None, :] * x[:, :, :, None]
    ssm_state.copy_(s.view(ssm_state.shape).to(ssm_state.dtype))
    y = (s * c[:, :, None, :]).sum(-1) + x * d_skip.float()[:, None]
    v = (y.reshape(R, -1) * F.silu(z)).view(R, norm_groups, -1)
    v = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).reshape(R, -1)
    return (norm_w.float() * v.to(zx.dtype).float()).to(zx.dtype)


# -- prefill: the selective scan over a prompt --------------------------------------------------------------------


@triton.jit
def _ssm_scan_kernel(x, dt, a, b, c, d_skip, dt_bias, s0, y, s_out, T, P, N, HPG, X_T, X_H, X_P, DT_T, DT_H, B_T, B_G, B_N,
                     C_T, C_G, C_N, Y_T, DT_MIN, DT_MAX, DT_DT: tl.constexpr, HAS_S0: tl.constexpr, HAS_D: tl.constexpr,
                     HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    """One program per (head, block of head channels): the state [BP, N] in registers through every token."""
    h, g, p, pm, n, nm = _head_tile(HPG, P, N, BP, BN)
    m = pm[:, None] & nm[None, :]
    ptr = h * P * N + p[:, None] * N + n[None, :]
    A = tl.load(a + h).to(tl.float32)
    D = tl.load(d_skip + h).to(tl.float32) if HAS_D else 0.0
    bias = rounded(tl.load(dt_bias + h).to(tl.float32), DT_DT) if HAS_DTB else 0.0
    if HAS_S0:
        s = tl.load(s0 + ptr, mask=m, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BP, BN], dtype=tl.float32)
    for t in range(T):
        xt = tl.load(x + t * X_T + h * X_H + p * X_P, mask=pm, other=0.0).to(tl.float32)
        # dt as transformers' scan makes it: each step rounded to dt's dtype (the bias added, softplus, the clamp)
        dv = rounded(tl.load(dt + t * DT_T + h * DT_H).to(tl.float32) + bias, DT_DT)
        if SOFTPLUS:
            dv = rounded(_softplus(dv), DT_DT)
        dv = rounded(tl.minimum(tl.maximum(dv, DT_MIN), DT_MAX), DT_DT)
        bt = tl.load(b + t * B_T + g * B_G + n * B_N, mask=nm, other=0.0).to(tl.float32)
        ct = tl.load(c + t * C_T + g * C_G + n * C_N, mask=nm, other=0.0).to(tl.float32)
        s = s * tl.exp(dv * A) + (dv * xt)[:, None] * bt[None, :]
        tl.store(y + t * Y_T + h * P + p, tl.sum(s * ct[None, :], axis=1) + D * xt, mask=pm)
    tl.store(s_out + ptr, s, mask=m)


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D=None, dt_bias=None,
             initial_states=None, dt_softplus: bool = False, dt_limit=(0.0, float("inf"))) -> tuple[torch.Tensor, torch.Tensor]:
    """A Mamba-2 selective scan over T tokens of one sequence, token by token in one launch: x [T, H, P], dt [T, H]
    (raw: the bias added and softplus applied here, when given), A [H] (negative), B and C [T, G, N], D [H],
    initial_states [H, P, N] or None (zeros) -> (y [T, H, P] fp32, final state [H, P, N] fp32).
        state_t = state_{t-1} * exp(dt_t A) + dt_t x_t B_t;  y_t = state_t C_t + D x_t
    Arithmetic in fp32; dt rounded to its dtype after each of its steps, as transformers' chunked scan does. Any
    strides (transformers passes views of the conv's transposed output: T innermost)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    assert dt.shape == (T, H) and C.shape == B.shape and H % G == 0
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    s_out = torch.empty(H, P, N, dtype=torch.float32, device=x.device)
    s0 = initial_states.reshape(H, P, N).contiguous() if initial_states is not None else s_out
    BP = min(16, triton.next_power_of_2(P))
    _ssm_scan_kernel[(H, triton.cdiv(P, BP))](
        x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, s0, y, s_out, T, P, N, H // G,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), y.stride(0), float(dt_limit[0]), float(dt_limit[1]),
        DT_DT=TL_DTYPES[dt.dtype], HAS_S0=initial_states is not None, HAS_D=D is not None, HAS_DTB=dt_bias is not None,
        SOFTPLUS=dt_softplus, BP=BP, BN=triton.next_power_of_2(N))
    return y, s_out


def ssm_scan_ref(x, dt, A, B, C, D=None, dt_bias=None, initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """The plain-torch reference of `ssm_scan`: the same recurrence, token by token."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    b = B.float().repeat_interleave(H // G, dim=1)  # [T, H, N]
    c = C.float().repeat_interleave(H // G, dim=1)
    s = initial_states.reshape(H, P, N).float().clone() if initial_states is not None else x.new_zeros(H, P, N, dtype=torch.float32)
    ys = []
    for t in range(T):
        s = s * torch.exp(dt[t] * A.float())[:, None, None] + (dt[t][:, None] * x[t].float())[:, :, None] * b[t][:, None, :]
        ys.append((s * c[t][:, None, :]).sum(-1) + (D.float()[:, None] * x[t].float() if D is not None else 0))
    return torch.stack(ys), s


def chunk_scan(hidden_states, dt, A, B, C, chunk_size=None, D=None, dt_bias=None, initial_states=None,
               dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False):
    """transformers' `mamba2_chunk_scan` call (hidden_states [1, T, H, P], dt [1, T, H], B and C [1, T, G, N],
    initial_states [1, H, P, N]) through `ssm_scan`; its result as that function gives it (y [1, T, H, P] fp32, and
    the final state [1, H, P, N] with `return_final_states`); chunk_size is the chunked scan's, unused here. Batch 1,
    no gate z and no packed sequences only: models/nemotron_h.py `scan_swapped` checks."""
    y, s = ssm_scan(hidden_states[0], dt[0], A, B[0], C[0], D, dt_bias,
                    initial_states[0] if initial_states is not None else None, dt_softplus, dt_limit)
    return (y[None], s[None]) if return_final_states else y[None]
