"""The engine worker: one thread that owns the engine and serves every request fairly.

Requests (jobs) arrive on a queue; the worker takes them in turns, one step each: a prefill chunk
or one decode token. So a long prompt does not hold back the others' tokens. With `max_batch` > 1
jobs share a step, up to `max_batch` of them, within a budget of `step_tokens` rows (as continuous
batching schedulers do): the decoding jobs' tokens first (the turn's job and those waiting, in
order), then prompt chunks in arrival order (first come, first prefilled) cut to what the budget
leaves. The step's MoE layers run once over all its rows (`Engine.extend_many`: each block
read once for every sequence that routed to it); tokens are those the jobs would get alone within
the kernels' rounding. With `max_batch` 1 (or a model that cannot batch) N requests at once produce
exactly what they would one at a time. Events go back to the
server's event loop through a callback. A cancelled job (client gone, stop string seen) is dropped
at its next turn and its state freed.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from sluice.api.memory import trim
from sluice.api.snapshots import SnapshotStore
from sluice.errors import StoreError
from sluice.pipeline.engine import split_image_rows
from sluice.pipeline.runtime import TIERS
from sluice.pipeline.sampling import Sampler


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop_ids: frozenset[int]
    emit: Callable[[tuple], None]  # ("token", id) | ("done", finish_reason, usage) | ("error", message)
    images: Any = None  # models/vision.PromptImages of the prompt's image tokens, or None
    key: list[int] | None = None  # the prompt as a snapshot key (image tokens told apart), default: the prompt
    constraint: Any = None  # api/grammar.Constraint: the tokens a grammar allows, or None (free text)
    snapshot: Any = None  # a snapshot read from disk for this prompt (api/snapshot_disk.py): used if it covers more than RAM's
    cancelled: threading.Event = field(default_factory=threading.Event)
    # worker-owned
    seq: Any = None
    pending: list[int] = field(default_factory=list)
    logits: Any = None
    generated: list[int] = field(default_factory=list)
    rows: Any = None  # the image rows of the prompt's image tokens not yet processed
    cached: int = 0
    io: dict = field(default_factory=dict)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    arrival: int = 0  # its place in the worker's arrival order

    def cancel(self) -> None:
        self.cancelled.set()


class EngineWorker:
    def __init__(self, engine, snapshots: SnapshotStore, metrics, prefill_chunk: int = 512, max_batch: int = 1,
                 step_tokens: int | None = None):
        """step_tokens: the rows a shared step holds at most (default: prefill_chunk; at least max_batch)."""
        self.engine = engine
        self.snapshots = snapshots
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch if engine.model.batchable else 1
        self.step_tokens = max(step_tokens or prefill_chunk, self.max_batch)
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._arrivals = itertools.count()  # each job's place in arrival order (shared steps prefill first come first)
        self.active = 0
        self.fault: str | None = None  # the first store fault a step met (a corrupt block): /health reports it

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        job.arrival = next(self._arrivals)
        self._inbox.put(job)

    def _run(self) -> None:
        jobs: deque[Job] = deque()
        while not self._stop.is_set():
            if not jobs and self._inbox.empty():  # going idle: what the requests freed goes back to the system (bounds
                trim()  # the RSS), never while a request waits for its first token
            try:
                while True:  # take everything that arrived; block only when idle
                    job = self._inbox.get(block=not jobs)
                    if job is None:
                        return
                    jobs.append(job)
            except queue.Empty:
                pass
            self.active = len(jobs)
            self.metrics.queued.set(len(jobs) - 1)
            job = jobs.popleft()
            if job.cancelled.is_set():
                self._close(job, None)
            else:
                try:
                    self._begin(job)
                    if self.max_batch > 1 and (_decoding(job) or _prefilling(job)) and (step := self._compose(job, jobs)):
                        self._batch_turn(*step, jobs)
                        continue
                    finished = self._turn(job)
                except Exception as e:  # the job fails; the server keeps serving
                    if job.cancelled.is_set():  # its client left during the step, which stopped there
                        self._close(job, None)
                        continue
                    if isinstance(e, StoreError) and self.fault is None:
                        self.fault = str(e)
                    self.metrics.requests.labels(status="error").inc()
                    job.emit(("error", f"{type(e).__name__}: {e}"))
                    self._free(job)
                else:
                    if finished is None:
                        jobs.append(job)
                    else:
                        self._close(job, finished)
            self.active = len(jobs)

    def _turn(self, job: Job) -> str | None:
        """One step of a job (begun: `_begin`). Returns its finish reason when it is done, else None."""
        engine = self.engine
        before = engine.rt.stats.counters(device=True)  # the last turn's sample already waited for the GPU
        if job.constraint is not None:
            job.constraint.start()  # the grammar's mask is computed while the step runs
        try:
            if job.pending:
                chunk = self._next_chunk(job)
                token = engine.image_encoder.image_token_id if job.rows is not None else None
                rows, job.rows = split_image_rows(chunk, job.rows, token)
                job.logits = engine.extend(job.seq, chunk, rows, last=True, cancel=job.cancelled)[-1]
                if job.pending:
                    return None
            else:
                job.logits = engine.extend(job.seq, [job.generated[-1]])[-1]
            token = _sample(job, job.logits)
        finally:
            _add(job.io, engine.rt.stats.counters_since(before, device=True))
        return self._emit(job, token)

    def _begin(self, job: Job) -> None:
        """A job's first turn: its sequence, from the longest snapshot its prompt begins with, and its image rows."""
        engine = self.engine
        if job.seq is None:
            snap = self.snapshots.longest_prefix(job.key or job.prompt)
            if job.snapshot is not None and (snap is None or len(job.snapshot.tokens) > len(snap.tokens)):
                snap = job.snapshot
            job.snapshot = None  # the sequence holds its own copy
            job.seq = engine.restore(snap) if snap is not None else engine.new_sequence()
            job.cached = len(job.seq.tokens)
            job.pending = job.prompt[job.cached :]
            if job.images is not None:
                token = engine.image_encoder.image_token_id
                if token in job.pending:  # rows for the image tokens past the restored prefix
                    rows = engine.encode_images(job.images.pixel_values, job.images.image_grid_hw)
                    job.rows = rows[sum(1 for i in job.prompt[: job.cached] if i == token) :]

    def _compose(self, job: Job, jobs: deque) -> tuple[list[Job], list[list[int]]] | None:
        """The step `job`'s turn shares, or None where it would be `job`'s alone: decode tokens first (job's, then those
        of decoding jobs in `jobs`, in order), then prompt chunks in arrival order (first come, first prefilled: the
        first prompts in get their first tokens soonest; fresh jobs begun on the way) cut to the rows `step_tokens`
        leaves, up to `max_batch` jobs. The jobs taken leave `jobs` (job, if left out, stays at its front); each job's
        piece is taken off its pending prompt."""
        if not any(_decoding(j) or _prefilling(j) for j in jobs):
            return None
        decode = [j for j in [job, *jobs] if _decoding(j)][: self.max_batch]
        room, batch, sizes = self.step_tokens - len(decode), list(decode), [1] * len(decode)
        for j in sorted((j for j in [job, *jobs] if _prefilling(j)), key=lambda j: j.arrival):
            if len(batch) == self.max_batch or room < 1:
                break
            if j.seq is None:
                try:
                    self._begin(j)  # a fresh job's sequence (from a snapshot if one covers its prompt)
                except Exception:
                    continue  # its own turn begins it again and reports the error to it
                if not _prefilling(j):
                    continue
            n = min(len(j.pending), self.prefill_chunk, room)
            batch.append(j)
            sizes.append(n)
            room -= n
        if batch == [job] or not batch:
            return None
        taken = set(map(id, batch))
        kept = [j for j in jobs if id(j) not in taken]
        jobs.clear()
        jobs.extend(kept)
        if job not in batch:
            jobs.appendleft(job)
        pieces = []
        for j, n in zip(batch, sizes):
            pieces.append(self._next_chunk(j, n) if j.pending else [j.generated[-1]])
            if j.constraint is not None and not j.pending:
                j.constraint.start()
        return batch, pieces

    def _batch_turn(self, batch: list[Job], pieces: list[list[int]], jobs: deque) -> None:
        """One step shared by `batch`'s jobs, each with its piece (a decode token or a prompt chunk); each job goes back
        to `jobs` or finishes. A failed step fails them all (the server keeps serving); a batch's expert I/O is shared
        out evenly among its jobs."""
        engine = self.engine
        self.metrics.batch.set(len(batch))
        before = engine.rt.stats.counters(device=True)
        try:
            logits = engine.extend_many([j.seq for j in batch], pieces)
        except Exception as e:
            if isinstance(e, StoreError) and self.fault is None:
                self.fault = str(e)
            for job in batch:
                self.metrics.requests.labels(status="error").inc()
                job.emit(("error", f"{type(e).__name__}: {e}"))
                self._free(job)
            return
        finally:
            share = engine.rt.stats.counters_since(before, device=True)
            for job in batch:
                _add(job.io, _scaled(share, 1 / len(batch)))
        for job, row in zip(batch, logits):
            if job.pending:  # a prompt chunk before the last: no token yet
                jobs.append(job)
                continue
            finished = self._emit(job, _sample(job, row[-1]))
            if finished is None:
                jobs.append(job)
            else:
                self._close(job, finished)

    def _next_chunk(self, job: Job, n: int | None = None) -> list[int]:
        """The next n (default `prefill_chunk`) tokens of the job's prompt, taken off what is pending."""
        n = n or self.prefill_chunk
        chunk, job.pending = job.pending[:n], job.pending[n:]
        return chunk

    def _emit(self, job: Job, token: int) -> str | None:
        """The job's new token out to its client; its finish reason when that ends it, else None."""
        job.generated.append(token)
        if job.t_first is None:
            job.t_first = time.perf_counter()
            self.metrics.ttft.observe(job.t_first - job.t_submit)
        self.metrics.tokens.inc()
        job.emit(("token", token))
        if token in job.stop_ids or job.constraint is not None and job.constraint.done:
            return "stop"
        if len(job.generated) >= job.max_tokens:
            return "length"
        return None

    def _close(self, job: Job, finish: str | None) -> None:
        """Finish or drop a job; a finished reply's state is kept as a snapshot."""
        if finish is not None and job.seq is not None and not job.seq.broken:
            self.snapshots.put(self.engine.snapshot(job.seq), (job.key or job.prompt) + job.generated)
        if job.io:
            self.metrics.observe_io(job.io, self.engine.store.block_bytes)
        if finish is None:
            self.metrics.requests.labels(status="cancelled").inc()
            job.emit(("done", "cancelled", self._usage(job)))
        else:
            self.metrics.requests.labels(status="ok").inc()
            rate = _decode_rate(job)
            if rate is not None:
                self.metrics.decode_rate.set(rate)
            job.emit(("done", finish, self._usage(job)))
        self._free(job)

    def _free(self, job: Job) -> None:
        """The job's state handed back to the engine for the next job (its graphs replay at once), not left to the
        garbage collector."""
        if job.seq is not None:
            self.engine.release(job.seq)
            job.seq = None

    def _usage(self, job: Job) -> dict:
        io, n = job.io, self.engine.store.block_bytes
        blocks = io.get("blocks", dict.fromkeys(TIERS, 0))
        total = sum(blocks.values())
        return {
            "prompt_tokens": len(job.prompt),
            "completion_tokens": len(job.generated),
            "total_tokens": len(job.prompt) + len(job.generated),
            "prompt_tokens_details": {"cached_tokens": job.cached},
            "sluice": {  # expert I/O of this request; OpenAI clients ignore unknown fields
                "expert_bytes": {t: round(blocks[t] * n) for t in TIERS},  # a batched step's, shared out
                "hit_rate": round((total - blocks["disk"]) / total, 4) if total else None,
                "prefetch_accuracy": round(io["predicted_right"] / io["predicted"], 4) if io.get("predicted") else None,
                "stall_s": round(io.get("stall_s", 0.0), 4),
                "time_to_first_token_s": round(job.t_first - job.t_submit, 4) if job.t_first is not None else None,
                "decode_tokens_per_s": None if (rate := _decode_rate(job)) is None else round(rate, 2),
            },
        }


