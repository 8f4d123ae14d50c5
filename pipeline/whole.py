"""A one-token step whole, embed to logits over every layer, replayed as one CUDA graph.

Where a schedule's one-token MoE layers need no host wait (the plan's composed steps: routed ids kept on the GPU,
blocks read where they lie, in VRAM or pinned RAM) and every resident layer's one-token step is a fixed set of
kernels over state updated in place (attention over a static cache, `--static-kv`; Mamba-2 and MLP blocks), the
whole step is captured once per sequence state and replayed: one launch a token instead of hundreds of launches and
the Python between them. The host work that is left runs around the replay: the token's first host work (fetch: the
VRAM tier's turn, `TokenPlan.begin_token`) before it, each MoE layer's tallies and trace spans after it.

A sequence's first one-token step runs as it would without this (eagerly: its kernels compiled and tuned, its
per-layer graphs made); its second captures the step (capture runs nothing) and replays it; the later ones replay it
while the sequence's state tensors stay where they were. A replay runs the kernels the eager step runs, in its order,
on the same tensors, so its logits are bit-identical to the eager step's (tests/test_whole.py on CUDA). A capture
that fails (a step that needs the host) leaves every later step eager, with a warning naming why.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from sluice.log import get_logger

OUT_OF_VRAM = "out of VRAM"  # a step kept under its key in place of its capture: it runs layer by layer


@dataclass
class _Whole:
    """One sequence state's captured step (or several sequences' one batched step: `WholeStep.run_rows`)."""

    ids: torch.Tensor  # [B, 1] int64 on the device: each sequence's token, written before each replay
    past: torch.Tensor  # [] int64 on the device: its position ([B]: each sequence's)
    inputs: torch.Tensor  # [B + B] or [1 + 1]: ids then past, of which the two are views
    graphs: list = field(default_factory=list)  # torch.cuda.CUDAGraph segments, replayed in order, each followed by its
    # host turns; none: the body runs eagerly at each step (a CPU: tests/test_whole.py)
    turns: list = field(default_factory=list)  # per segment, the host's turns after its replay (stages/table_cpu.py CpuTurn):
    # one that ends it (cpu_wait: host), or those its graph waits for on the device (cpu_wait: device), in layer order
    logits: torch.Tensor | None = None  # [B, V] fp32, in the graphs' pool: read before the next replay
    ran: list = field(default_factory=list)  # the plan's composed steps the body holds (their tallies per replay)
    marks: list = field(default_factory=list)  # their parts' trace marks


def default_static_kv(config, model, device) -> int | None:
    """The static cache an engine's sequences get (config.static_kv; 0: none): where unset, the model's context on CUDA
    for a model whose whole step is checked on a GPU (`ResidentModel.whole_checked`), so that its one-token steps
    replay whole without a flag; the cache's slots are allocated as a sequence needs them (models/static_cache.py)."""
    if config.static_kv is not None:
        return config.static_kv or None
    if device.type == "cuda" and model.whole_checked and config.whole_step is not False:
        return getattr(model.config, "max_position_embeddings", None)
    return None


