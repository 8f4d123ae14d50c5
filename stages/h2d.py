"""h2d: RAM slot -> VRAM slot on the schedule's stream, one event per batch of copies.

On a CPU there is nothing to copy: compute reads the RAM slot in place, and the RAM pin is held
until compute releases the block. On CUDA each block is copied (non-blocking, from pinned memory)
into a slot of the VRAM bank; the blocks that arrive together are copied back to back and share
one event (fewer host calls per block); the RAM pin is dropped as soon as the copy is enqueued,
with that event attached so the slot is not refilled before the copy has read it. When the VRAM
bank has no free slot the stage ends a wave and waits for compute to release one.

`copy: up` (zero-copy down) copies every projection but `down`; compute then reads `down`
straight from the pinned RAM slot over PCIe, and the RAM pin is held until compute is done.
With zero-skip in compute, only the 16-neuron groups live after ReLU^2 cross the bus.

Hybrid miss path (`cpu_share` > 0, one-token steps): that fraction of the blocks the layer would copy
stays in its RAM slot, and compute runs those experts on the CPU (kernels/cpu.py) while the GPU
runs the copied ones. With `cpu_balance` the split follows the measured rates, so that the CPU and
the copies finish together: a block costs tg = its bytes / (pinned H2D rate) on the copy path
and tc = the CPU's measured seconds per block on the other, and of the layer's VRAM misses the CPU takes the
count that finishes both soonest (`balance_cpu_blocks`), the first to arrive: none when a CPU block
would end after the copies of all the others (few misses, a slow CPU), about tg / (tg + tc) of
them when the misses are many; and one now and then (MIN_SHARE of the misses) so that the CPU's rate
keeps being measured. Before the CPU's first measurement, and without `cpu_balance`, the share is
`cpu_share`: each block that would be copied adds it to a credit carried across layers, and a whole
credit sends the block to the CPU.
In prompt steps (`cpu_prefill`), an expert routed only a few of the prompt's tokens is computed on the
CPU rather than copied: with -1, where that beats the copy (tokens x tc <= tg, from the same rates).

Prefetch (`prefetch`, one-token steps): once the layer's own copies are enqueued, the experts that
predict guessed for the next MoE layer and that sit loaded in RAM are copied into free or evictable
VRAM slots, on the same stream after those copies (never alongside a demand copy), so that the next
layer finds them in VRAM and its copies leave the critical path: they run under this layer's expert
compute and the resident layers up to the next router. A guess never waits for a slot or a read,
and counts as no use for `lfu` (a wrong one is the first to go).

The VRAM tier these copies fill is set here too: `vram_policy` (lru | lfu, storage/cache.py) picks
what it evicts, and `hot_set` (a routing trace recorded with --record-routing) loads the blocks that
trace routed to most often at start and keeps them for good, all but two layers' worth of slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.errors import ScheduleError
from sluice.stages.base import Stage, StageIO
from sluice.stages.types import DeviceBlock, HostBlock


@dataclass(frozen=True)
class H2DKnobs:
    copy: str = "all"  # all | up (leave `down` in pinned RAM for the zero-copy kernel)
    vram_policy: str = "lru"  # lru | lfu: what the VRAM tier evicts
    hot_set: str = ""  # routing trace whose most-routed blocks are loaded at start and held in VRAM
    cpu_share: float = 0.0  # fraction of a one-token layer's to-be-copied blocks computed on the CPU instead
    cpu_balance: bool = False  # adapt cpu_share to the measured CPU and H2D rates
    cpu_prefill: int = 0  # prompt steps: experts routed at most this many tokens run on the CPU (-1: where cheaper)
    prefetch: bool = False  # one-token steps: copy the next MoE layer's guessed experts from RAM into VRAM
    min_recall: float = 0.0  # prefetch: copy guesses only while their recent recall is at least this (0: always)

    def __post_init__(self):
        from sluice.storage.cache import POLICIES

        if not 0.0 <= self.cpu_share <= 1.0:
            raise ScheduleError(f"stage 'h2d': 'cpu_share' must be between 0 and 1, got {self.cpu_share!r}")
        if self.cpu_prefill < -1:
            raise ScheduleError(f"stage 'h2d': 'cpu_prefill' must be -1 (where cheaper), 0 (never) or a token count, got {self.cpu_prefill!r}")

        if not 0.0 <= self.min_recall <= 1.0:
            raise ScheduleError(f"stage 'h2d': 'min_recall' must be between 0 and 1, got {self.min_recall!r}")
        if self.vram_policy not in POLICIES:
            raise ScheduleError(f"stage 'h2d': 'vram_policy' must be one of {', '.join(POLICIES)}, got {self.vram_policy!r}")


MIN_SHARE = 0.005  # one block in 200: enough to keep measuring the CPU, little to wait for when it is slow


def cpu_rated(rt) -> bool:
    """Whether the hybrid's balance can follow the CPU's measured rate: timed, and beside a GPU's PCIe."""
    return rt.cpu_rate.block_s is not None and rt.device.type == "cuda"


