"""An attention layer's per-head query and key RMSNorms and their rotary embedding in one Triton launch.

transformers' Qwen3-MoE attention normalises each query and key head (two RMSNorms) and rotates them
(`apply_rotary_pos_emb`: a multiply, a slice, a negation, a concatenation, a multiply and an add for each of the two),
about a dozen kernels a layer on a GPU; Qwen3-30B-A3B's one-token step has 48 such layers. Here a program per (token,
head) of the query and the key does it all, each op rounded to the dtype as torch rounds it: norm (transformers'
formula, `kernels/norm.py`'s two forms) then y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]. The norm's
sum adds in another order than torch's, so normed rows agree within fp32 rounding; without norms (Mixtral) the result
is torch's bit for bit (no fused multiply-adds). `norm_rope_ref` is the plain-torch reference.

Shape legend: T tokens, Hq query heads, Hk key heads, D head width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.decode import TL_DTYPES
from sluice.kernels.norm import norm_dtype
from sluice.kernels.rounding import FLOATS, rounded


@triton.jit
def _row(x, w, cs, sn, y, eps, D: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr, ROUND_FIRST: tl.constexpr,
         XT: tl.constexpr, DT: tl.constexpr):
    d = tl.arange(0, BD)
    m = d < D
    p = (d + D // 2) % D  # the partner rotate_half reads
    xd = tl.load(x + d, mask=m, other=0.0).to(tl.float32)
    xp = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    if NORM:
        scale = 1.0 / tl.sqrt(tl.sum(xd * xd, axis=0) / D + eps)
        nd, np_ = xd * scale, xp * scale
        if ROUND_FIRST:  # Llama's form: the normed row in x's dtype, then the weight
            nd, np_ = rounded(nd, XT), rounded(np_, XT)
        xd = rounded(tl.load(w + d, mask=m, other=0.0).to(tl.float32) * nd, DT)
        xp = rounded(tl.load(w + p, mask=m, other=0.0).to(tl.float32) * np_, DT)
    rot = tl.where(d < D // 2, -xp, xp)
    c = tl.load(cs + d, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sn + d, mask=m, other=0.0).to(tl.float32)
    out = rounded(rounded(xd * c, DT) + rounded(rot * s, DT), DT)
    tl.store(y + d, out.to(DT), mask=m)


@triton.jit
def _norm_rope_kernel(q, k, qw, kw, cs, sn, qo, ko, eps, Hq, Q_T, K_T, C_T, QO_T, KO_T, D: tl.constexpr, BD: tl.constexpr,
                      NORM: tl.constexpr, ROUND_FIRST: tl.constexpr, XT: tl.constexpr, DT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    if h < Hq:
        _row(q + t * Q_T + h * D, qw, cs + t * C_T, sn + t * C_T, qo + t * QO_T + h * D, eps, D, BD, NORM, ROUND_FIRST, XT, DT)
    else:
        _row(k + t * K_T + (h - Hq) * D, kw, cs + t * C_T, sn + t * C_T, ko + t * KO_T + (h - Hq) * D, eps, D, BD, NORM,
             ROUND_FIRST, XT, DT)


def norm_rope(q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float,
              round_first: bool, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, T, Hq, D] and k [1, T, Hk, D] (heads contiguous within a token), their norms' weights [D] (None: no norms),
    cos and sin [1, T, D] in the normed rows' dtype (kernels/norm.py `norm_dtype`; the rotation keeps it) -> the rotated
    query [1, Hq, T, D] and key [1, Hk, T, D], transformers' layout after its transpose."""
    T, Hq, D = q.shape[1:]
    Hk = k.shape[2]
    dt = norm_dtype(q.dtype, q_w.dtype if q_w is not None else None, round_first)
    qo = torch.empty(1, T, Hq, D, dtype=dt, device=q.device)
    ko = torch.empty(1, T, Hk, D, dtype=dt, device=q.device)
    norm = q_w is not None
    _norm_rope_kernel[(T, Hq + Hk)](q, k, q_w if norm else q, k_w if norm else k, cos, sin, qo, ko, eps, Hq, q.stride(1),
                                    k.stride(1), cos.stride(1), qo.stride(1), ko.stride(1), D=D, BD=triton.next_power_of_2(D),
                                    NORM=norm, ROUND_FIRST=round_first, XT=TL_DTYPES[q.dtype], DT=TL_DTYPES[dt], num_warps=1,
                                    enable_fp_fusion=False)  # each product rounded before the add, as torch's ops (fp32 too)
    return qo.transpose(1, 2), ko.transpose(1, 2)


def fits(q: torch.Tensor, k: torch.Tensor, q_w, k_w, cos: torch.Tensor, sin: torch.Tensor, round_first: bool) -> bool:
    """Whether `norm_rope` takes these: one sequence, heads of one even width contiguous, both norms or none, cos and
    sin [1, T, D] in the normed rows' dtype with the rows contiguous."""
    if q.dim() != 4 or q.shape[0] != 1 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3] or q.shape[3] % 2:
        return False
    if (q_w is None) != (k_w is None) or q.dtype not in FLOATS or k.dtype != q.dtype:
        return False
    dt = norm_dtype(q.dtype, q_w.dtype if q_w is not None else None, round_first)
    if q_w is not None and (q_w.dtype != k_w.dtype or q_w.dtype not in FLOATS):
        return False
    return (all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k)) and sin.stride(1) == cos.stride(1)
            and all(t.shape == (1, q.shape[1], q.shape[3]) and t.dtype == dt and t.stride(-1) == 1 for t in (cos, sin)))


def norm_rope_ref(q, k, q_w, k_w, eps, round_first, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ops: RMSNorm per head (kernels/norm.py's reference), transpose, then x * cos + rotate_half(x) * sin."""
    from sluice.kernels.norm import rms_norm_ref

    def one(x, w):
        if w is not None:
            x = rms_norm_ref(x, w, eps, round_first)
        x = x.transpose(1, 2)
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos.unsqueeze(1) + rot * sin.unsqueeze(1)

    return one(q, q_w), one(k, k_w)
