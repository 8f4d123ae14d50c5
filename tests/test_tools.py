"""Tool calling: prompts rendered as transformers renders them, each family's call text parsed into `tool_calls`
(whole and streamed, read by the official `openai` client), tool results in follow-ups, forced calls end to end."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from sluice.api.app import _render_chat
from sluice.api.protocol import parse_chat
from sluice.api.toolcalls import DeepSeek, Hermes, ToolCallSplitter, Tool, Xml, detect_format
from templates import CLOCK, DEEPSEEK, DEEPSEEK_TOKENS, NEMOTRON, QWEN, WEATHER
from test_api import MODEL, LiveServer

TOOLS = [WEATHER, CLOCK]


def _by_name(tools: list[dict]) -> dict[str, Tool]:
    return {t["function"]["name"]: Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
            for t in tools}


BY_NAME = _by_name(TOOLS)
CALLS = {  # each family's text for: "Let me look." + get_weather(city="Paris", days=3) + clock()
    "qwen": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>',
    "nemotron": "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=clock>\n</function>\n</tool_call>\n",
    "deepseek": 'Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
                "<｜tool▁call▁end｜><｜tool▁call▁begin｜>clock<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
}
FORMATS = {"qwen": Hermes(), "nemotron": Xml(), "deepseek": DeepSeek()}
TEMPLATES = {"qwen": QWEN, "nemotron": NEMOTRON, "deepseek": DEEPSEEK}
HEADERS = {"qwen": "<|im_start|>assistant\n", "nemotron": "<|im_start|>assistant\n<think></think>", "deepseek": "<｜Assistant｜></think>"}
EXPECTED = [("get_weather", {"city": "Paris", "days": 3}), ("clock", {})]


def tokenizer(store, family: str):
    """The tiny char tokenizer with the family's template (DeepSeek's markers added as tokens, as its tokenizer has them)."""
    tok = AutoTokenizer.from_pretrained(store)
    if family == "deepseek":
        tok.add_tokens(list(DEEPSEEK_TOKENS))
    tok.chat_template = TEMPLATES[family]
    return tok


class Script:
    """A token-level stand-in for Engine.extend: whatever the prompt, the reply after the last `header` is the text
    given to `say` (then EOS), as logits that leave no other choice at any temperature. Records each prompt it is given."""

    def __init__(self, tok, header: str):
        self.tok, self.header = tok, tok(header, add_special_tokens=False)["input_ids"]
        self.reply: list[int] = []
        self.prompts: list[str] = []

    def say(self, text: str) -> None:
        self.reply = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]

    def __call__(self, seq, ids, images=None, last=False, cancel=None):
        seq.tokens.extend(ids)
        n = len(self.header)
        start = max((i + n for i in range(len(seq.tokens) - n + 1) if seq.tokens[i : i + n] == self.header), default=None)
        if start is None:  # a prompt piece before the generation prompt: its logits are not read
            return torch.zeros(1, len(self.tok))
        if start == len(seq.tokens):
            self.prompts.append(self.tok.decode(seq.tokens))
        i = len(seq.tokens) - start
        logits = torch.zeros(1, len(self.tok))
        logits[0, self.reply[i] if i < len(self.reply) else self.tok.eos_token_id] = 1e3  # sampled or not
        return logits


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("family", list(CALLS))
def test_splitter_reads_each_family_whole_and_piecewise(family):
    text = CALLS[family]
    whole = ToolCallSplitter(FORMATS[family], BY_NAME).push(text)
    split = ToolCallSplitter(FORMATS[family], BY_NAME)
    pieces = [p for ch in text for p in split.push(ch)] + split.flush()
    for out in (whole, pieces):
        assert "".join(t for k, t in out if k == "content").strip() == "Let me look."
        calls = [c for k, c in out if k == "tool_call"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == EXPECTED
        assert [c["index"] for c in calls] == [0, 1] and len({c["id"] for c in calls}) == 2


def test_splitter_keeps_what_is_not_a_call():
    s = ToolCallSplitter(Hermes(), BY_NAME)
    out = s.push("a <tool_cal") + s.push("l>\nnot json\n</tool_call> b <tool") + s.flush()
    assert "".join(t for _, t in out) == "a <tool_call>\nnot json\n</tool_call> b <tool" and s.calls == 0


@pytest.mark.parametrize("template, family", [(QWEN, "hermes"), (NEMOTRON, "xml"), (DEEPSEEK, "deepseek"), ("{{ x }}", "xml")])
def test_format_is_read_from_the_template(template, family):
    assert detect_format(template, "nemotron_h").name == family


@pytest.mark.parametrize("family", list(CALLS))
def test_rendered_prompt_matches_transformers(stores, family):
    """OpenAI messages (arguments as JSON text, tool results by tool_call_id) render to the ids transformers gives for
    the same conversation in its own form (arguments as objects, tools passed as `tools=`)."""
    tok = tokenizer(stores["nemotron_h"], family)
    system = "Answer briefly."
    openai_messages = [
        {"role": "system", "content": system}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "user", "content": "And tomorrow?"}]
    req = parse_chat({"model": MODEL, "messages": openai_messages, "tools": TOOLS}, {MODEL: False})
    served = SimpleNamespace(tokenizer=tok, models={MODEL: False}, tool_format=detect_format(tok.chat_template, "x"),
                             tokenizing=threading.Lock())
    ours = _render_chat(served, req.messages, False, req.tools)
    hf_messages = [
        {"role": "system", "content": system}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"}]
    if family == "deepseek":  # its template renders no tools: the model card's description goes into the system prompt
        hf_messages[0]["content"] = system + "\n\n" + DeepSeek().describe(list(BY_NAME.values()))
    theirs = tok.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ours == list(theirs["input_ids"])
    text = tok.decode(ours)
    assert "get_weather" in text and "sunny" in text and ('"days": 3' in text or "<parameter=days>\n3" in text)


@pytest.fixture(scope="module", params=list(CALLS))
def canned(request, stores):
    family = request.param
    tok = tokenizer(stores["nemotron_h"], family)
    script = Script(tok, HEADERS[family])
    s = LiveServer(stores["nemotron_h"], context=4096, tokenizer=tok, script=script)  # the script runs no model
    s.script, s.family = script, family
    yield s
    s.close()


def test_canned_calls_through_the_openai_client(canned):
    """The family's call text, non-streamed and streamed (read by the client's own stream accumulator), becomes the
    same tool_calls with finish_reason tool_calls; the text before them stays content."""
    canned.script.say(CALLS[canned.family])
    messages = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    r = canned.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=300)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and calls_of(choice.message) == EXPECTED
    assert choice.message.content.strip() == "Let me look."
    with canned.client.chat.completions.stream(model=MODEL, messages=messages, tools=TOOLS, max_tokens=300) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls" and calls_of(final.choices[0].message) == EXPECTED
    assert [c.id for c in final.choices[0].message.tool_calls] != [c.id for c in choice.message.tool_calls]  # fresh ids
    assert "get_weather" in canned.script.prompts[-1] and "The weather in a city" in canned.script.prompts[-1]


def test_canned_follow_up_with_tool_results(canned):
    """A follow-up carrying the assistant's tool_calls and the `role: tool` results renders them and is answered."""
    canned.script.say("It is sunny.")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"}]
    r = canned.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=50)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    assert "sunny, 21 C" in canned.script.prompts[-1] and "Paris" in canned.script.prompts[-1]


