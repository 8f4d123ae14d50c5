"""`sluice` command line: repack | verify | generate | chat | serve | synth | simulate | plan | bench model | bench kernels.

With no --model, commands use the bundled default model (made on first use).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sluice import options
from sluice.benchmarks.commands import add_bench_parser
from sluice.errors import SluiceError


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line naming the culprit; the traceback only when asked for
        if getattr(args, "debug", False):
            raise
        what = str(e).splitlines()[0][:500] if str(e) else type(e).__name__
        kind = "" if isinstance(e, SluiceError) else f"{type(e).__name__}: "
        print(f"sluice: error: {kind}{what}" + ("" if isinstance(e, SluiceError) else " (--debug shows the traceback)"),
              file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description="Run MoE models larger than the GPU by streaming routed experts.")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = p.add_subparsers(metavar="COMMAND")

    r = sub.add_parser("repack", help="turn a Hugging Face checkpoint into an expert store")
    r.add_argument("checkpoint", type=Path)
    r.add_argument("store", type=Path)
    r.add_argument("--force", action="store_true", help="replace an existing store")
    r.set_defaults(func=cmd_repack)

    v = sub.add_parser("verify", help="check every block of a store against its checksum and the source checkpoint")
    v.add_argument("store", type=Path)
    v.add_argument("--source", type=Path, help="source checkpoint (default: the path recorded at repack)")
    v.set_defaults(func=cmd_verify)

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    options.engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--image", type=Path, action="append", default=[],
                   help="an image before the prompt (vision-language models; repeat for several)")
    g.add_argument("--doc", action="store_true", help="images at the processor's maximum resolution (for reading documents)")
    options.sampling_args(g)
    g.set_defaults(func=cmd_generate)

    sy = sub.add_parser("synth", help="a random-weight checkpoint with the exact tensor shapes of a real model")
    sy.add_argument("out", type=Path)
    sy.add_argument("--shape", required=True, help="nemotron-3.5-super | nemotron-3-nano-30b-a3b | qwen3-30b-a3b | qwen3-next-80b-a3b | deepseek-v3")
    sy.add_argument("--format", default="nvfp4", help="routed experts in nvfp4 | fp8 (128x128 blocks) | bf16")
    sy.add_argument("--moe-layers", type=options.at_least(1), help="keep the layers up to the N-th MoE layer (a slice that fits the disk)")
    sy.add_argument("--headers-only", action="store_true", help="write only the shards' headers (for `sluice plan`)")
    sy.set_defaults(func=cmd_synth)

    sm = sub.add_parser("simulate", help="replay a routing trace through tier caches (size caches on paper)")
    sm.add_argument("trace", type=Path)
    sm.add_argument("--ram-cache", help="RAM cache size, e.g. 20GiB (default: the recorded run's)")
    sm.add_argument("--vram-slots", type=int, help="VRAM expert slots (default: the recorded run's)")
    sm.add_argument("--policy", default="lru", help="lru | lfu | fifo | belady")
    sm.add_argument("--no-prefetch", action="store_true", help="replay without the recorded guesses' prefetch")
    sm.add_argument("--vram-prefetch", choices=["recorded", "on", "off"], default="recorded",
                    help="copy the guesses in RAM into VRAM ahead, as `h2d: {prefetch: true}` does (default: as recorded)")
    sm.add_argument("--depth", type=int, help="MoE layers guessed ahead, up to the recorded run's `depth` (predict's or fetch's, via: table) "
                    "(default: as recorded)")
    sm.add_argument("--sweep", type=Path, metavar="PREFIX", help="hit rate vs RAM size: write PREFIX.csv and PREFIX.png")
    sm.set_defaults(func=cmd_simulate)

    pl = sub.add_parser("plan", help="memory and speed plan from config.json and file headers, without loading weights; "
                                     "from config.json alone, an estimate for each weight format")
    pl.add_argument("path", type=Path)
    pl.add_argument("--vram", default="8GiB", help="GPU memory (default: %(default)s)")
    pl.add_argument("--ram", default="32GiB", help="host RAM (default: %(default)s)")
    pl.add_argument("--pcie-gbps", type=float, default=28.0, help="host-to-GPU copy rate in GB/s (default: %(default)s)")
    pl.add_argument("--disk-gbps", type=float, default=7.0, help="drive read rate in GB/s (default: %(default)s)")
    pl.add_argument("--context", type=int, default=4096, help="tokens of context the KV cache holds (default: %(default)s)")
    pl.add_argument("--trace", type=Path, help="a routing trace: hit rates simulated from it")
    pl.set_defaults(func=cmd_plan)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with streaming and conversation snapshots")
    options.engine_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    sv.add_argument("--port", type=options.port, default=8000, help="port to listen on (default: %(default)s)")
    sv.add_argument("--model-id", help="the id clients use (default: the model folder's name; sluice-default for the bundled model)")
    sv.add_argument("--snapshot-ram", default="2GiB", help="RAM for conversation snapshots, LRU (default: %(default)s)")
    sv.add_argument("--snapshot-dir", type=Path, help="a folder for conversation snapshots beyond --snapshot-ram, and for all of "
                    "them when the server stops: a restarted server continues the conversations (default: none, RAM only)")
    sv.add_argument("--snapshot-disk", default="8GiB", help="disk space --snapshot-dir may take, LRU (default: %(default)s)")
    sv.add_argument("--context", type=options.at_least(2), help="context length limit (default: the model's max_position_embeddings)")
    sv.add_argument("--default-max-tokens", type=int, metavar="N", help="reply length for requests that name no max_tokens "
                    "(chat front ends' background tasks often do not; default: 1024, or half the context when that is "
                    "shorter; 0: up to the end of the context)")
    sv.add_argument("--truncate", choices=["error", "left"], default="error", help="a prompt that leaves its reply no room "
                    "in the context: refused with context_length_exceeded (error), or cut from the left: a chat's oldest "
                    "messages after the system prompt first (left)")
    sv.add_argument("--log-format", choices=["console", "json"], default="console",
                    help="request log lines on stderr, one per request: key=value text or JSON objects (default: %(default)s)")
    sv.add_argument("--warm-up", type=int, metavar="TOKENS", help="before serving, run one prompt of this many random "
                    "tokens and a few one-token steps, so that the first request does not wait for kernel compiles and "
                    "graph captures (0: none; default: 512 on a GPU, 0 on a CPU)")
    sv.add_argument("--image-dir", type=Path, action="append", default=[], help="a folder whose image files file: URLs in "
                    "requests may name (repeat for several; default: none, file: URLs refused)")
    sv.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route but /health (default: none)")
    sv.add_argument("--max-body", default="24MiB", help="largest request body accepted, else 413 (default: %(default)s)")
    sv.add_argument("--max-batch", type=options.at_least(1), default=1, metavar="N", help="requests that are decoding share "
                    "one step, up to N: each MoE layer runs once over all their rows, resident layers without CUDA graphs "
                    "(not yet measured on a GPU; default: %(default)s: one request a step)")
    sv.add_argument("--step-tokens", type=options.at_least(1), metavar="N", help="with --max-batch: the rows a shared step "
                    "holds at most: decoding requests' tokens first, then prompt chunks cut to what is left (default: "
                    "--prefill-chunk)")
    sv.set_defaults(func=cmd_serve)

    add_bench_parser(sub)

    c = sub.add_parser("chat", help="interactive chat in the terminal (the conversation state is kept between turns)")
    options.engine_args(c)
    options.sampling_args(c)
    c.set_defaults(func=cmd_chat)
    for command in sub.choices.values():  # also after the command (SUPPRESS: it does not undo one given before it)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
    return p


def cmd_repack(args) -> int:
    from sluice.storage.repack import repack

    store = repack(args.checkpoint, args.store, force=args.force)
    print(f"{store.path}: {store.total_blocks} blocks of {store.block_bytes} bytes in {len(store.moe_layers)} MoE layers")
    return 0


def cmd_verify(args) -> int:
    from sluice.storage.verify import verify

    problems = verify(args.store, args.source)
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{args.store}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 0 if not problems else 1


def _stream_text(engine, tok, ids: list[int], args, seq=None, images=None) -> list[int]:
    """Generate, printing text as it forms; returns the new token ids."""
    out: list[int] = []
    shown = ""
    stop = tuple(i for i in (tok.eos_token_id,) if i is not None)
    context = getattr(engine.model.config, "max_position_embeddings", None)
    if context and len(ids) + args.max_new_tokens > context:
        print(f"warning: the prompt ({len(ids)} tokens) and --max-new-tokens {args.max_new_tokens} exceed the model's context "
              f"of {context} tokens; the output past it is not reliable", file=sys.stderr)
    t0 = time.perf_counter()
    before = engine.rt.stats.snapshot()
    first = None
    for token in engine.stream(ids, args.max_new_tokens, args.temperature, args.top_p, args.seed, stop, seq=seq, images=images):
        first = first or time.perf_counter()
        out.append(token)
        text = tok.decode(out, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for a multi-byte character to complete
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    sys.stdout.flush()  # the text ends before the summary on stderr starts, also where both share a terminal
    _report(engine.rt.stats.since(before), len(ids), len(out), t0, first)
    return out


def _report(s: dict, n_prompt: int, n_new: int, t0: float, first: float | None) -> None:
    end = time.perf_counter()
    decode = (n_new - 1) / (end - first) if first and n_new > 1 else 0.0
    blocks = s["blocks"]
    total = sum(blocks.values()) or 1
    pred = f"{s['predicted_right'] / s['routed_predicted']:.0%}" if s["routed_predicted"] else "n/a"
    print(
        f"[{n_prompt} prompt + {n_new} new tokens | first token {((first or end) - t0):.2f}s | decode {decode:.1f} tok/s | "
        f"blocks vram {blocks['vram']} ram {blocks['ram']} disk {blocks['disk']} (hit {1 - blocks['disk'] / total:.0%}) | "
        f"prediction recall {pred} | stall {s['stall_s']:.2f}s]",
        file=sys.stderr,
    )


def _chat_ids(tok, messages: list[dict]) -> list[int]:
    if not tok.chat_template:
        raise SluiceError("this model's tokenizer has no chat template")
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def cmd_generate(args) -> int:
    with options.open_engine(args) as engine:
        tok = options.tokenizer(engine)
        images = rows = None
        if args.image:
            from sluice.models.vision import ImageSettings, ImageTokens, prepare_images

            data = []
            for f in args.image:
                try:
                    data.append(f.read_bytes())
                except OSError as e:
                    raise SluiceError(f"--image {f}: {e.strerror}") from None
            images = prepare_images(data, ImageSettings.of(engine.store.path), args.doc, where="--image")
            marks = ImageTokens.of(tok, engine.image_encoder.image_token_id)
        if args.chat:
            parts = [{"type": "image"} for _ in args.image] + [{"type": "text", "text": args.prompt}]
            ids = _chat_ids(tok, [{"role": "user", "content": parts if args.image else args.prompt}])
        else:
            placeholder = marks.text(tok) + "\n" if args.image else ""
            ids = tok(placeholder * len(args.image) + args.prompt)["input_ids"]
        ids = list(ids)
        if images is not None:
            ids = marks.expand(ids, images.counts)
            rows = engine.encode_images(images.pixel_values, images.image_grid_hw)
        _stream_text(engine, tok, ids, args, images=rows)
    return 0


def cmd_synth(args) -> int:
    from sluice.storage.synth import synth

    out = synth(args.shape, args.format, args.out, args.moe_layers, args.headers_only)
    print(f"wrote {out}")
    return 0


def cmd_simulate(args) -> int:
    from sluice.pipeline.config import format_bytes, parse_size
    from sluice.storage.simulate import guess_recall, simulate, sweep, write_sweep
    from sluice.storage.trace import read_trace

    trace = read_trace(args.trace)
    h = trace.header
    block = h["block_bytes"]
    recorded = h.get("prefetch_depth", 1) if h.get("prefetch", False) else 0
    if recorded > 1 and not any(r.further for r in trace.records):
        print(f"note: the run guessed {recorded} MoE layers ahead; this trace (from before the guesses further ahead were "
              "recorded) holds the next layer's only, so the replay prefetches one layer ahead", file=sys.stderr)
    if args.depth is not None and not 1 <= args.depth <= max(recorded, 1):
        raise SluiceError(f"--depth {args.depth}: the trace holds guesses up to {max(recorded, 1)} MoE layer(s) ahead "
                          f"(the recorded run's `depth`); give 1 to {max(recorded, 1)}")
    if h.get("vram_tier") == "recorded" and (args.vram_slots is not None or args.vram_prefetch == "on"):
        raise SluiceError(f"{args.trace}: a run of {h.get('schedule', 'direct-stream')!r}, whose VRAM tier (a hot set refreshed from "
                          "use counts) the replay takes as recorded: --vram-slots and --vram-prefetch on cannot change it")
    ram = parse_size(args.ram_cache, "--ram-cache") // block if args.ram_cache else h["ram_blocks"]
    vram = args.vram_slots if args.vram_slots is not None else h.get("vram_blocks", 0)
    prefetch = False if args.no_prefetch else None
    vram_prefetch = {"recorded": None, "on": True, "off": False}[args.vram_prefetch]
    if args.sweep:
        total = h["num_experts"] * len(h["moe_layers"])
        sizes = sorted({max(1, round(total * f)) for f in (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)})
        results = sweep(trace, sizes, vram, args.policy, prefetch, vram_prefetch, args.depth)
        write_sweep(results, block, args.sweep.with_suffix(".csv"), args.sweep.with_suffix(".png"))
        for r in results:
            print(f"{r.ram_blocks:7d} blocks {format_bytes(r.ram_blocks * block):>12}  hit {r.hit_rate:6.1%}  disk reads/token {r.disk_per_token:7.2f}")
        print(f"wrote {args.sweep.with_suffix('.csv')} and {args.sweep.with_suffix('.png')}")
        return 0
    r = simulate(trace, ram, vram, args.policy, prefetch, vram_prefetch=vram_prefetch, depth=args.depth)
    tier = "VRAM as recorded" if h.get("vram_tier") == "recorded" else f"VRAM {vram} slots"
    print(f"{trace.tokens} tokens in {trace.steps} steps; RAM {ram} blocks ({format_bytes(ram * block)}), {tier}, policy {args.policy}")
    for tier, n in r.per_token().items():
        print(f"  {tier:5} {n:8.2f} blocks/token  {n * block / 1e6:9.2f} MB/token")
    print(f"  hit rate {r.hit_rate:.1%}; disk reads per token {r.disk_per_token:.2f}; prefetch reads {r.prefetch_reads}")
    near, far = guess_recall(trace)
    if near is not None:
        of = "of the blocks not read from VRAM" if h.get("vram_tier") == "recorded" else "of the routed blocks"
        print(f"  recorded guesses named {near:.1%} {of} (the next layer's)"
              + (f", {far:.1%} two or more MoE layers ahead" if far is not None else ""))
    if r.vram_prefetches:
        print(f"  guesses copied into VRAM {r.vram_prefetches / max(r.tokens, 1):.2f}/token, "
              f"{r.vram_prefetch_hits / max(r.tokens, 1):.2f}/token of them then routed")
    return 0


def cmd_plan(args) -> int:
    from sluice.pipeline.config import parse_size
    from sluice.storage.plan import format_plan, plan
    from sluice.storage.trace import read_trace

    from sluice.storage.estimate import estimate, format_estimate, has_weights

    trace = read_trace(args.trace) if args.trace else None
    sizes = (parse_size(args.vram, "--vram"), parse_size(args.ram, "--ram"), args.pcie_gbps, args.disk_gbps, args.context, trace)
    if args.path.is_dir() and not has_weights(args.path):  # before the download: every format estimated
        print(format_estimate(estimate(args.path, *sizes)))
    else:
        print(format_plan(plan(args.path, *sizes)))
    return 0


def cmd_serve(args) -> int:
    import uvicorn

    from sluice.api.app import create_app
    from sluice.log import get_logger
    from sluice.pipeline.config import parse_size

    log = get_logger(args.log_format)
    ram, disk = parse_size(args.snapshot_ram, "--snapshot-ram"), parse_size(args.snapshot_disk, "--snapshot-disk")  # before loading
    body = parse_size(args.max_body, "--max-body")
    for d in args.image_dir:
        if not d.is_dir():
            raise SluiceError(f"--image-dir {d}: not a folder")
    engine = options.open_engine(args, max_batch=args.max_batch)
    warm = args.warm_up if args.warm_up is not None else 512 if engine.device.type == "cuda" else 0
    if warm > 0:
        log.info("warming up", prompt_tokens=warm)
        log.info("warm", seconds=round(engine.warm_up(warm), 1))
    model_id = args.model_id or (Path(args.model).name if args.model else "sluice-default")
    app = create_app(engine, options.tokenizer(engine), model_id, snapshot_bytes=ram, context=args.context,
                     default_max_tokens=args.default_max_tokens, truncate=args.truncate, log_format=args.log_format,
                     snapshot_dir=args.snapshot_dir, snapshot_disk_bytes=disk, image_dirs=tuple(args.image_dir),
                     api_key=args.api_key, max_body=body, max_batch=args.max_batch,
                     step_tokens=args.step_tokens)
    log.info("serving", model=model_id, url=f"http://{args.host}:{args.port}", openai_base_url=f"http://{args.host}:{args.port}/v1")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()
    return 0


def cmd_chat(args) -> int:
    with options.open_engine(args) as engine:
        tok = options.tokenizer(engine)
        messages: list[dict] = []
        seq = engine.new_sequence()
        print("chat: empty line or Ctrl-D to quit", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            ids = _chat_ids(tok, messages)
            if ids[: len(seq.tokens)] != seq.tokens or seq.broken:
                engine.release(seq)
                seq = engine.new_sequence()  # the template rewrote history: start over
            tail = ids[len(seq.tokens):]
            new = _stream_text(engine, tok, tail, args, seq=seq)
            messages.append({"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
