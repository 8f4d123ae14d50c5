"""Who may call the server and how much they may send: the API key (`--api-key`) and the body cap (`--max-body`).

A pure ASGI middleware, so a refused request costs no parsing: a missing or wrong `Authorization: Bearer KEY` is
401 before the body is read; a body over the cap is 413, by its Content-Length up front or, for a chunked body,
as soon as the bytes read pass the cap. /health stays open (load balancers and probes carry no key).
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class Guard:
    app: object  # the ASGI app it guards
    api_key: str | None = None  # None: no key asked for
    max_body: int = 24 << 20  # bytes a request body may hold

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):  # constant time: no key guessing
                return await _refuse(send, 401, "a valid API key is required (Authorization: Bearer KEY)", "invalid_api_key")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            return await _refuse(send, 413, f"the request body is {int(length)} bytes, more than this server's "
                                            f"{self.max_body} (--max-body)", "request_too_large")
        seen = 0
        started = False

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge as e:
            if not started:
                await _refuse(send, 413, str(e), "request_too_large")


class BodyTooLarge(Exception):
    def __init__(self, cap: int):
        super().__init__(f"the request body is more than this server's {cap} bytes (--max-body)")


async def _refuse(send, status: int, message: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
