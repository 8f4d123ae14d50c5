"""The input embedding held in pinned RAM, each token's row read over PCIe by the GPU (`--embed-on-host`).

A token reads one row of the embedding (a few KB), yet the table holds the whole vocabulary: 0.66 GiB of Nano's
4.23 GiB resident part, 0.58 GiB of Qwen3-30B-A3B's. Held in pinned RAM, its VRAM goes to expert slots (the budget
counts what the allocator holds once the resident part is placed: pipeline/budget.py); the gather reads the rows
where they lie (zero-copy, as the expert kernels read RAM blocks), inside a captured step too. Rows are copied, not
computed: the output is bit for bit `F.embedding`'s (`embed_ref`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

BLOCK = 1024


@triton.jit(do_not_specialize=["ids"])  # a batched step's ids are rows of one tensor: one variant, whatever the offset
def _gather_kernel(table, ids, out, V, D, B: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    d = part * B + tl.arange(0, B)
    i = tl.load(ids + row).to(tl.int64)  # int64: vocabulary x width passes 2^31 elements
    width = tl.where((i >= 0) & (i < V), D, 0)  # an id outside the table reads nothing (a zero row), no other memory
    row_out = out + row.to(tl.int64) * D
    tl.store(row_out + d, tl.load(table + i * D + d, mask=d < width, other=0.0), mask=d < D)


def embed(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table [V, D] (pinned RAM, rows contiguous) read at ids [...] (on the device) -> [..., D] on ids' device."""
    flat = ids.reshape(-1).contiguous()
    V, D = table.shape
    out = torch.empty(flat.numel(), D, dtype=table.dtype, device=ids.device)
    if flat.numel():
        _gather_kernel[(flat.numel(), triton.cdiv(D, BLOCK))](table, flat, out, V, D, B=BLOCK, num_warps=4)
    return out.view(*ids.shape, D)


def embed_ref(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids.to(table.device), table).to(ids.device)


class HostEmbedding(nn.Module):
    """Stands where an nn.Embedding was, its table in pinned RAM: ids on a GPU through `embed`, on a CPU its reference."""

    def __init__(self, embedding: nn.Embedding, pin: bool) -> None:
        super().__init__()
        weight = embedding.weight.detach().to("cpu")
        self.table = weight.pin_memory() if pin else weight  # not a parameter: no device move, not in state_dict
        self.num_embeddings, self.embedding_dim = self.table.shape
        self.padding_idx = embedding.padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embed(self.table, ids) if ids.is_cuda else embed_ref(self.table, ids)
