"""One log line per request (structlog): who asked for what, what was served, how long it took.

Served requests are logged by the handler that streams or collects their reply, once the reply's end
is known (a stop string ends a reply the worker would call cancelled); requests answered with an error
before any work (a 4xx, or a 5xx of the server itself) by the error handler. Fields: id, model, status (ok | cancelled | error | rejected),
http_status, finish_reason, prompt / cached / generated tokens, time to first token, duration.
"""

from __future__ import annotations

import time
from typing import Any

from sluice.log import get_logger


class RequestLog:
    def __init__(self, log_format: str = "console"):
        self.log = get_logger(log_format)

    def request(self, meta: dict, job: Any) -> "RequestRecord":
        """The log line of a request the worker took, written once by whichever end of it comes first."""
        return RequestRecord(self.log, meta, job)

    def rejected(self, method: str, path: str, status: int, message: str, code: str | None) -> None:
        """A request answered with an error before the worker took it: refused (a 4xx: bad input, an unknown model, a
        prompt over the context) or failed in the server itself (a 5xx)."""
        event = self.log.warning if status < 500 else self.log.error
        event("request", id=None, path=f"{method} {path}", status="rejected" if status < 500 else "error", http_status=status,
              error=message, code=code)


class RequestRecord:
    """One served request's log line, written by the first of its ends to come (the reply's last event, or the
    client leaving)."""

    def __init__(self, log, meta: dict, job: Any):
        self.log, self.meta, self.job = log, meta, job
        self.written = False

    def __call__(self, status: str, finish: str | None = None, usage: dict | None = None) -> None:
        """Write the line (the first call only): `usage` as the reply reports it, else the job's own counts (a client gone)."""
        if self.written:
            return
        self.written = True
        job = self.job
        if usage is not None:
            prompt, generated = usage["prompt_tokens"], usage["completion_tokens"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
        else:
            prompt, cached, generated = len(job.prompt), job.cached, len(job.generated)
        ttft = round(job.t_first - job.t_submit, 4) if job.t_first is not None else None
        event = self.log.error if status == "error" else self.log.info
        event("request", id=self.meta["id"], model=self.meta["model"], status=status, http_status=500 if status == "error" else 200,
              finish_reason=finish, prompt_tokens=prompt, cached_tokens=cached, generated_tokens=generated,
              time_to_first_token_s=ttft, duration_s=round(time.perf_counter() - job.t_submit, 4))
