"""The `direct` schedule (the `via: table` stages, stages/table.py) against transformers and against the streaming schedules: every block
held in RAM, the kernels reading VRAM or RAM blocks in place through a device table, the VRAM tier's updates,
prompts through the staging bank, and the errors for what it cannot do."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.pipeline.schedule import SCHEDULES_DIR
from common import DEVICE, MUST_DIFFER, PROMPT, VARIANTS, assert_logits_close, greedy_logits
from test_golden import check_golden, least_blocks, ram_sizes, triton_schedule


def direct_schedule(tmp_path, name: str = "direct-edited", base: str = "direct", **knobs) -> str:
    """schedules/BASE.yaml (a `via: table` schedule) with knobs changed, each in the stage whose variant has it."""
    import dataclasses

    import yaml

    from sluice.stages import VARIANTS

    doc = yaml.safe_load((SCHEDULES_DIR / f"{base}.yaml").read_text())
    for knob, value in knobs.items():
        stage = next(n for n in doc["stages"] if n != "combine"
                     and knob in {f.name for f in dataclasses.fields(VARIANTS[(n, "table")].Knobs)})
        doc["stages"][stage] = {**doc["stages"][stage], knob: value}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def table_of(engine):
    """The device table a `via: table` schedule's stages share (stages/table.py)."""
    return engine.coordinator.plan.table


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_direct_matches_transformers(variant, stores, refs):
    """direct, plain-torch experts (a CPU's default): every block held in RAM, the logits of the prompt and of every
    decode step and the greedy tokens the reference's."""
    with sluice.load(stores[variant], device=DEVICE, schedule="direct") as engine:
        assert len(engine.rt.ram) == engine.store.total_blocks
        check_golden(engine, variant, refs, f"{variant}/direct")
        assert engine.generate(PROMPT, 32) == refs.greedy(variant, PROMPT, 32), f"{variant}/direct: greedy tokens differ (generate)"


