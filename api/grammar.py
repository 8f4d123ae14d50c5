"""Grammar-constrained decoding: `response_format` (json_object, json_schema) and forced tool calls
(`tool_choice` required or a named function), through llguidance.

llguidance (Microsoft's Rust core of Guidance, used by vLLM, SGLang and llama.cpp) was chosen over xgrammar and
outlines-core: one abi3 wheel serves every CPython >= 3.9 on x86-64 and aarch64 with no dependency (xgrammar pulls
torch, transformers, triton and a TVM runtime of its own, and ships a wheel per Python version), it compiles a JSON
schema or a Lark grammar in well under a millisecond without a vocabulary-wide precompute, and its Lark dialect
embeds JSON schemas (`%json {...}`), which is how a tool call's arguments are written inside the family's markers.

Per token: llguidance writes the allowed-token bitmask (one bit per id) into a pinned host buffer on a thread of
its own while the engine runs the step (it drops the GIL), the 4-byte-per-32-ids mask goes to the device without a
wait, and the device unpacks it and fills the banned logits with -inf. The only host sync is the sampled id, which
sampling had already (the matcher must see each token to compute the next mask).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from sluice.api.protocol import APIError
from sluice.api.toolcalls import ToolFormat, json_lexeme
from sluice.api.tools import ToolRequest
from sluice.errors import SluiceError

THINK = 'think[lazy]: /(.|\\n)*/ "</think>"\nTHINK_END: /\\n*/'  # the reasoning a template opened: free text up to its end


def parse_response_format(body: dict) -> dict | None:
    """`response_format` -> the JSON schema the reply must match, or None (plain text)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}", "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"type": "object"}
    spec = rf.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise APIError(400, "'response_format.json_schema.schema' must be a JSON schema object", "response_format")
    return schema


class Grammars:
    """Builds the Constraint of a request over one tokenizer (llguidance's view of it made on first use)."""

    def __init__(self, tokenizer, vocab_size: int, device: torch.device):
        self.tokenizer, self.vocab_size, self.device = tokenizer, vocab_size, device
        self._ll = None
        self._pool: ThreadPoolExecutor | None = None  # computes masks beside the engine's step
        self._lock = threading.Lock()  # requests build their constraints on threads of their own

    def constraint(self, schema: dict | None, tools: ToolRequest | None, fmt: ToolFormat, thinking: bool) -> "Constraint | None":
        """The constraint of a chat reply: forced tool calls, else the response_format schema (or a tool call, when
        tools are offered), else None (free text)."""
        forced = tools.forced if tools is not None else ()
        if not forced and schema is None:
            return None
        rules, body = [], ""
        if forced:
            call_rules = []
            for i, t in enumerate(forced):
                rules += fmt.call_grammar(t, self._lit, f"call_{i}")
                call_rules.append(f"call_{i}")
            rules.append(f"call: {' | '.join(call_rules)}")
            body = fmt.calls_grammar("call", tools.parallel, self._lit)
        else:
            body = "answer"
            rules.append(f"answer: {json_lexeme(schema)}")
        start = f"start: {'think THINK_END ' if thinking else ''}{body}"
        lark = "\n".join([start, *rules, *([THINK] if thinking else [])])
        where = "tool_choice" if forced else "response_format"
        return Constraint(self._matcher(lark, where), self.vocab_size, self.device, self._executor())

    def _matcher(self, lark: str, where: str):
        ll = self._llguidance()
        m = ll.LLMatcher(self._tok(), ll.LLMatcher.grammar_from_lark(lark), log_level=0)
        if m.is_error():
            raise APIError(400, f"'{where}': cannot build its grammar: {m.get_error().splitlines()[0]}", where)
        return m

    def _lit(self, text: str) -> str:
        """A Lark literal for text; a special token is named by id (its bytes are not text the model spells)."""
        ids = self.tokenizer.convert_tokens_to_ids([text])
        if ids and isinstance(ids[0], int) and ids[0] != self.tokenizer.unk_token_id and self._tok().is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text, ensure_ascii=False)

    def _llguidance(self):
        try:
            import llguidance
        except ImportError:
            raise APIError(501, "structured output (response_format, tool_choice 'required' or a named function) needs "
                                "llguidance: pip install llguidance", code="grammar_unavailable") from None
        return llguidance

    def _tok(self):
        with self._lock:
            return self._ll or self._make_tok()

    def _make_tok(self):
        llguidance = self._llguidance()
        import llguidance.hf

        eos = [i for i in {self.tokenizer.eos_token_id} if i is not None] or None
        try:
            self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        except Exception:  # a decoder llguidance does not read (a character tokenizer's Fuse): each id's bytes
            wrapper = llguidance.TokenizerWrapper(_TokenBytes(self.tokenizer))
            self._ll = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=eos)
        return self._ll

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar")
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class _TokenBytes:
    """A tokenizer as llguidance's TokenizerWrapper reads one: each id's bytes, the special ids, str -> ids."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.tokens = [tokenizer.decode([i]).encode() for i in range(len(tokenizer))]
        self.special_token_ids = list(tokenizer.all_special_ids)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")  # tells the wrapper to pass strings
        return self.tok(text, add_special_tokens=False)["input_ids"]


class Constraint:
    """One reply's grammar state. The worker thread calls `start` before a step, `apply` on the step's logits,
    `advance` with the sampled token; `done` once the grammar is complete (only EOS may follow)."""

    def __init__(self, matcher: Any, vocab_size: int, device: torch.device, pool: ThreadPoolExecutor):
        self.matcher, self.vocab_size, self.pool = matcher, vocab_size, pool
        words = (vocab_size + 31) // 32
        cuda = device.type == "cuda"
        self.host = torch.zeros(words, dtype=torch.int32, pin_memory=cuda)
        # the device copy of `host`; `host` is rewritten only after the sample of the step that read it, which waited
        self.mask = torch.empty(words, dtype=torch.int32, device=device) if cuda else self.host
        self.shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._pending: Future | None = None

    def start(self) -> None:
        """Compute the next mask on the grammar thread (no-op when under way)."""
        if self._pending is None:
            self._pending = self.pool.submit(self._fill)

    def _fill(self) -> None:  # a method, so the queued task holds `host` alive even if the reply is dropped meanwhile
        self.matcher.unsafe_compute_mask_ptr(self.host.data_ptr(), self.host.numel() * 4)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] (device) -> the same with every token the grammar forbids at -inf."""
        self.start()
        self._pending.result()
        self._pending = None
        if self.mask is not self.host:
            self.mask.copy_(self.host, non_blocking=True)
        allowed = ((self.mask[:, None] >> self.shifts) & 1).view(-1)[: logits.shape[-1]].bool()
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise SluiceError(f"the grammar rejected token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()
