"""A sigmoid top-k router (DeepSeek-V3's, as Nemotron-H runs it with one expert group) and a softmax one (Qwen3-MoE's,
Mixtral's) in two Triton launches each.

transformers' router is about a dozen kernels a call on a GPU (the input to fp32, the linear, sigmoid, the bias,
top-k, gather, sum, add, divide, scale); a one-token step of Nemotron-3-Nano routes 23 times (and guesses the next
layer's experts as many times more), so in a step replayed as one graph those small kernels are a large share of its
time. Here:

  `_scores_kernel`, one program per (row, block of experts; one expert in use): the fp32 dot products of the row with the experts'
      router weights, sigmoid.
  `_select_kernel`, one program per row: the top-k of the scores plus the correction bias, best first (the first
      index among equal ones), their scores normalised to sum 1 (with transformers' 1e-20) and scaled.

The softmax router (`softmax_router`): the logits rounded to the router weight's dtype (transformers' linear in that
dtype), their softmax in fp32, the top-k of the probabilities best first, optionally normalised to sum 1 (no 1e-20),
the weights in the dtype the model returns them in. `softmax_router_ref` is its plain-torch reference.

Up to FEW rows (one-token steps, small batches); a prompt's rows go through the reference, one GEMM that reads the
weights once. The same arithmetic in fp32; the dot products add in another order than cuBLAS's, so scores agree
within fp32 rounding, and the ids come best first (transformers' top-k leaves them unsorted: the routed sum then adds the same
experts in another order). `router_ref` is the plain-torch reference (transformers' formula, ids best first).

Shape legend: T rows (tokens), D the router's input width, E experts, K routed per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scores_kernel(x, w, s, D, E, X_T, BE: tl.constexpr, BD: tl.constexpr, SIGMOID: tl.constexpr):
    t, eb = tl.program_id(0), tl.program_id(1)
    e = eb * BE + tl.arange(0, BE)
    em = e < E
    acc = tl.zeros([BE], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < D
        xv = tl.load(x + t * X_T + d, mask=dm, other=0.0).to(tl.float32)
        wv = tl.load(w + e[:, None] * D + d[None, :], mask=em[:, None] & dm[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], axis=1)
    if SIGMOID:
        acc = 1.0 / (1.0 + tl.exp(-acc))
    tl.store(s + t * E + e, acc.to(s.dtype.element_ty), mask=em)  # the logits rounded to s's dtype, or the scores


@triton.jit
def _top_k(choice, value, e, ids, K: tl.constexpr, BE: tl.constexpr):
    """The K best of `choice` [BE] stored at ids[0..K-1] best first (the first index among equal ones); (each index's
    rank, -1 outside; the sum of their `value`s, added in rank order)."""
    rank, total = tl.full([BE], -1, tl.int32), 0.0
    for k in tl.static_range(K):
        best = tl.max(choice, axis=0)
        at = tl.min(tl.where(choice == best, e, BE), axis=0)
        tl.store(ids + k, at.to(tl.int64))
        rank = tl.where(e == at, k, rank)
        total += tl.sum(tl.where(e == at, value, 0.0), axis=0)
        choice = tl.where(e == at, float("-inf"), choice)
    return rank, total


@triton.jit
def _softmax_select_kernel(s, weights, ids, E, K: tl.constexpr, NORM: tl.constexpr, BE: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BE)
    em = e < E
    logit = tl.load(s + t * E + e, mask=em, other=float("-inf")).to(tl.float32)
    p = tl.exp(logit - tl.max(logit, axis=0))
    p = tl.where(em, p / tl.sum(p, axis=0), float("-inf"))
    rank, total = _top_k(p, p, e, ids + t * K, K, BE)
    for k in tl.static_range(K):
        got = tl.sum(tl.where(rank == k, p, 0.0), axis=0)
        if NORM:
            got = got / total
        tl.store(weights + t * K + k, got.to(weights.dtype.element_ty))


@triton.jit
def _select_kernel(s, bias, weights, ids, E, K: tl.constexpr, scale, NORM: tl.constexpr, BE: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BE)
    em = e < E
    score = tl.load(s + t * E + e, mask=em, other=0.0)
    choice = tl.where(em, score + tl.load(bias + e, mask=em, other=0.0), float("-inf"))
    rank, total = _top_k(choice, score, e, ids + t * K, K, BE)
    for k in tl.static_range(K):  # the weights from registers (a value stored is not read back: no barrier orders it)
        w = tl.sum(tl.where(rank == k, score, 0.0), axis=0)
        if NORM:
            w = w / (total + 1e-20)
        tl.store(weights + t * K + k, w * scale)


FEW = 8  # rows up to which the kernels route; more (a prompt) go through `router_ref`'s GEMM, which reads the weights once


def _scores(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, sigmoid: bool) -> torch.Tensor:
    """x [T, D] -> [T, E] in dtype: the rows' dot products with the router weights, through a sigmoid or not."""
    T, D = x.shape
    E = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    s = torch.empty(T, E, dtype=dtype, device=x.device)
    # one expert a program, its whole row in one load: latency, not bytes, bounds a call (16 experts a program, then 2
    # in a loop over D, left most of the GPU idle: BENCHMARKS.md, 2026-12-06)
    BD = min(4096, triton.next_power_of_2(D))
    _scores_kernel[(T, E)](x, weight, s, D, E, x.stride(0), BE=1, BD=BD, SIGMOID=sigmoid, num_warps=8 if BD >= 2048 else 4)
    return s


def sigmoid_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, scale: float,
                   norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (weights [T, K] fp32, ids [T, K] int64 best first); weight [E, D] and bias [E] fp32."""
    T = x.shape[0]
    if T > FEW:
        return router_ref(x, weight, bias, k, scale, norm)
    E = weight.shape[0]
    s = _scores(x, weight, torch.float32, sigmoid=True)
    weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    # one warp: its K rounds of max, first index and sum are register shuffles, not shared-memory rounds across warps
    _select_kernel[(T,)](s, bias, weights, ids, E, K=k, scale=scale, NORM=norm, BE=triton.next_power_of_2(E), num_warps=1)
    return weights, ids


def router_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, scale: float,
               norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.nn.functional.linear(x.float(), weight.float()).sigmoid()
    ids = torch.topk(scores + bias, k=k, dim=-1, sorted=True)[1]
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def softmax_router(x: torch.Tensor, weight: torch.Tensor, k: int, norm: bool,
                   out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (weights [T, K] out_dtype, ids [T, K] int64 best first); weight [E, D] in the router's dtype."""
    T = x.shape[0]
    if T > FEW:
        return softmax_router_ref(x, weight, k, norm, out_dtype)
    E = weight.shape[0]
    s = _scores(x, weight, torch.promote_types(x.dtype, weight.dtype), sigmoid=False)
    weights = torch.empty(T, k, dtype=out_dtype, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    _softmax_select_kernel[(T,)](s, weights, ids, E, K=k, NORM=norm, BE=triton.next_power_of_2(E), num_warps=1)
    return weights, ids


def softmax_router_ref(x: torch.Tensor, weight: torch.Tensor, k: int, norm: bool,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(torch.nn.functional.linear(x, weight).float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1, sorted=True)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids
