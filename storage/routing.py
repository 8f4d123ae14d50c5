"""Routing under control, for honest benchmarks: which experts each token's MoE layers route to, drawn instead of
chosen by the model (`--routing`).

Random-weight checkpoints route as their weights happen to, and that decides every cache figure: a VRAM tier that
serves nearly every block on one checkpoint serves a tenth of them on another. So speed on a real model's shape is
measured with routing whose statistics are set:

    natural                                  the model's own routers (a real checkpoint; no speed claim on synth)
    uniform                                  K distinct experts uniformly at random per token and layer: pessimistic
    skewed[:popularity=S,reuse=P,recall=Q]   per layer a Zipf(S) popularity over a random order of its experts; each of
                                             a token's experts routes again for the next token with chance P, the rest
                                             drawn by popularity (defaults calibrated to real models, BENCHMARKS.md)
    trace:FILE[,recall=Q]                    a recorded routing (`--record-routing`) replayed token by token

A setting becomes two tables over token positions (`routing_tables`): the routed ids [N, L, K] and the guesses of them
[N, L, K], where each guess names the true expert with chance `recall` (the predictor's measured recall, 65-72% on
real models), else an expert the token does not route to. Positions wrap after N tokens. The engine reads both tables
on the device (pipeline/routing.py), so routed ids never need the host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from sluice.errors import ConfigError

KINDS = ("natural", "uniform", "skewed", "trace")
RECALL = 0.7
# real models' routing, which `skewed` is calibrated to by default: an LRU cache of 24% of the blocks hits 81-84% of
# lookups, and ~40% of a layer's experts repeat on the next token (the reference system's measurements)
TARGET_SHARE, TARGET_HIT, TARGET_REPEAT = 0.24, 0.825, 0.40
TABLE_BYTES = 32 << 20  # both tables' size on the device at most (int16 ids): positions = this / (L * K * 4)
MIN_POSITIONS, MAX_POSITIONS = 1024, 16384
DRAW_AT_ONCE = 1 << 22  # random values drawn at once while tables are made


@dataclass(frozen=True)
class RoutingSetting:
    """How a run's MoE layers choose their experts (`--routing`; the module docstring lists the kinds)."""

    kind: str = "natural"  # natural | uniform | skewed | trace
    popularity: float | None = None  # skewed: Zipf exponent of the experts' popularity within a layer (None: calibrated)
    reuse: float | None = None  # skewed: chance each of a token's experts routes again for the next token (None: calibrated)
    recall: float = RECALL  # drawn kinds: chance a guess of the next layer's experts names a true one
    trace: str | None = None  # trace: the routing trace replayed
    seed: int = 0  # the draws' seed

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"--routing: unknown kind {self.kind!r} (natural, uniform, skewed, trace:FILE)")
        if self.kind == "trace" and not self.trace:
            raise ConfigError("--routing: trace needs a file: trace:FILE")
        for name, lo, hi in (("popularity", 0.0, 10.0), ("reuse", 0.0, 1.0), ("recall", 0.0, 1.0)):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and lo <= v <= hi):
                raise ConfigError(f"--routing: {name} must be in [{lo:g}, {hi:g}], got {v!r}")

    @property
    def controlled(self) -> bool:
        return self.kind != "natural"

    def __str__(self) -> str:
        if self.kind == "skewed":
            if self.popularity is None or self.reuse is None:
                return f"skewed:calibrated,recall={self.recall:g}"
            return f"skewed:popularity={self.popularity:g},reuse={self.reuse:g},recall={self.recall:g}"
        if self.kind == "uniform":
            return f"uniform:recall={self.recall:g}"
        if self.kind == "trace":
            return f"trace:{self.trace},recall={self.recall:g}"
        return "natural"


