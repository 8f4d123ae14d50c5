"""Limits that fit chat front ends: a default reply length, a prompt over the context refused or cut from the left,
and /metrics counting every request by status and error code, rejected ones too."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from sluice.api.limits import Limits
from sluice.api.protocol import APIError
from sluice.errors import ConfigError
from test_api import MODEL, LiveServer
from test_tools import Script

CHATML_HEADER = "<|im_start|>assistant\n"


def test_fit_refuses_or_cuts_and_bounds_the_reply():
    strict, left = Limits(100, 10), Limits(100, 10, "left")
    assert strict.fit(list(range(50)), None, "prompt") == (list(range(50)), 10)  # the default when none is asked
    assert strict.fit(list(range(95)), None, "prompt")[1] == 5  # and no more than what is left
    assert strict.fit(list(range(50)), 30, "prompt")[1] == 30
    with pytest.raises(APIError, match="context") as e:
        strict.fit(list(range(120)), None, "prompt")
    assert e.value.code == "context_length_exceeded"
    ids, n = left.fit(list(range(120)), None, "prompt")
    assert ids == list(range(30, 120)) and n == 10  # the oldest tokens go, the reply keeps its room
    assert left.fit(list(range(95)), 20, "prompt") == (list(range(15, 95)), 20)
    with pytest.raises(APIError, match="exceeds the context"):
        left.fit([1], 100, "prompt")
    assert Limits.of(100, None).default_max_tokens == 50 and Limits.of(4096, None).default_max_tokens == 1024
    assert Limits.of(100, 0).default_max_tokens is None
    for bad in (dict(default_max_tokens=100), dict(default_max_tokens=-1), dict(truncate="right")):
        with pytest.raises(ConfigError):
            Limits(100, **bad)


def test_fit_takes_a_long_prompts_length_with_its_last_ids_or_none():
    """A prompt longer than the context comes as its length with its last context's worth of ids (under "left") or none
    (api/render.py `prompt_ids`): refused naming its whole length, or cut as the whole prompt would be."""
    strict, left = Limits(100, 10), Limits(100, 10, "left")
    with pytest.raises(APIError, match="the prompt is 5000 tokens"):
        strict.fit([], None, "prompt", total=5000)
    assert left.fit(list(range(4900, 5000)), None, "prompt", total=5000) == left.fit(list(range(5000)), None, "prompt")


@pytest.mark.parametrize("tokenizer", ["char", "bundled"])
def test_prompt_ids_are_the_tokenizers_call(tokenizer, stores):
    """prompt_ids gives the ids of the tokenizer's call (special-token text, unicode, a post-processor's BOS), also after
    a call that split special tokens; of a prompt longer than `most`, its last `most` (tail) or none, with its whole
    length either way."""
    from sluice.api.render import prompt_ids
    from sluice.models.builtin import DEFAULT_MODEL

    tok = AutoTokenizer.from_pretrained(stores["nemotron_h"] if tokenizer == "char" else DEFAULT_MODEL)
    texts = ("Hello, world!", "<|im_start|>user\nhi<|im_end|>", "caf\u00e9 \u2603 tabs\tand  spaces", "x" * 700)
    wants = [list(tok(text)["input_ids"]) for text in texts]
    tok("<|im_start|>", split_special_tokens=True)  # (a chat's user text: leaves the backend splitting special tokens)
    for text, want in zip(texts, wants):
        assert prompt_ids(tok, text, 10_000, tail=False) == (want, len(want))
        assert prompt_ids(tok, text, 5, tail=True) == (want[-5:], len(want))
        assert prompt_ids(tok, text, 5, tail=False) == (want if len(want) <= 5 else [], len(want))
    assert len(want) > 5  # (the long one)


def test_drop_messages_keeps_the_system_prompt_and_the_last_turn():
    render = lambda ms: [0] * sum(10 for _ in ms)  # noqa: E731  ten tokens a message
    msgs = [{"role": "system"}, {"role": "user"}, {"role": "assistant"}, {"role": "tool"}, {"role": "user"}, {"role": "user"}]
    assert len(Limits(100, 10, "left").drop_messages(msgs, render, None)) == 60
    seen = []
    Limits(45, 10, "left").drop_messages(msgs, lambda ms: seen.append([m["role"] for m in ms]) or render(ms), None)
    assert seen[-1] == ["system", "user", "user"]  # the tool result went with its call, the system prompt stayed
    assert ["system", "tool", "user", "user"] not in seen
    assert len(Limits(45, 10).drop_messages(msgs, render, None)) == 60  # "error": nothing dropped


@pytest.fixture(scope="module")
def limited(stores):
    tok = AutoTokenizer.from_pretrained(stores["nemotron_h"])
    script = Script(tok, CHATML_HEADER)
    s = LiveServer(stores["nemotron_h"], context=300, tokenizer=tok, script=script, default_max_tokens=7, truncate="left")
    script.say("a reply much longer than seven tokens")
    s.script = script
    yield s
    s.close()


def test_default_max_tokens_bounds_requests_without_one(limited):
    r = limited.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "title?"}])
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length" and r.choices[0].message.content == "a reply"
    r = limited.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "title?"}], max_tokens=9)
    assert r.usage.completion_tokens == 9


def test_truncate_left_drops_the_oldest_turns(limited):
    old = [{"role": "user", "content": "old question " * 8}, {"role": "assistant", "content": "old answer " * 8}] * 3
    messages = [{"role": "system", "content": "Be brief."}, *old, {"role": "user", "content": "the question now"}]
    r = limited.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    assert r.usage.prompt_tokens + 20 <= 300 and r.usage.completion_tokens == 20
    prompt = limited.script.prompts[-1]
    assert prompt.startswith("<|im_start|>system\nBe brief.") and "the question now" in prompt and prompt.count("user\nold question") < 3


def test_metrics_count_rejected_requests_by_status_and_code(stores):
    s = LiveServer(stores["nemotron_h"], context=64)
    try:
        bad_json = httpx.post(s.url + "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
        unknown = httpx.post(s.url + "/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        long = httpx.post(s.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 100}]})
        missing = httpx.get(s.url + "/v2/nothing")
        assert [r.status_code for r in (bad_json, unknown, long, missing)] == [400, 404, 400, 404]
        ok = s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert ok.usage.completion_tokens >= 1
        assert s.metric('sluice_requests_total{status="rejected"}') == 4
        assert s.metric('sluice_requests_total{status="ok"}') == 1
        assert s.metric('sluice_request_errors_total{code="context_length_exceeded",status="400"}') == 1
        assert s.metric('sluice_request_errors_total{code="model_not_found",status="404"}') == 1
        assert s.metric('sluice_request_errors_total{code="invalid_request_error",status="400"}') == 1
        assert s.metric('sluice_request_errors_total{code="404",status="404"}') == 1
    finally:
        s.close()
