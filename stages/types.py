"""What stages hand each other, per MoE layer. Shapes use the legend in models/base.py.

Values are one-shot (a stage produces one per layer) or item channels (fetch -> h2d -> compute
pass blocks one by one, so copies and compute can start before the last read lands). Anything
made on one stream and used on another carries the event recorded after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sluice.models.base import MoEBlock
from sluice.storage.cache import CacheEntry


@dataclass(frozen=True)
class LayerInput:
    """The coordinator's input for one MoE layer."""

    block: MoEBlock
    next_block: MoEBlock | None  # the next MoE layer (the predict stage's target), None for the last
    x: torch.Tensor  # [T, D] MoE input (normalised), model dtype, device, compute stream
    residual: torch.Tensor  # [1, T, D] added after the experts, device, compute stream
    ahead: tuple[MoEBlock, ...] = ()  # the MoE layers after next_block also guessed (predict's or direct's depth)
    decoding: bool = False  # every row is a decode token (one sequence's, or a batch's: pipeline/batch.py)

    @property
    def decode(self) -> bool:
        """Decode rows, not a prompt: a one-token step or a batch of decode tokens."""
        return self.decoding or self.x.shape[0] == 1


@dataclass(frozen=True)
class Routing:
    """route -> fetch, compute, combine."""

    weights: torch.Tensor  # [T, K] routing weights in the dtype the router makes them, device, compute stream
    ids: torch.Tensor  # [T, K] int64 expert ids, CPU (what the layer waits for the GPU to give); in a one-token step on
    # CUDA a pinned buffer the route stage reuses at the next token's step of this layer (Streams.host_buffer): read it
    # within the layer, copy it to keep it
    xe: torch.Tensor  # [T, Dx] expert input, model dtype, device, compute stream
    experts: tuple[int, ...]  # distinct experts used, ascending
    rows: Mapping[int, torch.Tensor]  # expert -> flat (token * K + k) positions it serves, int64, device (route.OneTokenRows
    # in a one-token step: host ints, device tensors on demand)
    predicted: tuple[int, ...] | None  # the guesses the predict stage made for this layer, if any
    shared: torch.Tensor | None = None  # [T, D] the block's shared term (MoEBlock.shared), compute stream, where route ran it


@dataclass(frozen=True)
class Prediction:
    """predict -> fetch: guesses for the next MoE layer, made from this layer's input."""

    layer: int | None  # model layer index of the next MoE layer; None when this is the last
    experts: tuple[int, ...]  # guessed expert ids, most likely first
    further: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (layer, guesses) for the layers after it, nearest first


@dataclass(frozen=True)
class HostBlock:
    """fetch -> h2d: one block resident in a faster tier, pinned there until released."""

    expert: int
    tier: str  # where fetch found it: "vram" | "ram" | "disk"
    ram: CacheEntry | None  # pinned RAM entry (None for a VRAM hit, unless `down` is read from RAM)
    vram: CacheEntry | None  # pinned VRAM entry when the block is already on the GPU


@dataclass(frozen=True)
class DeviceBlock:
    """h2d -> compute: where the compute stream can read one block.

    The block is `bank[offset : offset + block_bytes]` (the VRAM slot bank on CUDA, the host arena
    on a CPU); its `down` projection is read from `down_bank` at `down_offset`, which is the pinned
    host slot when h2d copies only `up` (zero-copy down) and the same block otherwise."""

    expert: int
    bank: torch.Tensor  # uint8 arena
    offset: int  # bytes
    down_bank: torch.Tensor
    down_offset: int
    ready: Any  # CUDA event after the copy (None on CPU or for a VRAM hit)
    release: Callable[[Any], None]  # compute calls release(done_event) once its reads are enqueued
    on_cpu: bool = False  # the hybrid path: left in the RAM slot for compute's CPU kernels, not copied


@dataclass(frozen=True)
class ExpertOutputs:
    """compute -> combine."""

    y: torch.Tensor  # [T*K, Dx] weighted output of each (token, k), combine dtype, device, compute stream


@dataclass(frozen=True)
class LayerOutput:
    """combine -> the engine: the layer's output hidden state."""

    h: torch.Tensor  # [1, T, D] model dtype, device, compute stream


@dataclass(frozen=True)
class TokenLayer:
    """What a stage's GPU-only face (`Stage.launch`, `beside`, `before`, `after`) knows of the one-token step it is
    composed into (pipeline/plan.py), fixed when the step is built."""

    block: MoEBlock
    i: int  # its MoE index
    nxt: MoEBlock | None  # the next MoE layer (whose guesses the step may make), None for the last
    hosted: bool  # the routed ids and block offsets come in with the step, found by the host (`via: table` over a
    # RAM cache, `hold: false`), rather than routed and resolved in it
    part: Callable[[str], Any]  # part(stage name): a context timing what it wraps under that name (only with --trace)
    rows: int = 1  # the step's rows: 1 (a one-token step), or T decode rows of a batched step (pipeline/batch.py)
    cpu: bool = False  # a one-token step whose routed blocks the CPU shares (compute's `cpu_share`): the GPU's rows
    # are left unsummed, and combine sums them with the CPU's in rank order once the host has them
