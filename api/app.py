"""The OpenAI-compatible app: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, /.

Handlers parse and validate (api/protocol.py), render the chat template, submit a job to the engine
worker (api/worker.py) and turn its token events into text: streamed as server-sent events, or
collected into one response. Every error is OpenAI-style JSON with a 4xx/5xx status, and the
server keeps serving. A client that goes away cancels its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from sluice.api.grammar import Grammars
from sluice.api.guard import Guard
from sluice.api.image_files import ImageFiles
from sluice.api.limits import Limits
from sluice.api.memory import limit_arenas
from sluice.api.metrics import Metrics
from sluice.api.protocol import APIError, Params, parse_chat, parse_completion
from sluice.api.render import chat_ids, prompt_ids
from sluice.api.replies import TextStream, collect, reply_events, sse
from sluice.api.requestlog import RequestLog
from sluice.api.snapshot_disk import DiskSnapshots
from sluice.api.snapshot_file import cache_classes, model_identity
from sluice.api.snapshots import SnapshotStore
from sluice.api.text import THINK_OPEN
from sluice.api.toolcalls import ToolCallSplitter, ToolFormat, detect_format
from sluice.api.tools import with_tools
from sluice.api.worker import EngineWorker, Job
from sluice.pipeline.sampling import Sampler

PAGE = Path(__file__).resolve().parent / "static" / "index.html"


@dataclass
class Served:
    engine: Any
    tokenizer: Any
    model_id: str
    models: dict[str, bool]  # id -> reasoning mode
    context: int
    worker: EngineWorker
    metrics: Metrics
    snapshots: SnapshotStore
    log: RequestLog
    disk: DiskSnapshots | None  # --snapshot-dir: the snapshots' spill tier
    doc_ids: frozenset[str] = frozenset()  # ids whose images use the processor's maximum resolution
    images: bool = False  # whether the model takes images (its store has an image encoder)
    limits: Limits | None = None  # reply lengths and what a prompt over the context gets
    grammars: Grammars | None = None  # constrained decoding (response_format, forced tool calls)
    tool_format: ToolFormat | None = None  # how this model writes tool calls
    markers: frozenset[int] = frozenset()  # the tool format's marker tokens, shown even where they are special
    files: ImageFiles = ImageFiles()  # the local files file: image URLs may name (--image-dir; none by default)
    tokenizing: threading.Lock = field(default_factory=threading.Lock)  # a fast tokenizer is not safe in two threads at once


def create_app(engine, tokenizer, model_id: str, snapshot_bytes: int = 1 << 30, context: int | None = None,
               prefill_chunk: int | None = None, default_max_tokens: int | None = None, truncate: str = "error",
               log_format: str = "console", snapshot_dir: Path | None = None, snapshot_disk_bytes: int = 8 << 30,
               image_dirs: tuple[Path, ...] = (), api_key: str | None = None, max_body: int = Guard.max_body,
               max_batch: int = 1, step_tokens: int | None = None) -> Starlette:
    limit_arenas()  # before the worker and thread pools allocate (api/memory.py)
    log = RequestLog(log_format)
    metrics = Metrics()
    disk = None
    if snapshot_dir is not None:
        classes = cache_classes(engine.new_sequence().cache)
        disk = DiskSnapshots(snapshot_dir, snapshot_disk_bytes, model_identity(engine), classes, log.log)
    snapshots = SnapshotStore(snapshot_bytes, on_evict=disk.spill if disk else None)
    worker = EngineWorker(engine, snapshots, metrics, prefill_chunk or engine.prefill_chunk, max_batch, step_tokens)
    models = {model_id: False}
    if "enable_thinking" in (tokenizer.chat_template or ""):
        models[f"{model_id}-think"] = True
    images = engine.store.manifest.encoder is not None
    doc = frozenset({f"{model_id}-doc"} if images else ())
    models.update(dict.fromkeys(doc, False))
    context = context or getattr(engine.model.config, "max_position_embeddings", None) or 4096
    context = min(context, engine.config.static_kv or context)  # a static cache holds no more
    s = Served(engine, tokenizer, model_id, models, context, worker, metrics, snapshots, log, disk, doc, images,
               Limits.of(context, default_max_tokens, truncate), Grammars(tokenizer, engine.model.config.vocab_size, engine.device))
    s.tool_format = detect_format(tokenizer.chat_template or "", engine.store.manifest.architecture)
    s.markers = _marker_ids(tokenizer, s.tool_format)
    s.files = ImageFiles.of(image_dirs)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with anyio.create_task_group() as tg:
            if disk is not None:
                await disk.open()
                tg.start_soon(disk.run)
            worker.start()
            try:
                yield
            finally:
                worker.stop()
                if disk is not None:
                    with anyio.CancelScope(shield=True):  # what RAM holds reaches the disk, also on a cancelled shutdown
                        await disk.close(snapshots)
                s.grammars.close()

    async def page(request):
        return HTMLResponse(PAGE.read_text())

    async def health(request):
        if worker.fault is not None:  # a store that failed a read fails the next ones too: take this server out
            return JSONResponse({"status": "store_fault", "model": model_id, "error": worker.fault}, status_code=503)
        return JSONResponse({"status": "ok", "model": model_id, "images": s.images})

    async def metrics_route(request):
        return _metrics(s)

    async def models_route(request):
        return _models(s)

    async def chat(request):
        return await _chat(s, request)

    async def completions(request):
        return await _completions(s, request)

    routes = [
        Route("/", page, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/v1/models", models_route, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    def rejected(request: Request, e: APIError) -> JSONResponse:
        if e.code != "generation_failed":  # a reply that failed in the worker has its line already
            log.rejected(request.method, request.url.path, e.status, e.message, e.code)
        return metrics.reject(e)

    handlers = {APIError: rejected, HTTPException: lambda r, e: rejected(r, _http_error(r, e)),
                Exception: lambda r, e: rejected(r, _server_error(r, e))}
    guard = Middleware(Guard, api_key=api_key, max_body=max_body)
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers, middleware=[guard])


def _http_error(request: Request, exc: HTTPException) -> APIError:
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=str(exc.status_code))


def _server_error(request: Request, exc: Exception) -> APIError:
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")


def _marker_ids(tokenizer, fmt: ToolFormat) -> frozenset[int]:
    vocab = tokenizer.get_vocab()
    return frozenset(vocab[m] for m in (fmt.open, fmt.close, *fmt.wrappers) if m in vocab)


def _metrics(s: Served) -> Response:
    s.metrics.snapshots.set(len(s.snapshots))
    s.metrics.snapshot_bytes.set(s.snapshots.bytes)
    s.metrics.active.set(s.worker.active)
    return Response(s.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _models(s: Served) -> JSONResponse:
    now = int(time.time())
    return JSONResponse({"object": "list", "data": [{"id": m, "object": "model", "created": now, "owned_by": "sluice"} for m in s.models]})


async def _json(request: Request) -> Any:
    return await anyio.to_thread.run_sync(_parse_json, await request.body())  # a big body parses off the event loop


def _parse_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    try:
        _encode_texts(body)  # a lone surrogate (\ud800) is no text a tokenizer takes
    except UnicodeEncodeError as e:
        raise APIError(400, f"the request body holds a lone surrogate ({e.object[e.start:e.end]!a}): not valid Unicode") from None
    return body


def _encode_texts(body: Any) -> None:
    """Encode every string of a parsed body as UTF-8 (raises on a lone surrogate), one string at a time: a 10 MB
    body's json.dumps held the GIL ~0.1 s in one go, and the event loop with it."""
    todo = [body]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            v.encode()
        elif isinstance(v, dict):
            todo += v.keys()
            todo += v.values()
        elif isinstance(v, list):
            todo += v


