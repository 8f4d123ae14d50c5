"""Block reads: O_DIRECT with a logged fallback to buffered reads, checksums, short files."""

from __future__ import annotations

import errno
import os

import pytest

from sluice.errors import CorruptBlockError
from sluice.storage.reader import BlockReader, HostArena
from sluice.storage.store import ExpertStore


def test_reads_match_the_file(stores):
    store = ExpertStore.open(stores["qwen3_moe"])
    arena = HostArena(1, store.block_bytes, pin=False)
    reader = BlockReader(store, threads=2)
    layer = store.moe_layers[0]
    reader.submit(layer, 4, arena.slot(0)).result()
    with open(store.file(layer), "rb") as f:
        f.seek(4 * store.block_bytes)
        assert bytes(arena.slot(0).numpy()) == f.read(store.block_bytes)
    assert reader.reads == 1 and reader.bytes_read == store.block_bytes
    reader.close()


def test_falls_back_to_buffered_reads_with_a_warning(stores, monkeypatch, capsys):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open

    def refuse_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refuse_direct)
    store = ExpertStore.open(stores["qwen3_moe"])
    arena = HostArena(1, store.block_bytes, pin=False)
    reader = BlockReader(store, threads=1)
    reader.read_into(store.moe_layers[0], 0, arena.slot(0))
    reader.close()
    err = capsys.readouterr().err
    assert "buffered reads instead of O_DIRECT" in err and "layer_" in err


def test_checksum_mismatch_names_layer_and_expert(stores, tmp_path):
    import shutil

    bad = tmp_path / "s"
    shutil.copytree(stores["qwen3_moe"], bad)
    store = ExpertStore.open(bad)
    layer = store.moe_layers[1]
    with open(store.file(layer), "r+b") as f:
        f.seek(2 * store.block_bytes + 5)
        b = f.read(1)
        f.seek(2 * store.block_bytes + 5)
        f.write(bytes([b[0] ^ 0x80]))
    arena = HostArena(1, store.block_bytes, pin=False)
    with pytest.raises(CorruptBlockError, match=f"layer {layer}, expert 2: checksum mismatch"):
        BlockReader(store, threads=1).read_into(layer, 2, arena.slot(0))
    BlockReader(store, threads=1, verify=False).read_into(layer, 2, arena.slot(0))  # switchable
