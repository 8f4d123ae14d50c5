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
    whole_layer: bool = False  # a stage runs a one-token MoE layer whole from its input (`Stage.token`): it gets the
    # model's own blocks, not the engine's graph views of their parts


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

    def __init__(self, knobs: Any, stream: str, rt: "Runtime"):
        self.knobs = knobs
        self.stream = stream
        self.rt = rt

    @classmethod
    def needs(cls, knobs: Any) -> dict[str, Any]:
        """The `Needs` fields this stage sets from its knobs (none by default)."""
        return {}

    def token(self, layer: Any, h: Any, next_block: Any = None) -> Any:
        """A one-token step of MoE `layer` whole from its input h [1, 1, D], or None where the stage cannot run it so
        (the engine then runs the layer through the graph); stages with `Needs.whole_layer` implement it."""
        return None

    @abstractmethod
    async def run(self, io: StageIO) -> Any:
        """Do this layer's work; return the produced value (channel stages return None)."""

    def empty_vram(self) -> None:
        """Give back the blocks the stage keeps in VRAM itself (the direct schedule's tier); the host has synchronized."""

    def close(self) -> None:
        """Release what the stage holds between layers (threads); the engine calls it once, on close."""
