"""compute, `via: table`: a one-token step's routed experts, each block read where the fetch stage found it.

One launch of the decode kernels (kernels/decode.py) over the K routed blocks at their byte offsets from the table's
base (VRAM slots, staging slots, or pinned RAM read over PCIe), each row weighted and summed over k in rank order in
the down kernel's tail (on the step's stream, before the side stream's join; the order of the streaming combine's
`ordered_sum`; combine finishes). A prompt's experts run group by group as their blocks land (`group`: the grouped GEMM over blocks
wherever they lie), or through the plain-torch reference (`reference`, the torch backend); combine sums those.
`routed: false` skips the routed experts (and loading their blocks at open): a zero routed sum, outputs that are not
the model's, to time the resident part alone (schedules/resident-alone.yaml). With `cpu_share` the CPU computes part
of a one-token step's blocks outside VRAM (stages/table_cpu.py): the GPU's rows stay unsummed for combine. With h2d's
`prompt_cpu` a prompt's blocks of few rows are computed by the CPU on a worker thread beside the GPU's groups
(`beside_cpu`), a block's rows one after another so that it is read from RAM once.
"""

from __future__ import annotations

import contextlib
import re
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from sluice.errors import ScheduleError
from sluice.log import get_logger
from sluice.kernels.down import ordered_sum
from sluice.stages.base import Stage
from sluice.stages.compute import check_fp4_matvec, torch_expert
from sluice.stages.route import group_by_expert


@dataclass(frozen=True)
class ComputeTableKnobs:
    backend: str = "auto"  # auto (triton on CUDA, torch on a CPU) | triton | torch
    zero_skip: bool = False  # ReLU^2 down reads only live 16-neuron groups
    graphs: bool = True  # a one-token layer step replays one CUDA graph (CUDA, triton backend)
    fp4_matvec: str = "auto"  # one-token NVFP4 / FP8 formulation: f16x2 | words | auto (stages/compute.py fp4_formulation)
    routed: bool = True  # false: skip the routed experts (times the resident part alone; outputs are not the model's)
    host_hint: bool = False  # with a VRAM tier: one-token steps' re-laid down kernel declares rows 16-byte aligned: wider
    # zero-copy loads for the blocks it reads from RAM (`sluice bench kernels --mixed`), but on a GPU FP4 / FP8 partial
    # sums then add in another order, so outputs are no longer bit-identical to the streaming schedules'

    batch_rows: str = "device"  # a batched step's decode rows (pipeline/batch.py): device (one pass a layer over the
    # union of their experts, grouped on the GPU: no host wait) | host (routed on the host, as a prompt's rows)
    rows_tile: str = "auto"  # a batched step's grouped GEMMs' tiles over its decode rows: BNxBKxWARPS (e.g. 64x128x4) |
    # auto (the format's prompt tiles: FP4 128x128x8); `sluice bench kernels --rows` times them from pinned RAM
    cpu_share: float = 0.0  # fraction of a one-token step's blocks outside VRAM that the CPU computes from their RAM
    # slots while the GPU reads the rest (the ids come to the host: one wait a MoE layer; stages/table_cpu.py)
    cpu_balance: bool = False  # the CPU's count follows the measured CPU and PCIe rates (cpu_share until measured)
    cpu_wait: str = "host"  # a whole step with the CPU's share: host (a graph segment a MoE layer, replayed by the host)
    # | device (one graph; the GPU waits at each MoE layer for a flag the host writes after its rows: kernels/host_wait.py);
    # the two within their spread run to run (BENCHMARKS.md, fourteenth set)
    cpu_poll_ns: int = 0  # cpu_wait: device: the GPU's pause between reads of the host's flag (0: reads back to back)
    cpu_threads: int = 0  # the CPU experts' native threads; 0: all cores but two
    cpu_compile: bool = True  # the CPU experts without a native kernel through torch.compile (else eager torch ops)
    cpu_int8: bool = False  # the CPU's FP4 experts with activations rounded to int8 per scale group (stages/compute.py)

    def __post_init__(self):
        check_fp4_matvec("compute", self.fp4_matvec)
        if self.batch_rows not in ("device", "host"):
            raise ScheduleError(f"stage 'compute': 'batch_rows' must be device or host, got {self.batch_rows!r}")
        if self.rows_tile != "auto" and not _tile_ok(self.rows_tile):
            raise ScheduleError(f"stage 'compute': 'rows_tile' must be auto or BNxBKxWARPS, BN and BK powers of two from 32 "
                                f"to 512, WARPS 1, 2, 4, 8 or 16 (e.g. 64x128x4), got {self.rows_tile!r}")
        if self.cpu_wait not in ("device", "host"):
            raise ScheduleError(f"stage 'compute': 'cpu_wait' must be device or host, got {self.cpu_wait!r}")
        if self.cpu_poll_ns > 100_000:  # a longer sleep is a stall of the GPU, no pause
            raise ScheduleError(f"stage 'compute': 'cpu_poll_ns' must be at most 100000, got {self.cpu_poll_ns!r}")
        if not 0.0 <= self.cpu_share <= 1.0:
            raise ScheduleError(f"stage 'compute': 'cpu_share' must be between 0 and 1, got {self.cpu_share!r}")


