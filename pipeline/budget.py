"""A VRAM budget (`--vram-budget`): what it leaves for expert slots after the resident part, the CUDA context and a
reserve sized from the need (a prompt chunk's activations, a Mamba-2 prefill run's scratch, the states of a step's
sequences, the workspaces), so that a run on a large GPU behaves as on a card of that size."""

from __future__ import annotations

import os

import torch

from sluice.errors import ConfigError
from sluice.log import get_logger
from sluice.pipeline.config import format_bytes
from sluice.storage.store import ExpertStore

RESERVE_SHARE = 8  # at least 1/8 of a VRAM budget stays free of expert slots (architectures whose prompts' temporaries
# the estimate below misses: an attention that materialises its scores)
WORKSPACE = 256 << 20  # beside the estimates: cuBLAS's and Triton's workspaces, CUDA graphs' pools, the allocator's slack
MAX_MIXER_CHUNK = 512  # the default (and the automatic piece's largest) run of a Mamba-2 prefill
MAX_PREFILL_CHUNK = 2048  # the default prompt piece of one step (`extend`)
CARD = "card"  # a budget of the card's memory this process may have (the CLI's default): `card_budget`


def prompt_bytes(hf_config, top_k: int, tokens: int) -> int:
    """A generous estimate of what one layer holds for a `tokens`-token prompt chunk beyond its scratch: the
    residual stream's fp32 rows and a MoE layer's routed rows (input, up, activation and output in 16 bits). Measured
    on Nemotron-3-Nano at 8 GiB (BENCHMARKS.md, 2026-12-06): a 2048-token chunk held 0.55 GiB above the resident part
    and the slots, state and staging included, where this gives 0.33 GiB alone."""
    c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    h = c.hidden_size
    i = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    return tokens * (16 * h + 2 * top_k * (2 * h + 3 * i))