def _render_chat(s: Served, messages, think: bool, tools=None) -> list[int]:
    messages, kwargs = with_tools(list(messages), tools, s.tool_format, s.tokenizer.chat_template or "")
    if len(s.models) > 1:
        kwargs["enable_thinking"] = think
    try:
        with s.tokenizing:
            return chat_ids(s.tokenizer, messages, **kwargs)
    except Exception as e:  # templates raise on, e.g., roles out of order
        raise APIError(400, f"the model's chat template rejected these messages: {e}", "messages") from None


async def _chat(s: Served, request: Request) -> Response:
    body = await _json(request)
    # parsing (image files are read), rendering and tokenising run in a thread: /health and streams go on meanwhile
    req = await anyio.to_thread.run_sync(parse_chat, body, s.models, s.images, s.files)
    render = lambda m: _render_chat(s, m, req.think, req.tools)  # noqa: E731
    ids = await anyio.to_thread.run_sync(s.limits.drop_messages, list(req.messages), render, req.params.max_tokens)
    thinking = s.tokenizer.decode(ids[-32:]).rstrip().endswith(THINK_OPEN)  # the template opened a think block
    images = key = None
    if req.images:
        images, ids, key = await asyncio.to_thread(_prompt_images, s, req, ids)
    constraint = await asyncio.to_thread(s.grammars.constraint, req.schema, req.tools, s.tool_format, thinking)
    calls = ToolCallSplitter(s.tool_format, req.tools.by_name()) if req.tools is not None and req.tools.active else None
    return await _generate(s, request, ids, req.params, req.model, chat=True, thinking=thinking, images=images, key=key,
                           constraint=constraint, calls=calls)


