"""Per-stage timings: structlog JSON lines, Chrome trace-event JSON (Perfetto), and totals.

Span names are the stage file names (route, predict, fetch, h2d, compute, combine), so a trace
maps onto stages/. Each stage gets a host track (wall time of its coroutine for the layer) and,
on CUDA, a GPU track on its stream (from an event recorded when the stage starts to one when it
ends). Disk reads are async spans on a "reads" track. GPU timestamps are resolved at `flush()`
(after the step's sync) against a reference event, so tracing adds no sync of its own.
A stage fused into one call (the fast path's composed one-token step, one CUDA graph) times its parts with `phase`, under
the same stage names: host spans where it runs eagerly, GPU spans from events the graph itself records on replay.
When disabled every call returns at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

import structlog
import torch

from sluice.kernels.graphs import capturing
from sluice.pipeline.streams import Streams


def _now_us() -> float:
    return time.perf_counter_ns() / 1000.0


class Tracer:
    """Disabled when `path` is None. Otherwise stage lines go to PATH.jsonl as they happen and
    `close()` writes the Chrome trace to PATH."""

    def __init__(self, streams: Streams, path: str | None = None):
        self.streams = streams
        self.path = path
        self.enabled = path is not None
        self.events: list[dict] = []
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # stage -> [count, host_us, gpu_us]
        self.step = 0
        self._pending_gpu: list[tuple[str, str, int, Any, Any]] = []
        self._jsonl: IO[str] | None = open(f"{path}.jsonl", "w") if path else None
        self._log = structlog.wrap_logger(structlog.PrintLogger(self._jsonl), processors=[structlog.processors.JSONRenderer()]) if path else None
        self._t0 = _now_us()
        self._ev0 = streams.record("compute", timing=True) if path else None
        self._read_id = 0

    @contextlib.contextmanager
    def span(self, name: str, layer: int, stream: str | None = None, **args):
        """A stage's host span (and with `stream` its GPU span) around what it wraps, with `args` in its host record
        (e.g. the CPU's blocks in a call); nothing inside a graph's capture, whose parts time themselves (`phase`)."""
        if not self.enabled or capturing():
            yield
            return
        start_ev = self.streams.record(stream, timing=True) if stream else None
        t = _now_us()
        try:
            yield
        finally:
            self._host(name, layer, t, _now_us() - t, **args)
            if start_ev is not None:
                self._pending_gpu.append((name, stream, layer, start_ev, self.streams.record(stream, timing=True)))

    def _host(self, name: str, layer: int, t: float, dur: float, **args) -> None:
        """A host span of stage `name` from t, dur us long: in the Chrome trace, the totals and the JSON lines."""
        self._add(name, f"host/{name}", t, dur, layer=layer, **args)
        self.totals[name][0] += 1
        self.totals[name][1] += dur
        if self._log is not None:
            self._log.info("stage", stage=name, layer=layer, step=self.step, host_us=round(dur, 1), start_us=round(t - self._t0, 1),
                           **args)

    @contextlib.contextmanager
    def phase(self, name: str, layer: int, stream: str, marks: list):
        """The part `name` (a stage's name) of a fused step of `layer`, on the current CUDA stream or the CPU. Run
        eagerly: a host span (and on CUDA a GPU span). Inside a CUDA graph's capture: two event-record nodes of the
        graph (`external` events), kept in `marks` for `replayed`, nothing on the host."""
        if not self.enabled:
            yield
            return
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        captured = cuda and capturing()
        if cuda:
            start = torch.cuda.Event(enable_timing=True, external=captured)
            start.record()
        t = _now_us()
        try:
            yield
        finally:
            if cuda:
                end = torch.cuda.Event(enable_timing=True, external=captured)
                end.record()
                (marks.append if captured else self._pending_gpu.append)((name, stream, layer, start, end))
            if not captured:
                self._host(name, layer, t, _now_us() - t)

    def replayed(self, marks: list) -> None:
        """A graph holding `phase` marks was replayed: its parts' GPU spans are read at `flush`."""
        if self.enabled:
            self._pending_gpu.extend(marks)
            for name, *_ in marks:
                self.totals[name][0] += 1

    def read_started(self, layer: int, expert: int, fut: Future) -> None:
        """An async span on the reads track from submission to landing (completion is seen in a reader thread)."""
        self._read_id += 1
        rid, t = self._read_id, _now_us()
        args = {"layer": layer, "expert": expert}
        self.events.append({"name": "read", "cat": "io", "ph": "b", "id": rid, "ts": t - self._t0, "pid": 1, "tid": "reads", "args": args})
        fut.add_done_callback(
            lambda f: self.events.append({"name": "read", "cat": "io", "ph": "e", "id": rid, "ts": _now_us() - self._t0, "pid": 1, "tid": "reads"})
        )

    def flush(self) -> None:
        """Resolve GPU spans of the finished step (its results already reached the host) and log them."""
        if not self.enabled:
            return
        for name, stream, layer, s, e in self._pending_gpu:
            e.synchronize()
            start = self._ev0.elapsed_time(s) * 1000.0
            dur = s.elapsed_time(e) * 1000.0
            self.events.append({"name": name, "ph": "X", "ts": start, "dur": dur, "pid": 2, "tid": f"{stream} stream/{name}", "args": {"layer": layer}})
            self.totals[name][2] += dur
            if self._log is not None:
                self._log.info("gpu", stage=name, layer=layer, step=self.step, stream=stream, gpu_us=round(dur, 1))
        self._pending_gpu.clear()
        self.step += 1

    def _add(self, name: str, tid: str, t: float, dur: float, **args) -> None:
        self.events.append({"name": name, "ph": "X", "ts": t - self._t0, "dur": dur, "pid": 1, "tid": tid, "args": args})

    def summary(self) -> dict[str, dict[str, float]]:
        return {k: {"count": v[0], "host_ms": v[1] / 1000, "gpu_ms": v[2] / 1000} for k, v in self.totals.items()}

    def close(self) -> None:
        if self.enabled:
            self.write_chrome(self.path)
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def write_chrome(self, path: str | Path) -> None:
        meta = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "host"}},
            {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "gpu"}},
        ]
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
