"""Grammar-constrained decoding (llguidance): each family's forced-call grammar takes its own call text, the mask
leaves only what the grammar allows, and the bundled model answers response_format with schema-valid JSON."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from sluice.api.grammar import Grammars
from sluice.api.protocol import APIError
from sluice.api.tools import parse_tools
from sluice.models.builtin import default_model_path
from templates import DEEPSEEK_TOKENS, WEATHER
from test_api import MODEL, LiveServer
from test_tools import CALLS, FORMATS, TOOLS

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["word", "count", "kind"],
          "properties": {"word": {"type": "string", "maxLength": 24}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "kind": {"enum": ["noun", "verb"]}, "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def grammars(stores):
    tok = AutoTokenizer.from_pretrained(stores["nemotron_h"])
    tok.add_tokens(list(DEEPSEEK_TOKENS))
    return Grammars(tok, len(tok), torch.device("cpu")), tok


def _accepts(grammars, constraint, text: str) -> bool:
    _, tok = grammars
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return constraint.matcher.consume_tokens(ids) and constraint.matcher.is_accepting()


@pytest.mark.parametrize("family", list(CALLS))
def test_forced_call_grammar_takes_the_family_text(grammars, family):
    g, _ = grammars
    tools = parse_tools({"tools": TOOLS, "tool_choice": "required"})
    calls = CALLS[family].replace("Let me look.", "").lstrip("\n").rstrip("\n")
    assert _accepts(grammars, g.constraint(None, tools, FORMATS[family], thinking=False), calls)
    thought = "<think>\nhm</think>\n" if family != "deepseek" else "hm</think>"  # the template opened the block
    assert _accepts(grammars, g.constraint(None, tools, FORMATS[family], thinking=True), thought.removeprefix("<think>\n") + calls)
    single = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert not _accepts(grammars, g.constraint(None, single, FORMATS[family], thinking=False), calls)  # two calls: one too many
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "clock"}}})
    assert not _accepts(grammars, g.constraint(None, named, FORMATS[family], thinking=False), calls)  # get_weather is not clock


def test_mask_leaves_only_what_the_grammar_allows(grammars):
    g, tok = grammars
    c = g.constraint({"type": "object"}, None, FORMATS["qwen"], thinking=False)
    logits = torch.randn(len(tok))
    masked = c.apply(logits)
    assert tok.decode([int(masked.argmax())]) == "{" and torch.isinf(masked).sum() == len(tok) - 1
    c.advance(int(masked.argmax()))
    assert not c.done


def test_a_schema_llguidance_cannot_compile_is_a_400(grammars):
    g, _ = grammars
    with pytest.raises(APIError, match="response_format"):
        g.constraint({"type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}, None, FORMATS["qwen"], False)


@pytest.fixture(scope="module")
def bundled():
    s = LiveServer(default_model_path(), context=2048)
    yield s
    s.close()


def test_bundled_model_answers_in_schema_valid_json(bundled):
    """The bundled model (a tiny NemotronH trained on dictionary text) knows no JSON; under the grammar its reply,
    streamed or not, is JSON that the schema validates, and json_object gives an object."""
    messages = [{"role": "user", "content": "Describe the word 'river'."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "word", "schema": SCHEMA, "strict": True}}
    r = bundled.client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=120, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, SCHEMA)
    chunks = bundled.client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=120,
                                                    temperature=0, stream=True)
    assert json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)) == answer
    sampled = bundled.client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=120,
                                                     temperature=1.0, seed=3)
    jsonschema.validate(json.loads(sampled.choices[0].message.content), SCHEMA)
    obj = bundled.client.chat.completions.create(model=MODEL, messages=messages, response_format={"type": "json_object"},
                                                 max_tokens=300, temperature=0)
    if obj.choices[0].finish_reason == "stop":  # an open-ended object may run out of tokens first
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert obj.choices[0].message.content.startswith("{")


def test_bundled_model_forced_tool_call(bundled):
    """The bundled model's template renders no tools: they reach it as a system message in its family's format, and
    tool_choice required makes it call one with schema-valid arguments (one: greedy, it would call again and again)."""
    weather = json.loads(json.dumps(WEATHER))
    weather["function"]["parameters"]["properties"]["city"].update(maxLength=16)
    r = bundled.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                               tools=[weather], tool_choice="required", max_tokens=80, temperature=0,
                                               parallel_tool_calls=False)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])


def test_without_llguidance_a_request_for_structure_gets_one_clear_error(stores, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)  # as if not installed
    g = Grammars(AutoTokenizer.from_pretrained(stores["nemotron_h"]), 99, torch.device("cpu"))
    assert g.constraint(None, None, FORMATS["qwen"], False) is None  # free text needs none
    with pytest.raises(APIError, match="needs llguidance: pip install llguidance") as e:
        g.constraint({"type": "object"}, None, FORMATS["qwen"], False)
    assert e.value.status == 501
    with pytest.raises(APIError, match="needs llguidance"):
        g.constraint(None, parse_tools({"tools": TOOLS, "tool_choice": "required"}), FORMATS["deepseek"], False)
