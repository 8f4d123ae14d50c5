"""The stage contract: what a stage consumes, what it produces, its knobs, and the IO it runs with.

A stage is one step of a MoE layer's work. It declares the values it consumes and the one value
it produces; a schedule (YAML) wires stages by those names, says which stream each runs on and
sets its knobs. Knobs are a frozen dataclass per stage, validated by the schedule loader.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, ClassVar

if TYPE_CHECKING:
    from sluice.pipeline.runtime import Runtime


@dataclass(frozen=True)
class NoKnobs:
    pass


@dataclass(frozen=True)
class Needs:
    """What a schedule asks of the engine when it opens (the runtime's sizes and tiers), merged from its stages'
    `Stage.needs`: the engine reads these, never a stage's name or knobs."""

    readers: int = 8  # reader threads of the engine's one pool (the stage that reads blocks from disk sizes it)
    guess_reads: int = 2  # guess reads in flight at most
    read_pieces: int = 1  # a block read as this many parts at once
    ram: str = "cache"  # cache: an LRU cache of --ram-cache | all: every block held (RAM for the whole store) |
    # one: routed experts skipped, one slot will do
    depth: int = 1  # MoE layers guessed ahead from one layer's input (1: the next one)
    guess_extra: int = 0  # guesses past the next layer's top-k, as its router ranks them (needs `MoEBlock.ranked`)
    down_in_ram: bool = False  # `down` stays in pinned RAM, read zero-copy
    vram_policy: str = "lru"  # what the VRAM tier evicts
    hot_set: str = ""  # routing trace whose most routed blocks are held in VRAM from the start
    table: bool = False  # the schedule's stages are the device-table variants (`via: table`): a one-token MoE layer
    # runs as the plan's composed step (pipeline/plan.py) on the model's own blocks, not the engine's graph views


class StageIO(ABC):
    """How a running stage reaches its inputs and outputs (implemented by the coordinator)."""

    @abstractmethod
    async def value(self, name: str) -> Any:
        """A one-shot input, once its producer has finished."""

    @abstractmethod
    def has(self, name: str) -> bool:
        """Whether the schedule produces `name` (for optional inputs)."""

    @abstractmethod
    def batches(self, name: str) -> AsyncIterator[list]:
        """A channel input as lists of items: each list is what has arrived ('each') or one wave ('wave')."""

    @abstractmethod
    def emit(self, item: Any) -> None:
        """Send one item on this stage's output channel."""

    @abstractmethod
    def end_wave(self) -> None:
        """Mark a wave boundary: consumers batching by wave may now process what was emitted.

        A stage must call this before it waits for capacity held by items it already emitted.
        """


class Stage(ABC):
    name: ClassVar[str]
    consumes: ClassVar[tuple[str, ...]] = ()
    optional: ClassVar[tuple[str, ...]] = ()  # consumed only when some stage of the schedule produces it
    produces: ClassVar[str]
    channel: ClassVar[bool] = False  # output is an item channel rather than one value
    Knobs: ClassVar[type] = NoKnobs
    via: ClassVar[str] = "cache"  # the variant (the schedule's `via` key): cache (the streaming stages, each block
    # found through the host's caches) | table (the device-table stages of the fast path)

    def __init__(self, knobs: Any, stream: str, rt: "Runtime"):
        self.knobs = knobs
        self.stream = stream
        self.rt = rt

    @classmethod
    def needs(cls, knobs: Any) -> dict[str, Any]:
        """The `Needs` fields this stage sets from its knobs (none by default)."""
        return {}

    # -- the GPU-only face (pipeline/plan.py composes a one-token layer step from these) ----------------------------
    # `t` is the layer's `TokenLayer` (stages/types.py); the callables read and write the step's values `v` by name
    # (x, residual, weights, ids, offs, xe, y, routed, shared, h) and only enqueue GPU work: they are captured.

    def launch(self, t: Any) -> Any:
        """This stage's part of a one-token step of layer t on the step's stream: a callable of the values, or None."""
        return None

    def beside(self, t: Any) -> Any:
        """Its part on a side stream forked from the step's and joined before the layer's output, or None."""
        return None

    def before(self, t: Any, first: bool) -> None:
        """Host work before each one-token step of layer t (not captured); `first`: the token's first MoE layer."""

    def after(self, t: Any) -> None:
        """Host work after each one-token step of layer t is queued (not captured)."""

    def token_begins(self) -> None:
        """Host work due once a token, before its first MoE layer's step (not captured; `before` with `first` calls it,
        and a whole step replayed as one graph before each replay: pipeline/whole.py)."""

    def token_queued(self) -> None:
        """Host work once a token's steps are queued, beside the GPU's work (after a whole step's replay is launched,
        pipeline/whole.py; a stage may call it after its token's last layer itself)."""

    def tally(self, t: Any) -> None:
        """The host's counts of a one-token step of layer t that ran (after `after`, or after each replay of a whole
        step that holds it); counts only, nothing queued."""

    async def run(self, io: StageIO) -> Any:
        """Do this layer's work; return the produced value (channel stages return None)."""
        raise NotImplementedError(f"stage {self.name!r} has no streaming face")

    def empty_vram(self) -> None:
        """Give back the blocks the stage keeps in VRAM itself (the direct schedule's tier); the host has synchronized."""

    def close(self) -> None:
        """Release what the stage holds between layers (threads); the engine calls it once, on close."""
