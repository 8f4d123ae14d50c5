"""kernels/ahead.py (the direct schedule's one-token lookahead) against its plain-torch twins: guesses picked, blocks
copied from RAM into a staging bank, routed ids resolved to the offsets the expert kernels read."""

from __future__ import annotations

import pytest
import torch

from sluice.kernels.ahead import resolve, resolve_ref, select, select_ref, stage_copy
from common import DEVICE

E, BB = 24, 4096 * 3  # experts a layer, block bytes


def zeros(n, dtype=torch.int64):
    return torch.zeros(n, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("K, S, seed", [(6, 4, 0), (22, 8, 1), (22, 3, 2), (4, 8, 3), (1, 1, 4)])
def test_select_takes_the_first_guesses_vram_lacks(K, S, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(E, generator=g)[:K]
    in_vram = (torch.rand(E, generator=g) < 0.6).long()
    table = torch.randint(-2**40, 2**40, (E,), generator=g) * 4096
    out_ids, out_src, copies = zeros(S) + 7, zeros(S) + 7, zeros(())
    gid0 = 3 * E
    for _ in range(2):  # the count adds up
        select(ids.to(DEVICE), in_vram.to(DEVICE), table.to(DEVICE), gid0, out_ids, out_src, copies)
    ref_ids, ref_src, n = select_ref(ids, in_vram, table, gid0, S)
    assert torch.equal(out_ids.cpu(), ref_ids) and int(copies) == 2 * n
    assert torch.equal(out_src.cpu()[:n], ref_src[:n])
    assert n == min(S, int((in_vram[ids] == 0).sum()))


@pytest.mark.parametrize("K, S, seed", [(6, 4, 0), (22, 8, 1), (8, 1, 2), (3, 8, 3)])
def test_resolve_reads_staged_blocks_the_table_has_in_ram(K, S, seed):
    g = torch.Generator().manual_seed(seed)
    gid0, stage0 = 2 * E, 1 << 20
    ids = torch.randperm(E, generator=g)[:K]
    in_vram = (torch.rand(E, generator=g) < 0.4).long()
    table = torch.randint(-2**30, 2**30, (E,), generator=g) * 4096
    # staged: some routed, some not, some in VRAM too, a block of another layer with a routed expert's number, empty slots
    pool = [gid0 + int(e) for e in torch.randperm(E, generator=g)[: S - 1]] + [gid0 - E + int(ids[0])]
    staged = torch.tensor(pool[:S], dtype=torch.int64)
    staged[torch.rand(S, generator=g) < 0.25] = -1
    uses, vram, stag, out = zeros(E), zeros(()), zeros(()), zeros(K)
    resolve(ids.to(DEVICE), table.to(DEVICE), in_vram.to(DEVICE), staged.to(DEVICE), stage0, BB, gid0, out, uses, vram, stag)
    ref, rv, rs = resolve_ref(ids, table, in_vram, staged, stage0, BB, gid0)
    assert torch.equal(out.cpu(), ref) and (int(vram), int(stag)) == (rv, rs)
    assert torch.equal(uses.cpu(), torch.zeros(E, dtype=torch.int64).index_add_(0, ids, torch.ones(K, dtype=torch.int64)))


def test_resolve_takes_staging_only_for_this_layers_ram_blocks():
    """Staged: expert 5 of this layer (read from slot 1), expert 1 of the layer before (not this layer's 1), expert 9
    of this layer, which VRAM holds too (read from VRAM); with nothing staged, the table."""
    ids = torch.tensor([5, 1, 9, 2])
    table = torch.arange(E, dtype=torch.int64) * BB
    in_vram = torch.zeros(E, dtype=torch.int64)
    in_vram[9] = 1
    gid0, stage0 = 4 * E, 100 * BB
    staged = torch.tensor([gid0 - E + 1, gid0 + 5, gid0 + 9, -1])
    for st, want in [(staged, [stage0 + BB, BB, 9 * BB, 2 * BB]), (zeros(0), [5 * BB, BB, 9 * BB, 2 * BB])]:
        out, uses, vram, stag = zeros(4), zeros(E), zeros(()), zeros(())
        resolve(ids.to(DEVICE), table.to(DEVICE), in_vram.to(DEVICE), st.to(DEVICE), stage0, BB, gid0, out, uses, vram, stag)
        assert out.cpu().tolist() == want and int(vram) == 1 and int(stag) == int(st.numel() > 0)


@pytest.mark.parametrize("pinned", [False, True])
def test_stage_copy_moves_whole_blocks_from_ram(pinned):
    """Blocks in host memory (pinned on a GPU: read over PCIe) copied into staging slots of a bank; empty slots and
    the bytes around each slot stay as they were."""
    if pinned and DEVICE != "cuda":
        pytest.skip("pinned host memory read by a kernel: CUDA")
    S, nblocks = 3, 5
    bank = torch.full(((S + 2) * BB,), 0xAB, dtype=torch.uint8, device=DEVICE)  # [guard slot][S staging slots][guard slot]
    host = torch.randint(0, 256, (nblocks, BB), dtype=torch.uint8)
    host = host.pin_memory() if pinned else host.to(DEVICE)
    src = torch.tensor([host[i].data_ptr() - bank.data_ptr() for i in (4, 0, 2)], dtype=torch.int64, device=DEVICE)
    ids = torch.tensor([40, -1, 7], dtype=torch.int64, device=DEVICE)
    stage_copy(bank, ids, src, BB, BB)
    got = bank.view(S + 2, BB).cpu()
    assert torch.equal(got[1], host[4].cpu()) and torch.equal(got[3], host[2].cpu())
    assert (got[2] == 0xAB).all() and (got[0] == 0xAB).all() and (got[4] == 0xAB).all()
