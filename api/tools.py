"""OpenAI tool calling on the request side: `tools`, `tool_choice`, `parallel_tool_calls`, and the messages that
carry calls and their results (assistant `tool_calls`, `role: tool`), turned into what chat templates read.

Templates take the tools as transformers passes them (`apply_chat_template(..., tools=...)`) and a call's
arguments as an object, not the JSON text OpenAI sends. A template that renders no tools gets the family
format's own description of them as a system message, so the model still learns they exist and how to call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sluice.api.protocol import APIError
from sluice.api.toolcalls import Tool, ToolFormat

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (dots for namespaced tools)
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str  # none | auto | required | function (the one named in `function`)
    function: str | None = None
    parallel: bool = True  # several calls in one reply allowed

    @property
    def active(self) -> bool:
        """Tools offered to the model and its calls parsed from the reply."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools a reply must call one of (required, a named function); () when the model may answer in text."""
        if self.choice == "required":
            return self.tools
        return tuple(t for t in self.tools if t.name == self.function) if self.choice == "function" else ()

    def by_name(self) -> dict[str, Tool]:
        return {t.name: t for t in self.tools}

    def specs(self) -> list[dict]:
        """The tools as OpenAI sends them, which is what templates iterate (`tool.function.name`, ...)."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
                for t in self.tools]


def parse_tools(body: dict) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request; None when it offers no tools."""
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise APIError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"'tools' names a function twice: {sorted({n for n in names if names.count(n) > 1})}", "tools")
    choice, function = _choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not tools and choice in ("required", "function"):
        raise APIError(400, f"'tool_choice' {body.get('tool_choice')!r} needs 'tools'", "tool_choice")
    return ToolRequest(tools, choice, function, parallel) if tools else None


def _tool(t: Any, where: str) -> Tool:
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
        raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
    f = t["function"]
    name = f.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise APIError(400, f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}", "tools")
    description = f.get("description") or ""
    if not isinstance(description, str):
        raise APIError(400, f"{where}.function.description must be a string", "tools")
    params = f.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise APIError(400, f"{where}.function.parameters must be a JSON schema object", "tools")
    return Tool(name, description, params)


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in CHOICES:
            raise APIError(400, f"'tool_choice' must be one of {', '.join(CHOICES)} or a named function, got {value!r}", "tool_choice")
        return value, None
    name = value.get("function", {}).get("name") if isinstance(value, dict) and isinstance(value.get("function"), dict) else None
    if not isinstance(name, str):
        raise APIError(400, "'tool_choice' as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise APIError(400, f"'tool_choice' names the function {name!r}, which 'tools' does not declare", "tool_choice")
    return "function", name


def message_fields(m: dict, where: str, call_names: dict[str, str]) -> dict:
    """The tool-related fields of one request message, as templates read them. call_names: the ids of the calls
    seen so far -> their function names (a tool result without a `name` gets its call's)."""
    out: dict = {}
    if m.get("role") == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise APIError(400, f"{where}.tool_calls must be a list", "messages")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]", call_names) for j, c in enumerate(calls)]
    elif m.get("role") == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise APIError(400, f"{where}.tool_call_id must be a string", "messages")
        name = m.get("name") or call_names.get(call_id or "")
        out.update({k: v for k, v in (("tool_call_id", call_id), ("name", name)) if v is not None})
    return out


def _call(c: Any, where: str, call_names: dict[str, str]) -> dict:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise APIError(400, f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": ...}}}}",
                       "messages")
    args = f.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise APIError(400, f"{where}.function.arguments is not valid JSON: {e}", "messages") from None
    if not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object", "messages")
    call_id = c.get("id") if isinstance(c.get("id"), str) else f"call_{len(call_names)}"
    call_names[call_id] = f["name"]
    return {"id": call_id, "type": "function", "function": {"name": f["name"], "arguments": args}}


def with_tools(messages: list[dict], tools: ToolRequest | None, fmt: ToolFormat, template: str) -> tuple[list[dict], dict]:
    """(messages, apply_chat_template keywords) that show the model its tools: `tools=` for a template that renders
    them, else the format's description merged into the system message. tool_choice none shows none."""
    if tools is None or not tools.active:
        return messages, {}
    if re.search(r"\btools\b", template):
        return messages, {"tools": tools.specs()}
    text = fmt.describe(list(tools.tools))
    if messages and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]], {}
    return [{"role": "system", "content": text}, *messages], {}
