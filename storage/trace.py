"""Routing traces: per step and MoE layer, the routed experts, the guesses made for that layer, and
the tier each block came from. Written by `--record-routing FILE`, replayed by `sluice simulate`.

Format: JSON lines (gzip when the name ends in .gz). The first line is a header (`trace_header`):
    {"sluice_routing_trace": 1, "architecture", "moe_layers", "num_experts", "top_k",
     "block_bytes", "ram_blocks", "vram_blocks", "schedule", "routing" (storage/routing.py), "prefetch", "vram_prefetch", "prefetch_depth",
     and "vram_tier": "recorded" for direct-stream's hot-set tier}
then one line per (step, MoE layer), in execution order:
    {"s": step, "t": tokens in the step, "l": layer, "ids": [T*K routed ids, token-major],
     "e": [distinct experts, ascending], "tier": "RRDV..." (one letter per entry of e:
     V vram, R ram, D disk), "p": [guesses made for this layer] or null,
     "f": [[layer, [guesses]], ...] (only where made: `predict: {depth: N}` or `fetch: {via: table, depth: N}`, N > 1, the guesses this layer's input made
     for the MoE layers after the next one, nearest first)}
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from sluice.errors import SluiceError

TIER_CODE = {"vram": "V", "ram": "R", "disk": "D"}


def trace_header(store, schedule, ram_blocks: int, vram_blocks: int, routing: str = "natural") -> dict:
    """A trace's header for a run of `schedule` on `store` with these tier sizes (blocks): what `sluice simulate`
    replays by default. The device table's fetch (`via: table`, hold: false: the only one that records) reads its guesses for the next
    MoE layer (and the `depth` - 1 after it), and its VRAM tier is a hot set refreshed from use counts, which the
    replay takes as recorded ("vram_tier": "recorded": the blocks the run read from VRAM are VRAM hits)."""
    m = store.manifest
    head = {"architecture": m.architecture, "moe_layers": list(store.moe_layers), "num_experts": m.num_experts, "top_k": m.top_k,
            "block_bytes": m.block_bytes, "ram_blocks": ram_blocks, "vram_blocks": vram_blocks, "schedule": schedule.name,
            "routing": routing}
    fetch, predict, h2d = (schedule.stage(n) for n in ("fetch", "predict", "h2d"))
    if fetch is not None and fetch.cls.via == "table":
        guesses = fetch.knobs.prefetch
        return {**head, "prefetch": guesses, "vram_prefetch": False, "prefetch_depth": fetch.knobs.depth if guesses else 0,
                "vram_tier": "recorded"}
    return {**head, "prefetch": fetch is not None and fetch.knobs.prefetch and predict is not None,
            "vram_prefetch": h2d is not None and h2d.knobs.prefetch and predict is not None,
            "prefetch_depth": predict.knobs.depth if predict is not None else 0}


class RoutingRecorder:
    """Appends trace lines as the engine runs (event-loop thread only)."""

    def __init__(self, path: str | Path, header: dict):
        path = Path(path)
        self.path = path
        self._f: IO[str] = gzip.open(path, "wt") if path.suffix == ".gz" else open(path, "w")
        self._f.write(json.dumps({"sluice_routing_trace": 1, **header}) + "\n")
        self.step = 0
        self.tokens = 0

    def begin_step(self, tokens: int) -> None:
        self.tokens = tokens

    def end_step(self) -> None:
        self.step += 1

    def layer(self, layer: int, ids: list[int], experts: tuple[int, ...], tiers: list[str], predicted: tuple[int, ...] | None,
              further: tuple[tuple[int, tuple[int, ...]], ...] = ()) -> None:
        line = {"s": self.step, "t": self.tokens, "l": layer, "ids": ids, "e": list(experts),
                "tier": "".join(TIER_CODE[t] for t in tiers), "p": list(predicted) if predicted is not None else None}
        if further:
            line["f"] = [[l, list(g)] for l, g in further]
        self._f.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._f.close()


@dataclass(frozen=True)
class TraceRecord:
    step: int
    tokens: int
    layer: int
    ids: tuple[int, ...]
    experts: tuple[int, ...]
    tiers: str
    predicted: tuple[int, ...] | None
    further: tuple[tuple[int, tuple[int, ...]], ...] = ()  # guesses for the MoE layers after the next, made from this input

    def from_vram(self) -> list[bool]:
        """Per expert in `experts`: the run read its block from the VRAM tier."""
        return [t == "V" for t in self.tiers]


@dataclass(frozen=True)
class Trace:
    header: dict
    records: tuple[TraceRecord, ...]

    @property
    def steps(self) -> int:
        return len({r.step for r in self.records})

    @property
    def tokens(self) -> int:
        seen, total = set(), 0
        for r in self.records:
            if r.step not in seen:
                seen.add(r.step)
                total += r.tokens
        return total


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    if not path.is_file():
        raise SluiceError(f"{path}: no such routing trace")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        lines = iter(f)
        try:
            header = json.loads(next(lines))
        except (StopIteration, json.JSONDecodeError, UnicodeDecodeError, OSError):
            raise SluiceError(f"{path}: not a Sluice routing trace (bad first line)") from None
        if header.get("sluice_routing_trace") != 1:
            raise SluiceError(f"{path}: not a Sluice routing trace (no 'sluice_routing_trace': 1 header)")
        return Trace(header, tuple(_records(path, lines)))


def _records(path: Path, lines: Iterator[str]) -> Iterator[TraceRecord]:
    for n, line in enumerate(lines, start=2):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            p = d.get("p")
            further = tuple((int(l), tuple(g)) for l, g in d.get("f", ()))
            if len(d["tier"]) != len(d["e"]):
                raise ValueError(f"{len(d['e'])} experts but {len(d['tier'])} tiers")
            yield TraceRecord(d["s"], d["t"], d["l"], tuple(d["ids"]), tuple(d["e"]), d["tier"], tuple(p) if p is not None else None,
                              further)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise SluiceError(f"{path}: line {n} is malformed ({e!r})") from None
