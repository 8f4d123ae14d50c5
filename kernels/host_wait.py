"""The GPU waits, inside a stream (and so inside a captured CUDA graph), for a number the host writes to pinned memory.

A whole step with the CPU's share (stages/table_cpu.py) used to end a graph segment at each MoE layer, the host
replaying the next segment once the CPU's rows were in pinned memory: a launch, and the GPU idle until it, at every
MoE layer. With this kernel the step stays one graph: the launch that reads the CPU's rows first spins on the layer's
flag (a pinned word the host writes after the rows), so the GPU goes on ~a PCIe read after the host's write.

Order: the host writes the rows, then the flag (x86 keeps stores in order: stages/table_cpu.py waits so on x86-64
hosts only); the kernel's volatile loads read the flag over PCIe each time; the copy of the rows is queued after the
kernel. A flag never written (a host that died without raising it) ends the wait after `limit` loads (~1 us each over
PCIe: minutes, past the host's own 60-s wait for the GPU) and sets `gave_up`, which stays set for the host to see
(the rows the GPU then read are not this token's). `wait_for_host_ref` is the plain form: the same test, on the host.
A pause between loads (`pause_ns`, compute's `cpu_poll_ns`; `nanosleep`, CUDA only) spaces the reads out, in case a
tight poll slows the host's own work (on the one host that timed it, it did not: BENCHMARKS.md, fourteenth set).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LIMIT = 1 << 28  # loads before the wait gives up: a few minutes at ~1 us a load over PCIe


@triton.jit
def _wait_kernel(flag, want, gave_up, limit, pause, PAUSE: tl.constexpr):
    target = tl.load(want)
    seen = tl.load(flag, volatile=True)
    n = 0
    while (seen < target) & (n < limit):
        if PAUSE:  # the warp sleeps ~`pause` ns (not pure: kept in the loop)
            tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.u32 $0, $1;", "=r,r", [pause], dtype=tl.int32, is_pure=False,
                                      pack=1)
        seen = tl.load(flag, volatile=True)
        n += 1
    tl.store(gave_up, 1, mask=seen < target)  # set only: a later wait that ends in time leaves it for the host to see


def wait_for_host(flag: torch.Tensor, want: torch.Tensor, gave_up: torch.Tensor, limit: int = LIMIT, pause_ns: int = 0) -> None:
    """Queue on the current stream a wait until flag [1] int64 (pinned host memory) >= want [1] int64 (on the device);
    gave_up [1] int32 (on the device) is set to 1 where `limit` loads passed first (and left as it was otherwise);
    pause_ns between loads on CUDA (the limit's loads fewer by as much: the same minutes)."""
    pause = pause_ns if want.device.type == "cuda" else 0
    _wait_kernel[(1,)](flag, want, gave_up, max(1, limit * 1000 // (1000 + pause)), pause, PAUSE=pause > 0, num_warps=1)


def wait_for_host_ref(flag: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether the wait is over: the host's number has reached the wanted one."""
    return int(flag[0]) >= int(want[0])
