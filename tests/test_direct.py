"""The `direct` schedule (the `via: table` stages, stages/table.py) against transformers and against the streaming schedules: every block
held in RAM, the kernels reading VRAM or RAM blocks in place through a device table, prompts through the staging bank,
and the errors for what it cannot do (the VRAM tier's own tests: tests/test_vram_tier.py)."""

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
    # blocks in RAM past the VRAM beside the resident part: the CPU computes a share of those outside where it pays
    assert auto_schedule("auto:h2d.prompt_cpu=2", 3 * G, L, None, 64 * G, vram_room=2 * G) == "direct-hybrid:h2d.prompt_cpu=2"
    assert auto_schedule("auto", 3 * G, L, None, 64 * G, vram_room=3 * G) == "direct"  # every block fits in VRAM
    assert auto_schedule("auto", 3 * G, L, None, 2 * G, vram_room=G) == "direct-stream"  # RAM decides first
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


