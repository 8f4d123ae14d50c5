"""The GPU waits, inside a stream (and so inside a captured CUDA graph), for a number the host writes to pinned memory.

A whole step with the CPU's share (stages/table_cpu.py) used to end a graph segment at each MoE layer, the host
replaying the next segment once the CPU's rows were in pinned memory: a launch, and the GPU idle until it, at every
MoE layer. With this kernel the step stays one graph: the launch that reads the CPU's rows first spins on the layer's
flag (a pinned word the host writes after the rows), so the GPU goes on ~a PCIe read after the host's write.

Order: the host writes the rows, then the flag (x86 keeps stores in order); the kernel's volatile loads read the flag
over PCIe each time; the copy of the rows is queued after the kernel. A flag never written (a host that failed) ends
the wait after `limit` loads (~1 us each over PCIe) with `timed_out` set, so no graph spins for good.
`wait_for_host_ref` is the plain form: the same test of flag against the wanted number, on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LIMIT = 1 << 26  # loads before the wait gives up: ~1 minute at ~1 us a load over PCIe


@triton.jit
def _wait_kernel(flag, want, timed_out, limit):
    target = tl.load(want)
    seen = tl.load(flag, volatile=True)
    n = 0
    while (seen < target) & (n < limit):
        seen = tl.load(flag, volatile=True)
        n += 1
    tl.store(timed_out, (seen < target).to(tl.int32))


def wait_for_host(flag: torch.Tensor, want: torch.Tensor, timed_out: torch.Tensor, limit: int = LIMIT) -> None:
    """Queue on the current stream a wait until flag [1] int64 (pinned host memory) >= want [1] int64 (on the device);
    timed_out [1] int32 (on the device) is set to 1 where `limit` loads passed first, else 0."""
    _wait_kernel[(1,)](flag, want, timed_out, limit, num_warps=1)


def wait_for_host_ref(flag: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether the wait is over: the host's number has reached the wanted one."""
    return int(flag[0]) >= int(want[0])
