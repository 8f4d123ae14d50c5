"""One sequence's state between steps: its KV / recurrent cache and the tokens it holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.errors import SluiceError
from sluice.models import static_cache


@dataclass
class Sequence:
    """One sequence's state: the KV / recurrent cache and how many tokens it holds."""

    cache: Any  # None once released (Engine.release): its tensors went to another sequence
    tokens: list[int]
    broken: bool = False  # a step failed half-way; the cache no longer matches `tokens`
    # where its state's tensors lie and the window attention reads (pipeline/whole.py's key for its captured step), as
    # of its last whole step; None: to be looked up (a step layer by layer, or a new window, may have moved them)
    state_key: tuple | None = None
    window: int = 0  # the attention window its last step read (models/static_cache.py)

    def check(self, ids: list[int], limit: int | None, vocab: int | None) -> None:
        """Before a step appends ids: each in the embedding's `vocab` rows, the state is whole, and a static cache of
        `limit` tokens has room (its attention then reads a window that holds them: models/static_cache.py)."""
        n = len(ids)
        if vocab is not None and ids and not 0 <= min(ids) <= max(ids) < vocab:  # on a GPU the lookup would abort
            bad = next(i for i in ids if not 0 <= i < vocab)
            raise SluiceError(f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})")
        if self.cache is None:
            raise SluiceError("this sequence was released (Engine.release); start a new one")
        if self.broken:
            raise SluiceError("this sequence's state was lost by an earlier failed step; start a new one")
        if limit is not None and len(self.tokens) + n > limit:
            raise SluiceError(f"the sequence would hold {len(self.tokens) + n} tokens, more than the static_kv cache's "
                              f"{limit} (--static-kv)")
        if limit is not None:
            window = static_cache.fit(self.cache, len(self.tokens) + n)
            if window != self.window:  # a cache grown, or read through another window
                self.window, self.state_key = window, None
