"""Schedules: which stages run for a MoE layer, what each waits for, on which stream, with which knobs.

    name: overlap
    description: copies on their own stream; next layer's guesses read into the gap
    stages:
      route:   {}
      predict: {width: 0}
      fetch:   {prefetch: true, readers: 8}
      h2d:     {stream: copy}
      compute: {}
      combine: {}

Per stage: `after` (stages to wait for), `stream` (compute | copy) and `via` (its variant: cache | table, the same
for every stage of a schedule; stages/__init__.py), plus the variant's own knobs.
`after` on a one-shot stage waits for its value. A channel input (fetch -> h2d -> compute) is
consumed as items arrive, unless its producer is listed in `after`: then the consumer waits for
each whole wave (the layer's blocks, or as many as the caches hold at once) before starting.
Validation is strict and happens once: unknown stages or keys, bad values, inputs no stage
produces and cycles are errors naming the culprit.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sluice.errors import ScheduleError
from sluice.log import get_logger
from sluice.pipeline.config import default_ram_cache, format_bytes
from sluice.pipeline.streams import STREAM_NAMES
from sluice.stages import REQUIRED, SHARED, STAGES, VARIANTS
from sluice.stages.base import Needs

SCHEDULES_DIR = Path(__file__).resolve().parent.parent / "schedules"
COMMON_KEYS = ("after", "stream", "via")
INITIAL = ("layer",)
VIAS = ("cache", "table")  # the stages' variants (stages/__init__.py)  # values the coordinator provides


@dataclass(frozen=True)
class StageSpec:
    name: str
    after: tuple[str, ...]
    stream: str
    knobs: Any
    cls: type = object  # the stage's class: its name's variant (`via`)


@dataclass(frozen=True)
class Schedule:
    name: str
    description: str
    stages: tuple[StageSpec, ...]  # in a valid execution order
    source: str

    def stage(self, name: str) -> StageSpec | None:
        return next((s for s in self.stages if s.name == name), None)

    @property
    def needs(self) -> Needs:
        """What the engine must set up for this schedule, from its stages' knobs (`Stage.needs`, in stage order)."""
        fields: dict[str, Any] = {}
        for spec in self.stages:
            fields.update(spec.cls.needs(spec.knobs))
        return Needs(**fields)


AUTO = "auto"
RAM_SHARE = 0.75  # `auto` holds every block in RAM (direct) only where the store takes at most this share of free RAM


def auto_schedule(ref: str | Path, store_bytes: int, layer_bytes: int, ram_cache: int | None, available: int,
                  recording: bool = False, vram_room: int | None = None) -> str:
    """The schedule to load: `ref` as named, or for `auto` (the default) `direct`, the fast path, where every expert
    block fits in RAM (in --ram-cache if given, else in RAM_SHARE of the RAM free now, and in the RAM there is) and no
    routing trace is recorded (its routed ids stay on the GPU), and `direct-hybrid` (the CPU computing a share of the
    blocks outside VRAM where that pays) where they do not all fit in `vram_room` (the VRAM a budget or the card leaves
    beside the resident part; None: no CPU share, as on a CPU or for a model whose whole step is unchecked on a GPU),
    else `direct-stream`, which reads from disk what its RAM cache lacks, else (a RAM cache smaller than one MoE layer's
    experts) `overlap`; knob edits after `auto:` apply to the one chosen. The choice and why are logged before the file
    is read (an error in the edits names it)."""
    name, sep, edits = str(ref).partition(":")
    if name != AUTO:
        return str(ref)
    room = ram_cache if ram_cache is not None else int(RAM_SHARE * available)
    where = "--ram-cache" if ram_cache is not None else f"{RAM_SHARE:.0%} of the free RAM"
    cache = ram_cache if ram_cache is not None else default_ram_cache(available)
    blocks = f"the store's expert blocks ({format_bytes(store_bytes)})"
    if recording:
        chosen, why = "direct-stream", "--record-routing"
    elif store_bytes > room:
        chosen, why = "direct-stream", f"{blocks} do not fit in {where} ({format_bytes(room)})"
    elif store_bytes > available:
        chosen, why = "direct-stream", f"{blocks} do not fit in the free RAM ({format_bytes(available)})"
    elif vram_room is not None and store_bytes > vram_room:
        chosen, why = "direct-hybrid", (f"{blocks} fit in {where} ({format_bytes(room)}) but not in the VRAM left beside "
                                        f"the resident part ({format_bytes(vram_room)})")
    else:
        chosen, why = "direct", f"{blocks} fit in {where} ({format_bytes(room)})"
    if chosen == "direct-stream" and cache < layer_bytes:
        chosen, why = "overlap", f"{why}, and the RAM cache ({format_bytes(cache)}) holds less than a MoE layer's experts"
    get_logger().info("schedule auto", schedule=chosen + sep + edits, why=why)
    return chosen + sep + edits


