"""The device table's one-token steps whose routed blocks the CPU shares (compute's `cpu_share`): the hybrid miss path.

Of the blocks a one-token MoE step routes to, those in the VRAM tier are read there by the GPU; of the others (in
pinned RAM) the CPU computes a share from their RAM slots (kernels/cpu.py) while the GPU reads the rest over PCIe,
so that PCIe and the host's RAM bandwidth add up. The CPU's rows are its kernels' arithmetic, so the layer's output
is the streaming schedules' within rounding, not bit for bit. Two forms:
- a whole step (pipeline/whole.py; `cpu_split`, `cpu_turn`): the split is made on the device in the step's fetch
  part (the CPU takes the lowest-ranked routed blocks outside VRAM, up to the layer's count for this token, their
  offsets pointed at a zero block), which copies the ids, weights, expert input and masks to pinned memory and then
  the token's number; the GPU's rows are queued; the host spins until the number lands and computes the CPU's rows
  into pinned memory; the step's next part copies them in and mixes them into combine's fixed-order sum. With
  compute's `cpu_wait: host` (the default) a graph segment ends at each such layer and the host replays the next
  after the rows; with `cpu_wait: device` the step is one graph: that part begins with the GPU waiting for a flag
  the host writes after the rows (kernels/host_wait.py), so the host's work a MoE layer is one wait and the rows.
- layer by layer (`_token_cpu`: a sequence's first one-token step, or where no whole step runs): the ids come to the
  host, which picks the CPU's blocks, queues the plan's first part (pipeline/plan.py `TokenPlan.split`), computes
  its rows and queues the second.

How many: `cpu_share` of the blocks outside VRAM (a credit carried across layers, so a share of 0.25 sends one block
in four), or with `cpu_balance` the count that finishes both soonest from the measured rates: the CPU's seconds a
block and a call (its own timings: kernels/rates.py `CpuRate`) and a block's bytes over the host-to-device rate. In a
whole step the device picks each layer's count from a row made before the token (`cpu_counts`: the count for each
number of blocks outside VRAM) by the number this token has: under uniform routing a layer's number moves token to token
(3 to 6 of 6 at 8 GiB), which the count of the token before followed a token late. Every PROBE-th token with the
share gives the CPU one block more than the balance, so that the count next to the balance's stays timed as things are
now (a call's time depends on the PCIe reads beside it).

Which tokens (`cpu_choose`, balanced): a token replayed whole runs with the CPU's share only while the split saves more
than its turns cost (a wait on the device, or a segment's end), else the step captured without the CPU's share
replays (one capture each per sequence state); under skewed routing a layer has a block or two outside VRAM, which the
23 turns may outweigh.

`CpuSteps` is a part of `Table` (a mixin): it uses the table's rt, knobs, stream, tier, blocks, base, graphs, its `split` (the plan's) and
StreamedSteps' offsets and landing set.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from sluice.errors import SluiceError
from sluice.kernels.host_wait import wait_for_host
from sluice.stages.compute import cpu_experts
from sluice.stages.h2d import balance_cpu_blocks, cpu_rated
from sluice.stages.types import LayerInput

ALIGN = 4096  # a block's alignment in its bank (the kernels' offsets assume it)
TURN_S = 63e-6  # a segment's end at a MoE layer: the host's wait and the next replay (H100: BENCHMARKS.md, sixth set)
WAIT_S = 15e-6  # cpu_wait: device: the pack's copy to the host, its sight, the flag's read over PCIe (an estimate)
PROBE = 32  # tokens run whole without the CPU's share before one with it refreshes the layers' counts
IN_ORDER = platform.machine().lower() in ("x86_64", "amd64")  # stores seen in program order: the GPU that sees the
# flag sees the rows written before it (cpu_wait: device); elsewhere a fence would be needed: segments there


@dataclass(frozen=True)
class CpuTurn:
    """A MoE layer's CPU share in a whole step (pipeline/whole.py): `host` after the replay of the graph that queued the
    layer's first part (waits for its ids, computes the CPU's rows into pinned memory, raises the layer's flag),
    `finish` queues the rest (with `in_graph`, the GPU's wait for the flag first; their copy to the device, the mix,
    combine) -> h; `release` raises the flag without rows, so that a graph waiting on it ends (a failed host)."""

    host: Callable[[], None]
    finish: Callable[[], torch.Tensor]
    release: Callable[[], None]
    in_graph: bool  # the graph goes on past this turn (cpu_wait: device), else a segment ends before `finish`


@dataclass
class _LayerBuffers:
    """A MoE layer's buffers for the device split: what the device tells the host, and the CPU's rows back."""

    pack: torch.Tensor  # pinned fp32 [4K + Dx]: ids, weights, expert input, the CPU's mask, the mask of blocks outside VRAM
    seq: torch.Tensor  # pinned int64 [1]: the token's number, copied after the pack (the host's sign that it landed)
    y: torch.Tensor  # pinned [K, Dx] combine dtype: the CPU's rows
    y_dev: torch.Tensor  # [K, Dx] on the device: their copy, which the mix reads
    flag: torch.Tensor  # pinned int64 [1]: the token's number, written by the host after the rows (cpu_wait: device)
    x_dtype: torch.dtype


class CpuSteps:
    async def _token_cpu(self, li: LayerInput, i: int) -> torch.Tensor:
        """A one-token step with the CPU's share: ids to the host, the split, the GPU's part, the CPU's rows, the rest."""
        block, K = li.block, li.block.top_k
        rt, tracer, streams = self.rt, self.rt.tracer, self.rt.streams
        if i == 0:
            self.between_tokens()  # the tier's turn, before the host reads where blocks lie
        with tracer.span("route", layer=block.layer, stream=self.stream):
            with streams.use(self.stream):
                weights, ids, both = self._cpu_router(block)(li.x)
            host, arrived = streams.to_host(self.stream, both, reuse=("cpu share", i))
            await rt.ids_arrived(arrived)
        routed = host[0, :K].long().tolist()
        w, xe = host[0, K : 2 * K].clone(), host[0, 2 * K :].clone()  # the buffer is the next token's
        if self.knobs.cpu_balance and rt.cpu_rate.block_s is None:
            self._cpu_calibrate(block, xe)
        rt.stats.observe_routing(block.layer, tuple(routed))
        tier, landing, bb = self.tier, self._landing(), self.block_bytes
        slots = [tier.slot_of.get((i, e)) if (i, e) not in landing else None for e in routed]
        in_ram = [k for k, slot in enumerate(slots) if slot is None]
        self._cpu_outside[i] = len(in_ram)  # for the choice of the next tokens' steps (`cpu_choose`)
        cpu = in_ram[len(in_ram) - self._cpu_count(len(in_ram)) :]  # the lowest-ranked
        zero, ram = self._zero_offset(), self.blocks.off[i]
        offs_host, offs = self._offsets(i, K)
        offs_host.numpy()[:] = [zero if k in cpu else ram[e] if slot is None else slot * bb
                                for k, (e, slot) in enumerate(zip(routed, slots))]
        with streams.use(self.stream):
            offs.copy_(offs_host, non_blocking=True)
        finish = self.split(block, li.next_block, (li.x, li.residual), (weights, ids, offs), False)
        b = self._cpu_buffers(i, block, xe.shape[0], li.x)  # made here, before a whole step's capture needs them
        self.token_vram += K - len(in_ram)
        mask_host = streams.host_buffer(("cpu mask", i), torch.Size([K]), torch.bool)
        mask_host.zero_()
        if cpu:
            with tracer.span("compute:cpu", layer=block.layer, blocks=len(cpu)):  # a host span: the CPU's share in the trace
                self._cpu_rows(block, [routed[k] for k in cpu], xe, w[cpu], li.x.dtype, b.y, cpu)
            mask_host[cpu] = True
        with streams.use(self.stream):
            b.y_dev.copy_(b.y, non_blocking=True)
            return finish(b.y_dev, mask_host.to(li.x.device, non_blocking=True))

    def cpu_kernels(self, block) -> tuple:
        """The CPU's expert kernels for `block`'s kind (compute's cpu_threads, cpu_compile, cpu_int8), and whether this
        call made them (its first use builds them: not a rate)."""
        k = self.knobs
        first = (block.kind, block.act_name) not in self._cpu
        return cpu_experts(self._cpu, self.rt, block, k.cpu_threads, k.cpu_compile, k.cpu_int8), first

    def _cpu_rows(self, block, experts: list[int], xe: torch.Tensor, w: torch.Tensor, x_dtype: torch.dtype, y: torch.Tensor,
                  rows: list[int]) -> None:
        """The CPU's experts on xe [Dx] fp32 from their RAM slots, each output rounded to x_dtype and weighted
        as the GPU's kernels do, into y's `rows`; the time a block feeds the CPU's rate (`cpu_balance`)."""
        rt = self.rt
        kernels, first = self.cpu_kernels(block)
        t = time.perf_counter()
        kernels.weighed_rows([self.blocks.entries[(block.layer, e)].buf for e in experts], xe, w, x_dtype, y, rows)
        rt.stats.cpu_blocks += len(experts)
        if not first:  # the first call compiles the kernels: not a rate
            rt.cpu_rate.observe(len(experts), time.perf_counter() - t)
            self._cpu_retimed = self._cpu_retimed or self._cpu_forced  # `cpu_counts` gave it these to time it

    def _cpu_calibrate(self, block, xe: torch.Tensor, n: int = 4, runs: int = 3) -> None:
        """The CPU's rate before any step has timed it (`cpu_balance`): the best of a few calls over one and over n of
        the layer's blocks (a call's overhead and a block's seconds), after one that compiles the kernels. Without it
        a first slow call would leave the CPU no blocks, and so no later timing to correct it."""
        kernels, _ = self.cpu_kernels(block)
        held = (self.blocks.resident(block.layer, e) for e in range(self.num_experts))  # hold: false holds some
        bufs = [entry.buf for entry in held if entry is not None][:n]
        if not bufs:
            return
        kernels.run_many(bufs, xe)
        for some in {1: bufs[:1], len(bufs): bufs}.values():
            best = float("inf")
            for _ in range(runs):
                t = time.perf_counter()
                kernels.run_many(some, xe)
                best = min(best, time.perf_counter() - t)
            self.rt.cpu_rate.give(len(some), best)

    def cpu_choose(self) -> bool:
        """Before a token replayed whole: whether it runs with the CPU's share (`cpu_now`) or without it. With
        `cpu_balance`, with it only while the blocks each layer had outside VRAM at its last step with the share, split
        by the measured rates, save more than its turns cost (a wait on the device or a segment's end; skewed routing
        leaves a layer a block or two, which the turns may outweigh); the share is tried again every PROBE tokens,
        which refreshes those counts. A fixed share, or rates or counts not yet measured: with it."""
        if not self.cpu_share or not self._balanced() or not self._cpu_outside:
            self.cpu_now = bool(self.cpu_share)
            return self.cpu_now
        tg, rate = self.copy_s(), self.rt.cpu_rate
        saved, given = 0.0, 0
        for n in self._cpu_outside.values():
            c = balance_cpu_blocks(n, tg, rate.block_s, rate.call_s)
            saved += n * tg - max(rate.seconds(c), (n - c) * tg)
            given += c
        # a rate that gives the CPU nothing is re-timed once at once (`cpu_counts`), not first at the next probe
        stale = not given and not self._cpu_retimed and max(self._cpu_outside.values()) >= 2
        pays = saved > (WAIT_S if self._waits_on_device() else TURN_S) * len(self.layers) or stale
        self._cpu_plain = 0 if pays or self._cpu_plain >= PROBE else self._cpu_plain + 1
        self.cpu_now = self._cpu_plain == 0
        return self.cpu_now

    def copy_s(self) -> float:
        """A block's seconds over PCIe at the measured host-to-device rate."""
        return self.block_bytes / self.rt.h2d_rate()

    def prompt_rates(self, block, dx: int) -> tuple[float, float, float] | None:
        """The CPU's (seconds a block's first row, seconds a call, seconds each next row) over a prompt's (block, row)
        pairs (h2d's `prompt_cpu: -1`): as timed in prompts (compute's `beside_cpu`: kernels/rates.py PairRate), else a
        one-token call's seconds a block for every row (a row that reads its block from RAM; calibrated on zeros once
        where nothing timed it); None off a GPU (no PCIe to balance against)."""
        rt = self.rt
        if rt.device.type != "cuda" or self.backend != "triton":
            return None
        if (parts := self.prompt_rate.parts()) is not None:
            return parts
        if rt.cpu_rate.block_s is None:
            self._cpu_calibrate(block, torch.zeros(dx))
        block_s = rt.cpu_rate.block_s
        return (block_s, rt.cpu_rate.call_s, block_s) if block_s is not None else None

    def _waits_on_device(self) -> bool:
        """Whether a whole step's CPU turns are waits on the device (`cpu_wait: device`, on CUDA, stores in order), not
        segments' ends."""
        return self.knobs.cpu_wait == "device" and self.rt.device.type == "cuda" and IN_ORDER

    def _balanced(self) -> bool:
        """Whether the CPU's counts follow the measured rates (`cpu_balance`, once its rate is timed, on CUDA)."""
        return self.knobs.cpu_balance and cpu_rated(self.rt)

    def _cpu_count(self, outside: int) -> int:
        """How many of a step's `outside` blocks (not in VRAM) the CPU computes."""
        k, rt = self.knobs, self.rt
        if self._balanced():
            return balance_cpu_blocks(outside, self.copy_s(), rt.cpu_rate.block_s, rt.cpu_rate.call_s)
        self._cpu_credit += k.cpu_share * outside
        n = min(outside, int(self._cpu_credit + 1e-9))
        self._cpu_credit -= n
        return n

    def _cpu_router(self, block):
        """x -> (weights, ids, [1, 2K + Dx] fp32: the ids, weights and expert input, for one copy to the host), replayed
        as a graph where graphs are on."""
        router = self._routers.get(("cpu", block.layer))
        if router is None:
            def route(x):
                weights, ids = block.router(x)
                return weights, ids, torch.cat((ids.float(), weights.float(), block.expert_input(x).float()), dim=1)

            graphed = self.graphs is not None and block.graph_safe
            router = self._routers[("cpu", block.layer)] = self.graphs.wrap(route, f"router+xe:{block.layer}") if graphed else route
        return router

    def _zero_offset(self) -> int:
        """The offset from the kernels' base of a zero block on the device, which the GPU reads in place of the CPU's
        blocks: its rows come out zero whatever the format (zero weights and scales)."""
        if self._zero is None:
            pad = torch.zeros(self.block_bytes + ALIGN, dtype=torch.uint8, device=self.rt.device)
            self._zero = (pad, (-pad.data_ptr()) % ALIGN)
        pad, at = self._zero
        return pad.data_ptr() + at - self.base.data_ptr()

    # -- the split made on the device (a whole step) --------------------------------------------------------------------

    def cpu_split(self, v: dict, t) -> None:
        """In a step's fetch part: the CPU takes the lowest-ranked routed blocks outside VRAM, as many as the layer's row
        of counts (`cpu_token_begins`) gives for the number outside VRAM; their offsets point at the zero block; the
        ids, weights, expert input and masks go to pinned memory, then the token's number (the host waits for it:
        `cpu_turn`)."""
        i, ids = t.i, v["ids"][0]
        ram = 1 - self.tier.in_vram[i][ids]
        later = ram.flip(0).cumsum(0).flip(0)  # blocks outside VRAM from each rank on (later[0]: all of them)
        cpu = (ram > 0) & (later <= self._cpu_dev[0][i].gather(0, later[:1]))
        v["offs"] = torch.where(cpu, self._cpu_dev[2], v["offs"])
        v["cpu_mask"] = cpu
        b = self._cpu_buffers(i, t.block, v["xe"].shape[1], v["x"])
        b.pack.copy_(torch.cat((ids.float(), v["weights"][0].float(), v["xe"][0].float(), cpu.float(), ram.float())),
                     non_blocking=True)
        b.seq.copy_(self._cpu_dev[1], non_blocking=True)

    def cpu_turn(self, block, i: int, mix: Callable) -> CpuTurn:
        """The host's part of MoE index i's device split this token, and the mix: mix(cpu_y on the device) -> h."""
        b, K = self._cpu_bufs[i], block.top_k
        in_graph = self._waits_on_device()

        def release() -> None:
            b.flag.numpy()[0] = self._cpu_seq

        def host() -> None:  # at every replay: this token's number; read through numpy (a torch op on a small CPU
            # tensor costs microseconds of dispatch, and this runs at every MoE layer of the token)
            self._await_seq(b.seq, self._cpu_seq)
            pack = b.pack.numpy()
            rows = np.flatnonzero(pack[-2 * K : -K] > 0.5).tolist()
            self._cpu_outside[i] = int(np.count_nonzero(pack[-K:] > 0.5))  # for the next token's count
            if rows:  # xe is read in place: the next token's copy into the pack comes after the next replay
                w = torch.from_numpy(pack[K : 2 * K][rows])
                with self.rt.tracer.span("compute:cpu", layer=block.layer, blocks=len(rows)):  # a host span: the CPU's share
                    self._cpu_rows(block, pack[:K][rows].astype(np.int64).tolist(), torch.from_numpy(pack[2 * K : -2 * K]),
                                   w, b.x_dtype, b.y, rows)
            release()  # after the rows: stores in order (IN_ORDER), so the GPU that sees the flag sees them

        def finish() -> torch.Tensor:
            if in_graph:
                wait_for_host(b.flag, self._cpu_dev[1], self._cpu_gave_up[0], pause_ns=self.knobs.cpu_poll_ns)
            b.y_dev.copy_(b.y, non_blocking=True)
            return mix(b.y_dev)
        return CpuTurn(host, finish, release, in_graph)

    def cpu_token_begins(self) -> None:
        """Before a token's first MoE layer, once a step has split on the device: each layer's row of counts for the
        device split (`cpu_counts`), and the token's number."""
        if not self._cpu_bufs:
            return
        gave_up, seen = self._cpu_gave_up
        if seen[0]:  # copied at an earlier token's start, landed before that token's packs
            raise SluiceError("the GPU stopped waiting for the CPU's rows of a MoE layer (no flag from the host in "
                              "minutes): the tokens since then are not the model's")
        seen.copy_(gave_up, non_blocking=True)
        K = self.rt.store.manifest.top_k
        counts = self.rt.streams.host_buffer(("cpu counts",), torch.Size([len(self.layers), K + 1]), torch.int64)
        counts.numpy()[:] = self.cpu_counts(K)
        self._cpu_seq += 1
        counts_dev, seq_dev, _ = self._cpu_dev
        counts_dev.copy_(counts, non_blocking=True)
        seq_dev.fill_(self._cpu_seq)

    def cpu_counts(self, K: int) -> list[list[int]]:
        """Each MoE layer's row of CPU counts for this token, its entry n the count where n of its K routed blocks are
        outside VRAM. Balanced, every layer's row is the balance's (`_cpu_count`). Where that gives the CPU none at the
        numbers the layers had at their last step with the share (K where none yet), its rate may be stale (one slow
        first timing, and a CPU given no blocks is never timed again): two wherever two or more are outside, which
        re-times it (each layer's call feeds its rate). Every PROBE-th token with the share, one block more than that
        wherever there is one: a count the balance stopped giving (its figure slowed by the RAM's other readers at the
        time) is timed again as things are now. A fixed share: the layer's count from its last number (a credit carried
        across layers), at most the blocks outside."""
        outside = [self._cpu_outside.get(i, K) for i in range(len(self.layers))]
        if not self._balanced():
            self._cpu_forced = False
            return [[min(n, c) for n in range(K + 1)] for c in [self._cpu_count(n) for n in outside]]
        row = [self._cpu_count(n) for n in range(K + 1)]
        self._cpu_forced = not any(row[n] for n in outside)
        if self._cpu_forced:
            row = [2 if n >= 2 else 0 for n in range(K + 1)]
        self._cpu_probe = (self._cpu_probe + 1) % PROBE
        if not self._cpu_probe:
            row = [min(n, c + 1) for n, c in enumerate(row)]
        return [row] * len(self.layers)

    def _cpu_buffers(self, i: int, block, dx: int, x: torch.Tensor) -> _LayerBuffers:
        """MoE index i's buffers for the device split (made by a sequence's first, layer-by-layer step: pinned memory
        cannot be allocated while a graph captures)."""
        b = self._cpu_bufs.get(i)
        if b is None:
            K, streams = block.top_k, self.rt.streams
            b = self._cpu_bufs[i] = _LayerBuffers(
                streams.host_buffer(("cpu pack", i), torch.Size([4 * K + dx]), torch.float32),
                streams.host_buffer(("cpu seq", i), torch.Size([1]), torch.int64),
                streams.host_buffer(("cpu rows", i), torch.Size([K, dx]), block.combine_dtype),
                torch.empty(K, dx, dtype=block.combine_dtype, device=x.device),
                streams.host_buffer(("cpu flag", i), torch.Size([1]), torch.int64).zero_(), x.dtype)
            if self._cpu_gave_up is None:
                self._cpu_gave_up = (torch.zeros(1, dtype=torch.int32, device=x.device),
                                     streams.host_buffer(("cpu gave up",), torch.Size([1]), torch.int32).zero_())
            if self._waits_on_device():  # compiled now (0 >= 0: no wait), not in a graph's capture
                wait_for_host(b.flag, torch.zeros(1, dtype=torch.int64, device=x.device), self._cpu_gave_up[0],
                              pause_ns=self.knobs.cpu_poll_ns)
        return b

    def _await_seq(self, seq: torch.Tensor, value: int) -> None:
        """Spin until the device's copy of the token's number has landed (its pack came before it, in stream order)."""
        got, t = seq.numpy(), time.perf_counter()
        while got[0] != value:
            if time.perf_counter() - t > 60:
                raise SluiceError(f"a whole step's MoE ids did not reach the host in 60 s (token {value})")
        self.rt.stats.ids_wait_s += time.perf_counter() - t
