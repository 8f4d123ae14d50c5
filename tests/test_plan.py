"""Routing traces, the offline cache simulator and the planner."""

from __future__ import annotations

import json

import pytest

import sluice
from sluice.storage.plan import plan
from sluice.storage.safetensors_io import write_header_only
from sluice.storage.simulate import simulate, write_sweep
from sluice.errors import SluiceError
from sluice.storage.trace import Trace, TraceRecord, read_trace
from common import DEVICE, PROMPT

MiB, GiB = 2**20, 2**30
NANO = dict(  # NVIDIA-Nemotron-3-Nano-30B-A3B (REFERENCE.md)
    hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", hidden_size=2688,
    moe_intermediate_size=1856, n_routed_experts=128, num_experts_per_tok=6, moe_shared_expert_intermediate_size=3712,
    routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1, mamba_num_heads=64, mamba_head_dim=64,
    ssm_state_size=128, n_groups=8, conv_kernel=4, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
    vocab_size=131072, dtype="bfloat16",
)


def nano_headers(tmp_path):
    """config.json and a header-only safetensors file: NVFP4 routed experts, BF16 embeddings and head."""
    from transformers import NemotronHConfig

    NemotronHConfig(**NANO).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    moe = [i for i, t in enumerate(cfg["layers_block_type"]) if t == "moe"]
    tensors = [("backbone.embeddings.weight", "BF16", (131072, 2688)), ("lm_head.weight", "BF16", (131072, 2688))]
    for layer in moe:
        for e in range(128):
            for proj, (o, i) in (("up_proj", (1856, 2688)), ("down_proj", (2688, 1856))):
                p = f"backbone.layers.{layer}.mixer.experts.{e}.{proj}"
                tensors += [(f"{p}.weight", "U8", (o, i // 2)), (f"{p}.weight_scale", "F8_E4M3", (o, i // 16)),
                            (f"{p}.weight_scale_2", "F32", ()), (f"{p}.input_scale", "F32", ())]
    write_header_only(tmp_path / "model.safetensors", tensors)
    return tmp_path


def test_plan_nemotron_nano_from_headers(tmp_path):
    p = plan(nano_headers(tmp_path), vram=8 * GiB, ram=8 * GiB, pcie_gbps=28, disk_gbps=7, context=8192)
    assert p.moe_layers == 23 and p.top_k == 6
    assert p.kv_bytes_per_token == 6 * 1024  # 6 attention layers x (K, V) x 2 KV heads x 128 x 2 bytes
    ssm = 23 * 64 * 64 * 128 * 4  # 23 Mamba layers, fp32 SSM state: exactly 46 MiB
    conv = 23 * (64 * 64 + 2 * 8 * 128) * 4 * 2  # conv state: conv_dim x kernel, bf16
    assert ssm == 46 * MiB and p.recurrent_bytes == ssm + conv
    expert = (1856 * 2688 // 2 + 1856 * 2688 // 16) * 2  # up + down: nibbles + one E4M3 scale per 16
    assert expert < p.block_bytes < expert + 4096 + 4 * 256  # the 4 KiB-rounded block with aligned scalars
    assert abs(p.expert_bytes_per_token - 6 * 23 * expert) / (6 * 23 * expert) < 0.002  # ~0.77 GB per token
    assert 0.77e9 < p.expert_bytes_per_token < 0.78e9
    assert p.resident_bytes == 2 * 131072 * 2688 * 2 == p.tiers["bf16"]
    assert p.tiers["nvfp4"] == 23 * 128 * (expert + 4 * 4)  # + the four fp32 scalars of each expert
    assert p.fits_vram
    cache_blocks = (8 * GiB - p.resident_bytes) // p.block_bytes  # fewer than all 2944 blocks
    assert p.ram_blocks == cache_blocks and p.ram_hit_rate == pytest.approx(cache_blocks * p.block_bytes / p.expert_bytes_total)
    expected_ms = 1000 * p.expert_bytes_per_token * (1 / 28e9 + (1 - p.ram_hit_rate) / 7e9)
    assert p.ms_per_token == pytest.approx(expected_ms)
    small = plan(tmp_path, vram=1 * GiB, ram=32 * GiB)
    assert not small.fits_vram


def test_plan_from_config_alone_sizes_every_format(tmp_path, capsys):
    """A folder with only config.json (Nemotron-3-Nano-30B-A3B's shape, storage/synth.py SHAPES): weights per format
    from the model built on the meta device, KV at the context and the Mamba state from the config, the same NVFP4
    block as its checkpoint's headers give, GGUF rows at their types' bits per weight; `sluice plan` prints the table."""
    from transformers import AutoConfig

    from sluice.cli import main
    from sluice.storage.estimate import estimate
    from sluice.storage.synth import SHAPES

    model_type, kw = SHAPES["nemotron-3-nano-30b-a3b"]
    AutoConfig.for_model(model_type, **kw, dtype="bfloat16").save_pretrained(tmp_path / "nano")
    rows = {r.name: r for r in estimate(tmp_path / "nano", vram=24 * GiB, ram=32 * GiB, context=262_144)}
    nano = rows["nvfp4"].plan
    assert nano.kv_bytes_per_token == 6 * 1024 and nano.kv_bytes_per_token * nano.context == 1.5 * GiB
    ssm, conv = 23 * 64 * 64 * 128 * 4, 23 * (64 * 64 + 2 * 8 * 128) * 4 * 2  # fp32 SSM state 46 MiB; bf16 conv state
    assert nano.recurrent_bytes == ssm + conv and 46.5 * MiB < nano.recurrent_bytes < 47.5 * MiB
    headers = plan(nano_headers(tmp_path / "headers"), vram=24 * GiB, ram=32 * GiB)
    assert nano.block_bytes == headers.block_bytes and nano.expert_bytes_per_token == headers.expert_bytes_per_token
    assert 31.5e9 < rows["bf16"].weights / 2 < 31.7e9  # 31.6 B parameters
    assert [round(rows[f].bits, 3) for f in ("bf16", "fp8", "nvfp4", "mxfp4")] == [16, 8.002, 4.5, 4.25]  # + scales (fp8: one fp32 per 128 x 128)
    assert rows["gguf Q4_K"].bits == 4.5 and rows["gguf Q8_0"].bits == 8.5
    assert rows["bf16"].fits == "streamed" and rows["nvfp4"].fits == "all in VRAM"
    assert rows["gguf Q8_0"].total > 24 * GiB > rows["gguf Q4_K"].total
    for r in rows.values():
        assert r.total == r.weights + 1.5 * GiB + nano.recurrent_bytes and r.plan.tokens_per_s > 0
    assert main(["plan", str(tmp_path / "nano"), "--vram", "24GiB", "--context", "262144"]) == 0
    out = capsys.readouterr().out
    assert "from config.json alone" in out and "1.50 GiB at 262,144 tokens" in out and "47.1 MiB per sequence" in out
    table = [line.split()[0] + (" " + line.split()[1] if line.startswith("gguf") else "") for line in out.splitlines()
             if line.startswith(("bf16", "fp8", "nvfp4", "mxfp4", "gguf"))]
    assert table[:4] == ["bf16", "fp8", "nvfp4", "mxfp4"] and "gguf Q4_K" in table


def test_plan_reads_gguf_through_the_gguf_package(tmp_path):
    import gguf
    import numpy as np
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(hidden_size=256, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000).save_pretrained(tmp_path)
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "qwen3moe")
    q4k = gguf.GGMLQuantizationType.Q4_K
    block, size = gguf.GGML_QUANT_SIZES[q4k]
    per_expert = 256 * 256 // block * size  # one 256x256 matrix in Q4_K
    for layer in range(2):
        for proj in ("gate", "up", "down"):
            w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.zeros((8, 256, 256 // block * size), dtype=np.uint8), raw_dtype=q4k)
    w.add_tensor("token_embd.weight", np.zeros((1000, 256), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = plan(tmp_path, vram=GiB, ram=GiB)
    assert p.block_bytes == 3 * per_expert // 4096 * 4096 + 4096 * (3 * per_expert % 4096 > 0)
    assert p.expert_bytes_per_token == 2 * 2 * p.block_bytes and p.tiers["q4_k"] == 2 * 3 * 8 * per_expert
    assert p.resident_bytes == 1000 * 256 * 2 and p.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2


def rec(step, layer, experts, predicted=None, further=()):
    return TraceRecord(step, 1, layer, tuple(experts), tuple(sorted(set(experts))), "D" * len(set(experts)), predicted, further)


def test_policies_on_hand_made_traces():
    # one MoE layer; accesses A B A C B A (experts 1 2 1 3 2 1), capacity 2
    t = Trace({"prefetch": False}, tuple(rec(s, 0, [e]) for s, e in enumerate([1, 2, 1, 3, 2, 1])))
    assert simulate(t, 2, policy="lru").blocks["disk"] == 5  # 1 2 . 3(evicts 2) 2(evicts 1) 1(evicts 3)
    assert simulate(t, 2, policy="fifo").blocks["disk"] == 4  # 1 2 . 3(evicts 1) . 1(evicts 2)
    assert simulate(t, 2, policy="belady").blocks["disk"] == 4  # 1 2 . 3(evicts 1, used last) . 1
    assert simulate(t, 3, policy="lru").blocks["disk"] == 3  # only the cold misses
    # LFU keeps the frequently used expert 1 through a scan of one-off experts
    scan = [1, 1, 1, 2, 3, 4, 1]
    t2 = Trace({"prefetch": False}, tuple(rec(s, 0, [e]) for s, e in enumerate(scan)))
    assert simulate(t2, 2, policy="lfu").blocks["disk"] == 4 < simulate(t2, 2, policy="lru").blocks["disk"] == 5
    scan = [1, 1, 1, 2, 3, 1]
    t3 = Trace({"prefetch": False}, tuple(rec(s, 0, [e]) for s, e in enumerate(scan)))
    assert simulate(t3, 2, policy="lfu").blocks["disk"] == 3 < simulate(t3, 2, policy="fifo").blocks["disk"] == 4
    # prefetch of the recorded guesses turns the next layer's miss into a hit
    t4 = Trace({"prefetch": True}, (rec(0, 0, [1]), rec(0, 1, [5], predicted=(5,))))
    assert simulate(t4, 4).blocks == {"vram": 0, "ram": 1, "disk": 1} and simulate(t4, 4, prefetch=False).blocks["disk"] == 2
    # guesses further ahead (`predict: {depth: 3}`): layer 0's input guessed layer 2's 7 and layer 3's 8 and 9; read
    # after layer 1's guesses, nearest layer first; depth 2 leaves layer 3's out, depth 1 layer 2's too
    t6 = Trace({"prefetch": True, "prefetch_depth": 3},
               (rec(0, 0, [1], further=((2, (7,)), (3, (8, 9)))), rec(0, 1, [5], predicted=(5,)), rec(0, 2, [7]), rec(0, 3, [8, 9])))
    assert simulate(t6, 8).blocks == {"vram": 0, "ram": 4, "disk": 1} and simulate(t6, 8).prefetch_reads == 4
    assert simulate(t6, 8, depth=2).blocks == {"vram": 0, "ram": 2, "disk": 3}
    assert simulate(t6, 8, depth=1).blocks == {"vram": 0, "ram": 1, "disk": 4}
    with pytest.raises(SluiceError, match="depth must be >= 1"):
        simulate(t6, 8, depth=0)
    # a VRAM tier in front of RAM
    t5 = Trace({"prefetch": False}, tuple(rec(s, 0, [e]) for s, e in enumerate([1, 2, 1, 2])))
    assert simulate(t5, 8, vram_blocks=2).blocks == {"vram": 2, "ram": 0, "disk": 2}


@pytest.fixture
def guesses_land(monkeypatch):
    """Each guess read lands before the loop goes on, as the simulator assumes: on a loaded machine reader threads
    lag, a guess still queued when its layer comes is read as a demand, and live counts drift from the replay."""
    from sluice.pipeline.runtime import Runtime

    read_guess = Runtime.read_guess

    def landed(self, layer, expert):
        started = read_guess(self, layer, expert)
        if started:
            self.ram.peek((layer, expert)).job.result()
        return started

    monkeypatch.setattr(Runtime, "read_guess", landed)


@pytest.mark.parametrize("ram_blocks", [10, 24])  # caches below one prefill layer's experts are out of scope
def test_simulated_misses_match_the_live_run(stores, tmp_path, ram_blocks, guesses_land):
    from sluice.storage.store import ExpertStore

    store = stores["nemotron_h_latent"]
    path = tmp_path / "routing.jsonl.gz"
    n = ExpertStore.open(store).block_bytes
    with sluice.load(store, device=DEVICE, ram_cache=ram_blocks * n, record_routing=str(path)) as engine:
        engine.generate(PROMPT, 32)
        engine.generate(PROMPT[:5] + [9, 9], 16)
        live = engine.rt.stats.snapshot()
        ram = engine.rt.ram.capacity
        block = engine.store.block_bytes
    trace = read_trace(path)
    assert trace.header["ram_blocks"] == ram and trace.header["block_bytes"] == block
    assert trace.tokens == live["tokens"] and len(trace.records) == live["steps"] * 3
    sim = simulate(trace, ram, trace.header["vram_blocks"])
    live_disk = live["blocks"]["disk"] / live["tokens"]
    assert abs(sim.disk_per_token - live_disk) <= 0.5, (sim.disk_per_token, live_disk)
    assert sum(sim.blocks.values()) == sum(live["blocks"].values())
    results = [simulate(trace, n) for n in (2, 8, 32, 48)]
    write_sweep(results, block, tmp_path / "sweep.csv", tmp_path / "sweep.png")
    rows = (tmp_path / "sweep.csv").read_text().splitlines()
    assert rows[0].startswith("ram_blocks,") and len(rows) == 5
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rates = [r.hit_rate for r in results]
    assert rates == sorted(rates)  # LRU: more RAM never hurts


def test_plan_each_family(checkpoints):
    """Every architecture plans from its checkpoint; KV and recurrent state follow its mixers."""
    figures = {name: plan(path, vram=GiB, ram=GiB) for name, path in checkpoints.items()}
    for name, p in figures.items():
        assert p.expert_bytes_per_token == p.top_k * p.moe_layers * p.block_bytes > 0, name
    assert figures["qwen3_moe"].recurrent_bytes == 0 and figures["qwen3_moe"].kv_bytes_per_token == 4 * 2 * 2 * 16 * 4
    assert figures["qwen3_next"].recurrent_bytes > 0 and figures["qwen3_next"].kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert figures["deepseek_v3"].kv_bytes_per_token == 3 * (16 + 8) * 4  # MLA: the compressed latent + RoPE key per layer
    assert figures["mixtral"].kv_bytes_per_token == 3 * 2 * 2 * 16 * 4
    assert figures["nemotron_h"].recurrent_bytes > 0
    for name in ("gpt_oss", "gpt_oss_unquantized"):  # one full-attention layer grows; two sliding ones hold 8 tokens each
        assert figures[name].kv_bytes_per_token == 1 * 2 * 2 * 16 * 4 and figures[name].recurrent_bytes == 8 * 2 * 2 * 2 * 16 * 4
    assert figures["gpt_oss"].block_bytes < figures["gpt_oss_unquantized"].block_bytes / 3  # MXFP4 ~4.25 bits a weight vs fp32, 4 KiB pages
    for name in ("qwen3_5_moe", "qwen3_5_moe_text"):  # the vision-language config plans its LM, as does the LM's own
        assert figures[name].kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 and figures[name].recurrent_bytes == figures["qwen3_next"].recurrent_bytes
    assert figures["deepseek_v4"].kv_bytes_per_token == (2 * (32 + 16) // 4 + 32 // 8) * 4  # compressed entries of 2 CSA, 1 HCA layers
    windows, buffers = 4 * 7 * 32, 7 * 2 * 32 + 2 * (3 * 4 + 4 * 2) * (32 + 16)  # HCA's buffer; CSA's buffers and overlaps
    assert figures["deepseek_v4"].recurrent_bytes == (windows + buffers) * 4


def test_plan_counts_the_image_encoder(tmp_path):
    """A vision-language checkpoint's plan names its image encoder's bytes, resident when it fits twice over
    in the VRAM left, else streamed; a language model's plan has none."""
    pytest.importorskip("transformers.models.nemotron_h_omni", reason="nemotron_h_omni needs transformers 5.23+")
    from safetensors.torch import load_file

    from tiny import make_tiny_checkpoint
    from sluice.storage.plan import format_plan

    path = make_tiny_checkpoint(tmp_path / "omni", "nemotron_h_omni", seed=2)
    encoder = sum(t.numel() * t.element_size() for k, t in load_file(path / "model.safetensors").items()
                  if k.startswith(("vision_model.", "mlp1.")))
    roomy = plan(path, vram=2 * GiB, ram=GiB)
    assert roomy.encoder_bytes == encoder > 0 and roomy.encoder_resident
    from sluice.models.vision import ENCODER_MARGIN

    tight = plan(path, vram=roomy.vram_needed + ENCODER_MARGIN + roomy.encoder_bytes, ram=GiB)
    assert not tight.encoder_resident
    assert "image encoder" in format_plan(roomy) and "streamed" in format_plan(tight)
    assert plan(make_tiny_checkpoint(tmp_path / "lm", "nemotron_h", seed=2), vram=GiB, ram=GiB).encoder_bytes == 0


def test_simulated_vram_prefetch_matches_the_live_run(stores, tmp_path):
    """A run of prefetch-vram (guesses copied into an emulated VRAM tier on a CPU) replayed offline: the same
    blocks per tier and the same guessed copies and hits as the live counters; without the copies the replay
    serves fewer blocks from VRAM."""
    path = tmp_path / "routing.jsonl.gz"
    with sluice.load(stores["nemotron_h"], device=DEVICE, schedule="prefetch-vram", vram_slots=12,
                     record_routing=str(path)) as engine:
        engine.generate(PROMPT, 32)
        live = engine.rt.stats.counters()
        ram = engine.rt.ram.capacity
    trace = read_trace(path)
    assert trace.header["vram_prefetch"] and trace.header["vram_blocks"] == 12
    sim = simulate(trace, ram, 12)
    # the live order in which reads land varies from run to run: a block or two either way
    close = lambda a, b: abs(a - b) <= 3  # noqa: E731
    assert all(close(sim.blocks[t], live["blocks"][t]) for t in sim.blocks), (sim.blocks, live["blocks"])
    assert close(sim.vram_prefetches, live["vram_prefetches"]) and close(sim.vram_prefetch_hits, live["vram_prefetch_hits"])
    assert sim.vram_prefetch_hits > 20
    assert simulate(trace, ram, 12, vram_prefetch=False).blocks["vram"] < sim.blocks["vram"] - 10


def test_simulated_guesses_further_ahead_match_the_live_run(stores, tmp_path, capsys, guesses_land):
    """A run of `predict: {depth: 2}` records the guesses for the layer after the next one with each layer; the
    replay reads them as fetch does: the live disk reads per token and guess reads, within a few blocks (reads land
    in a live order, and a live guess still queued when its layer comes is dropped). Replayed at depth 1 it reads
    fewer guesses; `sluice simulate --depth` beyond the recorded run's is an error naming it."""
    import yaml

    from sluice import cli
    from sluice.pipeline.schedule import SCHEDULES_DIR
    from sluice.storage.store import ExpertStore

    store = stores["nemotron_h_latent"]
    doc = yaml.safe_load((SCHEDULES_DIR / "overlap.yaml").read_text())
    doc["stages"]["predict"] = {"depth": 2}
    schedule = tmp_path / "depth2.yaml"
    schedule.write_text(yaml.safe_dump(doc))
    path = tmp_path / "routing.jsonl"
    n = ExpertStore.open(store).block_bytes
    with sluice.load(store, device=DEVICE, schedule=str(schedule), ram_cache=24 * n, record_routing=str(path)) as engine:
        engine.generate(PROMPT, 32)
        live = engine.rt.stats.snapshot()
        ram = engine.rt.ram.capacity
    trace = read_trace(path)
    assert trace.header["prefetch_depth"] == 2
    layers = list(ExpertStore.open(store).moe_layers)
    further = [r for r in trace.records if r.further]
    assert further and all(r.further[0][0] == layers[layers.index(r.layer) + 2] for r in further)
    sim, near = simulate(trace, ram), simulate(trace, ram, depth=1)
    assert abs(sim.disk_per_token - live["blocks"]["disk"] / live["tokens"]) <= 0.5, (sim.blocks, live["blocks"])
    assert abs(sim.prefetch_reads - live["prefetch_reads"]) <= 0.1 * live["prefetch_reads"] + 3, (sim.prefetch_reads, live)
    assert near.prefetch_reads < sim.prefetch_reads
    assert cli.main(["simulate", str(path), "--depth", "1"]) == 0
    out = capsys.readouterr().out
    assert f"prefetch reads {near.prefetch_reads}" in out
    assert "of the routed blocks (the next layer's), " in out and "two or more MoE layers ahead" in out
    assert cli.main(["simulate", str(path), "--depth", "3"]) == 1
    assert "--depth 3: the trace holds guesses up to 2 MoE layer(s) ahead" in capsys.readouterr().err


def test_guess_recall_scores_near_and_far_guesses(tmp_path):
    """`guess_recall`: of each layer's routed blocks, the share its recorded guesses named, the next layer's apart
    from those made two or more layers ahead (matched to the layer of the same step); a direct-stream trace counts
    only the blocks not read from VRAM, which its guesses left out."""
    from sluice.storage.simulate import guess_recall

    def trace(vram_tier=None):
        head = {"sluice_routing_trace": 1, "moe_layers": [1, 3, 5], "num_experts": 8, "top_k": 2, "block_bytes": 4096,
                "ram_blocks": 8, "prefetch": True, "prefetch_depth": 2, **({"vram_tier": vram_tier} if vram_tier else {})}
        lines = [  # step 0: layer 1 guesses layer 5 (far); layer 3 was guessed by layer 1 (near), and so on
            {"s": 0, "t": 1, "l": 1, "ids": [0, 1], "e": [0, 1], "tier": "RR", "p": None, "f": [[5, [4, 6]]]},
            {"s": 0, "t": 1, "l": 3, "ids": [2, 3], "e": [2, 3], "tier": "VR", "p": [2, 7]},
            {"s": 0, "t": 1, "l": 5, "ids": [4, 5], "e": [4, 5], "tier": "RD", "p": [4, 5]},
            {"s": 1, "t": 1, "l": 1, "ids": [0, 2], "e": [0, 2], "tier": "RR", "p": None, "f": [[5, [7, 6]], [9, [1]]]},
            {"s": 1, "t": 1, "l": 3, "ids": [1, 3], "e": [1, 3], "tier": "DR", "p": [1, 3]},
            {"s": 1, "t": 1, "l": 5, "ids": [6, 7], "e": [6, 7], "tier": "RV", "p": [0, 1]},
        ]
        path = tmp_path / f"t-{vram_tier}.jsonl"
        path.write_text("\n".join(json.dumps(x) for x in [head, *lines]) + "\n")
        return read_trace(path)

    # near: layer 3 {2, 3} & {2, 7}: 1; layer 5 {4, 5}: 2; {1, 3}: 2; {6, 7} & {0, 1}: 0 -> 5 of 8. far (layer 9 is
    # not in the trace): {4, 5} & {4, 6}: 1; {6, 7} & {7, 6}: 2 -> 3 of 4
    assert guess_recall(trace()) == (5 / 8, 3 / 4)
    # blocks read from VRAM left out: near {3}: 0, {4, 5}: 2, {1, 3}: 2, {6}: 0 -> 4 of 6; far {4, 5}: 1, {6}: 1 -> 2 of 3
    assert guess_recall(trace("recorded")) == (4 / 6, 2 / 3)
    head = {"sluice_routing_trace": 1, "moe_layers": [1], "num_experts": 4, "top_k": 1, "block_bytes": 4096, "ram_blocks": 2}
    path = tmp_path / "none.jsonl"
    path.write_text(json.dumps(head) + "\n" + json.dumps({"s": 0, "t": 1, "l": 1, "ids": [2], "e": [2], "tier": "D", "p": None}))
    assert guess_recall(read_trace(path)) == (None, None)


def test_bad_routing_traces_are_named(tmp_path):
    """A trace that is missing, not a trace, or has a malformed line (a key missing, guesses further ahead that are
    not [layer, [ids]], tiers that do not match the experts) is an error naming the file and the line."""
    head = json.dumps({"sluice_routing_trace": 1, "moe_layers": [1], "num_experts": 4, "top_k": 1, "block_bytes": 4096,
                       "ram_blocks": 2, "prefetch": True, "prefetch_depth": 2})
    good = json.dumps({"s": 0, "t": 1, "l": 1, "ids": [2], "e": [2], "tier": "D", "p": None, "f": [[3, [1, 0]]]})
    path = tmp_path / "run.jsonl"
    path.write_text(head + "\n" + good + "\n")
    assert read_trace(path).records[0].further == ((3, (1, 0)),)
    cases = [
        ("", "bad first line"),
        (json.dumps({"moe_layers": [1]}) + "\n", "no 'sluice_routing_trace': 1 header"),
        (head + "\n" + good + "\n" + json.dumps({"s": 0, "t": 1, "l": 1, "ids": [2]}) + "\n", "line 3 is malformed"),
        (head + "\n" + good.replace("[[3, [1, 0]]]", "[3, 1]") + "\n", "line 2 is malformed"),
        (head + "\n{not json\n", "line 2 is malformed"),
        (head + "\n" + good.replace('"tier": "D"', '"tier": "DR"') + "\n", "line 2 is malformed.*1 experts but 2 tiers"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(SluiceError, match=message) as e:
            read_trace(path)
        assert str(path) in str(e.value)
    with pytest.raises(SluiceError, match="no such routing trace"):
        read_trace(tmp_path / "missing.jsonl")


# prompts copy the next layer's blocks ahead: into free slots, or a bank (24 slots: slow interpreted, marked so)
@pytest.mark.parametrize("vram_slots, depth", [(8, 1), pytest.param(24, 1, marks=pytest.mark.slow), (8, 2)])
def test_simulated_direct_stream_matches_the_live_run(stores, tmp_path, vram_slots, depth, capsys):
    """direct-stream (`fetch: {via: table, hold: false}`) records its routing: per layer the tier each block came from, and the
    next layer's guesses it read (with `depth` 2, the guesses for the layer after it too). The replay takes its VRAM
    tier (a hot set refreshed from use counts) as recorded and gives the live RAM and disk blocks and guess reads,
    within a few blocks; with no RAM to spare it reads more from disk; a VRAM size cannot be replayed for it, and
    `direct` that holds every block refuses to record. Guessing further changes what is read, not the tokens."""
    from sluice import cli
    from test_direct import direct_schedule

    store = stores["nemotron_h_latent"]
    from sluice.storage.store import ExpertStore

    st = ExpertStore.open(store)
    E, bb = st.manifest.num_experts, st.block_bytes
    near = direct_schedule(tmp_path, "streamed", backend="triton", refresh=2, prompt_group=2, hold=False)
    schedule = near + (f":fetch.depth={depth}" if depth > 1 else "")  # a knob edited after the file's path
    path = tmp_path / "direct.jsonl"
    n = 24 if DEVICE != "cpu" else 16  # tokens of the first prompt (interpreted on a CPU: fewer)
    with sluice.load(store, device=DEVICE, schedule=schedule, ram_cache=(E + 6) * bb, vram_slots=vram_slots,
                     record_routing=str(path)) as engine:
        tokens = engine.generate(PROMPT, n)
        engine.generate(PROMPT[3:] + [7, 7, 2], 8)  # a second prompt, on the tier the first one's steps left
        ahead = engine.rt.stats.counters()["vram_prefetches"]
        live = engine.rt.stats.counters(device=True)
        ram = engine.rt.ram.capacity
    trace = read_trace(path)
    assert trace.header["vram_tier"] == "recorded" and trace.header["prefetch"] and ahead > 0
    assert trace.tokens == live["tokens"] and len(trace.records) == live["steps"] * len(st.moe_layers)
    assert any(r.predicted for r in trace.records) and {"V", "R", "D"} <= set("".join(r.tiers for r in trace.records))
    sim = simulate(trace, ram)
    close = lambda a, b: abs(a - b) <= 3  # noqa: E731  (reads land in a live order)
    assert sim.blocks["vram"] == live["blocks"]["vram"]
    assert close(sim.blocks["disk"], live["blocks"]["disk"]) and close(sim.blocks["ram"], live["blocks"]["ram"]), (sim, live)
    assert close(sim.prefetch_reads, live["prefetch_reads"]), (sim.prefetch_reads, live["prefetch_reads"])
    assert simulate(trace, E).blocks["disk"] > sim.blocks["disk"]
    assert trace.header["prefetch_depth"] == depth
    if depth > 1:
        layers = list(st.moe_layers)
        further = [r for r in trace.records if r.further]
        assert further and all(r.further[0][0] == layers[layers.index(r.layer) + 2] for r in further)
        assert simulate(trace, ram, depth=1).prefetch_reads < sim.prefetch_reads
        assert cli.main(["simulate", str(path)]) == 0
        out = capsys.readouterr().out
        assert "of the blocks not read from VRAM (the next layer's), " in out and "two or more MoE layers ahead" in out
        with sluice.load(store, device=DEVICE, schedule=near, ram_cache=(E + 6) * bb, vram_slots=vram_slots) as engine:
            assert engine.generate(PROMPT, n) == tokens
    assert cli.main(["simulate", str(path), "--vram-slots", "4"]) == 1
    held = direct_schedule(tmp_path, "held", backend="triton")
    with pytest.raises(SluiceError, match="records no routing trace"):
        sluice.load(store, device=DEVICE, schedule=held, record_routing=str(tmp_path / "no.jsonl"))
