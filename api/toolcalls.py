"""Tool-call text formats, one per model family, and the streaming splitter that finds calls in a reply.

A model calls a tool by writing text its chat template taught it:
    hermes    (Qwen3, Qwen3-Next)            <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    xml       (Nemotron 3, Qwen3.5, Coder)   <tool_call>\\n<function=f>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>
    deepseek  (DeepSeek V3.1; V3's variant)  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
Each format knows its markers, how to read one call's body, how to describe the tools to a template that does
not render them, and the grammar (llguidance Lark) of a forced call. The format of a checkpoint is read from its
chat template (what it renders is what the model learned), else from its architecture family.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from sluice.api.text import partial_tag

Lit = Callable[[str], str]  # text -> a Lark literal (a quoted string, or a special token's <name>)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # the JSON schema of the arguments object


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 hex digits, unique per reply
    name: str
    arguments: str  # a JSON object, as OpenAI's `function.arguments`

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call(name: str, arguments: dict) -> ToolCall:
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))


class ToolFormat:
    name = ""
    open = ""  # starts one call
    close = ""  # ends one call
    wrappers: tuple[str, ...] = ()  # text around a group of calls, dropped from the content

    def decode(self, body: str, tools: dict[str, Tool]) -> ToolCall | None:
        """One call's text between `open` and `close` -> the call, or None when it does not parse."""
        raise NotImplementedError

    def describe(self, tools: list[Tool]) -> str:
        """A system-prompt section that teaches the format, for a template that does not render tools."""
        raise NotImplementedError

    def call_grammar(self, tool: Tool, lit: Lit, rule: str) -> list[str]:
        """Lark rules whose first, named `rule`, matches exactly one call of `tool`."""
        raise NotImplementedError

    def calls_grammar(self, call: str, parallel: bool, lit: Lit) -> str:
        """The body of the rule matching a reply's calls: one `call` (a rule name), or with `parallel` one or more."""
        return f"{call} ({lit(chr(10))} {call})*" if parallel else call


class Hermes(ToolFormat):
    name, open, close = "hermes", "<tool_call>", "</tool_call>"

    def decode(self, body, tools):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return None
        return new_call(obj["name"], args)

    def describe(self, tools):
        specs = "\n".join(json.dumps(_spec(t), ensure_ascii=False) for t in tools)
        return (f"# Tools\n\nFunctions you can call, as JSON schemas:\n<tools>\n{specs}\n</tools>\n\nTo call one, write a JSON "
                'object with its name and arguments between <tool_call> tags:\n<tool_call>\n{"name": NAME, "arguments": '
                "{...}}\n</tool_call>")

    def call_grammar(self, tool, lit, rule):
        head = f'\n{{"name": {json.dumps(tool.name)}, "arguments": '
        return [f"{rule}: {lit(self.open)} {lit(head)} {json_lexeme(tool.parameters)} {lit('}' + chr(10))} "
                f"{lit(self.close)}"]


class Xml(ToolFormat):
    name, open, close = "xml", "<tool_call>", "</tool_call>"
    FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def decode(self, body, tools):
        m = self.FUNCTION.match(body)
        if m is None:
            return None
        name = m.group(1).strip()
        props = tools[name].parameters.get("properties", {}) if name in tools else {}
        args = {k.strip(): _typed(v, props.get(k.strip(), {})) for k, v in self.PARAMETER.findall(m.group(2))}
        return new_call(name, args)

    def describe(self, tools):
        out = ["# Tools\n\nYou have access to the following functions:\n\n<tools>"]
        for t in tools:
            out.append(f"<function>\n<name>{t.name}</name>\n<description>{t.description}</description>\n<parameters>")
            for k, p in t.parameters.get("properties", {}).items():
                out.append(f"<parameter>\n<name>{k}</name>\n<type>{p.get('type', 'string')}</type>\n"
                           f"<description>{p.get('description', '')}</description>\n</parameter>")
            out.append(f"<required>{json.dumps(t.parameters.get('required', []))}</required>\n</parameters>\n</function>")
        out.append("</tools>\n\nTo call a function, write:\n<tool_call>\n<function=NAME>\n<parameter=PARAMETER>\nVALUE\n"
                   "</parameter>\n</function>\n</tool_call>")
        return "\n".join(out)

    def call_grammar(self, tool, lit, rule):
        props = tool.parameters.get("properties", {})
        required = set(tool.parameters.get("required", []))
        rules, parts = [], []
        for i, (k, p) in enumerate(props.items()):
            r = f"{rule}_{i}"
            close = lit("\n</parameter>\n")
            if p.get("type") == "string" and "enum" in p:  # raw text: one of the values as written
                values = " | ".join(lit(str(v)) for v in p["enum"])
                rules.append(f"{r}: {lit(f'<parameter={k}>' + chr(10))} ({values}) {close}")
            elif p.get("type") == "string" or not p.get("type") and "enum" not in p:  # raw text up to the closing tag
                n = p.get("maxLength")
                rules.append(f"{r}: {lit(f'<parameter={k}>' + chr(10))} {r}_v")
                rules.append(f"{r}_v[lazy]: /(.|\\n){{0,{int(n)}}}/ {close}" if isinstance(n, int) else f"{r}_v[lazy]: /(.|\\n)*/ {close}")
            else:  # numbers, booleans, arrays, objects: JSON, as the templates write them
                rules.append(f"{r}: {lit(f'<parameter={k}>' + chr(10))} {json_lexeme(p)} {close}")
            parts.append(r if k in required else f"{r}?")
        body = " ".join(parts)
        head = [f"{rule}: {lit(self.open)} {lit(chr(10) + f'<function={tool.name}>' + chr(10))} {body} "
                f"{lit('</function>' + chr(10))} {lit(self.close)}"]
        return head + rules


