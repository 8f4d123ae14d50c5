"""Open a store (or a checkpoint, repacked once) into the engine's parts: resident model, runtime, coordinator.

The wiring of `Engine.open`, kept apart so the engine's file holds its steps: settings parsed and checked, the
schedule chosen, RAM and VRAM sized from it, the tiers built; whatever was built is closed if a later part fails.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from sluice.errors import ConfigError
from sluice.kernels import triton_runs_on
from sluice.log import get_logger
from sluice.models import get_architecture
from sluice.models.base import ResidentModel
from sluice.pipeline.budget import CARD, MAX_MIXER_CHUNK, MAX_PREFILL_CHUNK, card_budget, engine_slots
from sluice.pipeline.config import EngineConfig, available_ram, default_ram_cache, format_bytes, parse_size
from sluice.pipeline.coordinator import Coordinator
from sluice.pipeline.routing import RoutingControl, check_guess_extra, controlled_routing
from sluice.pipeline.runtime import Runtime
from sluice.pipeline.schedule import auto_schedule, load_schedule
from sluice.pipeline.whole import default_static_kv
from sluice.storage.home import resolve_store
from sluice.storage.store import ExpertStore
from sluice.storage.trace import RoutingRecorder, trace_header


def assemble(path: str | Path, progress: bool, settings: dict) -> tuple[ExpertStore, ResidentModel, Runtime, Coordinator,
                                                                          EngineConfig, RoutingControl | None]:
    """(store, model, runtime, coordinator, config, routing) for `Engine`; settings: EngineConfig fields, sizes may be
    strings ('8GiB')."""
    card = settings.get("vram_budget") == CARD  # the card's memory, found once the device is known
    if card:
        settings["vram_budget"] = None
    for size in ("ram_cache", "vram_budget", "vram_reserve"):
        if size in settings:
            settings[size] = parse_size(settings[size], size)
    config = EngineConfig(**{k: v for k, v in settings.items() if v is not None})
    device = config.torch_device
    if card and device.type == "cuda" and config.vram_slots is None:  # before the resident part takes its share
        config = replace(config, vram_budget=card_budget(device))
    store = ExpertStore.open(resolve_store(path, progress))
    from transformers import AutoConfig

    arch = get_architecture(store.manifest.architecture)
    hf_config = AutoConfig.from_pretrained(store.path)
    model = arch.build(hf_config, store.resident_tensors(config.verify_checksums), device, config.torch_dtype)
    config = replace(config, static_kv=default_static_kv(config, model, device))
    for name in ("fused_ops", "fused_mamba", "fused_linears"):
        if getattr(config, name) and not triton_runs_on(device):
            raise ConfigError(f"{name}: its Triton kernels need CUDA (or TRITON_INTERPRET=1 on a CPU)")
    if config.fused_ops if config.fused_ops is not None else device.type == "cuda":
        model.fuse()
    if config.fused_linears if config.fused_linears is not None else device.type == "cuda":
        model.fuse_linears()
    if config.embeds_on_host(device):  # its table to pinned RAM, its VRAM to expert slots (kernels/embed.py)
        model.embed_on_host(pin=device.type == "cuda")
    routing = controlled_routing(config.routing, model, device)
    # every block held in RAM (by default as much RAM as that takes), or one slot where routed experts are skipped
    whole = store.total_blocks * store.block_bytes
    schedule = load_schedule(auto_schedule(config.schedule, whole, store.manifest.num_experts * store.block_bytes,
                                           config.ram_cache, available_ram(), config.record_routing is not None,
                                           _vram_room(config, store, model, device)))
    needs = schedule.needs
    readers = config.readers or needs.readers
    ram_bytes = config.ram_cache if config.ram_cache is not None else \
        whole if needs.ram == "all" else store.block_bytes if needs.ram == "one" else default_ram_cache(available_ram())
    ram_blocks = max(1, min(store.total_blocks, ram_bytes // store.block_bytes))
    if needs.ram == "all" and whole > available_ram():
        raise ConfigError(f"schedule {schedule.name!r} holds every expert block in RAM: {format_bytes(whole)}, more "
                          f"than the {format_bytes(available_ram())} this machine has available; use a schedule "
                          f"that streams (direct-stream, overlap)")
    check_guess_extra(needs.guess_extra, model, routing, store.manifest.architecture)
    # by default on CUDA (faster decode: docs/benchmarks/); a CPU keeps transformers' step (the kernels would run
    # in Triton's interpreter there)
    fused_mamba = config.fused_mamba if config.fused_mamba is not None else device.type == "cuda"
    scratch = lambda tokens: arch.prefill_scratch_bytes(hf_config, tokens, fused=fused_mamba)  # noqa: E731
    prompt_piece = config.prefill_chunk or MAX_PREFILL_CHUNK
    # a scan without scratch (the fused one) takes a prompt piece in one run, where each run is a call of host work
    # (~1 ms a Nemotron-3-Nano layer); transformers' scan runs at most MAX_MIXER_CHUNK tokens at once
    asked = config.mixer_chunk or (prompt_piece if scratch(prompt_piece) == 0 else None)
    piece = asked or MAX_MIXER_CHUNK
    if config.vram_budget is not None and device.type == "cuda":
        vram_blocks, piece = engine_slots(config, store, device, arch, hf_config, schedule, model.dtype, prompt_piece,
                                          scratch, asked)
    else:
        if config.vram_budget is not None:
            get_logger().warning("vram_budget ignored: no GPU memory on this device", device=str(device))
        # on a CPU a VRAM tier only where vram_slots asks for one: an emulated tier in host memory that runs
        # the GPU's tier code (copies are memcpy), for tests and for sizing experiments
        vram_blocks = min(store.total_blocks, config.vram_slots or _default_slots(store, device))
    recorder = RoutingRecorder(config.record_routing, trace_header(store, schedule, ram_blocks, vram_blocks, str(routing.setting) if routing else "natural")) \
        if config.record_routing else None
    rt = Runtime(store, device, ram_blocks, vram_blocks, readers, config.verify_checksums, config.direct_io, config.trace,
                 down_in_ram=needs.down_in_ram, record_routing=recorder, vram_policy=needs.vram_policy,
                 guess_reads=needs.guess_reads, read_pieces=needs.read_pieces)
    if needs.hot_set and rt.vram is not None:
        try:
            held = rt.load_hot_set(needs.hot_set, reserve=2 * store.manifest.top_k)
        except BaseException:
            rt.close()
            raise
        get_logger().info("VRAM hot set loaded", blocks=held, trace=needs.hot_set)
    elif needs.hot_set:
        get_logger().warning("hot_set ignored: no VRAM tier on this device", trace=needs.hot_set)
    for layer in model.layers:
        layer.prefill_piece, layer.fused_decode, layer.fused_prefill = piece, fused_mamba, fused_mamba
        layer.torch_mixer = config.fused_mamba is None and device.type == "cpu"  # --no-fused-mamba: transformers' step
    try:
        coordinator = Coordinator(schedule, rt)
    except BaseException:
        rt.close()
        raise
    return store, model, rt, coordinator, config, routing


def _vram_room(config: EngineConfig, store: ExpertStore, model: ResidentModel, device) -> int | None:
    """The VRAM the expert slots may take (a budget's beside the resident part, else the default slots'), for `auto`'s
    CPU share; None where there is none to weigh: a CPU, or steps not replayed whole (the share's measured path)."""
    if device.type != "cuda" or not model.whole_checked or not config.static_kv or config.whole_step is False:
        return None
    if config.vram_budget is not None:
        return config.vram_budget - torch.cuda.memory_allocated(device)
    return (config.vram_slots or _default_slots(store, device)) * store.block_bytes


def _default_slots(store: ExpertStore, device) -> int:
    """Expert slots with neither a budget nor --vram-slots: 4 x top-k on a GPU, none on a CPU."""
    return 4 * store.manifest.top_k if device.type == "cuda" else 0
