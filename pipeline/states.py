"""Sequence states handed out again: a released sequence's cache is reset in place and given to the next sequence (or
filled from a snapshot in place), so that its tensors keep their addresses and the whole step captured over them
(pipeline/whole.py, keyed by those addresses) replays from the new sequence's first one-token step: it pays neither the
eager warm-up step nor a capture (BENCHMARKS.md: a capture is the slowest step of a sequence by far)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from sluice.models import static_cache
from sluice.pipeline.snapshot import Snapshot, restore, restore_into


class StatePool:
    """Caches of released sequences, at most `keep` (each holds VRAM: its attention slots and recurrent states); one
    whose static cache grew past its first slots is not kept (idle, a long sequence's slots would hold VRAM that the
    expert tier could use)."""

    def __init__(self, new: Callable[[], Any], device: torch.device, keep: int = 2):
        self.new, self.device, self.keep = new, device, keep
        self._spare: list[Any] = []

    def take(self) -> Any:
        """An empty cache: a released one (reset when it was given back) or a new one."""
        return self._spare.pop() if self._spare else self.new()

    def restore(self, snapshot: Snapshot) -> Any:
        """A cache equal to the snapshot's: a released one filled in place where one is spare."""
        if not self._spare:
            return restore(snapshot, self.device)
        with torch.inference_mode():  # the steps made its tensors under it
            return restore_into(snapshot, self._spare.pop(), self.device)

    def give(self, cache: Any) -> None:
        """A released sequence's cache: reset in place (its tokens' keys and states zeroed) and kept for the next."""
        if len(self._spare) < self.keep and hasattr(cache, "reset") and not static_cache.grown(cache):
            with torch.inference_mode():  # the steps made its tensors under it
                cache.reset()
            self._spare.append(cache)