class WholeStep:
    KEEP = 8  # steps kept: a server's turns switch among a few sequence states (two steps each with the CPU's share) and
    # batched steps' compositions

    def __init__(self, model, coordinator, rt, routing, graphs: bool = True):
        self.model, self.coordinator, self.rt, self.routing = model, coordinator, rt, routing
        self.graphs = graphs  # False: no capture, the body runs eagerly (the same composition, checked on a CPU)
        self.pool = rt.streams.capture_pool(rt.pools) if graphs else None
        # (a sequence's state key, the plan's variant) or ("rows", every sequence's state key) -> its step (None: warmed
        # up only)
        self._seen: OrderedDict[tuple, _Whole | None] = OrderedDict()
        self.off: str | None = None  # why whole steps stopped (a failed capture)
        self.rows_off: str | None = None  # why batched steps stopped replaying whole (one-token steps go on)
        self.captures = self.replays = 0

    @staticmethod
    def refusal(model, coordinator, rt, static_kv: int | None, asked: bool | None = None) -> str | None:
        """Why this engine's one-token steps cannot be replayed whole, or None where they can. `asked`: True runs them
        whole on a model not yet checked on a GPU (`ResidentModel.whole_checked`), None only on checked ones."""
        plan = coordinator.plan
        if plan is None:
            return "the schedule's MoE layers are not composed into one-token steps (a `via: table` schedule is)"
        table = plan.table
        if table.backend != "triton" or table.stream_ram:
            return "one-token MoE steps wait for the host (the torch backend, or fetch's hold: false)"
        if static_kv is None:
            return "attention over a growing cache (--static-kv N fixes its tensors)"
        if rt.recorder is not None:
            return "routing is recorded"
        sliding = sorted({type(layer).__name__ for layer in model.new_cache(static_kv).layers if "Sliding" in type(layer).__name__})
        if sliding:  # transformers keeps their fill on the host
            return f"{model.config.model_type}'s sliding-window attention ({', '.join(sliding)}) changes host state each token"
        if not model.whole_checked and asked is not True:
            return f"not yet checked on a GPU for {model.config.model_type} (--whole-step runs it whole all the same)"
        return None

    def run(self, seq, token: int) -> torch.Tensor | None:
        """The logits [1, V] fp32 of one token appended to sequence `seq`, from its whole step's replay; None where the
        step runs eagerly instead (the first one-token step over these state tensors, or whole steps off)."""
        if self.off is not None:
            return None
        cache, past = seq.cache, len(seq.tokens)
        # the walk over its state costs as much host time as the rest of a replay: kept while only replays ran on it
        seq.state_key = seq.state_key or _state_key(cache)
        w = self._step_for((seq.state_key, self.coordinator.plan.variant()), lambda: self._capture(self._body, cache, (1, 1), ()))
        if w is None:
            return None
        w.ids.fill_(token)
        w.past.fill_(past)
        self._replay(w, self._body, cache)
        return w.logits.clone()  # the pool's output is overwritten by the next replay

    def run_rows(self, seqs: list, tokens: list[int]) -> list[torch.Tensor] | None:
        """The logits [1, V] fp32 of each token appended to its sequence in one batched step (pipeline/batch.py), from
        the step's replay over these sequences' states; None where it runs layer by layer instead (their first batched
        step over these states, a MoE layer whose rows wait for the host, or whole steps off)."""
        if self.off is not None or self.rows_off is not None or len(seqs) < 2:
            return None
        caches = [s.cache for s in seqs]
        for s in seqs:
            s.state_key = s.state_key or _state_key(s.cache)
        w = self._step_for(("rows", *(s.state_key for s in seqs)),
                           lambda: self._capture(self._body_rows, caches, (len(seqs), 1), (len(seqs),), rows=True))
        if w is None:
            return None
        B = len(seqs)
        host = self.rt.streams.host_buffer(("whole rows",), torch.Size([2 * B]), torch.int64)  # the caller read the
        host.numpy()[:] = [*tokens, *(len(s.tokens) for s in seqs)]  # last step's logits: its copy from here landed
        w.inputs.copy_(host, non_blocking=True)
        self.coordinator.plan.table.cpu_now = False  # rows never share with the CPU: none of its per-token host work
        self._replay(w, self._body_rows, caches)
        return list(w.logits.clone().split(1))

    def _step_for(self, key: tuple, capture) -> _Whole | None:
        """The step kept under `key`: None at its first sight (that step warms up eagerly), captured at its second
        (`capture`); None for good where its capture ran out of VRAM (other keys still capture)."""
        if key not in self._seen:
            self._keep(key, None)
            return None
        w = self._seen[key]
        self._seen.move_to_end(key)
        if w is None:
            w = capture()
            if w is None:
                return None
            self._keep(key, w)
        return w if isinstance(w, _Whole) else None

    def _replay(self, w: _Whole, body, state) -> None:
        """The step's host work before it (`begin_token`), its segments replayed with the host's turns between them (or,
        without graphs, its body run eagerly), the host work that waits for it to be queued (`token_queued`: it runs
        beside the GPU's), then its tallies."""
        plan = self.coordinator.plan
        plan.begin_token()
        if not w.graphs:
            for turn in body(w, state):
                turn.host()
        else:
            for graph, turns in zip(w.graphs, w.turns):
                done = 0
                try:
                    graph.replay()
                    for turn in turns:
                        turn.host()
                        done += 1
                except BaseException:  # (an interrupt too) the graph must not wait on the turns left: their flags raised
                    for rest in turns[done:]:
                        rest.release()
                    raise
        plan.token_queued()
        self.replays += 1
        plan.replayed(w.ran, w.marks)

    def _keep(self, key: tuple, w: _Whole | str | None) -> None:
        self._seen[key] = w
        self._seen.move_to_end(key)
        while len(self._seen) > self.KEEP:
            self._seen.popitem(last=False)

    def _capture(self, make, state, ids: tuple, past: tuple, rows: bool = False) -> _Whole | str | None:
        """The step make(w, state) captured in segments (one where no host turn ends one; shapes of its token ids and
        positions); OUT_OF_VRAM where it does not fit now; None where it cannot be: whole steps off from now on
        (`rows`: batched ones only), with a warning."""
        dev = self.model.device
        n = math.prod(ids)  # ids and positions one tensor: a batched step sends both in one copy (`run_rows`)
        both = torch.zeros(n + math.prod(past), dtype=torch.int64, device=dev)
        w = _Whole(both[:n].view(ids), both[n:].view(past), both)
        if not self.graphs:
            return w
        try:
            body = make(w, state)
            while True:  # a segment up to each host turn that ends one, the last one to the logits
                graph, turns = torch.cuda.CUDAGraph(), []
                with self.rt.streams.capture(graph, self.pool):
                    while (turn := next(body, None)) is not None:
                        turns.append(turn)
                        if not turn.in_graph:
                            break
                w.graphs.append(graph)
                w.turns.append(turns)
                if turn is None:
                    break
        except torch.OutOfMemoryError as e:  # this step's states and pool do not fit now: it runs layer by layer
            body.close()
            get_logger().warning("a step runs layer by layer: out of VRAM while capturing it", error=str(e)[:120])
            return OUT_OF_VRAM
        except Exception as e:
            body.close()  # its plan.whole() ends
            why = str(e)[:200]
            if rows:
                self.rows_off = why
            else:
                self.off = why
                table = self.coordinator.plan.table  # layer by layer from now on: the CPU's share as its knobs say
                table.cpu_now = bool(table.cpu_share)
            get_logger().warning(f"{'batched' if rows else 'one-token'} steps run layer by layer: the whole step cannot be "
                                 "captured", error=why)
            return None
        self.captures += 1
        return w

    def _body(self, w: _Whole, cache):
        """The step's work: the engine's layer loop (pipeline/engine.py `_step`) for one token on the device alone,
        yielding at a MoE layer whose blocks the CPU shares its turn for the host (run after the replay of the graph that
        holds the layer's first part; with cpu_wait: host the segment ends there, the next begins with the layer's mix)."""
        model = self.model
        with self.coordinator.plan.whole() as (ran, marks):
            h, ctx = model.begin(w.ids, cache, w.past)
            for layer in model.layers:
                if layer.moe is None:
                    h = layer.forward(h, ctx)
                    continue
                out = self.coordinator.token(layer, h, ctx)
                if out is None:
                    raise RuntimeError(f"layer {layer.moe.layer}'s one-token MoE step needs the host")
                if isinstance(out, torch.Tensor):
                    h = out
                else:
                    yield out
                    h = out.finish()
            w.logits = model.head(h)
            if self.routing is not None:
                self.routing.advance(1)
        w.ran, w.marks = ran, marks

    def _body_rows(self, w: _Whole, caches: list):
        """A batched step's work over B sequences' one-token steps (pipeline/batch.py `step_many`, on the device alone):
        each resident layer over their rows at once where it can, each MoE layer's rows as one composed step."""
        model, coordinator = self.model, self.coordinator
        with coordinator.plan.whole() as (ran, marks):
            begun = [model.begin(w.ids[b : b + 1], cache, w.past[b]) for b, cache in enumerate(caches)]
            hs, ctxs = [h for h, _ in begun], [c for _, c in begun]
            for layer in model.layers:
                if layer.moe is None:
                    hs = resident_rows(layer, hs, ctxs)
                    continue
                hs = coordinator.rows(layer, hs, ctxs, first=False)
                if hs is None:
                    raise RuntimeError(f"layer {layer.moe.layer}'s batched MoE step needs the host")
            w.logits = torch.cat([model.head(h) for h in hs])
            if self.routing is not None:
                self.routing.advance(len(caches))
        w.ran, w.marks = ran, marks
        yield from ()  # a generator as `_body` is, with no host turn: one segment


def resident_rows(layer, hs: list, ctxs: list) -> list:
    """A resident layer over several sequences' rows: at once where the layer can (`forward_rows`), else one by one."""
    return layer.forward_rows(hs, ctxs) or [layer.forward(h, ctx) for h, ctx in zip(hs, ctxs)]


def _state_key(cache) -> tuple:
    """Where a sequence's state tensors lie (the addresses a captured step reads and writes), and the windows its
    attention reads them through (models/static_cache.py: a captured step reads a fixed number of slots). Run before
    every replay, so kept to exact-type checks (a state's tensors sit in attributes, dicts, lists and tuples)."""
    key = []
    for layer in cache.layers:
        for v in vars(layer).values():
            _addresses(v, key)
        key.append(getattr(layer, "window", 0))
    return tuple(key)


def _addresses(v, key: list) -> None:
    kind = type(v)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        key.append(v.data_ptr())
    elif kind is dict:
        for x in v.values():
            _addresses(x, key)
    elif kind is list or kind is tuple:
        for x in v:
            _addresses(x, key)
    elif isinstance(v, torch.Tensor):  # a subclass
        key.append(v.data_ptr())
