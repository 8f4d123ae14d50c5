"""The memory pools of the CUDA graphs one engine captures: one per stream, shared by all of that stream's graphs.

A graph's temporaries are dead once its replay ends, and replays on one stream never overlap, so graphs may reuse
each other's temporary memory (a pool per graph costs ~12 MB: a full Nemotron-3-Nano's graphs then outgrow an 8 GiB
budget). What must outlive a replay (outputs that later work reads) is copied inside the graph into buffers allocated
outside the pool; an output read only before the stream's next replay may stay in the pool.
"""

from __future__ import annotations

from typing import Any

import torch


class GraphPools:
    """Invariant: one pool per (device, stream), alive as long as this object (a one-op graph keeps each: a pool whose
    last graph is freed cannot be used again). Owned by the engine's Runtime; every capture of that engine uses it."""

    def __init__(self) -> None:
        self._pools: dict[tuple, tuple[Any, torch.cuda.CUDAGraph]] = {}

    def current(self) -> Any:
        """The pool for graphs captured on the current stream."""
        s = torch.cuda.current_stream()
        key = (s.device, s.cuda_stream)
        found = self._pools.get(key)
        if found is None:
            pool, keeper = torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(keeper, pool=pool, capture_error_mode="thread_local"):
                torch.zeros(1, device=s.device)
            found = self._pools[key] = (pool, keeper)
        return found[0]
