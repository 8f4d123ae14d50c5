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


def restore_into(snapshot: Snapshot, cache: Any, device: torch.device) -> Any:
    """`cache` (an engine's, of the same layer classes) made equal to the snapshot's: each tensor copied into the one it
    replaces where their shapes and dtypes agree (so the cache keeps its addresses), a new copy where not; every other
    attribute (flags, lengths) taken from the snapshot. A cache of other layer classes gets a fresh copy instead."""
    if len(cache.layers) != len(snapshot.cache.layers) or any(
            type(a) is not type(b) for a, b in zip(cache.layers, snapshot.cache.layers)):
        return restore(snapshot, device)
    for live, kept in zip(cache.layers, snapshot.cache.layers):
        for name, value in vars(kept).items():
            setattr(live, name, _fill(getattr(live, name, None), value, device))
    return cache


def _fill(old: Any, new: Any, device: torch.device) -> Any:
    """`new` on `device`, copied into `old` where `old` is a tensor of its shape and dtype there (in dicts, lists and
    tuples alike)."""
    if isinstance(new, torch.Tensor):
        if isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype and old.device == device:
            return old.copy_(new)
        return new.to(device, copy=True)
    if isinstance(new, dict):
        old = old if isinstance(old, dict) else {}
        return {k: _fill(old.get(k), v, device) for k, v in new.items()}
    if isinstance(new, (list, tuple)):
        old = old if isinstance(old, type(new)) and len(old) == len(new) else [None] * len(new)
        return type(new)(_fill(o, v, device) for o, v in zip(old, new))
    return new  # as `restore` shares them


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