def test_tool_choice_none_hides_the_tools(canned):
    canned.script.say(CALLS[canned.family])
    r = canned.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                              tool_choice="none", max_tokens=300)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    assert "get_weather" in r.choices[0].message.content and "The weather in a city" not in canned.script.prompts[-1]


@pytest.mark.parametrize("body, needle", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "'tool_choice' must be one of"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": TOOLS, "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "clock", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments is not valid JSON"),
    ({"response_format": {"type": "yaml"}}, "'response_format' must be"),
])
def test_bad_tool_requests_name_the_field(canned, body, needle):
    import httpx

    payload = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body}
    r = httpx.post(canned.url + "/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def tiny(stores):
    """The tiny random NemotronH with a Nemotron-style template: its own text is noise, so calls come from the grammar."""
    s = LiveServer(stores["nemotron_h"], context=1024, template=NEMOTRON)
    yield s
    s.close()


def test_required_and_named_tool_choice_end_to_end(tiny):
    """tool_choice required / a named function: the grammar makes even random weights call a declared tool with
    arguments that match its schema; streamed and not, the same greedy call; the follow-up is answered in text.
    (Free-text parameters are bounded here: random weights would never close one.)"""
    weather = json.loads(json.dumps(WEATHER))
    weather["function"]["parameters"]["properties"]["city"].update(maxLength=12)
    messages, tools = [{"role": "user", "content": "Weather in Paris?"}], [weather, CLOCK]
    r = tiny.client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                            max_tokens=200, temperature=0, parallel_tool_calls=False)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    name, args = calls_of(msg)[0]
    jsonschema.validate(args, _by_name(tools)[name].parameters)
    with tiny.client.chat.completions.stream(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                             max_tokens=200, temperature=0, parallel_tool_calls=False) as stream:
        assert calls_of(stream.get_final_completion().choices[0].message) == [(name, args)]
    named = tiny.client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=200, temperature=0,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (wname, wargs), *_ = calls_of(named.choices[0].message)
    assert wname == "get_weather"
    jsonschema.validate(wargs, weather["function"]["parameters"])
    follow = messages + [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"}]
    r2 = tiny.client.chat.completions.create(model=MODEL, messages=follow, tools=tools, max_tokens=8, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.usage.prompt_tokens > r.usage.prompt_tokens