def reserve_bytes(budget: int, scratch: int, states: int = 0, prompt: int = 0, staging: int = 0) -> int:
    """What a VRAM budget keeps free of expert slots, from the need: twice a Mamba-2 run's largest temporary (one
    chunk's exactly fails once the allocator has fragmented it), a prompt chunk's activations, the states of the
    sequences one step holds (53 MiB a Nemotron-3-Nano sequence), a prompt's staging bank and the workspaces; at least
    1/8 of the budget."""
    return max(budget // RESERVE_SHARE, 2 * scratch + _beside(states, prompt, staging))


def _beside(states: int, prompt: int, staging: int) -> int:
    """The reserve's need beside the Mamba-2 scratch."""
    return prompt + states + staging + WORKSPACE


def plan_budget(budget: int, used: int, total_blocks: int, block_bytes: int, scratch, chunk: int | None = None,
                states: int = 0, prompt: int = 0, staging: int = 0, reserve: int | None = None) -> tuple[int, int, int]:
    """(expert slots, Mamba-2 prefill run in tokens, reserve in bytes) for a VRAM budget with `used` bytes already
    resident (or otherwise out of reach); scratch(tokens) is the largest temporary of a mixer's run of that many
    tokens. An automatic run (chunk None) is the largest power of two <= 512 whose scratch (twice over) fits an eighth
    of the budget, or what the slots leave where every block fits: transformers' broadcast Mamba-2 prefill (0.5 GiB per
    128 tokens of a Nemotron-3-Nano layer) runs 128 tokens at 8 GiB, its einsum scan 512. A run asked for grows the
    reserve, and the slots give way; so do `states` (bytes of the sequences one step holds). A `reserve` given
    (--vram-reserve) is kept as it is: an automatic run's scratch must fit what the rest of the need leaves of it."""
    fit = lambda reserve: min(total_blocks, (budget - used - reserve) // block_bytes)  # noqa: E731
    if chunk is None:
        if reserve is not None:
            room = reserve - _beside(states, prompt, staging)
        else:
            base = reserve_bytes(budget, 0, states, prompt, staging)
            room = max(budget // RESERVE_SHARE, budget - used - base - max(fit(base), 0) * block_bytes)
        chunk = MAX_MIXER_CHUNK
        while chunk > 16 and 2 * scratch(chunk) > room:
            chunk //= 2
    if reserve is None:
        reserve = reserve_bytes(budget, scratch(chunk), states, prompt, staging)
    return int(fit(reserve)), chunk, reserve


def budget_slots(budget: int, store: ExpertStore, device: torch.device, scratch=lambda tokens: 0,
                 chunk: int | None = None, states: int = 0, prompt: int = 0, staging: int = 0,
                 reserve: int | None = None) -> tuple[int, int]:
    """(expert slots, Mamba-2 prefill run) a VRAM budget leaves after the resident part (already on the device), the
    device memory outside the allocator (this process's CUDA context and modules: on a card of that size they count)
    and a reserve for activations, states and scratch (`plan_budget`; `reserve` given: that instead); caps the
    allocator at what the budget leaves it, so the run behaves as on a card of that size."""
    index = cuda_index(device)
    outside = outside_allocator(index)
    used = torch.cuda.memory_allocated(device)
    slots, chunk, reserve = plan_budget(budget - outside, used, store.total_blocks, store.block_bytes, scratch, chunk,
                                        states, prompt, staging, reserve)
    total = torch.cuda.get_device_properties(index).total_memory
    need = store.manifest.top_k
    if slots < need:
        raise ConfigError(f"vram_budget {format_bytes(budget)}: the resident part takes {format_bytes(used)}, the CUDA context "
                          f"and what else lies outside the allocator {format_bytes(outside)}, and {format_bytes(reserve)} stays free for activations, a {chunk}-token "
                          f"Mamba-2 prefill run and {format_bytes(states)} of sequence states (--max-batch), leaving room for "
                          f"{max(slots, 0)} expert slots; a MoE layer needs {need}")
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(budget - outside, 0) / total), index)
    get_logger().info("VRAM budget", budget=format_bytes(budget), resident=format_bytes(used), outside=format_bytes(outside),
                      reserve=format_bytes(reserve), states=format_bytes(states),
                      expert_slots=int(slots), slot_bytes=format_bytes(slots * store.block_bytes), mixer_chunk=chunk)
    return int(slots), chunk


def engine_slots(config, store: ExpertStore, device: torch.device, arch, hf_config, schedule, dtype: torch.dtype,
                 prompt_tokens: int, scratch, chunk: int | None) -> tuple[int, int]:
    """`budget_slots` for an engine being opened: its Mamba-2 scratch(tokens) in runs of `chunk` tokens (None: the
    most that fits), and beside it the states of the sequences one step holds (--max-batch), a `prompt_tokens` chunk's
    activations, and a prompt's staging bank (h2d's prompt_group blocks, double-buffered, where the schedule has one)."""
    h2d = schedule.stage("h2d")
    group = getattr(h2d.knobs, "prompt_group", 0) if h2d is not None else 0
    return budget_slots(config.vram_budget, store, device, scratch,
                        chunk, config.max_batch * state_bytes(arch, hf_config, dtype, config.static_kv),
                        prompt_bytes(hf_config, store.manifest.top_k, prompt_tokens), 2 * group * store.block_bytes,
                        config.vram_reserve)


def card_budget(device: torch.device) -> int:
    """The GPU memory this process may have (`--vram-budget card`, the CLI's default): the card's, less what other
    processes hold now; without it the slot bank is the default 4 x top-k and every other block crosses PCIe."""
    index = cuda_index(device)
    free, _ = torch.cuda.mem_get_info(index)
    budget = free + torch.cuda.memory_reserved(index) + outside_allocator(index)
    get_logger().info("VRAM budget from the card", budget=format_bytes(budget))
    return budget


def outside_allocator(index: int) -> int:
    """Device memory this process holds outside PyTorch's allocator (its CUDA context, modules, cuBLAS handles): from
    NVML's count for this process where NVML is there, else all that is in use but the allocator's (other processes'
    memory too, then)."""
    reserved = torch.cuda.memory_reserved(index)
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
        finally:
            pynvml.nvmlShutdown()
        if mine and mine[0]:
            return max(0, mine[0] - reserved)
    except Exception:  # no NVML (or it cannot tell processes apart here): what the driver says is in use
        pass
    free, total = torch.cuda.mem_get_info(index)
    return max(0, total - free - reserved)


def cuda_index(device: torch.device) -> int:
    """The CUDA device's index ('cuda' alone means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def state_bytes(arch, hf_config, dtype: torch.dtype, static_kv: int | None) -> int:
    """One sequence's state on the device as a step first holds it: its recurrent states and its attention's first
    slots (a static cache's, models/static_cache.py; a growing cache's first as many tokens)."""
    from sluice.models.static_cache import FIRST_SLOTS

    size = torch.tensor([], dtype=dtype).element_size()
    slots = min(FIRST_SLOTS, static_kv) if static_kv else FIRST_SLOTS
    return arch.recurrent_bytes(hf_config, size) + arch.kv_bytes_per_token(hf_config, size) * slots
