"""A reply's way out: token events -> text pieces (content, reasoning, tool calls; stop strings), then streamed as
server-sent events in OpenAI's chunk format, or collected into one response. A client that leaves cancels its job."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse

from sluice.api.protocol import APIError
from sluice.api.text import Detokenizer, ReasoningSplitter, StopMatcher
from sluice.api.toolcalls import ToolCallSplitter
from sluice.api.worker import Job


class TextStream:
    """Token ids -> [(kind, payload)] with kind content | reasoning (text) | tool_call (the call's OpenAI dict, with
    its index); notices stop strings."""

    def __init__(self, tokenizer, stops: tuple[str, ...], thinking: bool | None, calls: ToolCallSplitter | None = None,
                 markers: frozenset[int] = frozenset()):
        self.detok = Detokenizer(tokenizer, keep=markers if calls is not None else frozenset())
        self.stop = StopMatcher(stops)
        self.split = ReasoningSplitter(thinking) if thinking is not None else None
        self.calls = calls

    def push(self, token: int) -> list[tuple[str, Any]]:
        return self._route(self.stop.push(self.detok.push(token)))

    def flush(self) -> list[tuple[str, Any]]:
        out = self._route(self.stop.flush())
        out += self._tools(self.split.flush() if self.split else [])
        return out + (self.calls.flush() if self.calls else [])

    def finish(self, reason: str) -> str:
        """A reply that called tools and ended by itself finishes with "tool_calls", as OpenAI's do."""
        return "tool_calls" if reason == "stop" and self.calls is not None and self.calls.calls else reason

    def _route(self, text: str) -> list[tuple[str, Any]]:
        if self.split is None:
            return self._tools([("content", text)] if text else [])
        return self._tools(self.split.push(text))

    def _tools(self, pieces: list[tuple[str, str]]) -> list[tuple[str, Any]]:
        if self.calls is None:
            return pieces
        return [out for kind, t in pieces for out in (self.calls.push(t) if kind == "content" else [(kind, t)])]


async def reply_events(job: Job, events: asyncio.Queue, text: TextStream, record) -> AsyncIterator[tuple[str, Any]]:
    """("text", pieces) per token, then ("done", (finish_reason, usage)) or ("error", message), the request's log
    line recorded before the last."""
    finish = None
    while True:
        ev = await events.get()
        if ev[0] == "token":
            if finish is None:
                pieces = text.push(ev[1])
                if text.stop.stopped:
                    finish = "stop"
                    job.cancel()  # the worker drops it at its next turn and reports its usage
                if pieces:
                    yield "text", pieces
        elif ev[0] == "done":
            pieces = text.flush()
            if pieces:
                yield "text", pieces
            finish = text.finish(finish or ev[1])
            record("cancelled" if finish == "cancelled" else "ok", finish, ev[2])
            yield "done", (finish, ev[2])
            return
        else:
            record("error")
            yield "error", ev[1]
            return


def chunk(meta: dict, chat: bool, pieces: list[tuple[str, str]] | None, finish: str | None = None, role: bool = False) -> dict:
    if chat:
        delta: dict = {"role": "assistant", "content": ""} if role else {}
        for kind, t in pieces or []:
            if kind == "tool_call":
                delta.setdefault("tool_calls", []).append(t)
                continue
            key = "reasoning_content" if kind == "reasoning" else "content"
            delta[key] = delta.get(key, "") + t
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {**meta, "object": "chat.completion.chunk", "choices": [choice]}
    t = "".join(x for _, x in pieces or [])
    return {**meta, "object": "text_completion", "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": finish}]}


async def sse(job, replies, record, meta, chat: bool, include_usage: bool):
    try:
        if chat:
            yield {"data": json.dumps(chunk(meta, chat, None, role=True))}
        async for kind, payload in replies:
            if kind == "text":
                yield {"data": json.dumps(chunk(meta, chat, payload))}
            elif kind == "error":
                yield {"data": json.dumps({"error": {"message": payload, "type": "server_error", "param": None, "code": None}})}
            else:
                finish, usage = payload
                yield {"data": json.dumps(chunk(meta, chat, None, finish=finish))}
                if include_usage:
                    yield {"data": json.dumps({**meta, "object": "chat.completion.chunk" if chat else "text_completion", "choices": [], "usage": usage})}
        yield {"data": "[DONE]"}
    finally:
        job.cancel()  # a client that left: drop the job and free its state
        record("cancelled")  # (a reply that ended has its line already)


async def collect(request: Request, job, replies, record, meta, chat: bool) -> JSONResponse:
    async def watch():
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
        job.cancel()

    watcher = asyncio.create_task(watch())
    content: dict[str, list] = {"content": [], "reasoning": [], "tool_call": []}
    try:
        async for kind, payload in replies:
            if kind == "text":
                for k, t in payload:
                    content[k].append(t)
            elif kind == "error":
                raise APIError(500, payload, code="generation_failed", kind="server_error")
            else:
                finish, usage = payload
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        job.cancel()
        record("cancelled")  # (a reply that ended has its line already)
    body = "".join(content["content"])
    if chat:
        calls = [{k: v for k, v in c.items() if k != "index"} for c in content["tool_call"]]
        message = {"role": "assistant", "content": body.strip() or None if calls else body}
        if calls:
            message["tool_calls"] = calls
        if content["reasoning"]:
            message["reasoning_content"] = "".join(content["reasoning"])
        choice = {"index": 0, "message": message, "finish_reason": finish}
        return JSONResponse({**meta, "object": "chat.completion", "choices": [choice], "usage": usage})
    choice = {"index": 0, "text": body, "logprobs": None, "finish_reason": finish}
    return JSONResponse({**meta, "object": "text_completion", "choices": [choice], "usage": usage})