def balance_cpu_blocks(misses: int, tg: float, tc: float, call: float = 0.0) -> int:
    """Of a layer's `misses` blocks to copy (tg seconds each over PCIe), how many the CPU computes instead
    (tc seconds each, one after another, and `call` seconds a call, alongside the copies): the count that
    finishes both soonest, max(call + c * tc, (misses - c) * tg), the fewer on a tie. A whole block that the CPU finishes after the
    copies of all the others would have is not worth sending: with tc = 7 tg and three misses, none goes."""
    best, best_t = 0, misses * tg
    for c in range(1, misses + 1):
        t = max(call + c * tc, (misses - c) * tg)
        if t < best_t - 1e-12:
            best, best_t = c, t
    return best


class H2D(Stage):
    name = "h2d"
    consumes = ("layer", "blocks", "routing")
    optional = ("prediction",)
    produces = "device_blocks"
    channel = True
    Knobs = H2DKnobs

    @classmethod
    def needs(cls, knobs: H2DKnobs) -> dict:
        return {"down_in_ram": knobs.copy == "up", "vram_policy": knobs.vram_policy, "hot_set": knobs.hot_set}

    def __init__(self, knobs, stream, rt):
        super().__init__(knobs, stream, rt)
        if knobs.copy not in ("all", "up"):
            raise ScheduleError(f"stage 'h2d': 'copy' must be all or up, got {knobs.copy!r}")
        down = rt.layouts.get("down")
        # bytes to copy: the whole block, or everything before `down` (blocks keep projections in order)
        self._nbytes = down.start if knobs.copy == "up" and down is not None else rt.store.block_bytes
        self._credit = 0.0  # the hybrid share accumulated over blocks that would be copied

    async def run(self, io: StageIO) -> None:
        li = await io.value("layer")
        layer = li.block.layer
        one_token = li.x.shape[0] == 1
        share = cpu_left = 0
        if one_token and self._balanced():
            cpu_left = await self._cpu_blocks(io, layer)
        elif one_token:
            share = self.knobs.cpu_share
        limit = self._prefill_limit() if not one_token else 0
        tokens = {}
        if limit:
            r = await io.value("routing")
            tokens = {e: int(rows.numel()) for e, rows in r.rows.items()}
        async for batch in io.batches("blocks"):
            pending: list[tuple[HostBlock, object]] = []  # blocks whose copies go out together, with their VRAM slot
            for hb in batch:
                if cpu_left and hb.vram is None:  # the first blocks to arrive: the CPU starts on them soonest
                    cpu_left -= 1
                    io.emit(self._on_cpu(hb))
                    continue
                if share and hb.vram is None:
                    self._credit += share
                    if self._credit >= 1.0 - 1e-9:
                        self._credit -= 1.0
                        io.emit(self._on_cpu(hb))
                        continue
                if limit and hb.vram is None and tokens[hb.expert] <= limit:
                    io.emit(self._on_cpu(hb))
                    continue
                placed = self._in_place(hb)
                if placed is not None:
                    io.emit(placed)
                    continue
                if hb.vram is not None:  # zero-copy down of a VRAM hit: up is in VRAM, down still needed from RAM
                    io.emit(self._device_block(hb, hb.vram, hb.vram.filled))
                    continue
                key = (layer, hb.expert)
                v = self.rt.vram.try_reserve(key)
                if v is None:
                    self._copy(io, pending)
                    io.end_wave()
                    v = await self.rt.vram.reserve(key)
                pending.append((hb, v))
            self._copy(io, pending)
            io.end_wave()  # pass the upstream wave boundary on
        if self.knobs.prefetch and one_token and self.rt.vram is not None and io.has("prediction"):
            self._prefetch(await io.value("prediction"))

    def _prefetch(self, pred) -> None:
        """Copy the guessed experts of the next MoE layer that are loaded in RAM and not in VRAM into VRAM
        slots, after the copies already on this stage's stream; stop at the first slot not to be had."""
        rt = self.rt
        if pred.layer is None or not rt.stats.guesses_pay(self.knobs.min_recall, len(pred.experts)):
            return
        pending = []
        for expert in pred.experts:
            key = (pred.layer, expert)
            ram = rt.ram.peek(key)
            if key in rt.vram or ram is None or not _loaded(ram):
                continue
            v = rt.vram.try_reserve(key, use=False)
            if v is None:
                break
            rt.ram.pin(ram)
            pending.append((ram, v))
        if not pending:
            return
        copied = self._enqueue(pending)
        for ram, v in pending:
            v.reuse_after, v.filled, v.prefetched = None, copied, True
            rt.ram.unpin(ram, copied)
            rt.vram.unpin(v, copied)
        rt.stats.vram_prefetches += len(pending)

    def _balanced(self) -> bool:
        """Whether this layer's CPU blocks follow the measured rates (else the fixed cpu_share)."""
        return self.knobs.cpu_balance and cpu_rated(self.rt)

    async def _cpu_blocks(self, io: StageIO, layer: int) -> int:
        """How many of this one-token layer's blocks to copy the CPU takes (cpu_balance): `balance_cpu_blocks`
        over the layer's VRAM misses, or one now and then (MIN_SHARE of the misses) so that the CPU's rate
        keeps being measured."""
        r = await io.value("routing")
        vram = self.rt.vram
        misses = sum(1 for e in r.experts if vram is None or (layer, e) not in vram)
        rate = self.rt.cpu_rate
        c = balance_cpu_blocks(misses, self._copy_seconds(), rate.block_s, rate.call_s)
        self._credit += MIN_SHARE * misses
        if c == 0 and misses and self._credit >= 1.0:
            c = 1
        if c:
            self._credit = max(0.0, self._credit - 1.0)
        return c

    def _prefill_limit(self) -> int:
        """Most prompt tokens an expert may have for the CPU to take it: the knob, or from the rates."""
        k, rt = self.knobs, self.rt
        if k.cpu_prefill >= 0:
            return k.cpu_prefill
        if not cpu_rated(rt):
            return 0
        return int(self._copy_seconds() / rt.cpu_rate.block_s)

    def _copy_seconds(self) -> float:
        return self.rt.store.block_bytes / self.rt.h2d_rate()  # with `copy: up` the GPU still reads `down` over PCIe

    def _on_cpu(self, hb: HostBlock) -> DeviceBlock:
        """The block where it sits in RAM, for compute's CPU path; its pin is held until the CPU is done."""
        rt, e = self.rt, hb.ram
        n = rt.store.block_bytes
        return DeviceBlock(hb.expert, rt.ram.arena.data, e.slot * n, rt.ram.arena.data, e.slot * n, None,
                           lambda done, e=e: rt.ram.unpin(e, done), on_cpu=True)

    def _in_place(self, hb: HostBlock) -> DeviceBlock | None:
        """A block compute can read where it is (a whole VRAM hit, or RAM on a CPU); None when it needs a copy."""
        rt = self.rt
        n = rt.store.block_bytes
        if hb.vram is not None and self._nbytes == n:
            v = hb.vram
            return DeviceBlock(hb.expert, rt.vram.arena.data, v.slot * n, rt.vram.arena.data, v.slot * n, v.filled,
                               lambda done, v=v: rt.vram.unpin(v, done))
        if rt.vram is None:
            e = hb.ram
            return DeviceBlock(hb.expert, rt.ram.arena.data, e.slot * n, rt.ram.arena.data, e.slot * n, None,
                               lambda done, e=e: rt.ram.unpin(e, done))
        return None

    def _copy(self, io: StageIO, pending: list) -> None:
        """Copy pending blocks RAM -> VRAM on this stage's stream, one event after them all; emit them."""
        if not pending:
            return
        copied = self._enqueue([(hb.ram, v) for hb, v in pending])
        for hb, v in pending:
            v.reuse_after = None
            v.filled = copied
            io.emit(self._device_block(hb, v, copied))
        pending.clear()

    def _enqueue(self, copies: list) -> object:
        """RAM entry -> VRAM entry copies on this stage's stream, each after its slot's previous reader; the
        event after them all."""
        streams = self.rt.streams
        with streams.use(self.stream):
            for ram, v in copies:
                streams.wait(self.stream, v.reuse_after)
                v.buf[: self._nbytes].copy_(ram.buf[: self._nbytes], non_blocking=True)
            return streams.record(self.stream)

    def _device_block(self, hb: HostBlock, v, copied) -> DeviceBlock:
        rt, n = self.rt, self.rt.store.block_bytes
        ram = hb.ram
        vbank, hbank = rt.vram.arena.data, rt.ram.arena.data
        if self._nbytes == n:
            rt.ram.unpin(ram, copied)
            return DeviceBlock(hb.expert, vbank, v.slot * n, vbank, v.slot * n, copied, lambda done, v=v: rt.vram.unpin(v, done))

        def release(done, v=v, ram=ram):
            rt.vram.unpin(v, done)
            rt.ram.unpin(ram, done)

        return DeviceBlock(hb.expert, vbank, v.slot * n, hbank, ram.slot * n, copied, release)


def _loaded(entry) -> bool:
    """Whether a RAM entry's block is there to copy: read, and read without error."""
    f = entry.ready
    return f is None or (f.done() and not f.cancelled() and f.exception() is None)