@pytest.mark.parametrize("variant", ["nemotron_h_latent", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_direct_table_reads_vram_and_ram_blocks(variant, stores, refs, tmp_path):
    """direct through the Triton kernels (interpreted on a CPU): one-token steps gather each expert's offset from the
    device table, some pointing at VRAM slots (the tier filled every 2 steps; emulated in host memory on a CPU),
    the rest at RAM slots; prompts copy RAM blocks two at a time into a staging bank. Greedy tokens are the reference's and the logits are the streaming overlap schedule's
    bit for bit (same kernels, same bytes, same sum); a table pointing one expert at another's block diverges."""
    n = 12 if DEVICE != "cpu" else 8  # interpreted on a CPU: fewer steps (the tier still refreshed 3 times)
    ref_tokens = refs.greedy(variant, PROMPT, n)
    schedule = direct_schedule(tmp_path, backend="triton", refresh=2, prompt_group=2, vram_fill=False)  # refreshes fill it
    overlap = triton_schedule(tmp_path, "overlap", backend="triton")

    def decode(engine):
        return greedy_logits(engine, PROMPT, n)

    with sluice.load(stores[variant], device=DEVICE, schedule=overlap, vram_slots=6) as engine:
        streamed = decode(engine)
    with sluice.load(stores[variant], device=DEVICE, schedule=schedule, vram_slots=6) as engine:
        direct = decode(engine)
        io = engine.rt.stats.snapshot()
        stage = table_of(engine)
        assert 0 < io["blocks"]["vram"] and 0 < io["blocks"]["ram"]
        assert int(stage.tier.in_vram.sum()) == len(stage.tier.slot_of) > 0
        # every block in a slot was copied in (by a refresh, or ahead of a prompt's layer), 6 per refresh at most
        assert len(stage.tier.slot_of) <= io["vram_fills"] + io["vram_prefetches"] and io["vram_fills"] <= 6 * ((n - 1) // 2)
        # a wrong table: expert 0's entry of the first MoE layer pointing at expert 1's block
        stage.tier.table[:, 0] = stage.tier.table[:, 1]
        stage.tier.vram, stage.tier.landing = None, None  # no tier update puts it right
        wrong = decode(engine)
    assert [int(t) for t in direct.argmax(-1)] == ref_tokens
    assert torch.equal(direct, streamed)
    assert (wrong - direct).abs().max().item() > 1e-3


@pytest.mark.parametrize("variant", ["nemotron_h_latent", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_one_token_steps_read_the_next_layers_guesses_from_staging(variant, stores, refs, tmp_path, monkeypatch):
    """`token_ahead`: each one-token step guesses the next MoE layer's experts, and those VRAM lacks are copied from
    RAM into a staging bank (kernels/ahead.py), from which that layer reads them. The tier stays empty here (no
    refresh, no prompt fill), so every block comes from RAM or staging. Logits are those of the same schedule
    without staging bit for bit, and greedy tokens the reference's; staging filled with the wrong blocks diverges."""
    import sluice.stages.h2d_table as direct_mod

    ref_tokens = refs.greedy(variant, PROMPT, 8)
    knobs = dict(backend="triton", refresh=1000, prompt_fill=False, prompt_ahead=0, vram_fill=False)
    off, on = direct_schedule(tmp_path, "off", token_ahead=0, **knobs), direct_schedule(tmp_path, "on", token_ahead=3, **knobs)
    with sluice.load(stores[variant], device=DEVICE, schedule=off, vram_slots=24) as engine:
        plain = greedy_logits(engine, PROMPT, 8)
    with sluice.load(stores[variant], device=DEVICE, schedule=on, vram_slots=24) as engine:
        staged = greedy_logits(engine, PROMPT, 8)
        io = engine.rt.stats.snapshot()
        assert table_of(engine).tier.S == 3
    assert [int(t) for t in staged.argmax(-1)] == ref_tokens
    assert torch.equal(staged, plain)
    # 7 one-token steps, each guessing for every MoE layer after its first: some right, all counted as copied
    assert 0 < io["vram_prefetch_hits"] <= io["vram_prefetches"] and io["vram_fills"] == 0
    assert io["blocks"]["vram"] == io["vram_prefetch_hits"]

    real = direct_mod.stage_copy
    monkeypatch.setattr(direct_mod, "stage_copy", lambda bank, ids, src, dst0, bb: real(bank, ids, src.roll(1), dst0, bb))
    with sluice.load(stores[variant], device=DEVICE, schedule=on, vram_slots=24) as engine:
        wrong = greedy_logits(engine, PROMPT, 8)
    assert (wrong - plain).abs().max().item() > 1e-3


def test_guesses_beside_or_in_line_give_the_same_logits(stores, tmp_path):
    """A reorder on the fast schedule as a YAML edit: the next layer's guesses on the side stream (beside the router
    and the routed experts) or in line after the router; the same blocks are staged and read, the same logits."""
    variant = "nemotron_h_latent"
    knobs = dict(backend="triton", refresh=1000, prompt_fill=False, prompt_ahead=0, token_ahead=3)
    runs = {}
    for beside in (True, False):
        schedule = direct_schedule(tmp_path, f"beside-{beside}", beside=beside, **knobs)
        with sluice.load(stores[variant], device=DEVICE, schedule=schedule, vram_slots=24) as engine:
            runs[beside] = greedy_logits(engine, PROMPT, 6), engine.rt.stats.snapshot()["vram_prefetch_hits"]
    assert torch.equal(runs[True][0], runs[False][0]) and runs[True][1] == runs[False][1] > 0


def test_a_fast_schedule_without_predict_stages_nothing(stores, tmp_path):
    """The plan composes the one-token step from the stages the file lists: without the predict stage there are no
    guesses, so h2d stages nothing (no staging bank is set aside, no copy is counted) whatever its `token_ahead`, and
    the logits are those of `token_ahead: 0` bit for bit."""
    import yaml

    variant = "nemotron_h_latent"
    knobs = dict(backend="triton", refresh=1000, prompt_fill=False, prompt_ahead=0)
    off = direct_schedule(tmp_path, "off", token_ahead=0, **knobs)
    doc = yaml.safe_load(open(direct_schedule(tmp_path, "unguessed", token_ahead=3, **knobs)))
    del doc["stages"]["predict"]
    unguessed = tmp_path / "unguessed.yaml"
    unguessed.write_text(yaml.safe_dump(doc))
    with sluice.load(stores[variant], device=DEVICE, schedule=off, vram_slots=24) as engine:
        plain = greedy_logits(engine, PROMPT, 6)
    with sluice.load(stores[variant], device=DEVICE, schedule=str(unguessed), vram_slots=24) as engine:
        got = greedy_logits(engine, PROMPT, 6)
        assert table_of(engine).tier.S == 0 and engine.rt.stats.snapshot()["vram_prefetches"] == 0
    assert torch.equal(got, plain)


def test_staging_beside_tier_refreshes_and_prompt_lookahead(stores, refs, tmp_path):
    """Staging with the rest of the tier at work: refreshes every 2 steps, prompt fills, the prompts' lookahead bank
    lent to the tier between prompts. Logits are those without staging bit for bit, for a second prompt and its
    decode too."""
    variant = "nemotron_h_latent"
    ref_tokens = refs.greedy(variant, PROMPT, 10)
    knobs = dict(backend="triton", refresh=2, prompt_group=2, prompt_ahead=2)
    off = direct_schedule(tmp_path, "off", token_ahead=0, **knobs)
    on = direct_schedule(tmp_path, "on", token_ahead=2, **knobs)
    with sluice.load(stores[variant], device=DEVICE, schedule=off, vram_slots=20) as engine:
        plain = greedy_logits(engine, PROMPT, 10)
    with sluice.load(stores[variant], device=DEVICE, schedule=on, vram_slots=20) as engine:
        staged, again = greedy_logits(engine, PROMPT, 10), greedy_logits(engine, PROMPT, 10)
        stage = table_of(engine)
        assert stage.tier.S == 2 and int(stage.staged_served) > 0  # staged blocks were read
        assert engine.rt.stats.snapshot()["vram_fills"] > 0  # and the tier refreshed
    assert [int(t) for t in staged.argmax(-1)] == ref_tokens
    assert torch.equal(staged, plain) and torch.equal(again, plain)


@pytest.mark.parametrize("variant", ["nemotron_h_latent", "qwen3_next"])
def test_shared_term_runs_early_or_late_with_the_same_logits(variant, stores, refs, tmp_path):
    """The shared expert (MoEBlock.shared) run early (route: while the host waits for the ids; direct: on a side stream
    of its own in one-token steps, graphs included on a GPU) or late (after the routed sum): the same logits bit for
    bit, and the reference's greedy tokens. Leaving the shared term out changes them."""
    import yaml

    backend = "triton" if DEVICE == "cuda" else "torch"  # on a CPU the one-token side stream does not exist
    ref_tokens = refs.greedy(variant, PROMPT, 8)

    def overlap(shared):
        doc = yaml.safe_load((SCHEDULES_DIR / "overlap.yaml").read_text())
        doc["stages"]["route"] = {"shared": shared}
        doc["stages"]["compute"] = {"backend": backend}
        path = tmp_path / f"overlap-{shared}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return str(path)

    runs = {}
    for name, schedule in [("route early", overlap("early")), ("route late", overlap("late")),
                           ("direct side", direct_schedule(tmp_path, "side", backend=backend, shared="side")),
                           ("direct late", direct_schedule(tmp_path, "late", backend=backend, shared="late"))]:
        with sluice.load(stores[variant], device=DEVICE, schedule=schedule, vram_slots=6) as engine:
            assert all(l.moe.shared is not None for l in engine.model.layers if l.moe is not None)
            runs[name] = greedy_logits(engine, PROMPT, 8)
            if name == "direct late":
                for layer in engine.model.layers:
                    if layer.moe is not None:
                        object.__setattr__(layer.moe, "shared", torch.zeros_like)  # a frozen dataclass: a fault injected
                engine.coordinator.plan._steps.clear()
                without = greedy_logits(engine, PROMPT, 8)
    first = runs["route early"]
    assert [int(t) for t in first.argmax(-1)] == ref_tokens
    for name, logits in runs.items():
        assert torch.equal(logits, first), f"{variant}: {name} differs from route early"
    assert (without - first).abs().max().item() > 1e-3


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


def test_guesses_past_the_top_k_are_read_last(stores, tmp_path, monkeypatch):
    """`guess_extra`: a one-token step's guesses for the next MoE layer go that many experts past its top-k, as the
    router ranks them (its top-k among them the router's own), read after the other guesses (those two layers ahead
    too: `depth` 2); every other guess, and the logits, are those of the same schedule without them. A model
    whose routers do not rank, or more guesses than experts, is refused."""
    from sluice.errors import ConfigError
    from sluice.stages.table_ram import RamBlocks
    from sluice.storage.store import ExpertStore

    variant, extra = "nemotron_h_latent", 3
    E, bb = (lambda s: (s.manifest.num_experts, s.block_bytes))(ExpertStore.open(stores[variant]))
    calls = []
    ensure = RamBlocks.ensure

    async def spy(self, layer, i, experts, guesses=()):
        calls.append([(g[0], list(g[1])) for g in guesses])
        return await ensure(self, layer, i, experts, guesses)

    monkeypatch.setattr(RamBlocks, "ensure", spy)
    logits, seen = {}, {}
    for depth in (2,):  # (the step before the last MoE layer guesses one layer ahead: depth 1's row)
        for n in (0, extra):
            calls.clear()
            schedule = direct_schedule(tmp_path, f"d{depth}x{n}", backend="triton", hold=False, guess_extra=n, depth=depth, vram=False)
            with sluice.load(stores[variant], device=DEVICE, schedule=schedule, ram_cache=2 * E * bb) as engine:
                logits[depth, n] = greedy_logits(engine, PROMPT, 6)
                K, blocks, D = engine.model.moe_blocks[0].top_k, engine.model.moe_blocks, engine.model.config.hidden_size
            seen[depth, n] = [g for g in calls if g]  # one-token steps of all but the last MoE layer guess ahead
            for g in seen[depth, n]:
                top = g[0][1]
                assert len(top) == K == len(set(top))
                if n:  # the extras, last: the nearest layer's, past its top-k, none of them among it
                    assert g[-1][0] == g[0][0] and len(g[-1][1]) == extra and not set(g[-1][1]) & set(top)
        # without the extras, the same guesses step by step (the top-k as sets: the ranking orders them)
        plain = [[(layer, sorted(e)) for layer, e in g] for g in seen[depth, 0]]
        assert plain and plain == [[(layer, sorted(e)) for layer, e in g[:-1]] for g in seen[depth, extra]]
        assert torch.equal(logits[depth, extra], logits[depth, 0])
    assert {len(g) for g in seen[2, 0]} == {1, 2}  # two layers ahead, and one from the layer before the last
    for b in blocks:  # the ranking's top-k is the router's choice
        xb = torch.randn(5, D, device=DEVICE)
        assert torch.equal(torch.sort(b.ranked(xb, b.top_k), dim=-1)[0], torch.sort(b.router(xb)[1], dim=-1)[0])
    with pytest.raises(ConfigError, match="'guess_extra' .* this model's routers \\(qwen3_moe\\) do not rank"):
        sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=direct_schedule(tmp_path, hold=False, guess_extra=2))
    with pytest.raises(ConfigError, match=f"'guess_extra' {E} past a top-{K} asks for more than the {E} experts"):
        sluice.load(stores[variant], device=DEVICE, schedule=direct_schedule(tmp_path, hold=False, guess_extra=E))


def test_direct_needs_every_block_in_ram(stores, tmp_path, monkeypatch):
    from sluice.errors import ConfigError, ScheduleError
    from sluice.pipeline import assemble
    from sluice.pipeline.schedule import parse_schedule

    with pytest.raises(ConfigError, match="every expert block in RAM.*ram_cache"):
        sluice.load(stores["qwen3_moe"], device=DEVICE, schedule="direct", ram_cache=ram_sizes(stores["qwen3_moe"])[1])
    with pytest.raises(ScheduleError, match="unknown stage 'direct'"):  # the fast path is its stages now
        parse_schedule({"stages": {"direct": {}, "combine": {}}}, "x.yaml")
    with pytest.raises(ScheduleError, match="'refresh' must be >= 1"):
        sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=direct_schedule(tmp_path, refresh=0))
    with pytest.raises(ScheduleError, match="stage 'fetch': 'margin' must be >= 0, got -1.0"):
        sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=direct_schedule(tmp_path, margin=-1))
    with pytest.raises(ScheduleError, match="stage 'fetch': 'noise' must be >= 0, got -0.5"):
        sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=direct_schedule(tmp_path, noise=-0.5))
    with pytest.raises(ScheduleError, match="stage 'compute': 'fp4_matvec' must be one of auto, f16x2, words, got 'fp16'"):
        sluice.load(stores["qwen3_moe"], device=DEVICE, schedule=direct_schedule(tmp_path, fp4_matvec="fp16"))
    monkeypatch.setattr(assemble, "available_ram", lambda: 4096)  # a machine with less RAM than the store's blocks
    with pytest.raises(ConfigError, match="holds every expert block in RAM.*use a schedule that streams"):
        sluice.load(stores["qwen3_moe"], device=DEVICE, schedule="direct")


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("variant", ["nemotron_h_latent", "qwen3_moe"])
def test_resident_alone_skips_only_the_routed_experts(variant, backend, stores, refs, monkeypatch, tmp_path):
    """schedules/resident-alone.yaml (the roofline's "resident part alone"): no block is loaded, no expert kernel
    runs, and prompts and one-token steps (the torch path, and the Triton backend's one-token step function)
    give transformers' logits with the routed experts' weights zeroed (router, shared expert, latent projections
    and mixers all still run); the real model's logits differ."""
    import yaml

    from sluice.kernels.experts import TritonExperts
    from sluice.models.base import cache_kw
    from sluice.stages.compute_table import ComputeTable
    from sluice.stages.h2d_table import H2DTable

    ran = []
    for cls, name in ((TritonExperts, "_decode"), (TritonExperts, "run"), (ComputeTable, "reference"), (ComputeTable, "group"),
                      (H2DTable, "plan")):
        monkeypatch.setattr(cls, name, lambda self, *a, **k: ran.append(name))
    doc = yaml.safe_load((SCHEDULES_DIR / "resident-alone.yaml").read_text())
    doc["stages"]["compute"]["backend"] = backend
    schedule = tmp_path / "alone.yaml"
    schedule.write_text(yaml.safe_dump(doc))
    model = refs.load(variant)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.zero_()

        def ref_greedy(n):
            out, ids, logits = None, list(PROMPT), []
            for _ in range(n):
                step = torch.tensor([ids if out is None else ids[-1:]])
                kw = {} if out is None else cache_kw(out.past_key_values)
                out = model(step, use_cache=True, **kw)
                logits.append(out.logits[0, -1].float())
                ids.append(int(logits[-1].argmax()))
            return torch.stack(logits)

        want = ref_greedy(4)
    with sluice.load(stores[variant], device=DEVICE, schedule=str(schedule)) as engine:
        assert len(engine.rt.ram) == 0 and engine.rt.ram.capacity == 1
        got = greedy_logits(engine, PROMPT, 4)
        assert engine.rt.stats.snapshot()["blocks"] == {"vram": 0, "ram": 0, "disk": 0}
    assert not ran, f"expert work ran: {ran}"
    assert_logits_close(variant, got, want, f"{variant}/resident-alone against transformers without routed experts")
    assert (got[0] - refs.logits(variant, PROMPT)[-1]).abs().max().item() > MUST_DIFFER


@pytest.mark.parametrize("variant, backend, vram_slots", [  # CI's suite: each variant and each case once
    ("nemotron_h_latent", "triton", 6), ("qwen3_moe", "triton", 0), ("nemotron_h_latent", "auto", 0),
    pytest.param("qwen3_moe", "triton", 6, marks=pytest.mark.slow), pytest.param("nemotron_h_latent", "triton", 0, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "auto", 0, marks=pytest.mark.slow)])
def test_direct_stream_reads_blocks_from_disk_and_matches_direct(variant, backend, vram_slots, stores, tmp_path):
    """`hold: false`: a RAM cache of one layer's experts and two more, blocks read from disk as layers route to them:
    prompts through the prompts' path, one-token steps (Triton) through direct's step once their ids have come to the
    host and their misses have been read (the VRAM tier refreshed every 2 steps where there is one; guesses two MoE
    layers ahead; each block read in two pieces). The logits are direct's bit for bit (the same kernels on the same bytes, the same sum); blocks come
    from disk, and nothing stays pinned; the guesses' recall is counted as the streaming schedules count it. Less RAM
    than one layer's experts is refused."""
    from sluice.errors import ConfigError
    from sluice.storage.store import ExpertStore

    store = ExpertStore.open(stores[variant])
    E, bb = store.manifest.num_experts, store.block_bytes
    held = direct_schedule(tmp_path, "held", backend=backend, refresh=2, prompt_group=2)
    streamed = direct_schedule(tmp_path, "streamed", backend=backend, refresh=2, prompt_group=2, hold=False, readers=3,
                               guess_reads=3, depth=2, read_pieces=2)
    kw = {"vram_slots": vram_slots} if vram_slots else {}
    with sluice.load(stores[variant], device=DEVICE, schedule=held, **kw) as engine:
        want = greedy_logits(engine, PROMPT, 10)
    with sluice.load(stores[variant], device=DEVICE, schedule=streamed, ram_cache=(E + 2) * bb, **kw) as engine:
        got = greedy_logits(engine, PROMPT, 10)
        io = engine.rt.stats.snapshot()
        stage = table_of(engine)
        # one-token steps of pure MoE functions (Triton) read blocks from disk themselves; others take the prompts' path
        own = stage.backend == "triton" and engine.model.moe_blocks[0].graph_safe
        assert (stage.token_disk > 0) == own and (io["prefetch_reads"] > 0) == own  # ... and the next layer's guesses
        assert engine.rt.ram.capacity == E + 2 < store.total_blocks
        # the stage's reader knobs size the pool; one thread stays free for demand reads
        assert (engine.rt.reader.threads, engine.rt.reader.guesses, len(engine.rt.reader.pieces)) == (3, 2, 2)
        assert all(e.pins == 0 and not e.loading for e in engine.rt.ram.entries())
    assert torch.equal(got, want)
    assert io["blocks"]["disk"] > E  # the cache turns over: more disk reads than it has slots
    if own:  # the guesses' recall, the next layer's and those two layers ahead, counted as the predict stage counts it
        # (overlap guessing as far ahead: the same routers on the same inputs)
        with sluice.load(stores[variant], device=DEVICE, schedule="overlap:predict.depth=2") as engine:
            assert torch.equal(greedy_logits(engine, PROMPT, 10).argmax(-1), got.argmax(-1))
            overlap = engine.rt.stats.snapshot()
        assert 0 < io["predicted_right"] < io["routed_predicted"] and 0 < io["further_right"] < io["further_routed"]
        keys = ("predicted", "predicted_right", "routed_predicted", "further_right", "further_routed")
        assert [io[k] for k in keys] == [overlap[k] for k in keys]
    if vram_slots:
        assert io["blocks"]["vram"] > 0
    elif not DEVICE.startswith("cuda"):  # (on a GPU a tier is there by default)
        assert io["blocks"]["vram"] == 0
    with pytest.raises(ConfigError, match="hold: false needs RAM for one layer's experts"):
        sluice.load(stores[variant], device=DEVICE, schedule=streamed, ram_cache=(E - 1) * bb)


@pytest.mark.parametrize("hold", [True, False])
def test_one_token_steps_time_each_stage_they_fuse(hold, stores, refs, tmp_path):
    """The fast path's one-token step is one call (one CUDA graph) but its trace keeps a span per stage it fuses, under
    the stages' names: route, fetch, compute, combine (and predict where it guesses the next layer's blocks), one of
    each per MoE layer and token, beside the layer's `direct` span; a prompt runs the stages' host faces, each under
    its name once per MoE layer (h2d twice: its plan, then its copies ahead); the logits are the untraced run's."""
    import json

    variant = "nemotron_h_latent"
    schedule = direct_schedule(tmp_path, f"traced-{hold}", backend="triton", hold=hold, vram=False)
    with sluice.load(stores[variant], device=DEVICE, schedule=schedule) as engine:
        plain = greedy_logits(engine, PROMPT, 4)
    trace = tmp_path / f"t-{hold}.json"
    with sluice.load(stores[variant], device=DEVICE, schedule=schedule, trace=str(trace)) as engine:
        traced = greedy_logits(engine, PROMPT, 4)
        layers = len(engine.store.moe_layers)
    assert torch.equal(plain, traced)
    lines = [json.loads(line) for line in (tmp_path / f"t-{hold}.json.jsonl").read_text().splitlines()]
    per_stage, prompt = {}, {}
    for line in lines:
        if line.get("event") == "stage" and line["step"] == 0:  # step 0 is the prompt, the others one-token steps
            prompt.setdefault(line["stage"], []).append(line["layer"])
        elif line.get("event") in ("stage", "gpu") and line["step"] > 0:  # host spans; a replayed graph's GPU spans
            per_stage.setdefault(line["stage"], set()).add((line["step"], line["layer"]))
    for stage in ("route", "fetch", "compute", "combine", "direct"):
        assert len(per_stage.get(stage, ())) == 3 * layers, (stage, per_stage.get(stage))  # each layer of 3 one-token steps
    for stage in ("route", "fetch", "h2d", "compute", "combine", "direct"):  # the prompt: the stages' host faces, a span each
        assert sorted(prompt.get(stage, ())) == sorted(list(engine.store.moe_layers) * (2 if stage == "h2d" else 1)), stage


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


def test_auto_holds_every_block_where_ram_allows_else_streams(stores, monkeypatch):
    from sluice.pipeline import assemble
    from sluice.pipeline import schedule
    from sluice.pipeline.schedule import auto_schedule

    store = stores["qwen3_moe"]
    G, L = 1 << 30, 1 << 20  # the store's blocks, a layer's experts
    assert auto_schedule("auto", 3 * G, L, None, 4 * G) == "direct"
    assert auto_schedule("auto:fetch.refresh=8", 4 * G, L, None, 4 * G) == "direct-stream:fetch.refresh=8"  # 75% of 4
    assert auto_schedule("auto", 3 * G, L, 2 * G, 64 * G) == "direct-stream"  # --ram-cache decides where given
    assert auto_schedule("auto", 3 * G, L, 4 * G, 2 * G) == "direct-stream"  # ... but not past the RAM there is
    assert auto_schedule("auto", 1 * G, L, None, 64 * G, recording=True) == "direct-stream"  # it records routing
    assert auto_schedule("auto", 3 * G, L, L - 1, 64 * G) == "overlap"  # a RAM cache below one layer's experts
    assert auto_schedule("overlap", 1, 1, None, 1 << 40) == "overlap"  # a schedule named is run as named
    with sluice.load(store, device=DEVICE) as e:  # the default
        assert e.coordinator.schedule.name == "direct"
        tokens = e.generate(PROMPT, 4)
    small = ram_sizes(store, least_blocks(store, "direct-stream"))[1]  # a RAM cache too small for every block
    with sluice.load(store, device=DEVICE, ram_cache=small) as e:
        assert e.coordinator.schedule.name == "direct-stream" and e.generate(PROMPT, 4) == tokens
    whole = ram_sizes(store)[2]
    monkeypatch.setattr(assemble, "available_ram", lambda: 2 * whole)  # free RAM whose share the store's blocks pass
    monkeypatch.setattr(schedule, "RAM_SHARE", 0.4)
    with sluice.load(store, device=DEVICE) as e:
        assert e.coordinator.schedule.name == "direct-stream"


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
