"""Token ids -> text deltas for streaming: incremental detokenising, stop strings, reasoning split.

Each class is fed pieces and returns what may be shown now, holding back only what could still
change: an unfinished multi-byte character, a possible start of a stop string, a possible start
of a <think> / </think> tag.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Detokenizer:
    """Incremental decode: the text a new token adds, once its characters are complete. keep: special tokens
    shown all the same (a tool-call format's markers, which some tokenizers mark special)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()):
        self.tok = tokenizer
        self.skip = skip_special_tokens and not keep
        self.hide = frozenset(tokenizer.all_special_ids) - keep if keep and skip_special_tokens else frozenset()
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already shown
        self.read = 0

    def push(self, token: int) -> str:
        if token in self.hide:
            return ""
        self.ids.append(token)
        shown = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        if len(full) <= len(shown) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(shown) :]


class StopMatcher:
    """Cuts text at the first stop string; holds back a tail that could begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.buf += text
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.buf = self.buf[:cut], ""
            return out
        keep = min(self.hold, len(self.buf))
        out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.stopped else self.buf), ""
        return out


class ReasoningSplitter:
    """Routes text inside <think>...</think> to reasoning, the rest to content.

    `thinking` starts True when the prompt already opened the think block (a template that ends
    the generation prompt with <think>)."""

    def __init__(self, thinking: bool = False):
        self.thinking = thinking
        self.buf = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            i = self.buf.find(tag)
            if i >= 0:
                out.append(("reasoning" if self.thinking else "content", self.buf[:i]))
                self.buf = self.buf[i + len(tag) :].lstrip("\n") if self.thinking else self.buf[i + len(tag) :]
                self.thinking = not self.thinking
                continue
            keep = partial_tag(self.buf, tag)
            out.append(("reasoning" if self.thinking else "content", self.buf[: len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep :]
            return [(k, t) for k, t in out if t]

    def flush(self) -> list[tuple[str, str]]:
        out, self.buf = self.buf, ""
        return [("reasoning" if self.thinking else "content", out)] if out else []


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