def _sample(job: Job, logits) -> int:
    """The job's next token from logits [V], among those its grammar allows (if any), which then advances."""
    token = job.sampler(logits if job.constraint is None else job.constraint.apply(logits))
    if job.constraint is not None:
        job.constraint.advance(token)
    return token


def _decoding(job: Job) -> bool:
    """Whether the job's next step is one decode token (its prompt is in, it is still wanted)."""
    return job.seq is not None and not job.pending and bool(job.generated) and not job.cancelled.is_set()


def _prefilling(job: Job) -> bool:
    """Whether the job's next step is a prompt chunk that may share a step (no image rows), or it has not begun (its
    sequence is made when a step takes it); not a cancelled one."""
    fresh = job.seq is None and job.images is None and not job.cancelled.is_set()
    return fresh or (job.seq is not None and bool(job.pending) and job.rows is None and not job.cancelled.is_set())


def _scaled(counts: dict, f: float) -> dict:
    return {k: _scaled(v, f) if isinstance(v, dict) else v * f if isinstance(v, (int, float)) else v
            for k, v in counts.items()}


def _decode_rate(job: Job) -> float | None:
    """Tokens per second after the first one, until now; None with fewer than two tokens."""
    elapsed = time.perf_counter() - job.t_first if job.t_first is not None else 0.0
    return (len(job.generated) - 1) / elapsed if len(job.generated) > 1 and elapsed > 0 else None


def _add(acc: dict, delta: dict) -> None:
    for k, v in delta.items():
        if isinstance(v, dict):
            _add(acc.setdefault(k, {}), v)
        else:
            acc[k] = acc.get(k, 0) + v
