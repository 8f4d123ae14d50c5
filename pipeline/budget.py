"""A VRAM budget (`--vram-budget`): what it leaves for expert slots after the resident part and a reserve for
activations, the KV cache and a Mamba-2 prefill run's scratch, so that a run on a large GPU behaves as on a card of
that size."""

from __future__ import annotations

import torch

from sluice.errors import ConfigError
from sluice.log import get_logger
from sluice.pipeline.config import format_bytes
from sluice.storage.store import ExpertStore

VRAM_RESERVE = 2 << 30  # at least this much of a VRAM budget stays free for activations and the KV cache
SCRATCH_MARGIN = 512 << 20  # beside twice a prefill chunk's largest temporary (the allocator's fragmentation)
MAX_MIXER_CHUNK = 512  # the default (and the automatic piece's largest) run of a Mamba-2 prefill


def reserve_bytes(budget: int, scratch: int, states: int = 0) -> int:
    """What a VRAM budget keeps free of expert slots: 2 GiB, a quarter of the budget, or twice the largest
    temporary of a prefill chunk, a margin and the states of the sequences one step holds, whichever is most (a
    reserve of exactly one chunk's temporaries fails once the allocator has fragmented it; 32 Nemotron-3-Nano
    sequences, 53 MiB of state each, ran out of VRAM in a 2 GiB reserve where 16 ran)."""
    return max(VRAM_RESERVE, budget // 4, 2 * scratch + SCRATCH_MARGIN + states)


def plan_budget(budget: int, used: int, total_blocks: int, block_bytes: int, scratch, chunk: int | None = None,
                states: int = 0) -> tuple[int, int, int]:
    """(expert slots, Mamba-2 prefill run in tokens, reserve in bytes) for a VRAM budget with `used` bytes already
    resident; scratch(tokens) is the largest temporary of a mixer's run of that many tokens. An automatic run
    (chunk None) is the largest power of two <= 512 whose scratch fits what the slots leave: the base reserve
    (2 GiB or a quarter), or more where every block fits with room to spare. A Nemotron-3-Nano layer's
    PyTorch Mamba-2 prefill needs 0.5 GiB per 128 tokens: 128 tokens for the full model at 8 GiB. A run asked
    for grows the reserve, and the slots give way; so do `states` (bytes of the sequences one step holds)."""
    fit = lambda reserve: min(total_blocks, (budget - used - reserve) // block_bytes)  # noqa: E731
    if chunk is None:
        spare = budget - used - max(fit(max(VRAM_RESERVE, budget // 4)), 0) * block_bytes
        chunk = MAX_MIXER_CHUNK
        while chunk > 16 and 2 * scratch(chunk) + SCRATCH_MARGIN > spare:
            chunk //= 2
    reserve = reserve_bytes(budget, scratch(chunk), states)
    return int(fit(reserve)), chunk, reserve


def budget_slots(budget: int, store: ExpertStore, device: torch.device, scratch=lambda tokens: 0,
                 chunk: int | None = None, states: int = 0) -> tuple[int, int]:
    """(expert slots, Mamba-2 prefill run) a VRAM budget leaves after the resident part (already on the device) and
    a reserve for activations, KV and a Mamba-2 prefill run's scratch (`plan_budget`); caps the process at the
    budget so the run behaves as on a card of that size. (transformers' PyTorch Mamba-2 prefill alone
    needs ~1.5 GiB for a 32-token prompt of a Nemotron-3-Nano layer: a 1 GiB reserve ran out.)"""
    used = torch.cuda.memory_allocated(device)
    slots, chunk, reserve = plan_budget(budget, used, store.total_blocks, store.block_bytes, scratch, chunk, states)
    need = store.manifest.top_k
    if slots < need:
        raise ConfigError(f"vram_budget {format_bytes(budget)}: the resident part takes {format_bytes(used)} and {format_bytes(reserve)} "
                          f"stays free for activations, a {chunk}-token Mamba-2 prefill run and {format_bytes(states)} of sequence "
                          f"states (--max-batch), leaving room for {max(slots, 0)} expert "
                          f"slots; a MoE layer needs {need}")
    index = cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), index)
    get_logger().info("VRAM budget", budget=format_bytes(budget), resident=format_bytes(used), reserve=format_bytes(reserve),
                      states=format_bytes(states),
                      expert_slots=int(slots), slot_bytes=format_bytes(slots * store.block_bytes), mixer_chunk=chunk)
    return slots, chunk


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
