"""Sequence snapshots: a deep copy of a sequence's state (attention KV, Mamba / DeltaNet conv and
recurrent states) that can be kept in RAM and restored later, exactly.

transformers' caches have no snapshot API, and their layer classes differ between versions, so
we copy each cache layer's attributes, replacing every tensor (also inside dicts and lists) by a
copy on the target device. Scalars and flags are copied as they are.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Snapshot:
    tokens: tuple[int, ...]  # the tokens whose state this is
    cache: Any  # a cache whose tensors live on the snapshot's device (host RAM)
    nbytes: int


def map_cache(cache: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of `cache` with fn applied to every tensor of every layer; the original is untouched."""
    new = copy.copy(cache)
    new.layers = []
    for layer in cache.layers:
        twin = copy.copy(layer)
        for name, value in vars(layer).items():
            setattr(twin, name, _map(value, fn))
        new.layers.append(twin)
    return new


def cache_nbytes(cache: Any) -> int:
    total = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    for layer in cache.layers:
        for value in vars(layer).values():
            _map(value, count)
    return total


def take(tokens: list[int], cache: Any, device: str | torch.device = "cpu") -> Snapshot:
    """Snapshot a sequence's state into `device` memory (copies; the live cache keeps running)."""
    snap = map_cache(cache, lambda t: t.to(device, copy=True))
    return Snapshot(tuple(tokens), snap, cache_nbytes(snap))


def restore(snapshot: Snapshot, device: torch.device) -> Any:
    """A fresh cache on `device` equal to the snapshot's (the snapshot stays reusable)."""
    return map_cache(snapshot.cache, lambda t: t.to(device, copy=True))


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_map(v, fn) for v in value)
    return value