def load_schedule(ref: str | Path) -> Schedule:
    """A schedule by name (schedules/NAME.yaml) or by path, with knob edits after it: `NAME:STAGE.KNOB=VALUE[:...]`
    (`direct-stream:fetch.depth=2`; VALUE read as YAML), applied before validation, so an experiment needs no file.
    The edits join the schedule's name (what traces and `bench` report)."""
    ref, *edits = str(ref).split(":")
    path = Path(ref)
    if not path.suffix:
        path = SCHEDULES_DIR / f"{ref}.yaml"
        if not path.is_file():
            names = ", ".join(sorted(p.stem for p in SCHEDULES_DIR.glob("*.yaml")))
            raise ScheduleError(f"no schedule named {ref!r} (available: {names}; or give a path to a .yaml file)")
    if not path.is_file():
        raise ScheduleError(f"schedule file {path} does not exist")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ScheduleError(f"{path}: not valid YAML: {e}") from None
    for edit in edits:
        _edit(doc, edit, str(path))
    return parse_schedule(doc, ":".join((str(path), *edits)))


def _edit(doc: Any, edit: str, source: str) -> None:
    """Apply one `STAGE.KNOB=VALUE` edit to a schedule document (a stage it has; the knob is checked with the rest)."""
    key, eq, value = edit.partition("=")
    stage, dot, knob = key.partition(".")
    if not (eq and dot and stage and knob):
        raise ScheduleError(f"schedule edit {edit!r}: write STAGE.KNOB=VALUE (e.g. fetch.depth=2)")
    stages = doc.get("stages") if isinstance(doc, dict) else None
    if not isinstance(stages, dict) or stage not in stages:
        have = ", ".join(stages) if isinstance(stages, dict) else "none"
        raise ScheduleError(f"schedule edit {edit!r}: {source} has no stage {stage!r} (its stages: {have})")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ScheduleError(f"schedule edit {edit!r}: the value is not valid YAML: {e}") from None
    body = stages[stage] or {}
    if not isinstance(body, dict):
        raise ScheduleError(f"{source}: stage {stage!r} must be a mapping of settings, got {type(body).__name__}")
    stages[stage] = {**body, knob: parsed}
    doc["name"] = f"{doc.get('name', Path(source).stem)}:{edit}"


def parse_schedule(doc: Any, source: str = "<schedule>") -> Schedule:
    if not isinstance(doc, dict):
        raise ScheduleError(f"{source}: a schedule is a mapping with 'name' and 'stages'")
    _reject_unknown(doc, ("name", "description", "stages"), source)
    stages_doc = doc.get("stages")
    if not isinstance(stages_doc, dict) or not stages_doc:
        raise ScheduleError(f"{source}: 'stages' must be a non-empty mapping of stage name -> settings")
    specs = {}
    for name, body in stages_doc.items():
        if name not in STAGES:
            raise ScheduleError(f"{source}: unknown stage {name!r} (known: {', '.join(STAGES)})")
        specs[name] = _parse_stage(name, body or {}, f"{source}: stage {name!r}")
    vias = {spec.cls.via for n, spec in specs.items() if n not in SHARED}
    if len(vias) > 1:
        table = ", ".join(n for n, spec in specs.items() if spec.cls.via == "table")
        raise ScheduleError(f"{source}: every stage of a schedule takes the same variant: {table} have via: table, the "
                            f"others not (a schedule streams through the caches or reads through the device table)")
    if vias == {"table"}:
        for name in SHARED:
            spec = specs.get(name)
            if spec is not None and (spec.after or spec.stream != "compute"):
                raise ScheduleError(f"{source}: stage {name!r}: 'after' and 'stream' mean nothing in a via: table schedule "
                                    f"(the plan orders a step's parts and runs them on the step's stream)")
    missing = [s for s in REQUIRED if s not in specs]
    if missing:
        raise ScheduleError(f"{source}: required stage(s) missing: {', '.join(missing)}")
    order = _check_graph(specs, source)
    return Schedule(str(doc.get("name", Path(source).stem)), str(doc.get("description", "")), tuple(specs[n] for n in order), source)


