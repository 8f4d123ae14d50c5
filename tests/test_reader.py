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


def test_busy_time_counts_the_drive_once_however_many_reads_are_on_it(stores, monkeypatch):
    """`busy_s`: the time with at least one read on the drive. Reads at once count once; a gap between reads does
    not count; a read still on the drive counts up to now. `counts` also times each read, queued and on the drive, as
    a demand or a guess. (A clock the test moves, and reads it lets finish.)"""
    import threading
    import types

    import sluice.storage.reader as reader_module

    clock, real = [0.0], reader_module._pread_full
    started = {e: threading.Event() for e in range(3)}
    finish = {e: threading.Event() for e in range(3)}

    def pread(fd, view, offset):  # on the drive until the test lets it finish
        e = offset // store.block_bytes
        started[e].set()
        assert finish[e].wait(10)
        return real(fd, view, offset)

    monkeypatch.setattr(reader_module, "_pread_full", pread)
    monkeypatch.setattr(reader_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    store = ExpertStore.open(stores["qwen3_moe"])
    arena = HostArena(3, store.block_bytes, pin=False)
    layer = store.moe_layers[0]
    reader = BlockReader(store, threads=2)
    try:
        both = [reader.submit(layer, e, arena.slot(e)) for e in (0, 1)]  # two reads on the drive from t = 0
        assert started[0].wait(10) and started[1].wait(10)
        clock[0] = 1.0
        finish[0].set()
        both[0].result(10)
        clock[0] = 3.0
        finish[1].set()
        both[1].result(10)
        assert reader.busy_s() == 3.0  # 0 -> 3 once, not 1 + 3
        clock[0] = 10.0  # idle from 3 to 10
        last = reader.submit(layer, 2, arena.slot(2), guess=True)
        assert started[2].wait(10)
        clock[0] = 11.0
        assert reader.busy_s() == 4.0  # the read on the drive counts up to now
        clock[0] = 12.0
        finish[2].set()
        last.result(10)
        assert reader.busy_s() == 5.0  # not the gap
        assert reader.counts() == {"disk_busy_s": 5.0, "demand_reads_timed": 2, "demand_queued_s": 0.0, "demand_drive_s": 4.0,
                                   "guess_reads_timed": 1, "guess_queued_s": 0.0, "guess_drive_s": 2.0}

        def guess_behind_two_demands(t0: float, land: float, end: float, promote_at: float | None = None) -> dict:
            """Two demand reads on both threads from t0, a guess queued behind them (promoted at `promote_at`), the
            demands landing at `land`, the guess at `end`: the counts then."""
            clock[0] = t0
            for e in range(3):
                finish[e], started[e] = threading.Event(), threading.Event()
            held = [reader.submit(layer, e, arena.slot(e)) for e in (0, 1)]
            assert started[0].wait(10) and started[1].wait(10)
            queued = reader.submit(layer, 2, arena.slot(2), guess=True)
            if promote_at is not None:
                clock[0] = promote_at
                assert reader.promote(queued)
            clock[0] = land
            finish[0].set()
            finish[1].set()
            for f in held:
                f.result(10)
            assert started[2].wait(10)
            clock[0] = end
            finish[2].set()
            queued.result(10)
            return reader.counts()

        c = guess_behind_two_demands(20.0, 21.0, 22.5)  # the guess taken at 21, when the demands land
        assert (c["guess_reads_timed"], c["guess_queued_s"], c["guess_drive_s"]) == (2, 1.0, 3.5)
        c = guess_behind_two_demands(30.0, 32.0, 33.0, promote_at=31.0)  # needed at 31: a demand, queued from then
        assert c["guess_reads_timed"] == 2 and c["demand_reads_timed"] == 7  # 2 + 2 + 2 demands, and the promoted guess
        assert (c["demand_queued_s"], c["demand_drive_s"]) == (1.0, (1 + 3) + (1 + 1) + (2 + 2) + 1)
    finally:
        for f in finish.values():
            f.set()
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


@pytest.mark.parametrize("pieces", [1, 3])
def test_guesses_wait_for_demand_reads_and_can_be_promoted_or_cancelled(stores, monkeypatch, pieces):
    """A guess starts only while no demand read is queued or running, at most `guesses` (pieces) at once; a queued
    guess can be read next (promote) or dropped unread (cancel); a future its holder cancels before it starts is not
    read, and the pool reads on. Blocks whole or in pieces."""
    import threading

    store = ExpertStore.open(stores["qwen3_moe"])
    arena = HostArena(8, store.block_bytes, pin=False)
    layer = store.moe_layers[0]
    reader = BlockReader(store, threads=4, guesses=1, verify=False, pieces=pieces)
    gate, lock, order, running, most = threading.Event(), threading.Lock(), [], [0], [0]

    def read_piece(job, i):  # a slow drive that reads nothing: expert 0 holds the drive until the gate opens
        expert = job.expert
        with lock:
            order.append(expert)
            running[0] += expert >= 10  # guesses are experts 10+
            most[0] = max(most[0], running[0])
        if expert == 0:
            gate.wait(10)
        with lock:
            running[0] -= expert >= 10

    monkeypatch.setattr(reader, "_read_piece", read_piece)
    first = reader.submit(layer, 0, arena.slot(0))
    guesses = [reader.submit(layer, e, arena.slot(i + 1), guess=True) for i, e in enumerate((10, 11, 12, 13))]
    demand = reader.submit(layer, 1, arena.slot(5))
    assert reader.promote(guesses[3])  # needed now (not started): read as a demand, before the other guesses
    assert reader.cancel(guesses[1]) and guesses[1].cancelled()
    dropped = reader.submit(layer, 14, arena.slot(6), guess=True)
    assert dropped.cancel()  # by its holder (as asyncio does for a cancelled waiter)
    gate.set()
    for f in (first, demand, guesses[0], guesses[2], guesses[3]):
        assert f.result(10) == store.block_bytes
    blocks = list(dict.fromkeys(order))  # in the order their first pieces were taken
    assert len(order) == 5 * pieces
    assert blocks[:3] in ([0, 1, 13], [0, 13, 1])  # demands (the promoted guess is one) before any guess
    assert sorted(blocks[3:]) == [10, 12] and 11 not in order and 14 not in order  # the cancelled ones never read
    assert most[0] == 1  # one guess piece at a time
    assert reader.submit(layer, 2, arena.slot(0)).result(10) == store.block_bytes  # the threads read on
    assert not reader.cancel(first)  # done: nothing to cancel
    reader.close()
    with pytest.raises(Exception, match="closed"):
        reader.submit(layer, 2, arena.slot(0))


def test_a_block_in_pieces_reads_the_file_and_each_piece_waits_its_turn(stores, monkeypatch):
    """`pieces`: a block is read as page-aligned parts by the pool's threads, checked and counted as one block. A
    demand read's pieces go before a guess's pieces not yet started; a guess promoted after its first piece started
    stays a guess (`promote` says False, `cancel` cannot drop it) and its other pieces are read as a demand's: behind
    the demands queued before, ahead of those queued after and of every guess. Closing the reader reads a block it has
    begun to its end and drops those it has not."""
    import threading

    import sluice.storage.reader as reader_module

    store = ExpertStore.open(stores["qwen3_moe"])
    n, layer = store.block_bytes, store.moe_layers[0]
    parts = reader_module._split(n, 3)  # whole pages, end to end, as even as pages allow
    assert len(parts) == 3 and parts[0][0] == 0 and sum(b for _, b in parts) == n
    assert all(a % 4096 == 0 and b % 4096 == 0 and a + b == c for (a, b), (c, _) in zip(parts, parts[1:]))
    assert max(b for _, b in parts) - min(b for _, b in parts) <= 4096
    assert reader_module._split(8192, 5) == ((0, 4096), (4096, 4096))  # never less than a page
    arena = HostArena(4, n, pin=False)
    with BlockReader(store, threads=3, pieces=3) as reader:
        reader.submit(layer, 4, arena.slot(0)).result(10)
        assert (reader.reads, reader.bytes_read) == (1, n)  # one block, however many pieces
    with open(store.file(layer), "rb") as f:
        f.seek(4 * n)
        assert bytes(arena.slot(0).numpy()) == f.read(n)

    real, order, gate, started = reader_module._pread_full, [], threading.Event(), threading.Event()

    def pread(fd, view, offset):  # one thread: the order pieces are taken in; a block's first piece at expert 10 or
        order.append((offset // n, offset % n))  # 14 waits for the gate
        if offset // n in (10, 14) and offset % n == 0:
            started.set()
            assert gate.wait(10)
        return real(fd, view, offset)

    monkeypatch.setattr(reader_module, "_pread_full", pread)
    with BlockReader(store, threads=1, pieces=3) as reader:
        s0, s1, s2 = [at for at, _ in reader.pieces]
        guess = reader.submit(layer, 10, arena.slot(0), guess=True)
        assert started.wait(10)
        other = reader.submit(layer, 11, arena.slot(1), guess=True)
        later = reader.submit(layer, 12, arena.slot(3), guess=True)
        demand = reader.submit(layer, 1, arena.slot(2))
        assert not reader.promote(guess) and not reader.cancel(guess)  # started: its last pieces read as a demand's
        after = reader.submit(layer, 2, arena.slot(1))
        assert reader.cancel(other) and other.cancelled()
        gate.set()
        for f in (guess, demand, after, later):
            assert f.result(10) == n
        counts = reader.counts()
    assert order == [(10, 0), (1, s0), (1, s1), (1, s2), (10, s1), (10, s2),  # the promoted guess before a later demand
                     (2, s0), (2, s1), (2, s2), (12, s0), (12, s1), (12, s2)]
    assert (counts["guess_reads_timed"], counts["demand_reads_timed"]) == (2, 2)

    gate.clear(), started.clear()
    reader = BlockReader(store, threads=1, pieces=3)
    begun = reader.submit(layer, 14, arena.slot(0))
    assert started.wait(10)
    queued = reader.submit(layer, 15, arena.slot(1))
    closing = threading.Thread(target=reader.close)
    closing.start()
    while not queued.cancelled():  # close drops the block not begun at once, then waits for the one begun
        threading.Event().wait(0.001)
    gate.set()
    closing.join(10)
    assert begun.result(10) == n and not closing.is_alive()


def test_a_block_in_pieces_fails_whole_naming_layer_and_expert(stores, tmp_path):
    """A piece's short read (the first short piece's count: what the file holds of the block) or a checksum over the
    pieces that does not match fails the block's future, naming layer and expert; the reader reads on."""
    import shutil

    bad = tmp_path / "s"
    shutil.copytree(stores["qwen3_moe"], bad)
    store = ExpertStore.open(bad)
    n, layer = store.block_bytes, store.moe_layers[1]
    arena = HostArena(2, n, pin=False)
    with open(store.file(layer), "r+b") as f:
        f.seek(2 * n + n - 3)
        b = f.read(1)
        f.seek(2 * n + n - 3)
        f.write(bytes([b[0] ^ 1]))  # in the last piece
    with BlockReader(store, threads=2, pieces=4) as reader:
        with pytest.raises(CorruptBlockError, match=f"layer {layer}, expert 2: checksum mismatch"):
            reader.submit(layer, 2, arena.slot(0)).result(10)
        with open(store.file(layer), "r+b") as f:
            f.truncate((store.manifest.num_experts - 1) * n + n // 2)  # the last block cut in its middle
        last = store.manifest.num_experts - 1
        # pieces 2 and 3 come up short; the message is the first one's (what the file holds of the block)
        with pytest.raises(CorruptBlockError, match=f"layer {layer}, expert {last}: short read: {n // 2} of {n} bytes"):
            reader.submit(layer, last, arena.slot(1)).result(10)
        assert reader.submit(layer, 1, arena.slot(0)).result(10) == n
