"""Request parsing for the OpenAI-compatible routes; every bad input becomes an OpenAI-style error.

Unknown fields are ignored (clients such as Open WebUI send extras); known fields are checked for
type and range, and the error names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}},
                            status_code=self.status)


@dataclass(frozen=True)
class Params:
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict, ...]  # {"role": str, "content": str | [{"type": "text", "text": str} | {"type": "image"}]}
    params: Params
    think: bool
    images: tuple[bytes, ...] = ()  # the image parts' encoded bytes, in order
    tools: Any = None  # api/tools.ToolRequest: the tools offered and tool_choice, or None
    schema: dict | None = None  # the JSON schema `response_format` asks the reply to match, or None


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str
    params: Params


ROLES = ("system", "developer", "user", "assistant", "tool")


def _field(body: dict, name: str, types: tuple, default=None, check=None, why: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise APIError(400, f"'{name}' must be {why or ' or '.join(t.__name__ for t in types)}, got {type(value).__name__}", name)
    if check is not None and not check(value):
        raise APIError(400, f"'{name}' is out of range: {why} (got {value!r})", name)
    return value


def _params(body: dict) -> Params:
    max_tokens = _field(body, "max_completion_tokens", (int,), None, lambda v: v >= 1, "an integer >= 1")
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", (int,), None, lambda v: v >= 1, "an integer >= 1")
    temperature = float(_field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]"))
    top_p = float(_field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"))
    seed = _field(body, "seed", (int,), None, lambda v: -(2**63) <= v < 2**64, "an integer in [-2**63, 2**64)")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,) if stop else ()  # an empty stop string would end every reply before it starts
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stop = tuple(s for s in stop if s)
    else:
        raise APIError(400, "'stop' must be a string or a list of at most 4 strings", "stop")
    stream = _field(body, "stream", (bool,), False)
    opts = _field(body, "stream_options", (dict,), {}) or {}
    include_usage = bool(opts.get("include_usage", False))
    n = _field(body, "n", (int,), 1)
    if n != 1:
        raise APIError(400, "only n=1 is supported", "n")
    return Params(max_tokens, temperature, top_p, seed, stop, stream, include_usage)


def _body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _model(body: dict, models: dict[str, bool]) -> tuple[str, bool]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required (a string)", "model")
    if model not in models:
        raise APIError(404, f"the model '{model}' does not exist; available: {', '.join(models)}", "model", "model_not_found")
    return model, models[model]


IMAGE_PARTS = ("image_url", "input_image")  # OpenAI's chat and responses spellings


def image_bytes(url: Any, where: str, files=None) -> bytes:
    """An image part's URL -> encoded bytes: data: URLs (base64) and file: URLs of files under the server's
    --image-dir folders (files: api/image_files.ImageFiles; None: none); remote URLs are refused (the server may
    have no network, and fetching for a client is not its job). Reads files: call it off the event loop."""
    import base64
    import binascii
    from urllib.parse import unquote, urlparse

    if not isinstance(url, str) or not url:
        raise APIError(400, f"{where}: an image part needs a 'url' string", "messages")
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise APIError(400, f"{where}: a data: URL must be base64 (data:image/png;base64,...)", "messages")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, f"{where}: the data: URL's base64 payload is malformed", "messages") from None
    u = urlparse(url)
    if u.scheme == "file":
        data = files.read(u.netloc, unquote(u.path)) if files is not None else None
        if data is None:  # one answer for every cause: a client learns nothing about which paths exist
            raise APIError(400, f"{where}: cannot read this file: URL (the server reads only regular image files under "
                                "its --image-dir folders; send the image inline as a data: URL)", "messages")
        return data
    if u.scheme in ("http", "https"):
        raise APIError(400, f"{where}: remote image URLs are not fetched (this server may have no network); "
                            "send the image inline as a data: URL", "messages")
    raise APIError(400, f"{where}: unsupported image URL scheme {u.scheme or url[:16]!r} (use data: or file:)", "messages")


def _content(value: Any, where: str, images: list | None, files=None) -> str | list[dict]:
    """A message's content: a string, or (with image parts, when `images` collects them) a list of
    {"type": "text"} / {"type": "image"} parts for the chat template."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or "type" not in part:
                raise APIError(400, f"{where}: content parts must be objects with a 'type'", "messages")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}: a text part needs a string 'text'", "messages")
                parts.append({"type": "text", "text": part["text"]})
            elif part["type"] in IMAGE_PARTS and images is not None:
                ref = part.get(part["type"])
                url = ref.get("url") if isinstance(ref, dict) else ref
                images.append(image_bytes(url, f"{where}.content[{i}]", files))
                parts.append({"type": "image"})
            elif part["type"] in IMAGE_PARTS:
                raise APIError(400, f"{where}: this model takes no images (text only)", "messages")
            elif part["type"] in ("input_audio", "audio_url"):
                raise APIError(400, f"{where}: audio input is not supported (Sluice does not run audio towers)", "messages")
            else:
                raise APIError(400, f"{where}: content part type '{part['type']}' is not supported by this model", "messages")
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts
    raise APIError(400, f"{where}: 'content' must be a string or a list of content parts", "messages")


def parse_chat(body: Any, models: dict[str, bool], images: bool = False, files=None) -> ChatRequest:
    """models: served model id -> whether it is the reasoning (-think) id; images: whether the model takes them;
    files: the local image files file: URLs may name (api/image_files.ImageFiles), None: none."""
    body = _body(body)
    model, think = _model(body, models)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    from sluice.api.grammar import parse_response_format
    from sluice.api.tools import message_fields, parse_tools

    out, found, calls = [], [] if images else None, {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(400, f"{where}: 'role' must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), where, found, files),
                    **message_fields(m, where, calls)})
    return ChatRequest(model, tuple(out), _params(body), think, tuple(found or ()), parse_tools(body), parse_response_format(body))


def parse_completion(body: Any, models: dict[str, bool]) -> CompletionRequest:
    body = _body(body)
    model, _ = _model(body, models)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "'prompt' must be a non-empty string", "prompt")
    return CompletionRequest(model, prompt, _params(body))
