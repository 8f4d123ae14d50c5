"""The direct schedule's one-token lookahead: the next MoE layer's guessed blocks that VRAM lacks, copied ahead.

Offsets are byte offsets from one base (the VRAM tier's arena): a VRAM slot, or a pinned RAM slot that a kernel
reads over PCIe (zero-copy), as in kernels/decode.py. Block ids are global: MoE index * E + expert.

- `select`: of the next layer's guessed experts (its router's top-k on this layer's input, most likely first), the
  first `S` whose blocks are not in VRAM: their ids and RAM offsets, -1 ids for the slots left empty, and the count
  added to a device counter (each is a block that crosses PCIe).
- `stage_copy`: those blocks copied from RAM into a staging bank of S VRAM slots, each read in chunks by many
  programs with 16-byte loads (a copy that waits on nothing the host knows: the ids stay on the GPU).
- `resolve`: a layer's routed experts -> the offsets its expert kernels read: the table's (VRAM or RAM), but a block
  the table has in RAM and the staging bank holds is read from its staging slot. Also counts the routed uses, the
  blocks read from VRAM and those read from staging.

Each has a plain-torch twin (`*_ref`); tests/test_ahead.py holds them to each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COPY_TILE = 2048  # int32 words a program moves per step (8 KiB)
COPY_CHUNKS = 16  # programs per staged block


@triton.jit
def _select_kernel(ids, in_vram, table, gid0, out_ids, out_src, copies, K, S, BK: tl.constexpr, BS: tl.constexpr):
    k = tl.arange(0, BK)
    km = k < K
    e = tl.load(ids + k, mask=km, other=0).to(tl.int64)
    miss = km & (tl.load(in_vram + e, mask=km, other=1) == 0)
    rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    take = miss & (rank < S)
    tl.store(out_ids + rank, gid0 + e, mask=take)
    tl.store(out_src + rank, tl.load(table + e, mask=take, other=0), mask=take)
    n = tl.sum(take.to(tl.int32), axis=0)
    s = tl.arange(0, BS)
    tl.store(out_ids + s, tl.full([BS], -1, tl.int64), mask=(s >= n) & (s < S))
    tl.atomic_add(copies, n.to(tl.int64))


@triton.jit
def _copy_kernel(bank, ids, src, DST0, NW, CHUNK, TILE: tl.constexpr):
    s = tl.program_id(0)
    if tl.load(ids + s) >= 0:
        words = bank.to(tl.pointer_type(tl.int32))
        so = tl.multiple_of(tl.load(src + s) // 4, 4)  # blocks start 4 KiB-aligned: 16-byte loads
        do = tl.multiple_of(DST0.to(tl.int64) + s.to(tl.int64) * NW, 4)  # in 64 bits: a bank past 8 GiB wraps 32
        start = tl.program_id(1) * CHUNK
        for w0 in range(start, start + CHUNK, TILE):
            w = w0 + tl.arange(0, TILE)
            m = w < NW
            tl.store(words + do + w, tl.load(words + so + w, mask=m), mask=m)


@triton.jit
def _resolve_kernel(ids, table, in_vram, staged, STAGE0, BB, gid0, out, uses, vram_ctr, staged_ctr, K, S,
                    BK: tl.constexpr, BS: tl.constexpr):
    k = tl.arange(0, BK)
    km = k < K
    e = tl.load(ids + k, mask=km, other=0).to(tl.int64)
    off = tl.load(table + e, mask=km, other=0)
    inv = tl.load(in_vram + e, mask=km, other=0)
    s = tl.arange(0, BS)
    st = tl.load(staged + s, mask=s < S, other=-1)
    match = ((gid0 + e)[:, None] == st[None, :]).to(tl.int32)
    which = tl.sum(match * s[None, :], axis=1)  # staged ids are distinct: at most one match a row
    use = km & (tl.sum(match, axis=1) > 0) & (inv == 0)
    off = tl.where(use, STAGE0 + which.to(tl.int64) * BB, off)
    tl.store(out + k, off, mask=km)
    tl.atomic_add(uses + e, tl.full([BK], 1, tl.int64), mask=km)
    tl.atomic_add(vram_ctr, tl.sum(tl.where(km, inv, 0), axis=0).to(tl.int64))
    tl.atomic_add(staged_ctr, tl.sum(use.to(tl.int64), axis=0))


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(max(n, 1)))


def select(ids: torch.Tensor, in_vram: torch.Tensor, table: torch.Tensor, gid0: int, out_ids: torch.Tensor,
           out_src: torch.Tensor, copies: torch.Tensor) -> None:
    """ids [K] guessed experts of MoE layer gid0 // E, most likely first; in_vram, table [E] that layer's rows.
    Writes out_ids [S] (global ids, -1 for none) and out_src [S] (their RAM offsets); adds the count to copies."""
    K, S = ids.numel(), out_ids.numel()
    _select_kernel[(1,)](ids, in_vram, table, gid0, out_ids, out_src, copies, K, S, BK=_pow2(K), BS=_pow2(S))


def stage_copy(bank: torch.Tensor, ids: torch.Tensor, src: torch.Tensor, dst0: int, block_bytes: int) -> None:
    """Copy block s (src[s], a byte offset from bank) to bank + dst0 + s * block_bytes where ids[s] >= 0."""
    nw = block_bytes // 4
    chunk = triton.cdiv(triton.cdiv(nw, COPY_CHUNKS), COPY_TILE) * COPY_TILE
    _copy_kernel[(ids.numel(), triton.cdiv(nw, chunk))](bank, ids, src, dst0 // 4, nw, chunk, TILE=COPY_TILE, num_warps=8)


def resolve(ids: torch.Tensor, table: torch.Tensor, in_vram: torch.Tensor, staged: torch.Tensor, stage0: int,
            block_bytes: int, gid0: int, out: torch.Tensor, uses: torch.Tensor, vram_ctr: torch.Tensor,
            staged_ctr: torch.Tensor) -> torch.Tensor:
    """Routed ids [K] of MoE layer gid0 // E -> out [K] byte offsets: table's, or staging slot s (stage0 + s *
    block_bytes) for a block the table has in RAM and staged [S] names. Adds 1 to uses[e] per routed e, the
    VRAM reads to vram_ctr and the staged reads to staged_ctr."""
    K, S = ids.numel(), staged.numel()
    _resolve_kernel[(1,)](ids, table, in_vram, staged, stage0, block_bytes, gid0, out, uses, vram_ctr, staged_ctr, K, S,
                          BK=_pow2(K), BS=_pow2(S))
    return out


# -- plain-torch twins -------------------------------------------------------------------------------


def select_ref(ids, in_vram, table, gid0: int, S: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    picked = [int(e) for e in ids.tolist() if int(in_vram[e]) == 0][:S]
    out_ids = torch.full((S,), -1, dtype=torch.int64)
    out_src = torch.zeros(S, dtype=torch.int64)
    for s, e in enumerate(picked):
        out_ids[s], out_src[s] = gid0 + e, int(table[e])
    return out_ids, out_src, len(picked)


def resolve_ref(ids, table, in_vram, staged, stage0: int, block_bytes: int, gid0: int) -> tuple[torch.Tensor, int, int]:
    """(offsets [K], VRAM reads, staged reads)."""
    where = {int(g): s for s, g in enumerate(staged.tolist()) if g >= 0}
    offs, vram, stag = [], 0, 0
    for e in ids.tolist():
        if int(in_vram[e]):
            vram += 1
            offs.append(int(table[e]))
        elif gid0 + e in where:
            stag += 1
            offs.append(stage0 + where[gid0 + e] * block_bytes)
        else:
            offs.append(int(table[e]))
    return torch.tensor(offs, dtype=torch.int64), vram, stag
