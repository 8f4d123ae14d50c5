"""How long a reply may be, and what becomes of a prompt that does not leave it room: the server's choice.

Chat front ends send background requests (titles, tags, follow-up suggestions) without `max_tokens`; left alone
each would run to the end of the context. `default_max_tokens` bounds them. A prompt over the context is refused
(`truncate` "error", OpenAI's context_length_exceeded) or loses its oldest part ("left"): a chat its oldest
messages after the system prompt, then, like a plain prompt, its oldest tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from sluice.api.protocol import APIError
from sluice.errors import ConfigError
from sluice.log import get_logger

TRUNCATE = ("error", "left")
DEFAULT_MAX_TOKENS = 1024  # `sluice serve`'s reply length for requests without max_tokens


@dataclass(frozen=True)
class Limits:
    context: int  # tokens a sequence may hold, prompt and reply
    default_max_tokens: int | None = None  # a reply's length when the request names none; None: to the context's end
    truncate: str = "error"  # a prompt over the context: refused ("error") or cut from the left ("left")

    def __post_init__(self):
        if self.context < 2:
            raise ConfigError(f"context: must be >= 2 tokens, got {self.context}")
        if self.default_max_tokens is not None and not 1 <= self.default_max_tokens < self.context:
            raise ConfigError(f"--default-max-tokens: must be in [1, {self.context - 1}] (the context is {self.context}), "
                              f"got {self.default_max_tokens}")
        if self.truncate not in TRUNCATE:
            raise ConfigError(f"--truncate: must be one of {', '.join(TRUNCATE)}, got {self.truncate!r}")

    @classmethod
    def of(cls, context: int, default_max_tokens: int | None, truncate: str = "error") -> "Limits":
        """The server's limits from its settings: default_max_tokens None is DEFAULT_MAX_TOKENS, or half the context
        when that is shorter; 0 is none (a reply may run to the end of the context)."""
        if default_max_tokens is None:
            default_max_tokens = min(DEFAULT_MAX_TOKENS, context // 2)
        return cls(context, default_max_tokens or None, truncate)

    def room(self, asked: int | None) -> int:
        """Tokens a prompt must leave free when it is cut: the reply asked for, else the default, else one."""
        return asked or self.default_max_tokens or 1

    def fits(self, n: int, asked: int | None) -> bool:
        return n + self.room(asked) <= self.context

    def fit(self, ids: list[int], asked: int | None, param: str, total: int | None = None) -> tuple[list[int], int]:
        """(the prompt, cut from the left where `truncate` says so, and the reply's max_tokens) or a 400 naming why.
        total: the prompt's length where ids hold only its last context's worth, or none under "error"
        (api/render.py `prompt_ids`)."""
        n = len(ids) if total is None else total
        if asked is not None and asked >= self.context:
            raise APIError(400, f"max_tokens ({asked}) exceeds the context of {self.context}, leaving no room for a prompt",
                           "max_tokens", "context_length_exceeded")
        if self.truncate == "left" and not self.fits(n, asked):
            keep = self.context - self.room(asked)
            get_logger().info("prompt cut from the left to fit the context", tokens=n, kept=keep, context=self.context)
            ids = ids[len(ids) - keep :]
            n = len(ids)
        if n >= self.context:
            raise APIError(400, f"the prompt is {n} tokens; this model's context is {self.context} (the server "
                                "refuses longer prompts: --truncate left cuts them instead)", param, "context_length_exceeded")
        if asked is not None and n + asked > self.context:
            raise APIError(400, f"prompt ({n} tokens) + max_tokens ({asked}) exceeds the context of {self.context}",
                           "max_tokens", "context_length_exceeded")
        return ids, min(asked or self.default_max_tokens or self.context, self.context - n)

    def drop_messages(self, messages: list[dict], render: Callable[[list[dict]], list[int]], asked: int | None) -> list[int]:
        """A chat's prompt ids; under "left", its oldest messages after the leading system ones dropped one at a time
        (the last one always kept) until the rest leaves the reply room."""
        ids = render(messages)
        if self.truncate != "left":
            return ids
        head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        dropped = 0
        while not self.fits(len(ids), asked) and head + dropped < len(messages) - 1:
            dropped += 1
            if messages[head + dropped]["role"] == "tool":  # a tool result without its call reads as noise
                continue
            try:
                ids = render(messages[:head] + messages[head + dropped :])
            except APIError:  # a template that wants, e.g., a user message first: drop on
                continue
        if dropped:
            get_logger().info("oldest messages dropped to fit the context", messages=dropped, tokens=len(ids), context=self.context)
        return ids