def _tile_ok(tile: str) -> bool:
    """BNxBKxWARPS that the grouped GEMMs compile: BN and BK powers of two in [32, 512] (an FP4 K tile decodes 32-value
    words), warps a power of two up to 16."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", tile)
    pow2 = lambda n, lo, hi: lo <= n <= hi and n & (n - 1) == 0  # noqa: E731
    return m is not None and pow2(int(m[1]), 32, 512) and pow2(int(m[2]), 32, 512) and pow2(int(m[3]), 1, 16)


class ComputeTable(Stage):
    name = "compute"
    via = "table"
    consumes = ("layer", "routing", "device_blocks")
    produces = "expert_outputs"
    Knobs = ComputeTableKnobs

    @classmethod
    def needs(cls, k: ComputeTableKnobs) -> dict:
        return {} if k.routed else {"ram": "one"}  # no routed experts: one RAM slot will do

    def __init__(self, knobs, stream, rt):
        super().__init__(knobs, stream, rt)
        self._worker: ThreadPoolExecutor | None = None  # prompt_cpu: the thread the CPU's blocks run on (`beside_cpu`)

    def launch(self, t):
        table, block, part = self.table, t.block, t.part
        if not self.knobs.routed:
            def zero(v):  # the resident part alone: a zero routed sum of the experts' output width
                v["routed"] = torch.zeros_like(v["xe"])
            return zero
        kern, base, zero_skip = table.kernel(block), table.base, self.knobs.zero_skip
        host = True if self.knobs.host_hint and table.tier.vram is not None else None  # blocks outside VRAM: pinned RAM
        if t.rows > 1:
            tile = (0, 0, 0) if self.knobs.rows_tile == "auto" else tuple(int(n) for n in self.knobs.rows_tile.split("x"))

            def rows(v):
                with part("compute"):  # y in the order the host path's combine sums it: each row's K in rank order
                    T, K = v["ids"].shape
                    y = torch.empty(T * K, v["xe"].shape[1], dtype=block.combine_dtype, device=v["xe"].device)
                    kern.run_rows(base, v["offs"], v["ids"], v["per_expert"], v["xe"], v["weights"], y, tile)
                    v["routed"] = ordered_sum(y.view(T, K, -1), v["x"].dtype)
            return rows

        if t.cpu:
            def beside_cpu(v):  # the CPU's blocks read as a zero block (the host's offsets): their rows are its
                with part("compute"):
                    offs = v["offs"]
                    v["y"] = kern._decode(base, offs, base, offs, v["xe"][0], v["weights"][0], block.combine_dtype, zero_skip,
                                          host)  # [K, Dx]: row k weighted, combine sums them with the CPU's
            return beside_cpu

        def experts(v):
            with part("compute"):  # and the fixed-order sum over the top-k, before the side stream's join
                offs = v["offs"]
                v["routed"] = kern._decode(base, offs, base, offs, v["xe"][0], v["weights"][0], block.combine_dtype,
                                           zero_skip, host, summed=True)  # [1, Dx]: rows k = 0..K-1 summed in order
        return experts

    def tally(self, t) -> None:
        if self.knobs.routed and t.rows == 1:  # a batched step's blocks are counted on the device (fetch)
            self.table.token_blocks += t.block.top_k
            self.table.kernel(t.block).count_groups(t.block.top_k)

    # -- a step whose ids come to the host (a prompt) ---------------------------------------------------------------

    def group(self, v: dict, experts: list[int]) -> None:
        """The grouped GEMM (kernels/prefill.py) of the next `experts` in place order, their blocks at the next
        offsets of `offs` and their rows the next slice of the sorted rows, weighted into y."""
        table, at, counts, kern = self.table, v["at"], v["counts"], self.table.kernel(v["li"].block)
        n, c, base = len(experts), [counts[e] for e in experts], table.base
        if v["xe"].shape[0] > 1:  # a prompt: the layer's groups planned once (one copy of their tiles), two launches each
            if "planned" not in v:
                v["planned"] = kern.plan_groups([[counts[e] for e in g] for g in (v["in_vram"], v["ahead"], *v["groups"]) if g],
                                                v["rows"], v["li"].block.top_k, v["xe"], v["w"])
            kern.run_group(v["planned"], at[2], base, v["offs"], base, v["offs"], v["xe"], v["y"])
            if at[2] + 1 == len(v["planned"].spans):  # the last group queued: its buffers go back before combine's
                del v["planned"]
        else:
            offs = v["offs"][at[0] : at[0] + n]
            kern.run(base, offs, base, offs, c, v["rows"][at[1] : at[1] + sum(c)], v["li"].block.top_k, v["xe"], v["w"],
                     v["y"], self.knobs.zero_skip)
        at[0] += n
        at[1] += sum(c)
        at[2] += 1

    @contextlib.contextmanager
    def beside_cpu(self, v: dict):
        """A prompt step's CPU blocks (h2d's `prompt_cpu`: `cpu`, their rows `cpu_pairs`) computed from their RAM slots on
        a worker thread (one native call, a block's rows side by side) while the step's GPU work is queued inside; their
        rows copied into y on leaving. The worker is joined on the way out however the step ends: its blocks go back to
        the RAM cache only after it."""
        if not v.get("cpu"):
            yield
            return
        table, rt, li = self.table, self.rt, v["li"]
        block, pairs, dev = li.block, v["cpu_pairs"], v["xe"].device
        kernels, first = table.cpu_kernels(block)
        rows = v["rows"][v["rows"].shape[0] - len(pairs):]  # on the device already: the sorted rows' tail (h2d's plan)
        on_dev = torch.cat((v["xe"].index_select(0, rows // block.top_k).float(),
                            v["w"].index_select(0, rows).float()[:, None]), 1)
        cuda = dev.type == "cuda"
        inputs = torch.empty(on_dev.shape, dtype=on_dev.dtype, pin_memory=cuda).copy_(on_dev, non_blocking=cuda)
        arrived = rt.streams.record(table.stream)  # the worker waits for it, not the host (None on a CPU)
        blocks = [table.blocks.entries[(block.layer, e)].buf for e in v["flat"][pairs].tolist()]
        out = torch.empty(len(pairs), on_dev.shape[1] - 1, dtype=v["y"].dtype, pin_memory=cuda)

        def work() -> float:
            if arrived is not None:
                arrived.synchronize()
            t = time.perf_counter()
            x, w = inputs[:, :-1].contiguous(), inputs[:, -1].contiguous()
            kernels.weighed_pairs(blocks, x, w, li.x.dtype, out, list(range(len(pairs))))
            return time.perf_counter() - t

        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="sluice-prompt-cpu")
        job = self._worker.submit(work)
        try:
            yield
            with rt.tracer.span("compute:cpu", layer=block.layer, blocks=len(v["cpu"]), rows=len(pairs)):  # the host's wait
                seconds = job.result()
        except BaseException as e:
            wait([job])  # joined however the step ends: its blocks go back to the RAM cache only after it
            if job.exception() not in (None, e):  # the step failed first: the worker's own error is not lost
                get_logger().warning("a prompt step's CPU rows failed too", error=str(job.exception())[:200])
            raise
        with rt.streams.use(table.stream):
            v["y"].index_copy_(0, rows, out.to(dev, non_blocking=True))
        rt.stats.cpu_blocks += len(v["cpu"])
        rt.stats.cpu_prompt_s += seconds
        if not first:
            table.prompt_rate.observe(len(v["cpu"]), len(pairs), seconds)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
            self._worker = None

    def reference(self, v: dict) -> None:
        """The plain-torch reference path (the torch backend), each expert from its RAM slot."""
        table, block, store = self.table, v["li"].block, self.rt.store
        experts, rows = group_by_expert(v["ids_cpu"].long(), v["li"].x.device)
        for e in experts:
            torch_expert(store, block, store.logical(table.blocks.entries[(block.layer, e)].buf), rows[e], v["xe"], v["w"],
                         v["y"])
