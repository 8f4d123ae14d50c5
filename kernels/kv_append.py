"""A one-token step's key and value written into a static cache's next slot, and its length moved on, in one launch.

transformers' StaticLayer.update is five kernels a call on a GPU (an arange, an add, the length's add_, two
index_copy_); a one-token Nemotron-3-Nano step calls it 6 times, so in a step replayed as one CUDA graph
(pipeline/whole.py) that is 24 small kernels fewer. The same copies, so the same cache; `kv_append_ref` is
transformers' arithmetic in plain torch. The slot is the length read on the device, so a replay writes where the
sequence is; a length past the slots writes nothing (the engine grows the cache before a step: static_cache.fit).

Shape legend: H heads, S slots, Dk / Dv key / value head widths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _append_kernel(keys, values, k, v, length, H, S, DK, DV, K_H, V_H, BK: tl.constexpr, BV: tl.constexpr):
    pos = tl.load(length)
    i = tl.arange(0, BK)
    m = i < tl.where(pos < S, H * DK, 0)  # a full cache: nothing written
    tl.store(keys + ((i // DK) * S + pos) * DK + i % DK, tl.load(k + (i // DK) * K_H + i % DK, mask=m), mask=m)
    j = tl.arange(0, BV)
    m = j < tl.where(pos < S, H * DV, 0)
    tl.store(values + ((j // DV) * S + pos) * DV + j % DV, tl.load(v + (j // DV) * V_H + j % DV, mask=m), mask=m)
    tl.debug_barrier()  # every lane has read the length before it moves on
    tl.store(length, pos + 1)


def appendable(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `kv_append` takes these: one sequence, one token, contiguous slots, rows of the slots' dtype."""
    return (keys.dim() == 4 and keys.shape[0] == 1 and k.shape[0] == 1 and k.shape[2] == 1 and keys.is_contiguous()
            and values.is_contiguous() and k.dtype == keys.dtype and v.dtype == values.dtype
            and k.stride(-1) == 1 and v.stride(-1) == 1 and k.shape[1] == keys.shape[1] and v.shape[1] == values.shape[1])


def kv_append(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor) -> None:
    """keys [1,H,S,Dk][:, :, length] = k [1,H,1,Dk], values likewise from v, then length += 1 (a 0-d int64)."""
    H, S, DK, DV = keys.shape[1], keys.shape[2], keys.shape[3], values.shape[3]
    _append_kernel[(1,)](keys, values, k, v, length, H, S, DK, DV, k.stride(1), v.stride(1),
                         BK=triton.next_power_of_2(H * DK), BV=triton.next_power_of_2(H * DV), num_warps=4)


def kv_append_ref(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor) -> None:
    position = torch.arange(k.shape[-2], device=keys.device) + length
    length.add_(k.shape[-2])
    keys.index_copy_(2, position, k)
    values.index_copy_(2, position, v)
