"""The `direct` schedule's VRAM tier (storage/vram_tier.py): filled at open, prompts filling its free slots and copying
the next layer's blocks ahead into its lookahead bank, refreshes from the use counts, a tier that holds every block;
each against the logits of a tier that holds fewer, bit for bit."""

from __future__ import annotations

import torch

import sluice
from common import DEVICE, PROMPT, greedy_logits
from test_direct import direct_schedule, table_of


def test_prompt_fills_free_vram_slots(stores, tmp_path):
    """A prompt copies its RAM blocks into the VRAM tier's free slots (as many as are free) instead of the staging
    bank, and they stay: the next prompt reads them from VRAM. The logits are those of prompts through the staging
    bank alone (and of RAM blocks read in place, `prompt_group: 0`), bit for bit; `empty_vram` points the table back at
    RAM and frees every slot."""
    fill = direct_schedule(tmp_path, backend="triton", prompt_group=2, prompt_ahead=0, vram_fill=False)
    staged = direct_schedule(tmp_path, "staged", backend="triton", prompt_group=2, prompt_fill=False, prompt_ahead=0,
                            vram_fill=False)
    other = [5, 9, 14, 3, 7, 21, 11, 2, 30, 17, 8]
    in_place = direct_schedule(tmp_path, "in-place", backend="triton", prompt_group=0, prompt_ahead=0, vram_fill=False)
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=staged, vram_slots=5) as engine:
        ref = [engine.forward(PROMPT), engine.forward(other)]
        assert engine.rt.stats.vram_fills == 0
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=in_place, vram_slots=5) as engine:  # RAM blocks read where they lie
        assert torch.equal(engine.forward(PROMPT), ref[0]) and engine.rt.stats.vram_fills == 0
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=fill, vram_slots=5) as engine:
        stage = table_of(engine)
        first = engine.forward(PROMPT)
        io = engine.rt.stats.snapshot()
        assert io["vram_fills"] == len(stage.tier.slot_of) == 5 and not stage.tier.free  # more RAM blocks than slots
        assert io["blocks"]["vram"] == 0
        assert int(stage.tier.in_vram.sum()) == 5
        slots = [stage.tier.table[i, e].item() for (i, e) in stage.tier.slot_of]
        assert sorted(slots) == [s * engine.store.block_bytes for s in range(5)]
        second = engine.forward(other)
        io2 = engine.rt.stats.since(io)
        assert io2["vram_fills"] == 0 and io2["blocks"]["vram"] > 0  # no free slot left; the filled ones read in place
        engine.empty_vram()
        assert not stage.tier.slot_of and len(stage.tier.free) == 5 and int(stage.tier.in_vram.sum()) == 0
        assert stage.tier.table.tolist() == stage.blocks.off
        again = engine.forward(other)
        assert engine.rt.stats.since(io)["vram_fills"] == 5
    assert torch.equal(first, ref[0]) and torch.equal(second, ref[1]) and torch.equal(again, ref[1])


def test_the_tier_is_filled_at_open(stores, tmp_path):
    """`vram_fill` (the default): at open the tier's slots take blocks spread evenly over the MoE layers (expert ids in
    order), the table pointing at them, so that a first prompt reads them from VRAM, with the logits of a prompt on an
    empty tier bit for bit; `empty_vram` leaves the tier as at open. Without it the tier opens empty and a first prompt
    reads nothing from VRAM (the must-fail side)."""
    opened = direct_schedule(tmp_path, "opened", backend="triton", prompt_group=2, prompt_ahead=0)
    empty = direct_schedule(tmp_path, "empty", backend="triton", prompt_group=2, prompt_ahead=0, vram_fill=False)
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=empty, vram_slots=5) as engine:
        assert not table_of(engine).tier.slot_of
        ref = engine.forward(PROMPT)
        assert engine.rt.stats.blocks["vram"] == 0
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=opened, vram_slots=5) as engine:
        tier, bb = table_of(engine).tier, engine.store.block_bytes
        n, E = len(engine.store.moe_layers), engine.store.manifest.num_experts
        spread = sorted([(i, e) for e in range(E) for i in range(n)][:5])
        assert sorted(tier.slot_of) == spread and not tier.free and int(tier.in_vram.sum()) == 5
        assert all(tier.table[i, e].item() == slot * bb for (i, e), slot in tier.slot_of.items())
        before = engine.rt.stats.snapshot()
        first = engine.forward(PROMPT)
        assert engine.rt.stats.since(before)["blocks"]["vram"] > 0
        engine.empty_vram()
        assert sorted(tier.slot_of) == spread and not tier.free
    assert torch.equal(first, ref)


