"""`sluice bench routing`: the statistics a routing setting's draws have, or a recorded routing's, side by side with
what real models show (storage/routing.py TARGET_*): how often an LRU cache of 24% of the blocks hits, the share of a
token's experts that the token before routed to as well, and how often a guess names a routed expert."""

from __future__ import annotations

from sluice.errors import SluiceError
from sluice.storage.routing import (TARGET_HIT, TARGET_REPEAT, TARGET_SHARE, for_shape, lru_hit_rate, parse_routing,
                                    repeat_share, routing_tables, split_settings, table_trace, trace_ids)
from sluice.storage.simulate import guess_recall, simulate


def routing_stats(ids, guesses=None, trace=None) -> dict:
    """ids [n, L, K] (int64): the statistics; guesses [n, L, K] or a recorded trace's own guesses for the recall."""
    n, layers, k = ids.shape
    experts = int(ids.max()) + 1
    whole = trace or table_trace(ids, None, list(range(layers)), experts)
    lru = simulate(whole, ram_blocks=int(TARGET_SHARE * layers * experts), prefetch=False, decode_only=trace is not None)
    if guesses is not None:
        recall = float((guesses.unsqueeze(-1) == ids.unsqueeze(-2)).any(-1).float().mean())
    else:
        recall = guess_recall(trace)[0] if trace is not None else None
    return {"tokens": n, "layers": layers, "lru_hit_per_layer": lru_hit_rate(ids, int(TARGET_SHARE * experts)),
            "lru_hit_simulated": lru.hit_rate, "repeat": repeat_share(ids), "recall": recall}


def cmd_bench_routing(args) -> int:
    rows = []
    if args.trace:
        from sluice.storage.trace import read_trace

        trace = read_trace(args.trace)
        h = trace.header
        ids = trace_ids(trace, len(h["moe_layers"]), h["num_experts"], h["top_k"])
        rows.append((f"trace {args.trace} ({h.get('routing', 'natural')})", routing_stats(ids, trace=trace)))
        shape = (len(h["moe_layers"]), h["num_experts"], h["top_k"])
    else:
        shape = (args.layers, args.experts, args.top_k)
    if not all(shape):
        raise SluiceError("bench routing: give --trace FILE, or --layers, --experts and --top-k")
    layers, experts, top_k = shape
    for text in split_settings(args.routing):
        setting = for_shape(parse_routing(text), experts, top_k)
        ids, guesses = routing_tables(setting, layers, experts, top_k, positions=args.tokens)
        rows.append((str(setting), routing_stats(ids.long(), guesses.long())))
    print(f"{layers} MoE layers, top-{top_k} of {experts} experts; real models: LRU ({TARGET_SHARE:.0%} of the blocks) "
          f"{TARGET_HIT:.1%}, repeat ~{TARGET_REPEAT:.0%}, recall 65-72%")
    print(f"| routing | tokens | LRU hit, per layer | LRU hit, simulated | repeat | guess recall |\n|---|---:|---:|---:|---:|---:|")
    for name, s in rows:
        rec = f"{s['recall']:.1%}" if s["recall"] is not None else "-"
        print(f"| {name} | {s['tokens']} | {s['lru_hit_per_layer']:.1%} | {s['lru_hit_simulated']:.1%} | {s['repeat']:.1%} | {rec} |")
    return 0


def add_routing_parser(bsub) -> None:
    br = bsub.add_parser("routing", help="a routing setting's statistics (or a recorded routing's) beside real models'")
    br.add_argument("--routing", default="uniform,skewed", help="settings, comma-separated (default: %(default)s)")
    br.add_argument("--trace", help="a recorded routing (--record-routing) to measure, at whose shape the settings are drawn")
    br.add_argument("--layers", type=int, help="MoE layers (without --trace)")
    br.add_argument("--experts", type=int, help="experts per MoE layer (without --trace)")
    br.add_argument("--top-k", type=int, help="experts per token (without --trace)")
    br.add_argument("--tokens", type=int, default=1500, help="tokens drawn per setting (default: %(default)s)")
    br.set_defaults(func=cmd_bench_routing)
