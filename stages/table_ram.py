"""The device table's RAM side: where each expert block lies in pinned RAM, and, for stores larger than RAM, reading it
there from disk when a layer routes to it.

`hold: true`: every block is read into the RAM cache once, at open, and held there for good. `hold: false`
(stream_ram): the RAM cache is an LRU cache of at least one layer's experts. A layer's step pins the blocks it routes
to (`ensure`: cache hits, else demand reads from disk, awaited), reads the next layer's guesses behind those demands
(`read_guesses`; with `depth` > 1, those of the layers after it next, nearest first), and once its kernels and copies
are queued unpins them (`release`): a slot then waits for that GPU work before a new block is read into it.

`off[i][e]` is block (MoE index i, expert e)'s byte offset from the stage's base (the VRAM tier's arena, else the RAM
arena): kernels add it to the base and read host memory over PCIe. Under stream_ram it is current only for the blocks
of the layer being stepped, set when `ensure` pins them.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import torch

from sluice.errors import ConfigError
from sluice.log import get_logger

LOAD_WINDOW = 64  # block reads in flight while the stage loads the store at open


class RamBlocks:
    def __init__(self, rt, layers: list[int], base: torch.Tensor, load: bool, stream_ram: bool, stream: str):
        """layers: MoE index -> model layer; base: the tensor the offsets count from; load: read every block at open
        and hold it (`hold: true` with routed experts); stream: the stage's stream, which reads the pinned blocks."""
        self.rt, self.layers, self.base, self.stream_ram, self.stream = rt, layers, base, stream_ram, stream
        E = rt.store.manifest.num_experts
        if stream_ram and rt.ram.capacity < E:
            need = E * rt.store.block_bytes / 2**30
            raise ConfigError(f"schedule stage 'fetch' with hold: false needs RAM for one layer's experts at least: {E} blocks "
                              f"({need:.2f} GiB), the RAM cache holds {rt.ram.capacity}; give ram_cache (--ram-cache) {need:.2f}GiB or more")
        # (layer, expert) -> its RAM entry: held for good, or (stream_ram) pinned for a step, then a cache's entry
        self.entries = self._load_all() if load else {}
        self.off = [[self.entries[(layer, e)].buf.data_ptr() - base.data_ptr() if self.entries else 0 for e in range(E)]
                    for layer in layers]
        self.disk: set[int] = set()  # stream_ram: the current layer's experts read from disk
        self._pinned: list = []  # stream_ram: the RAM entries the current layer pinned

    def _load_all(self) -> dict:
        """Read every block into the RAM tier and hold it there (once, at open)."""
        rt, store = self.rt, self.rt.store
        n = store.total_blocks
        if rt.ram.capacity < n:
            gib = n * store.block_bytes / 2**30
            raise ConfigError(f"schedule stage 'fetch' (hold: true) keeps every expert block in RAM: the store has {n} blocks ({gib:.2f} GiB), "
                              f"the RAM cache holds {rt.ram.capacity}; give ram_cache (--ram-cache) at least {gib:.2f}GiB, or read "
                              f"blocks from disk as they are routed to (hold: false, schedules/direct-stream.yaml)")
        t, entries, pending = time.perf_counter(), {}, deque()
        for layer in store.moe_layers:
            for e in range(store.manifest.num_experts):
                entry = entries[(layer, e)] = rt.ram.try_reserve((layer, e))
                pending.append((entry, rt.reader.submit(layer, e, entry.buf)))
                if len(pending) >= LOAD_WINDOW:
                    self._settle(*pending.popleft())
        while pending:
            self._settle(*pending.popleft())
        get_logger().info("direct: every expert block held in RAM", blocks=n, gib=round(n * store.block_bytes / 2**30, 2),
                          s=round(time.perf_counter() - t, 2))
        return entries

    def _settle(self, entry, fut) -> None:
        fut.result()  # a failed read raises, naming layer and expert
        self.rt.ram.hold(entry)
        self.rt.ram.unpin(entry)

    async def ensure(self, layer: int, i: int, experts: list[int], guesses: list[tuple[int, list[int]]] = ()) -> None:
        """stream_ram: the blocks of `experts` (of MoE layer `layer`, index i) in RAM, pinned for this layer's step: cache
        hits, else demand reads from disk (awaited; a failed read raises, naming layer and expert), a guess still queued
        read at once. Their offsets are set in `off`; `disk` names those read from disk. `guesses` ((MoE layer, experts
        that the VRAM tier lacks), nearest layer first): read from disk as guesses, after the demands, in that order."""
        rt, pending = self.rt, []
        self.disk = set()
        rt.cancel_guesses(layer, keep=set(experts))  # this layer's guesses still queued that it did not route to
        for e in experts:
            kind, entry = rt.demand(layer, e)
            if entry is None:  # guesses hold the other slots (at least E, checked at open): they give way
                rt.cancel_guesses()
                entry = await rt.demand_wait(layer, e)
            if kind == "disk":
                self.disk.add(e)
            rt.stats.prefetch_hits += kind == "guess"  # a guess read (or being read) that this layer routed to
            self._pinned.append(entry)
            if entry.loading:
                pending.append(entry.ready)
            self.entries[(layer, e)] = entry
            self.off[i][e] = entry.buf.data_ptr() - self.base.data_ptr()
        for guess in guesses:
            if not self.read_guesses(*guess):
                break
        if pending:
            t = time.perf_counter()
            await asyncio.gather(*pending)
            rt.stats.stall_s += time.perf_counter() - t

    def read_guesses(self, layer: int, experts: list[int]) -> bool:
        """The blocks of `experts` (MoE layer `layer`'s guesses, those the VRAM tier lacks) that RAM lacks too, read into
        RAM as guesses: the reader takes them only while no demand read is queued or running. False once RAM has no
        slot to spare for one."""
        for e in experts:
            if (layer, e) in self.rt.ram:
                continue
            if not self.rt.read_guess(layer, e):
                return False
        return True

    def release(self) -> None:
        """stream_ram: unpin the step's RAM blocks; their slots wait for the GPU work queued so far before reuse."""
        if not self._pinned:
            return
        done = self.rt.streams.record(self.stream)
        for entry in self._pinned:
            self.rt.ram.unpin(entry, busy=done)
        self._pinned = []

    def resident(self, layer: int, e: int):
        """A loaded RAM entry for (layer, e), or None: what a copy that is not this layer's may read (stream_ram)."""
        if not self.stream_ram:
            return self.entries[(layer, e)]
        entry = self.rt.ram.peek((layer, e))
        return entry if entry is not None and not entry.loading else None