def test_prompt_copies_the_next_layers_guesses_ahead(stores, tmp_path, monkeypatch):
    """`prompt_ahead`: while a prompt's layer computes, the next MoE layer's blocks that its router picks on this
    layer's input are copied ahead, into free VRAM tier slots, else into a bank of 2 x prompt_ahead slots taken from
    the tier; the next layer reads them from there. The logits are those of prompts without it, bit for bit, on an
    empty tier and on a full one; one-token steps lend the bank's slots to the tier with the blocks a prompt left in
    them, and the next prompt takes them back; a copy ahead of the wrong block changes the logits."""
    staged = direct_schedule(tmp_path, "staged", backend="triton", prompt_group=2, prompt_fill=False, prompt_ahead=0)
    ahead = direct_schedule(tmp_path, "ahead", backend="triton", prompt_group=2, prompt_ahead=2, refresh=2, vram_fill=False)
    other = [5, 9, 14, 3, 7, 21, 11, 2, 30, 17, 8]
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=staged, vram_slots=9) as engine:
        ref = [engine.forward(PROMPT), engine.forward(other)]
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=ahead, vram_slots=9) as engine:
        stage = table_of(engine)
        assert stage.tier.ahead_bank == [[5, 6], [7, 8]] and stage.tier.free == [4, 3, 2, 1, 0]
        first = engine.forward(PROMPT)
        io = engine.rt.stats.snapshot()
        assert sorted(stage.tier.slot_of.values()) == [0, 1, 2, 3, 4] and stage.ahead is None
        second = engine.forward(other)  # a full tier: the guesses go to the bank
        io2 = engine.rt.stats.since(io)
        assert 0 < io2["vram_prefetch_hits"] <= io2["vram_prefetches"] <= 2 * (len(engine.store.moe_layers) - 1)
        assert io2["vram_fills"] == 0 and sorted(stage.tier.slot_of.values()) == [0, 1, 2, 3, 4]
        held, bb = dict(stage.tier.bank_holds), engine.store.block_bytes
        assert held and set(held) <= {5, 6, 7, 8}
        stage.tier.lend_bank()  # as the next one-token step does: the blocks the prompt left in the bank stay in VRAM
        assert all(stage.tier.slot_of[key] == slot and stage.tier.table[key].item() == slot * bb for slot, key in held.items())
        assert sorted(stage.tier.free[: 4 - len(held)]) == sorted({5, 6, 7, 8} - set(held))
        engine.generate(PROMPT, 6)  # one-token steps: the tier's refreshes fill the lent bank
        assert stage.tier.bank_lent and {5, 6, 7, 8} & set(stage.tier.slot_of.values())
        third = engine.forward(other)
        assert not stage.tier.bank_lent and max(stage.tier.slot_of.values()) < 5 and stage.tier.free == []
        assert all(stage.tier.table[i, e].item() == stage.blocks.off[i][e] for i in range(len(stage.layers))
                   for e in range(engine.store.manifest.num_experts) if (i, e) not in stage.tier.slot_of)
        engine.empty_vram()
        assert stage.tier.free == [4, 3, 2, 1, 0] and not stage.tier.slot_of
        again = engine.forward(other)
        real = stage.blocks.entries

        class Shifted(dict):  # the lookahead copies expert e + 1's block for expert e
            def __getitem__(self, key):
                layer, e = key
                return real[(layer, (e + 1) % engine.store.manifest.num_experts)]

        h2d = next(s for spec, s in engine.coordinator.stages if spec.name == "h2d")
        look = h2d.look_ahead

        def wrong(v):
            stage.blocks.entries = Shifted(real)
            try:
                look(v)
            finally:
                stage.blocks.entries = real

        monkeypatch.setattr(h2d, "look_ahead", wrong)
        bad = engine.forward(other)
    room = engine.store.total_blocks - 1  # the most slots a tier has short of every block: the bank takes 4 of them
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=ahead, vram_slots=room) as engine:
        stage = table_of(engine)
        roomy = engine.forward(PROMPT)
        io = engine.rt.stats.snapshot()
        assert io["vram_prefetches"] > 0 and io["vram_prefetch_hits"] > 0
        # copies ahead went to tier slots while there were free ones (the bank is the last 4, never in slot_of)
        assert max(stage.tier.slot_of.values()) < room - 4 and len(stage.tier.slot_of) > io["vram_fills"]
    assert torch.equal(first, ref[0]) and torch.equal(roomy, ref[0]) and all(torch.equal(t, ref[1]) for t in (second, third, again))
    assert (bad - ref[1]).abs().max().item() > 1e-3