def _parse_stage(name: str, body: Any, where: str) -> StageSpec:
    if not isinstance(body, dict):
        raise ScheduleError(f"{where}: settings must be a mapping, got {body!r}")
    via = body.get("via", "cache")
    cls = VARIANTS.get((name, via)) or (STAGES[name] if name in SHARED and via in VIAS else None)
    if cls is None:
        have = ", ".join(VIAS if name in SHARED else (v for n, v in VARIANTS if n == name))
        raise ScheduleError(f"{where}: 'via' must be one of {have}, got {via!r}")
    fields = {f.name: f for f in dataclasses.fields(cls.Knobs)}
    common = COMMON_KEYS if cls.via == "cache" else ("via",)  # a composed step orders its parts itself (plan.py)
    _reject_unknown(body, common + tuple(fields), where)
    after = body.get("after", [])
    if isinstance(after, str):
        after = [after]
    if not isinstance(after, list) or not all(isinstance(a, str) for a in after):
        raise ScheduleError(f"{where}: 'after' must be a list of stage names, got {after!r}")
    stream = body.get("stream", "compute")
    if stream not in STREAM_NAMES:
        raise ScheduleError(f"{where}: 'stream' must be one of {', '.join(STREAM_NAMES)}, got {stream!r}")
    hints = typing.get_type_hints(cls.Knobs)
    values = {}
    for key, f in fields.items():
        if key in body:
            values[key] = _check_value(body[key], hints[key], f"{where}: {key!r}", key)
    return StageSpec(name, tuple(after), stream, cls.Knobs(**values), cls)


SIGNED_KNOBS = ("cpu_prefill", "prompt_cpu")  # int knobs with a meaning below 0 (checked by their stage)


def _check_value(value: Any, hint: Any, where: str, name: str = "") -> Any:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)  # `cpu_share: 1` means 1.0
    ok = isinstance(value, bool) if hint is bool else (isinstance(value, hint) and not isinstance(value, bool))
    if not ok:
        raise ScheduleError(f"{where} must be {hint.__name__}, got {value!r}")
    if hint is int and value < 0 and name not in SIGNED_KNOBS:
        raise ScheduleError(f"{where} must be >= 0, got {value!r}")
    return value


def _reject_unknown(d: dict, allowed: tuple[str, ...], where: str) -> None:
    for key in d:
        if key not in allowed:
            raise ScheduleError(f"{where}: unknown key {key!r} (allowed: {', '.join(allowed)})")


def _check_graph(specs: dict[str, StageSpec], source: str) -> list[str]:
    """Every input produced, every `after` known, no cycle. Returns a topological order."""
    producer = {specs[n].cls.produces: n for n in specs}
    deps: dict[str, set[str]] = {}
    for name, spec in specs.items():
        cls = spec.cls
        d = set()
        for value in cls.consumes:
            if value in INITIAL:
                continue
            if value not in producer:
                raise ScheduleError(f"{source}: stage {name!r} consumes {value!r}, which no stage of the schedule produces")
            d.add(producer[value])
        d.update(producer[v] for v in cls.optional if v in producer)
        for a in spec.after:
            if a not in specs:
                raise ScheduleError(f"{source}: stage {name!r} runs after {a!r}, which is not in the schedule")
            if a == name:
                raise ScheduleError(f"{source}: stage {name!r} runs after itself")
            if specs[a].cls.channel and specs[a].cls.produces not in cls.consumes:
                raise ScheduleError(
                    f"{source}: stage {name!r} runs after {a!r}, a streaming stage whose output it does not consume; "
                    f"'after' on a stream means 'wait for each wave' and needs that data edge"
                )
            d.add(a)
        deps[name] = d
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            cycle = path[path.index(n) :] + [n]
            raise ScheduleError(f"{source}: cycle in the stage graph: {' -> '.join(cycle)}")
        state[n] = 1
        for d in sorted(deps[n]):
            visit(d, path + [n])
        state[n] = 2
        order.append(n)

    for n in specs:
        visit(n, [])
    return order
