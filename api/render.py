"""A chat's prompt ids from the model's chat template, with what users wrote tokenised as text.

The template renders one string and the tokenizer turns every added token's text in it into that token, so a user
who types `<|im_start|>system` would write a real role marker. Where a message's text holds such a token's text,
each such text is rendered as a placeholder and tokenised on its own with `split_special_tokens` (its markers stay
characters); the template's own text around it is tokenised as usual. Messages without such text take the plain
path, so their ids are exactly the template's.
"""

from __future__ import annotations

import re

_MARK = "\ue000{}\ue001"  # private-use characters: no template or user text writes them by chance
_SPLIT = re.compile("\ue000(\\d+)\ue001")


def chat_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    """The ids apply_chat_template gives (generation prompt added), special-token text in contents kept as text."""
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.content]
    pieces: list[str] = []

    def hide(text):
        if not isinstance(text, str) or not any(s in text for s in specials):
            return text
        pieces.append(text)
        return _MARK.format(len(pieces) - 1)

    hidden = [_hide_message(m, hide) for m in messages]
    text = tokenizer.apply_chat_template(hidden, add_generation_prompt=True, tokenize=False, **kwargs)
    if not pieces:  # what tokenize=True runs on the rendered text
        return _encode(tokenizer, text)
    ids: list[int] = []
    for i, part in enumerate(_SPLIT.split(text)):
        if i % 2:  # a user's text: its special-token text stays characters
            ids += tokenizer(pieces[int(part)], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif part:
            ids += _encode(tokenizer, part)
    return ids


def _encode(tokenizer, text: str) -> list[int]:
    """tokenizer(text, add_special_tokens=False)'s ids (a 10 MB chat message through the call: /health waited 0.75 s)."""
    enc = _backend_encode(tokenizer, text, add_special_tokens=False)
    return enc.ids if enc is not None else list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _backend_encode(tokenizer, text: str, add_special_tokens: bool):
    """The Encoding the tokenizer's call would make of `text`, from its Rust backend, or None where the call does more
    (a slow tokenizer, truncation, padding). transformers' call builds the ids and the mask as Python lists of every
    token, holding the GIL. Its split of special-token text is set as the call sets it: a call with
    split_special_tokens=True leaves it on in the backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def prompt_ids(tokenizer, text: str, most: int, tail: bool) -> tuple[list[int], int]:
    """(a prompt's ids, its length in tokens): the ids of the tokenizer's call where it has at most `most`, else its
    last `most` (`tail`) or none (a prompt refused on its length alone). A fast tokenizer that neither truncates nor
    pads is measured before its ids become a Python list: a 10 MB prompt's lists (transformers' ids and mask, then a
    copy) held the GIL up to ~0.5 s at a time, and /health waited (2026-12-07)."""
    enc = _backend_encode(tokenizer, text, add_special_tokens=True)  # what the call runs, before any list
    if enc is None:
        ids = list(tokenizer(text)["input_ids"])
        n = len(ids)
    else:
        n = len(enc)
        ids = enc.ids if n <= most or tail else []  # (Encoding.truncate builds every overflow piece: slower)
    return (ids if n <= most else ids[-most:] if tail else []), n


def _hide_message(m: dict, hide) -> dict:
    content = m.get("content")
    if isinstance(content, list):
        content = [{**p, "text": hide(p["text"])} if p.get("type") == "text" else p for p in content]
    else:
        content = hide(content)
    return {**m, "content": content}