def _prompt_images(s: Served, req, ids: list[int]):
    """Decode and preprocess a request's images, expand their placeholders: (PromptImages, ids, snapshot key)."""
    from sluice.errors import SluiceError
    from sluice.models.vision import ImageError, ImageSettings, ImageTokens, prepare_images

    try:
        images = prepare_images(list(req.images), ImageSettings.of(s.engine.store.path), req.model in s.doc_ids, where="image")
    except ImageError as e:
        raise APIError(e.status, str(e), "messages") from None
    s.metrics.images.inc(len(images.counts))
    s.metrics.image_tokens.inc(sum(images.counts))
    marks = ImageTokens.of(s.tokenizer, s.engine.image_encoder.image_token_id)
    try:
        ids = marks.expand(ids, images.counts)
    except SluiceError as e:  # the chat template wrote no placeholder for an image part
        raise APIError(400, f"the model's chat template did not place every image: {e}", "messages") from None
    return images, ids, marks.key(ids, images)


async def _completions(s: Served, request: Request) -> Response:
    req = parse_completion(await _json(request), s.models)
    ids, total = await anyio.to_thread.run_sync(_tokenize, s, req.prompt)
    return await _generate(s, request, ids, req.params, req.model, chat=False, thinking=False, total=total)


def _tokenize(s: Served, text: str) -> tuple[list[int], int]:
    with s.tokenizing:  # no more ids than `fit` reads
        return prompt_ids(s.tokenizer, text, s.limits.context, tail=s.limits.truncate == "left")


async def _generate(s: Served, request: Request, ids: list[int], p: Params, model: str, chat: bool, thinking: bool,
                    images=None, key: list[int] | None = None, constraint=None, calls: ToolCallSplitter | None = None,
                    total: int | None = None) -> Response:
    if not (ids or total):
        raise APIError(400, "the prompt is empty after tokenisation", "messages" if chat else "prompt")
    n = len(ids)
    ids, max_tokens = s.limits.fit(ids, p.max_tokens, "messages" if chat else "prompt", total)
    if key is not None and len(ids) < n:
        key = key[n - len(ids) :]
    try:
        sampler = Sampler(p.temperature, p.top_p, p.seed)
    except Exception as e:
        raise APIError(400, str(e)) from None
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    eos = {i for i in (s.tokenizer.eos_token_id, getattr(s.engine.model.config, "eos_token_id", None)) if isinstance(i, int)}
    job = Job(ids, max_tokens, sampler, frozenset(eos), lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev), images, key,
              constraint)
    if s.disk is not None:
        job.snapshot = await s.disk.lookup(key or ids, s.snapshots)
    s.worker.submit(job)
    text = TextStream(s.tokenizer, p.stop, thinking if chat else None, calls, s.markers)
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model}
    record = s.log.request(meta, job)
    replies = reply_events(job, events, text, record)
    if p.stream:
        return EventSourceResponse(sse(job, replies, record, meta, chat, p.include_usage), ping=15)
    return await collect(request, job, replies, record, meta, chat)
