"""Conversation snapshots on disk (`serve --snapshot-dir`): spilled beyond the RAM budget, kept across a restart,
capped by size, checked on load."""

from __future__ import annotations

import time

import pytest

from test_api import LiveServer, chat

FIRST = [{"role": "user", "content": "Hello there."}]
OTHER = [{"role": "user", "content": "What is a river?"}]


def follow_up(s, first, reply):
    return chat(s, first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}], max_tokens=8)


def snaps(folder):
    return sorted(folder.glob("*/*.snap"))


def test_snapshots_survive_a_restart(stores, tmp_path):
    """serve, one turn, stop; a new server on the same folder serves the follow-up from the snapshot (cached tokens),
    with the text of a server that never had it."""
    store, folder = stores["nemotron_h_latent"], tmp_path / "snapshots"
    s = LiveServer(store, context=512, snapshot_dir=folder)
    try:
        reply, _, _ = chat(s, FIRST, max_tokens=8)
        assert snaps(folder) == []  # within --snapshot-ram: in RAM only while serving
    finally:
        s.close()
    assert len(snaps(folder)) == 1  # written when the server stopped
    s = LiveServer(store, context=512, snapshot_dir=folder)
    try:
        warm, _, usage = follow_up(s, FIRST, reply)
    finally:
        s.close()
    cold = LiveServer(store, context=512, snapshot_bytes=0)
    try:
        fresh, _, fresh_usage = follow_up(cold, FIRST, reply)
    finally:
        cold.close()
    assert usage.prompt_tokens_details.cached_tokens > 0 and fresh_usage.prompt_tokens_details.cached_tokens == 0
    assert warm == fresh


def test_snapshots_beyond_ram_spill_to_disk_capped_by_size(stores, tmp_path):
    """With no RAM for snapshots each one goes to disk as it is taken and comes back for its follow-up; a smaller
    --snapshot-disk keeps the most recently used files that fit."""
    store, folder = stores["nemotron_h_latent"], tmp_path / "snapshots"

    def written(n):
        deadline = time.time() + 30
        while len(snaps(folder)) < n:  # written off the engine's thread, after the reply
            assert time.time() < deadline, snaps(folder)
            time.sleep(0.05)
        return snaps(folder)

    s = LiveServer(store, context=512, snapshot_bytes=1, snapshot_dir=folder)
    try:
        first, _, _ = chat(s, FIRST, max_tokens=8)
        (a,) = written(1)
        other, _, _ = chat(s, OTHER, max_tokens=8)
        (b,) = set(written(2)) - {a}
        assert follow_up(s, FIRST, first)[2].prompt_tokens_details.cached_tokens > 0  # read back from disk
        (c,) = set(written(3)) - {a, b}
    finally:
        s.close()
    cap = a.stat().st_size + c.stat().st_size  # the two used last; the other conversation's is the oldest
    s = LiveServer(store, context=512, snapshot_bytes=1, snapshot_dir=folder, snapshot_disk_bytes=cap)
    try:
        assert snaps(folder) == sorted([a, c])  # the cap applied as the folder was opened
        assert follow_up(s, FIRST, first)[2].prompt_tokens_details.cached_tokens > 0
        assert follow_up(s, OTHER, other)[2].prompt_tokens_details.cached_tokens == 0
        assert sum(p.stat().st_size for p in snaps(folder)) <= cap
    finally:
        s.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_snapshot_file_is_dropped(stores, tmp_path, capsys, damage):
    """A snapshot file with a flipped byte (found by its checksum when it is read) or cut short (found by its length
    as the folder is opened) is removed with a log line naming it, and the follow-up runs from scratch."""
    store, folder = stores["nemotron_h_latent"], tmp_path / "snapshots"
    s = LiveServer(store, context=512, snapshot_dir=folder)
    try:
        reply, _, _ = chat(s, FIRST, max_tokens=8)
    finally:
        s.close()
    (path,) = snaps(folder)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x10
    else:
        del data[len(data) // 2 :]
    path.write_bytes(bytes(data))
    capsys.readouterr()
    s = LiveServer(store, context=512, snapshot_dir=folder)
    try:
        _, _, usage = follow_up(s, FIRST, reply)
        err = capsys.readouterr().err
    finally:
        s.close()
    assert usage.prompt_tokens_details.cached_tokens == 0
    line = next(x for x in err.splitlines() if "snapshot file dropped" in x)
    assert str(path) in line and ("checksum mismatch" if damage == "flip" else "truncated") in line
    assert path not in snaps(folder) or path.read_bytes() != bytes(data)  # removed (a new snapshot may take its name)
