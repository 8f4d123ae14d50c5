"""Streaming text pieces: incremental detokenising, stop strings across tokens, the reasoning split;
and the snapshot store's prefix lookup and byte budget."""

from __future__ import annotations

from types import SimpleNamespace

from sluice.api.snapshots import SnapshotStore
from sluice.api.text import Detokenizer, ReasoningSplitter, StopMatcher


class ByteTok:
    """Token i is byte i: multi-byte characters span tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_waits_for_whole_characters():
    d = Detokenizer(ByteTok())
    data = "añ€😀!".encode()
    out = [d.push(b) for b in data]
    assert "".join(out) == "añ€😀!"
    assert out[1] == "" and out[2] == "ñ"  # the first byte of ñ shows nothing yet


def test_stop_strings_split_across_pieces():
    m = StopMatcher(("END", "xyz"))
    pieces = ["hello E", "N", "D and more"]
    out = "".join(m.push(p) for p in pieces) + m.flush()
    assert out == "hello " and m.stopped
    m = StopMatcher(("END",))
    assert "".join(m.push(p) for p in ["no E", "nd here"]) + m.flush() == "no End here" and not m.stopped


def test_reasoning_split_with_partial_tags():
    s = ReasoningSplitter(thinking=True)
    pieces = []
    for t in ["let me th", "ink</th", "ink>\n\nThe ans", "wer"]:
        pieces += s.push(t)
    pieces += s.flush()
    text = {k: "".join(t for kk, t in pieces if kk == k) for k in ("reasoning", "content")}
    assert text == {"reasoning": "let me think", "content": "The answer"}
    s = ReasoningSplitter(thinking=False)
    got = s.push("a<thi") + s.push("nk>b</think>c") + s.flush()
    assert got == [("content", "a"), ("reasoning", "b"), ("content", "c")]


def snap(tokens, nbytes):
    return SimpleNamespace(tokens=tuple(tokens), nbytes=nbytes)


def test_snapshot_store_longest_prefix_and_budget():
    st = SnapshotStore(budget_bytes=100)
    st.put(snap([1, 2], 40))
    st.put(snap([1, 2, 3, 4], 40))
    assert st.longest_prefix([1, 2, 3, 4, 5]).tokens == (1, 2, 3, 4)
    assert st.longest_prefix([1, 2, 3, 4]).tokens == (1, 2)  # a proper prefix only: a new token must remain
    assert st.longest_prefix([9]) is None and (st.hits, st.misses) == (2, 1)
    st.put(snap([7], 40))  # over budget: the least recently used, (1, 2, 3, 4), goes
    assert len(st) == 2 and st.bytes == 80 and st.longest_prefix([1, 2, 3, 4, 5]).tokens == (1, 2)
    st.put(snap([8], 500))  # larger than the whole budget: not kept
    assert len(st) == 2
