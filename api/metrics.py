"""Prometheus metrics for /metrics (tokens/s, time to first token, expert hit rate and bytes per tier,
stall time per token). One registry per app, no process-global state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sluice.pipeline.runtime import TIERS


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tokens = Counter("sluice_generated_tokens", "Tokens generated", registry=r)
        self.requests = Counter("sluice_requests", "Requests, by outcome: ok, cancelled, error (failed while generating), "
                                "rejected (answered with a 4xx before generating)", ["status"], registry=r)
        self.errors = Counter("sluice_request_errors", "Error responses, by HTTP status and OpenAI error code",
                              ["status", "code"], registry=r)
        self.ttft = Histogram("sluice_time_to_first_token_seconds", "From submission to the first token", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.decode_rate = Gauge("sluice_decode_tokens_per_second", "Decode rate of the last finished request", registry=r)
        self.blocks = Counter("sluice_expert_blocks", "Routed expert blocks served, by the tier they came from", ["tier"], registry=r)
        self.bytes = Counter("sluice_expert_bytes", "Bytes of routed expert blocks served, by tier", ["tier"], registry=r)
        self.hit_rate = Gauge("sluice_expert_hit_rate", "Share of routed blocks not read from disk, since start", registry=r)
        self.stall = Counter("sluice_stall_seconds", "Time the fetch stage waited for disk reads", registry=r)
        self.stall_per_token = Gauge("sluice_stall_seconds_per_token", "Fetch stall per generated or prompt token, since start", registry=r)
        self.snapshots = Gauge("sluice_snapshots", "Conversation snapshots held", registry=r)
        self.snapshot_bytes = Gauge("sluice_snapshot_bytes", "Bytes of conversation snapshots held", registry=r)
        self.active = Gauge("sluice_active_requests", "Requests being served", registry=r)
        self.queued = Gauge("sluice_queued_requests", "Requests waiting for a turn (not in the step being run)", registry=r)
        self.batch = Gauge("sluice_decode_batch", "Sequences in the last step shared by several requests", registry=r)
        self.bytes_per_token = Gauge("sluice_expert_bytes_per_token", "Routed expert bytes served (every tier) per prompt or "
                                     "generated token, since start: falls as requests share steps", registry=r)
        self.images = Counter("sluice_images", "Images received in requests (decoded and preprocessed)", registry=r)
        self.image_tokens = Counter("sluice_image_tokens", "Prompt tokens the received images took", registry=r)
        self._served = dict.fromkeys(TIERS, 0)
        self._stall = 0.0
        self._tokens = 0

    def reject(self, error) -> "JSONResponse":
        """Count an error response (api/protocol.APIError) and make it: a 4xx is a rejected request, a 5xx a failed one
        (the worker has counted a generation that failed: code generation_failed)."""
        self.errors.labels(status=str(error.status), code=error.code or error.kind).inc()
        if error.status < 500 or error.code != "generation_failed":
            self.requests.labels(status="rejected" if error.status < 500 else "error").inc()
        return error.response()

    def observe_io(self, io: dict, block_bytes: int) -> None:
        """Add one request's expert I/O (worker thread)."""
        for t in TIERS:
            n = io.get("blocks", {}).get(t, 0)
            self.blocks.labels(tier=t).inc(n)
            self.bytes.labels(tier=t).inc(n * block_bytes)
            self._served[t] += n
        total = sum(self._served.values())
        if total:
            self.hit_rate.set(1 - self._served["disk"] / total)
        self.stall.inc(io.get("stall_s", 0.0))
        self._stall += io.get("stall_s", 0.0)
        self._tokens += io.get("tokens", 0)
        if self._tokens:
            self.stall_per_token.set(self._stall / self._tokens)
            self.bytes_per_token.set(sum(self._served.values()) * block_bytes / self._tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