class DeepSeek(ToolFormat):
    name = "deepseek"
    open, close = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    BEGIN, END, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁sep｜>"
    wrappers = (BEGIN, END)

    def __init__(self, fenced: bool = False):
        self.fenced = fenced  # V3's calls: function<｜tool▁sep｜>NAME\n```json\nARGS\n```

    def decode(self, body, tools):
        name, sep, args = body.partition(self.SEP)
        if not sep:
            return None
        if name.strip() == "function" and "\n" in args:  # V3: the name after the separator, the arguments fenced
            name, _, args = args.partition("\n")
            args = args.strip().removeprefix("```json").removesuffix("```")
        try:
            obj = json.loads(args)
        except json.JSONDecodeError:
            return None
        return new_call(name.strip(), obj) if isinstance(obj, dict) else None

    def describe(self, tools):
        out = ["## Tools\nFunctions you can call:\n"]
        for t in tools:
            out.append(f"### {t.name}\nDescription: {t.description}\n\nParameters: {json.dumps(t.parameters)}\n")
        out.append(f"To call functions, write {self.BEGIN}, then for each call {self.open}NAME{self.SEP}ARGUMENTS{self.close} "
                   f"(the arguments a JSON object that follows the function's Parameters schema), then {self.END}.")
        return "\n".join(out)

    def call_grammar(self, tool, lit, rule):
        schema = json_lexeme(tool.parameters)
        if self.fenced:
            return [f"{rule}: {lit(self.open)} {lit('function')} {lit(self.SEP)} {lit(tool.name + chr(10) + '```json' + chr(10))} "
                    f"{schema} {lit(chr(10) + '```')} {lit(self.close)}"]
        return [f"{rule}: {lit(self.open)} {lit(tool.name)} {lit(self.SEP)} {schema} {lit(self.close)}"]

    def calls_grammar(self, call, parallel, lit):
        return f"{lit(self.BEGIN)} {call}{'+' if parallel else ''} {lit(self.END)}"


def json_lexeme(schema: dict) -> str:
    """A Lark lexeme matching JSON that `schema` validates, spaced as json.dumps and Jinja's tojson write it (what
    models read in their templates), with no other whitespace: a small model cannot wander into endless blanks."""
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return f"%json {json.dumps({**schema, 'x-guidance': {**options, **schema.get('x-guidance', {})}})}"


def detect_format(template: str, architecture: str) -> ToolFormat:
    """The tool-call format a chat template renders; for one that renders none, the architecture family's."""
    if DeepSeek.open in template or "tool▁call" in template:
        return DeepSeek(fenced="```json" in template)
    if "<function=" in template:
        return Xml()
    if "<tool_call>" in template:
        return Hermes()
    if architecture.startswith("deepseek"):
        return DeepSeek()
    if architecture.startswith("nemotron_h") or architecture.startswith("qwen3_5"):
        return Xml()
    return Hermes()


def _spec(t: Tool) -> dict:
    return {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}


def _typed(text: str, schema: dict):
    """A parameter's text -> the value its schema's type asks for (strings stay text; the rest is JSON when it parses)."""
    kind = schema.get("type")
    if kind == "string":
        return text
    if kind == "boolean" and text.strip() in ("True", "False"):  # Jinja's `| string` of a Python bool
        return text.strip() == "True"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ToolCallSplitter:
    """Reply text -> [("content", text) | ("tool_call", the call as OpenAI writes it, with its index)]: content passes through as it comes, holding back
    only a tail that could begin a marker; a call is emitted whole when its closing marker arrives. A call whose
    body does not parse stays in the content as written. Content after the first call that is only whitespace
    (the newlines between calls) is dropped."""

    def __init__(self, fmt: ToolFormat, tools: dict[str, Tool]):
        self.fmt, self.tools = fmt, tools
        self.markers = (fmt.open, *fmt.wrappers)
        self.buf = ""
        self.inside = False
        self.calls = 0

    def push(self, text: str) -> list[tuple[str, object]]:
        self.buf += text
        out: list[tuple[str, object]] = []
        while True:
            if self.inside:
                i = self.buf.find(self.fmt.close)
                if i < 0:
                    return out
                body, self.buf, self.inside = self.buf[:i], self.buf[i + len(self.fmt.close) :], False
                call = self.fmt.decode(body, self.tools)
                if call is None:
                    self._content(out, self.fmt.open + body + self.fmt.close)
                else:
                    out.append(("tool_call", call.openai(self.calls)))
                    self.calls += 1
                continue
            hits = [(i, m) for m in self.markers if (i := self.buf.find(m)) >= 0]
            if not hits:
                keep = max((partial_tag(self.buf, m) for m in self.markers), default=0)
                self._content(out, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                return out
            i, marker = min(hits)
            self._content(out, self.buf[:i])
            self.buf = self.buf[i + len(marker) :]
            self.inside = marker == self.fmt.open

    def flush(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self._content(out, (self.fmt.open if self.inside else "") + self.buf)  # an unfinished call: shown as written
        self.buf, self.inside = "", False
        return out

    def _content(self, out: list, text: str) -> None:
        if text and not (self.calls and not text.strip()):
            out.append(("content", text))

