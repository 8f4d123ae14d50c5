"""A conversation snapshot as a file, checked whole before it is used.

    MAGIC (16 bytes) | header length (8 bytes, little-endian) | header (JSON) | payload

header: {"version", "identity" (the model and versions the state belongs to), "key" (the snapshot store's key),
"nbytes" (the state's bytes), "payload_bytes", "xxh3_64" (of the payload)}. payload: torch.save of
{"tokens": [...], "cache": the snapshot's cache}, read back with weights_only=True and only the cache classes
named in `allowed` admitted, so a file cannot run code. Everything here is CPU work on bytes: the caller does
the file I/O.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import torch
import xxhash

from sluice.pipeline.snapshot import Snapshot

MAGIC = b"SLUICE-SNAPSHOT\n"
VERSION = 1
PREFIX = len(MAGIC) + 8  # the bytes to read before the header's length is known


class SnapshotFileError(Exception):
    """A file that is not a usable snapshot; the message says what is wrong with it."""


@dataclass(frozen=True)
class Header:
    identity: str  # model_identity() of the engine that took the snapshot
    key: tuple[int, ...]  # the snapshot store's key (the tokens, image tokens told apart)
    nbytes: int  # the state's bytes, as the RAM store counts them
    payload_bytes: int
    checksum: int  # xxh3_64 of the payload

    @property
    def file_bytes(self) -> int:
        return PREFIX + len(self._json()) + self.payload_bytes

    def _json(self) -> bytes:
        return json.dumps({"version": VERSION, "identity": self.identity, "key": list(self.key), "nbytes": self.nbytes,
                           "payload_bytes": self.payload_bytes, "xxh3_64": self.checksum}).encode()

    def encode(self) -> bytes:
        head = self._json()
        return MAGIC + len(head).to_bytes(8, "little") + head


def model_identity(engine) -> str:
    """What a snapshot's state depends on: the store's weights (its manifest), the resident dtype, transformers' version."""
    import transformers

    manifest = (engine.store.path / "manifest.json").read_bytes()
    dtype = str(engine.model.dtype).removeprefix("torch.")
    return f"{xxhash.xxh3_64_hexdigest(manifest)}-{dtype}-transformers{transformers.__version__}"


def cache_classes(cache) -> tuple[type, ...]:
    """The classes a snapshot of this model's cache may hold: transformers' cache classes and those of a fresh cache."""
    import transformers.cache_utils as cu

    found = {c for c in vars(cu).values() if isinstance(c, type) and c.__module__ == cu.__name__}
    found.add(type(cache))
    found.update(type(layer) for layer in getattr(cache, "layers", ()))
    return tuple(found)


def encode(snap: Snapshot, key: tuple[int, ...], identity: str) -> bytes:
    buf = io.BytesIO()
    torch.save({"tokens": list(snap.tokens), "cache": snap.cache}, buf)
    payload = buf.getvalue()
    return Header(identity, tuple(key), snap.nbytes, len(payload), xxhash.xxh3_64_intdigest(payload)).encode() + payload


def header_length(prefix: bytes) -> int:
    """The header's length from a file's first PREFIX bytes."""
    if len(prefix) < PREFIX or prefix[: len(MAGIC)] != MAGIC:
        raise SnapshotFileError("not a Sluice snapshot (no magic)")
    n = int.from_bytes(prefix[len(MAGIC) : PREFIX], "little")
    if not 0 < n < 1 << 31:
        raise SnapshotFileError(f"header length {n} is out of range")
    return n


def parse_header(raw: bytes, identity: str) -> Header:
    """A header's JSON; a snapshot of another model or version, or a malformed header, raises."""
    try:
        d = json.loads(raw)
        h = Header(d["identity"], tuple(int(i) for i in d["key"]), int(d["nbytes"]), int(d["payload_bytes"]), int(d["xxh3_64"]))
        version = d["version"]
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotFileError(f"malformed header ({type(e).__name__}: {e})") from None
    if version != VERSION:
        raise SnapshotFileError(f"format version {version!r}, this server writes {VERSION}")
    if h.identity != identity:
        raise SnapshotFileError(f"taken with another model or version ({h.identity}, this server is {identity})")
    return h


def decode(data: bytes, identity: str, allowed: tuple[type, ...]) -> tuple[Header, Snapshot]:
    """A whole file's bytes -> (its header, the snapshot); every check failing raises SnapshotFileError."""
    n = header_length(data[:PREFIX])
    header = parse_header(data[PREFIX : PREFIX + n], identity)
    payload = memoryview(data)[PREFIX + n :]
    if len(payload) != header.payload_bytes:
        raise SnapshotFileError(f"truncated or padded: {len(payload)} payload bytes, the header says {header.payload_bytes}")
    if xxhash.xxh3_64_intdigest(payload) != header.checksum:
        raise SnapshotFileError("checksum mismatch (the file is corrupt)")
    try:
        with torch.serialization.safe_globals(list(allowed)):
            d = torch.load(io.BytesIO(payload), weights_only=True)
        snap = Snapshot(tuple(int(t) for t in d["tokens"]), d["cache"], header.nbytes)
    except Exception as e:  # torch raises many types for a payload it cannot read
        raise SnapshotFileError(f"unreadable state ({type(e).__name__}: {str(e)[:200]})") from None
    return header, snap