def test_the_refresh_waits_until_the_token_is_queued(stores, tmp_path, monkeypatch):
    """The tier's refresh (its host work: the choice, the table's updates, the copies) runs once the token's MoE layers
    are queued, on the counts read at the token's start, so that it runs beside the GPU's work: every refresh of a
    decode comes right after `after_queued`, none inside the token's layers."""
    from sluice.storage.vram_tier import VramTier

    calls, inside, refresh, after = [], [], VramTier.refresh, VramTier.after_queued

    def queued(self):
        inside.append(1)
        try:
            after(self)
        finally:
            inside.pop()

    monkeypatch.setattr(VramTier, "after_queued", queued)
    monkeypatch.setattr(VramTier, "refresh", lambda self, uses=None: calls.append(bool(inside)) or refresh(self, uses))
    schedule = direct_schedule(tmp_path, backend="triton", refresh=2)
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=schedule, vram_slots=4) as engine:
        engine.generate(PROMPT, 7)
    assert len(calls) >= 2 and all(calls), calls  # each from after_queued


def test_vram_refresh_swaps_only_for_a_clear_gain(stores, tmp_path):
    """Free slots take the most used blocks; a block outside then replaces the least used inside only when its
    decayed count beats that one's by more than `margin` (ties and near-ties cost no copies) plus `noise` times the
    square root of both counts (a gain within chance costs no copy)."""
    schedule = direct_schedule(tmp_path, backend="triton", margin=1.0, decay=0.5, noise=0.0, vram_fill=False)
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=schedule, vram_slots=2) as engine:
        tier = table_of(engine).tier
        tier.uses.zero_()
        tier._score[:] = 0
        tier._last_uses[:] = 0
        fills = engine.rt.stats.vram_fills

        def refresh(counts):  # cumulative routed uses of layer 0's experts -> the tier after the refresh lands
            for e, n in counts.items():
                tier.uses[0, e] += n
            tier.refresh()
            tier.land(wait=True)
            return sorted(e for i, e in tier.slot_of)

        assert refresh({0: 3, 1: 3, 2: 3}) == [0, 1]  # a three-way tie for two free slots: the first two
        assert refresh({2: 1}) == [0, 1]  # 2.5 against 1.5: not more than the margin
        assert engine.rt.stats.vram_fills - fills == 2
        assert refresh({2: 2}) == [0, 2]  # 1.25 + 2 = 3.25 against 0.75: swapped in
        assert engine.rt.stats.vram_fills - fills == 3
        assert int(tier.in_vram[0].sum()) == 2 and int(tier.in_vram[0, 1]) == 0
        tier.knobs = type(tier.knobs)({**tier.knobs.values, "noise": 1.5})
        assert refresh({1: 4}) == [0, 2]  # 4.375 against 0.375: more than the margin, not than 1 + 1.5 sqrt(4.75)
        assert refresh({1: 8}) == [1, 2]  # 10.1875 against 0.1875: more than 1 + 1.5 sqrt(10.375)
        assert engine.rt.stats.vram_fills - fills == 4


def test_a_tier_with_a_slot_for_every_block_holds_them_all(stores, tmp_path):
    """A VRAM budget with a slot for every block: all of them copied in at open and kept (no refresh, no staging, no
    lookahead bank; `empty_vram` keeps them); every routed block read from VRAM, the logits those of a tier that
    holds a few (the same kernels on the same bytes)."""
    schedule = direct_schedule(tmp_path, backend="triton", refresh=2, token_ahead=2, prompt_group=2)
    with sluice.load(stores["nemotron_h"], device=DEVICE, schedule=schedule, vram_slots=12) as engine:
        assert not table_of(engine).tier.holds_all
        want = greedy_logits(engine, PROMPT, 8)
    with sluice.load(stores["nemotron_h"], device=DEVICE, schedule=schedule, vram_slots=10_000) as engine:
        tier, total = table_of(engine).tier, engine.store.total_blocks
        assert tier.holds_all and tier.S == 0 and len(tier.slot_of) == total
        engine.empty_vram()
        assert len(tier.slot_of) == total
        got = greedy_logits(engine, PROMPT, 8)
        assert engine.rt.stats.blocks["ram"] == 0 and engine.rt.stats.blocks["vram"] > 0
    assert torch.equal(got, want)


