"""A one-token step's attention in one Triton launch: one query row per head over its KV head's keys and values.

In a Nemotron-3-Nano token replayed as one graph (pipeline/whole.py), transformers' SDPA path ran each attention
layer's single query as a memory-efficient kernel built for long query blocks (its time a call: BENCHMARKS.md). Here
a program per query head reads its KV head's slots in BW-wide tiles (the G heads that share a KV head read it from the
L2), scores scaled and masked, softmax kept online in fp32, values summed in fp32, rounded once to the query's dtype.
Agrees with SDPA within fp32 summation order, not bit for bit. `one_query_attention_ref` is the plain-torch
reference. A mask is SDPA's boolean one (True: attended) or none.

Shape legend: Hq query heads, Hk KV heads (G = Hq / Hk share one), W slots, D head width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.decode import TL_DTYPES
from sluice.kernels.rounding import rounded

BW = 64  # slots a tile


@triton.jit
def _one_query_kernel(q, k, v, mask, o, W, scale, Q_H, K_H, K_S, V_H, V_S, M_S, G: tl.constexpr, D: tl.constexpr,
                      BD: tl.constexpr, BW: tl.constexpr, HAS_MASK: tl.constexpr, DT: tl.constexpr):
    h = tl.program_id(0)
    kv = h // G
    d = tl.arange(0, BD)
    dm = d < D
    qv = tl.load(q + h * Q_H + d, mask=dm, other=0.0).to(tl.float32)
    m_i = tl.max(tl.full([BW], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BW], tl.float32), axis=0)
    acc = tl.zeros([BD], tl.float32)
    for s0 in range(0, W, BW):
        s = s0 + tl.arange(0, BW)
        sm = s < W
        if HAS_MASK:
            sm = sm & (tl.load(mask + s * M_S, mask=s < W, other=0) != 0)
        kt = tl.load(k + kv * K_H + s[:, None] * K_S + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        sc = tl.where(sm, tl.sum(kt.to(tl.float32) * qv[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing attended yet: no NaN from -inf - -inf
        p = tl.exp(sc - m_safe)
        alpha = tl.exp(m_i - m_safe)
        vt = tl.load(v + kv * V_H + s[:, None] * V_S + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * vt.to(tl.float32), axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(o + h * D + d, rounded(acc / l_i, DT).to(DT), mask=dm)  # nearest, as a GPU's cast, interpreted too


def fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `one_query_attention` takes these: one sequence, one query row, heads a multiple of the KV heads, one
    head width, a boolean mask (or none) over the slots."""
    return (query.dim() == 4 and query.shape[0] == 1 and query.shape[2] == 1 and key.shape[0] == 1
            and key.shape == value.shape and query.shape[-1] == key.shape[-1] and query.shape[1] % key.shape[1] == 0
            and query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
            and query.dtype == key.dtype == value.dtype and query.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (mask is None or (mask.dtype == torch.bool and mask.shape[-1] == mask.numel() == key.shape[2])))


def one_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """query [1, Hq, 1, D], key and value [1, Hk, W, D] (slots strided, rows contiguous), mask [.., W] bool or None ->
    the attention output [1, 1, Hq, D] in query's dtype (transformers' layout after its attention function)."""
    Hq, D = query.shape[1], query.shape[3]
    Hk, W = key.shape[1], key.shape[2]
    out = torch.empty(1, 1, Hq, D, dtype=query.dtype, device=query.device)
    m = mask.reshape(-1) if mask is not None else out
    _one_query_kernel[(Hq,)](query, key, value, m, out, W, scale, query.stride(1), key.stride(1), key.stride(2),
                             value.stride(1), value.stride(2), m.stride(0) if mask is not None else 0, G=Hq // Hk, D=D,
                             BD=triton.next_power_of_2(D), BW=BW, HAS_MASK=mask is not None,
                             DT=TL_DTYPES[query.dtype], num_warps=4)
    return out


def one_query_attention_ref(query, key, value, mask, scale) -> torch.Tensor:
    G = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(G, dim=1).float(), value.repeat_interleave(G, dim=1).float()
    scores = (query.float() @ k.transpose(-1, -2)) * scale  # [1, Hq, 1, W]
    if mask is not None:
        scores = scores.masked_fill(~mask.reshape(1, 1, 1, -1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [1, Hq, 1, D]
    return out.to(query.dtype).transpose(1, 2).contiguous()
