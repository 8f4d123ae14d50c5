"""Named CUDA streams and events; on a CPU every call is a no-op and work runs inline.

Stages name the stream they enqueue on ("compute" or "copy", from the schedule). Anything
produced on one stream and consumed on another travels with the event recorded after it, and the
consumer's stream waits on that event: ordering lives on the GPU, the host never blocks for it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

STREAM_NAMES = ("compute", "copy")


class Streams:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._streams = {"compute": torch.cuda.current_stream(device), "copy": torch.cuda.Stream(device)}
        else:
            self._streams = {}

    def get(self, name: str) -> Any:
        return self._streams.get(name)

    def use(self, name: str):
        """Context that makes `name` the current stream (no-op on CPU)."""
        s = self._streams.get(name)
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

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

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