def test_copy_blocks_joins_adjacent_blocks_only(monkeypatch):
    """A prompt's block copies (stages/h2d_table.py `copy_blocks`): blocks adjacent at both ends go as one copy, others
    one by one, and every destination ends up holding its own source (as block-by-block copies leave them); blocks of
    another storage that happen to be adjacent are not joined."""
    from sluice.stages.h2d_table import copy_blocks

    bb = 16
    src = torch.arange(8 * bb, dtype=torch.uint8)
    dst = torch.zeros(8 * bb, dtype=torch.uint8)
    blk = lambda t, i: t[i * bb : (i + 1) * bb]  # noqa: E731
    buf = bytearray(2 * bb)  # two storages over one buffer: adjacent blocks of different storages
    left, right = torch.frombuffer(buf, dtype=torch.uint8, count=bb), torch.frombuffer(buf, dtype=torch.uint8, offset=bb)
    assert right.data_ptr() == left.data_ptr() + bb
    pairs = [(blk(dst, 0), blk(src, 2)), (blk(dst, 1), blk(src, 3)), (blk(dst, 2), blk(src, 4)),  # one run of three
             (blk(dst, 5), blk(src, 0)), (blk(dst, 3), blk(src, 6)), (blk(dst, 6), left), (blk(dst, 7), right)]
    calls = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, s, non_blocking=False: (calls.append(self.numel()), real(self, s))[1])
    copy_blocks(pairs, bb)
    monkeypatch.undo()
    for d, s in pairs:
        assert torch.equal(d, s)
    assert calls == [3 * bb, bb, bb, bb, bb]  # left and right adjacent at both ends, but of two storages
    assert torch.equal(blk(dst, 4), torch.zeros(bb, dtype=torch.uint8))  # nothing past a run written


def test_prompt_copies_ahead_go_in_expert_order(stores, tmp_path, monkeypatch):
    """A prompt's copies ahead (h2d's `look_ahead`) take the free slots for the most chosen blocks and the bank's for
    the rest, each part's blocks in expert order into ascending slots, so that blocks adjacent in RAM go as one copy
    (`copy_blocks`); the logits are those of copies through the staging buffer alone (a wrong block moves them by
    more than 1e-3: `test_prompt_copies_the_next_layers_guesses_ahead`). The order is shown to matter: popularity
    order (the tree before 2026-12-08) failed the order check here."""
    import sluice.stages.h2d_table as h2d_table

    ahead = direct_schedule(tmp_path, "ahead", backend="triton", prompt_group=2, prompt_ahead=4, vram_fill=False)
    staged = direct_schedule(tmp_path, "staged", backend="triton", prompt_group=2, prompt_fill=False, prompt_ahead=0)
    prompt = (PROMPT * 4)[:40]  # enough rows that the blocks' counts differ: most chosen first is not expert order
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=staged, vram_slots=14) as engine:
        want = engine.forward(prompt)
    calls, real = [], h2d_table.copy_blocks
    monkeypatch.setattr(h2d_table, "copy_blocks", lambda pairs, bb: (calls.append(list(pairs)), real(pairs, bb))[1])
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=ahead, vram_slots=14) as engine:
        stage, E = table_of(engine), engine.store.manifest.num_experts
        expert = {stage.blocks.entries[(layer, e)].buf.data_ptr(): e for layer in stage.layers for e in range(E)}
        tier, bb = stage.tier, engine.store.block_bytes
        bank, arena = set(tier.ahead_bank[0] + tier.ahead_bank[1]), tier.vram.arena
        got = engine.forward(prompt)
    at = arena.data.data_ptr()
    slots = [[((d.data_ptr() - at) // bb, expert[s.data_ptr()]) for d, s in pairs] for pairs in calls]
    moved = [[p for p in m if 0 <= p[0] < arena.n] for m in slots]  # into the tier's slots (not the staging buffer)
    assert any(len([p for p in m if p[0] in bank]) > 2 for m in moved)
    for m in moved:
        for part in ([p for p in m if p[0] not in bank], [p for p in m if p[0] in bank]):
            assert part == sorted(part) and [e for _, e in part] == sorted(e for _, e in part), m
    assert (got - want).abs().max().item() < 1e-5  # fp32 rounding: the grouped GEMMs' groups follow where blocks lie
