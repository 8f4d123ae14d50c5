"""Named CUDA streams and events; on a CPU every call is a no-op and work runs inline.

Stages name the stream they enqueue on ("compute" or "copy", from the schedule). Anything
produced on one stream and consumed on another travels with the event recorded after it, and the
consumer's stream waits on that event: ordering lives on the GPU, the host never blocks for it. Values
the host needs (routed ids) come back through pinned memory and an event (`to_host`, `arrived`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from typing import Any

import torch

STREAM_NAMES = ("compute", "copy")
YIELDS = 4  # loop turns `arrived` gives the other ready stages before it blocks


class Streams:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._local = threading.local()  # .current: the named stream `use` made current in this thread
        self._check = os.environ.get("SLUICE_CHECK_STREAMS") == "1"
        self._host: dict[Any, torch.Tensor] = {}  # `host_buffer`'s tensors
        if self.cuda:
            self._streams = {"compute": torch.cuda.current_stream(device), "copy": torch.cuda.Stream(device)}
            self._capturing = torch.cuda.Stream(device)  # stands for the compute stream while a graph captures (`capture`)
        else:
            self._streams = {}

    def get(self, name: str) -> Any:
        return self._streams.get(name)

    def use(self, name: str):
        """Context that makes `name` the current stream (no-op on CPU, and where `name` is current already).

        Which named stream is current is kept here, per thread, from these contexts alone: entering
        torch.cuda.stream(...) costs tens of microseconds of host time, and a one-token step enters
        several per layer. So code inside a raw `torch.cuda.stream` block or a graph capture must not call
        `use` (or `to_host`), and a `use` block must not span an `await` (another task would see its stream).
        SLUICE_CHECK_STREAMS=1 (the tests set it) checks each skipped switch against the real current stream."""
        s = self._streams.get(name)
        if s is None:
            return contextlib.nullcontext()
        if getattr(self._local, "current", "compute") == name:
            if self._check and torch.cuda.current_stream(self.device) != s:
                raise RuntimeError(f"Streams.use({name!r}): another stream is current (a raw torch.cuda.stream block or a "
                                   "capture around this call)")
            return contextlib.nullcontext()
        return self._switch(name, s)

    @contextlib.contextmanager
    def _switch(self, name: str, s):
        before = getattr(self._local, "current", "compute")
        with torch.cuda.stream(s):
            self._local.current = name
            try:
                yield
            finally:
                self._local.current = before

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any):
        """Capture into `graph` what is queued on the compute stream meanwhile (`pool`: the graph's memory pool). The
        compute stream is the device's default stream, which cannot be captured: a private stream stands for it under
        its name until the capture ends, after the work already queued there; replays run on the current stream."""
        compute, s = self._streams["compute"], self._capturing
        s.wait_stream(compute)
        self._streams["compute"] = s
        try:
            with torch.cuda.graph(graph, pool=pool, stream=s, capture_error_mode="thread_local"):
                yield
        finally:
            self._streams["compute"] = compute

    def capture_pool(self, pools: Any) -> Any:
        """The memory pool of the graphs `capture` makes (kernels/graphs.py GraphPools: one per capturing stream)."""
        with torch.cuda.stream(self._capturing):
            return pools.current()

    def record(self, name: str, timing: bool = False) -> Any:
        """An event recorded now on stream `name`; None on CPU. `timing` for trace events."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(self._streams[name])
        return ev

    def wait(self, name: str, event: Any) -> None:
        """Make stream `name` wait for `event` (GPU-side; the host does not block)."""
        if event is not None and self.cuda:
            self._streams[name].wait_event(event)

    def host_buffer(self, key: Any, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor kept for `key` (pinned on CUDA), for values a one-token step sends or brings back (`to_host`'s
        `reuse`): allocating pinned memory costs host time each step. The same tensor is handed out again at the next
        call with this key, so its user must be done with it by then; the users key theirs by MoE layer, and a layer's
        one-token step reads what came back before it returns, and is queued only after the previous token's step
        of that layer, whose copies, in stream order, came before."""
        t = self._host.get(key)
        if t is None or t.shape != shape or t.dtype != dtype:
            t = self._host[key] = torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
        return t

    def to_host(self, name: str, t: torch.Tensor, reuse: Any = None) -> tuple[torch.Tensor, Any]:
        """Start copying device tensor t to pinned host memory on stream `name` (into `host_buffer(reuse, ...)` where
        `reuse` names one, else a new tensor); (host tensor, event after the copy). The host tensor is valid once
        `arrived(event)` has returned. On a CPU: (t, None)."""
        if not self.cuda:
            return t, None
        if reuse is not None:
            host = self.host_buffer(reuse, t.shape, t.dtype)
        else:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with self.use(name):
            host.copy_(t, non_blocking=True)
        return host, self.record(name)

    async def arrived(self, event: Any) -> None:
        """Wait for `event`, first letting the event loop run the other stages that are ready (so that predict
        enqueues its router and transfer behind route's, and both share one round trip to the GPU), then
        blocking with the GIL released: a loop that kept polling would hold the GIL from the reader threads
        and the hybrid path's CPU worker for as long as the GPU takes (a prompt's layer: many ms)."""
        if event is None:
            return
        for _ in range(YIELDS):
            if event.query():
                return
            await asyncio.sleep(0)
        event.synchronize()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
