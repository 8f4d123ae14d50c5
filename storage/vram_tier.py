"""The VRAM tier of the device-table schedules (`via: table`): which routed blocks sit in VRAM slots, and the
device table that says where each block is read from.

The slots are the VRAM slot bank's (storage/cache.py's BlockCache arena, the same bank the streaming schedules fill
under their LRU / LFU policy, indexed on the host); here the policy is a hot set chosen from use counts that the GPU
keeps itself. The table gives each (MoE index, expert) its block's byte offset from one base (the bank's arena, else
the RAM arena): a VRAM slot for the blocks the tier holds, else the block's pinned RAM slot, which the expert kernels
read over PCIe themselves. `in_vram` marks the entries that point at VRAM and `uses` counts routed (token, k) per
block, both on the GPU, where one-token steps update them without the host.

The tier's slots, in order: the hot set's own; the one-token staging bank (2 x S, `token_ahead`); the prompts'
lookahead bank (2 x A, `prompt_ahead`), lent to the hot set between prompts with the blocks a prompt left in it.

Every `refresh` one-token steps the host reads the counts (decayed by `decay` each time), and the most used blocks
that the hot set lacks are copied into its slots on the copy stream, in place of the least used: chosen once the
token's steps are queued (`after_queued`), so that the host's part runs while the GPU computes. A bank with a slot
for every block takes them all at open and keeps them (`holds_all`); a smaller one is filled at open with blocks spread
evenly over the layers (`vram_fill`), which refreshes then replace by use.

Invariants:
- The table points at a slot only in stream order: a leaving block's entry goes back to its RAM slot (on the tier's
  stream) before the copy stream overwrites the slot, and a new block's entry switches to the slot once its copy has
  landed (checked at each one-token step's first MoE layer, so compute never waits for the copies).
- A slot belongs to one of: the free list, `slot_of` (a held block), the staging bank, the lookahead bank; the bank's
  slots join the free list only while lent (`lend_bank`) and leave it, their blocks pointed back at RAM, before a
  prompt copies into them (`reclaim_bank`).
- Under `stream_ram` (blocks read from disk into a RAM cache, not all held) no step reads the table: the host finds
  every offset; a RAM entry a copy reads carries the copy's event (`busy`) so that its slot is not refilled first.
- `empty` runs only after the host synchronized: no copy in flight, every entry back at RAM, every slot free (then
  filled as at open, with `vram_fill`).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import torch


class VramTier:
    def __init__(self, knobs, rt, layers: list[int], vram, ram_off: list[list[int]], resident: Callable, stream: str,
                 banks: bool, staging: bool, stream_ram: bool):
        """vram: the VRAM cache whose slots the tier uses, or None (no tier: the table points at RAM only). ram_off
        [n_moe][E]: each block's RAM offset from the base (under stream_ram, current only for the blocks a step
        pinned). resident(layer, e): a loaded RAM entry to copy from, or None. banks: the prompts' lookahead bank;
        staging: the one-token staging bank."""
        self.knobs, self.rt, self.layers, self.vram, self.stream = knobs, rt, layers, vram, stream
        self.ram_off, self.resident, self.stream_ram = ram_off, resident, stream_ram
        self.block_bytes = rt.store.block_bytes
        n, E, dev = len(layers), rt.store.manifest.num_experts, rt.device
        self.table = torch.tensor(ram_off, dtype=torch.int64, device=dev)  # [n_moe, E] byte offsets from base
        self.in_vram = torch.zeros(n, E, dtype=torch.int64, device=dev)  # 1 where the table points at VRAM
        self.uses = torch.zeros(n, E, dtype=torch.int64, device=dev)  # routed (token, k) per expert
        self.slot_of: dict[tuple[int, int], int] = {}  # (MoE index, expert) -> slot
        self.landing: tuple[object, list[tuple[int, int, int]]] | None = None  # (copy event, [(i, e, slot)])
        # decayed counts on the host, in numpy: torch's small CPU ops were most of a refresh's host time on the GPU
        # machine (BENCHMARKS.md, 2026-12-07)
        self._score = np.zeros((n, E))
        self._last_uses = np.zeros((n, E), dtype=np.int64)
        self._steps = 0
        self._counts: np.ndarray | None = None  # a deferred refresh's counts (`between_tokens`, `after_queued`)
        cap = vram.capacity if vram is not None else 0
        # a bank that holds every block holds them for good (`take` at open): no refreshes, no staging, no lookahead bank
        self.holds_all = vram is not None and not stream_ram and cap >= n * E
        banks, staging = banks and not self.holds_all, staging and not self.holds_all
        a = min(knobs.prompt_ahead, cap // 4) if banks else 0
        self.ahead_bank = [list(range(cap - 2 * a, cap - a)), list(range(cap - a, cap))]  # prompts', by the layer's parity
        self.ahead_read: list = [None, None]  # per bank half: the event after the compute that last read it
        self.bank_lent = False  # between prompts the bank's slots serve the hot set too (`lend_bank`, `reclaim_bank`)
        self.bank_holds: dict[int, tuple[int, int]] = {}  # while reclaimed: bank slot -> the block (i, e) copied into it
        self.bank_landed = None  # ... the event after the last of those copies
        rest = cap - 2 * a
        self.S = min(knobs.token_ahead, rest // 8) if staging else 0  # one-token staging: 2 x S slots before the bank
        self.stage0 = rest - 2 * self.S  # the first staging slot
        self.free = self._own_slots()
        # every block in RAM from open (not stream_ram): the free slots can take some now
        self.fills = vram is not None and not stream_ram and knobs.vram_fill
        if self.holds_all:
            self.take([(i, e) for i in range(n) for e in range(E)])  # for good: never refreshed, kept through `empty`
        else:
            self.fill()

    def fill(self) -> None:
        """`vram_fill`: the free hot-set slots take blocks spread evenly over the MoE layers, expert ids in order: a
        first prompt (every block of a layer under uniform routing) and first tokens find the tier as full as later ones
        do, where an empty tier left its slots unused until prompts or refreshes filled them."""
        if self.fills and self.free:
            n, E = self.table.shape
            self.take([(i, e) for e in range(E) for i in range(n)][: len(self.free)])

    def take(self, picks: list[tuple[int, int]]) -> None:
        """Blocks (i, e) copied from their RAM slots into free slots, the table pointed at them once the copies landed
        (at open or after `empty`: nothing reads the slots yet)."""
        streams, moves = self.rt.streams, []
        with streams.use("copy"):
            for i, e in picks:
                slot = self.free.pop()
                self.vram.arena.slot(slot).copy_(self.resident(self.layers[i], e).buf, non_blocking=True)
                self.slot_of[(i, e)] = slot
                moves.append((i, e, slot))
            landed = streams.record("copy")
        streams.wait(self.stream, landed)
        self.point(moves, vram=True)
        self.rt.stats.vram_fills += len(moves)

    def _own_slots(self) -> list[int]:
        """The hot set's slots (all but the banks'), the lowest popped first."""
        return list(range(self.stage0 - 1, -1, -1)) if self.vram is not None else []

    def offset(self, i: int, e: int) -> int:
        slot = self.slot_of.get((i, e))
        return self.ram_off[i][e] if slot is None else slot * self.block_bytes

    def staging_offset(self, half: int) -> int:
        """The byte offset of staging half `half`'s first slot."""
        return (self.stage0 + half * self.S) * self.block_bytes

    def point(self, moves: list[tuple[int, int, int | None]], vram: bool) -> None:
        """Table entries (i, e) -> VRAM slot (vram) or their RAM slot (`ram_off`; the slot ignored), in stream order on the
        stage's stream. Under stream_ram no step reads the table (the host finds every offset: one-token steps send
        theirs, prompts theirs), so it is not kept."""
        if not moves or self.stream_ram:
            return
        i = torch.tensor([m[0] for m in moves])
        e = torch.tensor([m[1] for m in moves])
        off = torch.tensor([m[2] * self.block_bytes if vram else self.ram_off[m[0]][m[1]] for m in moves], dtype=torch.int64)
        dev = self.table.device
        with self.rt.streams.use(self.stream):
            i, e = i.to(dev, non_blocking=True), e.to(dev, non_blocking=True)
            self.table.index_put_((i, e), off.to(dev, non_blocking=True))
            self.in_vram.index_put_((i, e), torch.full_like(i, int(vram)))

    def read_by(self, sources, landed) -> None:
        """stream_ram: RAM entries that copies on the copy stream read: a new block waits for `landed` there."""
        if self.stream_ram:
            for src in sources:
                src.busy = landed

    def empty(self) -> None:
        """Point every table entry back at its RAM slot and free every slot (the host has synchronized: no copy is in
        flight), then fill it as at open (`vram_fill`); a tier that holds every block keeps them."""
        if self.vram is None or self.holds_all:
            return
        self.landing = None  # its moves are in slot_of: pointed back below with the rest
        self.point([(i, e, slot) for (i, e), slot in self.slot_of.items()], vram=False)
        self.slot_of.clear()
        self.free = self._own_slots()
        self.bank_lent, self.bank_holds = False, {}
        self.fill()

    def lend_bank(self) -> None:
        """One-token steps: the lookahead bank's slots join the hot set, those holding a block the prompt copied there
        (a block it lacks) with the block, pointed at once the copies landed; the rest join the free slots (taken after
        the others). A prompt's last layers' blocks stay in VRAM where a bank left empty would wait for refreshes."""
        bank = self.ahead_bank[0] + self.ahead_bank[1]
        if not bank or self.bank_lent:
            return
        keep = []
        for slot, key in self.bank_holds.items():
            if key not in self.slot_of:
                self.slot_of[key] = slot
                keep.append((*key, slot))
        if keep:
            self.rt.streams.wait(self.stream, self.bank_landed)
            self.point(keep, vram=True)
        held = {slot for _, _, slot in keep}
        self.free[:0] = [slot for slot in bank[::-1] if slot not in held]
        self.bank_lent, self.bank_holds = True, {}

    def bank_copied(self, moves: list[tuple[int, int, int]], landed) -> None:
        """A prompt's copies ahead (i, e, slot) into bank slots, landing with `landed`: what `lend_bank` keeps."""
        for i, e, slot in moves:
            self.bank_holds[slot] = (i, e)
        self.bank_landed = landed

    def reclaim_bank(self) -> None:
        """A prompt's step: the bank's slots leave the hot set, the blocks in them pointed back at RAM; the bank's copies
        wait for the compute queued so far (the one-token steps that read those slots)."""
        if not self.bank_lent:
            return
        bank = set(self.ahead_bank[0] + self.ahead_bank[1])
        self.free = [s for s in self.free if s not in bank]
        leave = [(i, e, slot) for (i, e), slot in self.slot_of.items() if slot in bank]
        for i, e, _ in leave:
            del self.slot_of[(i, e)]
        self.point(leave, vram=False)
        self.bank_holds = {slot: (i, e) for i, e, slot in leave}  # still there until a copy ahead overwrites them
        self.bank_landed = None  # copied in before the events the bank's copies wait for (`ahead_read`)
        self.ahead_read = [self.rt.streams.record(self.stream)] * 2
        self.bank_lent = False

    def land(self, wait: bool = False) -> None:
        """Point the table at the slots of the last refresh's copies once they have landed (`wait`: the stage's stream
        waits for them now: a prompt reads the slots the host believes in)."""
        if self.landing is None:
            return
        event, moves = self.landing
        if wait:
            self.rt.streams.wait(self.stream, event)
        elif event is not None and not event.query():
            return
        self.point(moves, vram=True)
        self.landing = None

    def between_tokens(self, defer: bool = False) -> None:
        """At a one-token step's first MoE layer: lend the bank, switch the table to blocks whose copies have landed,
        and every `refresh` steps choose the hot set anew (not while it holds every block): now, or (`defer`) once the
        token's steps are queued (`after_queued`), so that its host work runs while the GPU computes; the counts are
        read now either way (between tokens the GPU has nothing queued to wait for)."""
        self._counts = None
        if self.holds_all:
            return
        self.lend_bank()
        self.land()
        self._steps += 1
        if self.vram is not None and self.landing is None and self._steps % self.knobs.refresh == 0:
            counts = self._read_counts()
            if defer:
                self._counts = counts
            else:
                self._refresh_timed(counts)

    def after_queued(self) -> None:
        """Once the token's steps are queued: the refresh `between_tokens` deferred, if any (its table updates and
        copies queue behind the steps, which read the table as it was)."""
        counts, self._counts = self._counts, None
        if counts is not None:
            self._refresh_timed(counts)

    def _refresh_timed(self, counts: np.ndarray) -> None:
        t = time.perf_counter()
        self.refresh(counts)
        self.rt.stats.refreshes += 1
        self.rt.stats.refresh_s += time.perf_counter() - t

    def _read_counts(self) -> np.ndarray:
        """The GPU's use counts on the host: the one host wait of a refresh."""
        t = time.perf_counter()
        uses = self.uses.to("cpu", copy=True).numpy()
        self.rt.stats.refresh_wait_s += time.perf_counter() - t
        return uses

    def refresh(self, uses: np.ndarray | None = None) -> None:
        """Choose the hot set anew from the decayed use counts (`uses`: read at the token's start; None: now): free
        slots take the most used blocks outside it, and a block outside replaces the least used inside only while it
        beats it by `margin` routed uses (the cost of its copy) plus `noise` times the square root of both counts (their
        chance spread: scores from a few tokens differ by chance, and a swap on chance is a block over PCIe that saves
        nothing)."""
        uses = self._read_counts() if uses is None else uses  # kept as the last counts
        self._score = self._score * self.knobs.decay + (uses - self._last_uses)
        self._last_uses = uses
        E = self.table.shape[1]
        flat = self._score.ravel()
        score = flat.tolist()
        inside = np.zeros(flat.size, dtype=bool)
        if self.slot_of:
            inside[[i * E + e for i, e in self.slot_of]] = True
        order = np.argsort(-flat, kind="stable")  # most used first, ties in index order
        outside = order[~inside[order] & (flat[order] > 0)].tolist()  # candidates, most used first
        if self.stream_ram:  # only blocks in RAM can be copied in
            outside = [j for j in outside if self.resident(self.layers[j // E], j % E) is not None]
        come = [divmod(j, E) for j in outside[: len(self.free)]]
        incumbents = order[inside[order]][::-1].tolist()  # least used first
        leave = []
        for j, k in zip(outside[len(come):], incumbents):
            if score[j] - score[k] <= self.knobs.margin + self.knobs.noise * math.sqrt(score[j] + score[k]):
                break
            come.append(divmod(j, E))
            leave.append(divmod(k, E))
        if not come:
            return
        streams = self.rt.streams
        if leave:
            self.point([(i, e, self.slot_of[(i, e)]) for i, e in leave], vram=False)
            for k in leave:
                self.free.append(self.slot_of.pop(k))
        pointed = streams.record(self.stream)
        moves = []
        with streams.use("copy"):
            streams.wait("copy", pointed)  # the kernels that still read a leaving block's slot come first
            sources = []
            for i, e in come:
                slot = self.free.pop()
                sources.append(src := self.resident(self.layers[i], e))
                self.vram.arena.slot(slot).copy_(src.buf, non_blocking=True)
                self.slot_of[(i, e)] = slot
                moves.append((i, e, slot))
            landed = streams.record("copy")
        self.read_by(sources, landed)
        self.rt.stats.vram_fills += len(moves)
        self.landing = (landed, moves)