def parse_routing(text: str | RoutingSetting | None) -> RoutingSetting:
    """'natural' | 'uniform[:recall=Q]' | 'skewed[:popularity=S,reuse=P,recall=Q]' | 'trace:FILE[,recall=Q]'."""
    if isinstance(text, RoutingSetting):
        return text
    if text is None or text == "":
        return RoutingSetting()
    kind, _, rest = str(text).partition(":")
    if kind == "trace":
        path, *opts = rest.split(",")
        return replace(RoutingSetting("trace", trace=path), **_options(opts, ("recall", "seed"), text))
    if kind not in KINDS:
        raise ConfigError(f"--routing: unknown kind {kind!r} in {text!r} (natural, uniform, skewed, trace:FILE)")
    allowed = {"natural": (), "uniform": ("recall", "seed"), "skewed": ("popularity", "reuse", "recall", "seed")}[kind]
    return RoutingSetting(kind, **_options(rest.split(",") if rest else [], allowed, text))


def split_settings(text: str) -> list[str]:
    """'uniform,skewed:popularity=1,reuse=0.2' -> ['uniform', 'skewed:popularity=1,reuse=0.2']: a list of settings,
    whose own options are comma-separated too (a new setting starts with a kind's name)."""
    out: list[str] = []
    for part in text.split(","):
        if out and part.split(":")[0] not in KINDS:
            out[-1] += "," + part
        else:
            out.append(part)
    return [p for p in out if p]


def _options(parts: list[str], allowed: tuple[str, ...], text) -> dict:
    out = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if key not in allowed or not eq:
            raise ConfigError(f"--routing: {part!r} in {text!r} is not one of {', '.join(k + '=' for k in allowed) or 'no options'}")
        try:
            out[key] = int(value) if key == "seed" else float(value)
        except ValueError:
            raise ConfigError(f"--routing: {key} must be a number, got {value!r}") from None
    return out


def for_shape(setting: RoutingSetting, experts: int, top_k: int) -> RoutingSetting:
    """`setting` with a skewed one's unset popularity and reuse calibrated to real models' statistics at this shape
    (`calibrate`); other settings as they are."""
    if setting.kind != "skewed" or (setting.popularity is not None and setting.reuse is not None):
        return setting
    s, p = calibrate(experts, top_k, setting.seed, setting.reuse)
    return replace(setting, popularity=s if setting.popularity is None else setting.popularity, reuse=p)


def calibrate(experts: int, top_k: int, seed: int = 0, reuse: float | None = None) -> tuple[float, float]:
    """(popularity, reuse) at which skewed routing of top_k of `experts` hits TARGET_HIT with an LRU cache of
    TARGET_SHARE of a layer's blocks and repeats TARGET_REPEAT of a token's experts on the next token, as closely as the
    two allow: a static popularity that hits often also repeats often, so where the repeat is past the target at reuse
    0, reuse stays 0. Both grow with each knob: the popularity is found for the hit rate at each reuse tried, the reuse
    for the repeat. Deterministic; a second or two."""
    def at(p: float) -> tuple[float, float]:  # (popularity for the target hit rate, its repeat share) at reuse p
        lo, hi = 0.0, 4.0
        for _ in range(10):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if lru_hit_rate(_table(mid, p), int(TARGET_SHARE * experts)) < TARGET_HIT else (lo, mid)
        s = round((lo + hi) / 2, 3)
        return s, repeat_share(_table(s, p))

    def _table(s: float, p: float):
        return _skewed(CALIBRATION_TOKENS, 2, experts, top_k, s, p, torch.Generator().manual_seed(seed))

    if reuse is not None:
        return at(reuse)[0], reuse
    s, rep = at(0.0)
    if rep >= TARGET_REPEAT:
        return s, 0.0
    lo, hi = 0.0, 0.8
    for _ in range(6):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid)[1] < TARGET_REPEAT else (lo, mid)
    p = round((lo + hi) / 2, 3)
    return at(p)[0], p


CALIBRATION_TOKENS = 1000


def lru_hit_rate(ids: torch.Tensor, capacity: int) -> float:
    """Hits of an LRU cache of `capacity` blocks per layer over ids [n, layers, K], after the first n / 4 tokens (the
    cache filled): a block hits when fewer than `capacity` other blocks of its layer were used since its last use."""
    table = ids.numpy()
    n, layers, k = table.shape
    hits = lookups = 0
    last = np.full((layers, int(table.max()) + 1), -1, dtype=np.int64)
    rows = np.arange(layers)[:, None]
    for t in range(n):
        row = table[t]  # [layers, K]
        seen = last[rows, row]
        if t >= n // 4:
            since = (last[:, None, :] > seen[:, :, None]).sum(2)  # blocks of the layer used since each one's last use
            hits += int(((seen >= 0) & (since < capacity)).sum())
            lookups += row.size
        last[rows, row] = t
    return hits / max(lookups, 1)


def repeat_share(ids: torch.Tensor) -> float:
    """The share of a token's experts that the token before routed to as well, per layer, over ids [n, layers, K]."""
    return float((ids[1:].unsqueeze(-1) == ids[:-1].unsqueeze(-2)).any(-1).float().mean())


def table_positions(layers: int, top_k: int) -> int:
    """Token positions the tables hold before they wrap (both int16 tables within TABLE_BYTES)."""
    return max(MIN_POSITIONS, min(MAX_POSITIONS, TABLE_BYTES // (4 * layers * top_k)))


def routing_tables(setting: RoutingSetting, layers: int, experts: int, top_k: int,
                   positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(routed ids, guesses), each [N, layers, top_k] int16 on the CPU: per token position and MoE layer, K distinct
    experts, and K distinct guesses of them (each the true expert at its place with chance `recall`)."""
    if not setting.controlled:
        raise ConfigError("routing_tables: natural routing has no table")
    if experts > torch.iinfo(torch.int16).max:
        raise ConfigError(f"--routing: {experts} experts per layer do not fit the int16 tables")
    n = positions or table_positions(layers, top_k)
    g = torch.Generator().manual_seed(setting.seed)
    setting = for_shape(setting, experts, top_k)
    if setting.kind == "uniform":
        ids = _uniform(n, layers, experts, top_k, g)
    elif setting.kind == "skewed":
        ids = _skewed(n, layers, experts, top_k, setting.popularity, setting.reuse, g)
    else:
        from sluice.storage.trace import read_trace

        ids = trace_ids(read_trace(setting.trace), layers, experts, top_k)
    return ids.to(torch.int16), _guesses(ids, experts, setting.recall, g).to(torch.int16)


def _top_k_of(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.topk(k, dim=-1).indices


def _uniform(n: int, layers: int, experts: int, k: int, g: torch.Generator) -> torch.Tensor:
    out = torch.empty(n, layers, k, dtype=torch.int64)
    step = max(1, DRAW_AT_ONCE // (layers * experts))  # positions drawn at once: bounded memory
    for at in range(0, n, step):
        m = min(step, n - at)
        out[at : at + m] = _top_k_of(torch.rand(m, layers, experts, generator=g), k)  # random order: K distinct
    return out


def _skewed(n: int, layers: int, experts: int, k: int, s: float, reuse: float, g: torch.Generator) -> torch.Tensor:
    """Token by token: each of the previous token's experts kept with chance `reuse`, the rest drawn without
    replacement by popularity (Gumbel top-k over log-popularity: a draw proportional to it). numpy: a token's few small
    operations cost a tenth of torch's host time."""
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=g)))
    rank = np.stack([rng.permutation(experts) for _ in range(layers)])  # [L, E]: expert -> its popularity rank
    log_pop = -s * np.log1p(rank)  # Zipf: popularity ~ (rank + 1) ** -s
    keep = rng.random((n, layers, k)) < reuse
    out = np.empty((n, layers, k), dtype=np.int64)
    rows = np.arange(layers)[:, None]
    step = max(1, DRAW_AT_ONCE // (layers * experts))
    for t in range(n):
        if t % step == 0:  # the noise of `step` tokens at a time: bounded memory
            gumbel = -np.log(-np.log(rng.random((min(step, n - t), layers, experts)).clip(1e-20, None)))
        scores = log_pop + gumbel[t % step]
        if t:
            prev = out[t - 1]
            scores[rows, prev] = np.where(keep[t], np.inf, scores[rows, prev])
        out[t] = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    return torch.from_numpy(out)


def _guesses(ids: torch.Tensor, experts: int, recall: float, g: torch.Generator) -> torch.Tensor:
    """Per entry: the true id with chance `recall`, else one of K other experts the token does not route to."""
    n, layers, k = ids.shape
    out = torch.empty_like(ids)
    step = max(1, DRAW_AT_ONCE // (layers * experts))
    for at in range(0, n, step):
        true = ids[at : at + step]
        m = true.shape[0]
        scores = torch.rand(m, layers, experts, generator=g).scatter_(2, true, -1.0)  # the routed experts last
        others = _top_k_of(scores, k)
        keep = torch.rand(m, layers, k, generator=g) < recall
        out[at : at + m] = torch.where(keep, true, others)
    return out


def trace_ids(trace, layers: int, experts: int, top_k: int) -> torch.Tensor:
    """A recorded routing as a table [tokens, layers, K]: token by token in the order it ran; MoE layer i replays the
    trace's i-th MoE layer (cycling where the trace has fewer)."""
    h = trace.header
    if h.get("num_experts") != experts or h.get("top_k") != top_k:
        raise ConfigError(f"--routing: trace routes top-{h.get('top_k')} of {h.get('num_experts')} experts; this model "
                          f"top-{top_k} of {experts}")
    order = {layer: i for i, layer in enumerate(h["moe_layers"])}
    steps: dict[int, dict[int, tuple[int, ...]]] = {}
    tokens: dict[int, int] = {}
    for r in trace.records:
        steps.setdefault(r.step, {})[order[r.layer]] = r.ids
        tokens[r.step] = r.tokens
    rows = []
    n_trace = len(order)
    for s in sorted(steps):
        layer_ids = steps[s]
        if len(layer_ids) < n_trace:
            continue  # a step that ended early (an error) routed only some layers
        t = tokens[s]
        per = torch.tensor([layer_ids[i] for i in range(n_trace)], dtype=torch.int64).view(n_trace, t, top_k)
        rows.append(per.permute(1, 0, 2))
    if not rows:
        raise ConfigError(f"--routing: trace {trace.header.get('schedule', '')!r} holds no whole step")
    table = torch.cat(rows)
    return table[:, [i % n_trace for i in range(layers)]]


def table_trace(ids: torch.Tensor, guesses: torch.Tensor | None, moe_layers: list[int], experts: int, block_bytes: int = 1):
    """Tables as a routing trace of one-token steps (storage/trace.py), so the offline simulator replays them: each
    layer's record holds the guesses made for it (those of its own table row, made one layer earlier)."""
    from sluice.storage.trace import Trace, TraceRecord

    n, layers, k = ids.shape
    header = {"sluice_routing_trace": 1, "architecture": "table", "moe_layers": list(moe_layers), "num_experts": experts,
              "top_k": k, "block_bytes": block_bytes, "ram_blocks": 0, "vram_blocks": 0, "schedule": "table",
              "prefetch": guesses is not None, "vram_prefetch": False, "prefetch_depth": 1 if guesses is not None else 0}
    records = []
    for t in range(n):
        for i, layer in enumerate(moe_layers):
            row = tuple(ids[t, i].tolist())
            p = tuple(guesses[t, i].tolist()) if guesses is not None and i > 0 else None
            records.append(TraceRecord(t, 1, layer, row, tuple(sorted(set(row))), "R" * len(set(row)), p))
    return Trace(header, tuple(records))
