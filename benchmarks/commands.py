"""`sluice bench model | batch | load | baseline | images | cpu | kernels | peer | routing`: the benchmark commands' arguments and what
they run (the measuring itself: benchmarks/model.py, kernels.py, images.py, peer.py, routing.py)."""

from __future__ import annotations

from pathlib import Path

from sluice.errors import SluiceError


def add_bench_parser(sub) -> None:
    """The `bench` command and its subcommands, on the top-level parser's subparsers `sub`."""
    from sluice.options import engine_args

    b = sub.add_parser("bench", help="benchmarks (on a GPU)")
    bsub = b.add_subparsers(metavar="WHAT")
    bm = bsub.add_parser("model", help="decode and prefill speed of a model, with its expert I/O and the PCIe roofline")
    engine_args(bm)
    bm.add_argument("--prompt-lengths", default="32,512", help="comma-separated prefill lengths")
    bm.add_argument("--decode-tokens", type=int, default=32)
    bm.add_argument("--cold", action="store_true", help="time each prompt length, and decode after a 32-token prompt, from empty "
                                                        "expert caches (emptied after untimed runs that compile the kernels)")
    bm.add_argument("--json", type=Path, help="also write the results as JSON")
    bm.add_argument("--profile", action="store_true", help="also profile decode steps: host functions and GPU busy time")
    bm.add_argument("--compare", metavar="SCHEDULES", help="comma-separated schedules (names or paths, with knob edits if "
                    "wanted) run one after another and compared in one table, e.g. overlap,vram-lfu,hybrid,hybrid-vram or "
                    "direct-stream,direct-stream:fetch.depth=2")
    bm.add_argument("--resident-alone", action="store_true", help="also time decode with the routed experts skipped "
                    "(schedules/resident-alone.yaml) and report the roofline PCIe time + that")
    bm.set_defaults(func=cmd_bench_model)
    bb = bsub.add_parser("baseline", help="transformers + accelerate offloading at a VRAM budget, for the speedup ratio")
    bb.add_argument("--model", required=True, help="a Hugging Face checkpoint transformers can load")
    bb.add_argument("--vram-budget", default="8GiB")
    bb.add_argument("--decode-tokens", type=int, default=16)
    bb.add_argument("--json", type=Path, help="also write the result as JSON")
    bb.set_defaults(func=cmd_bench_baseline)

    bi = bsub.add_parser("images", help="seconds per image through a vision-language model's image encoder, per mode")
    bi.add_argument("--model", help="a vision-language checkpoint or store (default: a RADIO-H tower + tiny LM, random weights)")
    bi.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    bi.add_argument("--patches", default="1024,4096", help="image sizes in 16-pixel patches, comma-separated")
    bi.add_argument("--modes", default="resident,stream,cpu", help="resident | stream (GPU) | cpu, comma-separated")
    bi.add_argument("--json", type=Path, help="also write the rows as JSON")
    bi.set_defaults(func=cmd_bench_images)

    bc = bsub.add_parser("cpu", help="the CPU expert kernels' GB/s against the memory read rate measured now")
    bc.add_argument("--shape", nargs="*", default=None, help="model shapes (default: nano qwen3-30b)")
    bc.add_argument("--format", nargs="*", default=None, help="nvfp4 mxfp4 fp8 bf16 (default: all)")
    bc.add_argument("--threads", type=int, nargs="*", help="CPU threads (default: torch's); several: one table each, "
                    "to see how the kernels scale")
    bc.add_argument("--eager", action="store_true", help="without torch.compile")
    bc.add_argument("--int8", action="store_true", help="FP4 experts also with int8 activations (AVX-512 VNNI): a second row")
    bc.add_argument("--calls", action="store_true", help="the hybrid path's calls instead: microseconds a call by its count of "
                    "blocks, back to back, after the host's wait for ids, from cache (first --shape and --format: nano nvfp4)")
    bc.add_argument("--pairs", action="store_true", help="a prompt's CPU share instead (h2d.prompt_cpu): microseconds a block "
                    "by its rows, a block's rows side by side, from RAM (first --shape and --format: nano nvfp4)")
    bc.set_defaults(func=cmd_bench_cpu)

    from sluice.benchmarks.batch import add_batch_parser
    from sluice.benchmarks.gemv import add_gemv_parser
    from sluice.benchmarks.load import add_load_parser
    from sluice.benchmarks.peer import add_peer_parser
    from sluice.benchmarks.routing import add_routing_parser

    add_batch_parser(bsub)
    add_gemv_parser(bsub)
    add_load_parser(bsub)
    add_peer_parser(bsub)
    add_routing_parser(bsub)

    bk = bsub.add_parser("kernels", help="achieved GB/s of each expert kernel vs HBM and host-to-device bandwidth")
    bk.add_argument("--shape", nargs="*", default=None, help="model shapes (default: all)")
    bk.add_argument("--format", nargs="*", default=None, help="nvfp4 fp8 bf16 (default: all)")
    bk.add_argument("--live", type=float, default=0.25, help="fraction of live 16-neuron groups for zero-copy down")
    bk.add_argument("--json", type=Path, help="also write the rows as JSON")
    bk.add_argument("--sweep", action="store_true", help="time each kernel over tile configurations instead")
    bk.add_argument("--only", nargs="*", choices=["matvec-up", "matvec-up-words-gather", "matvec-up-words", "matvec-up-f16x2",
                                                  "down-relaid", "down-relaid-f16x2", "prefill-up"],
                    help="with --sweep: just these kernels")
    bk.add_argument("--prefill-rows", type=int, default=32, help="with --sweep: rows per expert of the prefill GEMM")
    bk.add_argument("--prefill-experts", type=int, default=64, help="with --sweep: experts in one prefill GEMM launch "
                    "(the direct schedule's prompt steps launch `prompt_group` at a time)")
    bk.add_argument("--mixed", metavar="R", type=int, nargs="*",
                    help="time a direct decode step's ReLU^2 expert kernels with R of the experts read from host memory "
                         "(e.g. --mixed 0 1 2 4), with and without the host alignment hint, against the PCIe floor")
    bk.add_argument("--rows", metavar="T", type=int, nargs="*",
                    help="time a batched step's grouped expert kernels over T decode rows (e.g. --rows 2 8 16), every block "
                         "read from host memory, per tile configuration (compute's rows_tile), against the PCIe floor")
    bk.add_argument("--launch-timing", action="store_true",
                    help="time single launches (do_bench) instead of calls captured in a CUDA graph, as decode runs them")
    bk.set_defaults(func=cmd_bench_kernels)


def cmd_bench_model(args) -> int:
    import json

    from sluice.options import open_engine
    from sluice.benchmarks.model import bench_model, format_bench, resident_roofline
    from sluice.benchmarks.profile import profile_decode, profile_prefill

    lengths = tuple(int(x) for x in args.prompt_lengths.split(",") if x)
    if args.compare:
        return _bench_compare(args, lengths)
    with open_engine(args) as engine:
        if args.cold and engine.coordinator.schedule.needs.ram == "all":
            raise SluiceError(f"--cold: schedule {engine.coordinator.schedule.name!r} holds every expert block in RAM, so no "
                              f"block would come from disk; name a streaming one (--schedule direct-stream or overlap)")
        r = bench_model(engine, lengths, args.decode_tokens, warm=not args.cold)
        print(f"{engine.store.path} on {engine.device} | schedule {engine.coordinator.schedule.name} | "
              f"RAM {engine.rt.ram.capacity} blocks | block {engine.store.block_bytes:,} bytes")
        print(format_bench(r, engine.store.block_bytes))
        whole = engine.whole
        print(f"one-token steps: {'layer by layer' if whole is None or not whole.replays else 'replayed whole as one graph'}"
              + (f" ({whole.replays} replays, {whole.captures} captures)" if whole is not None else "")
              + (f"; whole steps stopped: {whole.off}" if whole is not None and whole.off else ""))
        if args.profile:
            split: dict = {}
            print(profile_decode(engine, split=split))
            line = resident_roofline(r["decode"], split.get("resident_ms"))
            if line:
                print(line)
            if lengths and max(lengths) > 1:
                print(f"profile of a {max(lengths)}-token prompt on the VRAM tier as opened (as the table's first column), "
                      "per prompt token:")
                print(profile_prefill(engine, max(lengths), empty=True))
    del engine  # the second engine opens with this one's GPU memory given back (a VRAM budget counts it)
    if args.resident_alone:
        line = resident_roofline(r["decode"], _resident_alone(args), "alone")
        if line:
            print(line)
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


def _resident_alone(args) -> float:
    """Median decode ms/token of the model with its routed experts skipped (schedules/resident-alone.yaml), at the same
    settings: the resident part's own time, measured alone. In a fresh process: measured in the process that had just
    run the whole model, it came out slower than the whole model's decode (cause not found), which cannot be the
    resident part's own time."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        ms = pool.apply(_resident_alone_run, (args,))
    print(f"resident part alone (schedule resident-alone, a fresh process): {ms:.2f} ms/token median over {args.decode_tokens} tokens")
    return ms


def _resident_alone_run(args) -> float:
    from sluice.options import open_engine
    from sluice.benchmarks.model import bench_model

    args.schedule, args.ram_cache = "resident-alone", None  # no expert blocks: one RAM slot
    with open_engine(args) as engine:
        return bench_model(engine, (), args.decode_tokens, warm=not args.cold)["decode"]["ms_per_token_median"]


def _bench_compare(args, lengths) -> int:
    import json

    from sluice.options import open_engine
    from sluice.benchmarks.model import bench_model, format_compare, resident_roofline
    from sluice.kernels.rates import ram_read_bandwidth

    results, block = [], 0
    for name in [n for n in args.compare.split(",") if n]:
        args.schedule = name
        with open_engine(args) as engine:
            r = bench_model(engine, lengths, args.decode_tokens, warm=not args.cold)
            if engine.rt.cpu_rate.block_s:
                r["cpu_gbps"] = engine.store.block_bytes / engine.rt.cpu_rate.block_s / 1e9
            block = engine.store.block_bytes
            file, _, edits = name.partition(":")  # a path's stem, with any knob edits after it
            label = (Path(file).stem if file.endswith((".yaml", ".yml")) else file) + (f":{edits}" if edits else "")
            passes = [n.split("#")[0] for n, _ in results].count(label)  # a schedule run again: direct, direct#2, ...
            results.append((f"{label}#{passes + 1}" if passes else label, r))
        del engine  # the next schedule's engine opens with this one's GPU memory given back (a VRAM budget counts it)
        _free_device_memory()
    print(format_compare(results, block, ram_read_bandwidth()))
    if args.resident_alone:
        alone = _resident_alone(args)
        for name, r in results:
            line = resident_roofline(r["decode"], alone, "alone")
            if line:
                print(f"{name}: {line}")
    if args.json:
        args.json.write_text(json.dumps(dict(results), indent=1))
    return 0


def _free_device_memory() -> None:
    """Collect a closed engine's cycles (graphs and closures refer back to it) and return its cached GPU memory."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cmd_bench_baseline(args) -> int:
    import json

    import torch

    from sluice.benchmarks.model import accelerate_baseline
    from sluice.pipeline.config import parse_size

    if not torch.cuda.is_available():
        raise SluiceError("bench baseline needs a CUDA GPU")
    r = accelerate_baseline(args.model, parse_size(args.vram_budget, "--vram-budget"), decode_tokens=args.decode_tokens)
    print(f"transformers + accelerate, max_memory {args.vram_budget}: decode {r['tok_s']:.2f} tok/s, median "
          f"{r['ms_per_token_median']:.1f} ms/token; VRAM peak {r['vram_peak_bytes'] / 2**30:.2f} GiB; "
          f"{r['device_map_gpu_entries']} of {r['device_map_entries']} device-map entries on the GPU; load {r['load_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return 0


def cmd_bench_images(args) -> int:
    import json

    from sluice.benchmarks.images import bench_images, radio_h_checkpoint
    from sluice.pipeline.config import EngineConfig
    from sluice.storage.home import resolve_store

    device = EngineConfig(device=args.device).torch_device
    modes = tuple(m for m in args.modes.split(",") if m)
    if device.type != "cuda":
        modes = tuple(m for m in modes if m == "cpu") or ("cpu",)
    store = resolve_store(args.model or radio_h_checkpoint())
    rows = bench_images(store, device, tuple(int(p) for p in args.patches.split(",") if p), modes)
    print(f"{'mode':9} {'patches':>8} {'tokens':>7} {'s/image':>9} {'encoder MB':>11} {'PCIe floor s':>13} {'VRAM peak MB':>13}")
    for r in rows:
        floor = f"{r['pcie_floor_s']:.4f}" if r["pcie_floor_s"] else "-"
        peak = f"{r['vram_peak_mb']:.0f}" if r["vram_peak_mb"] is not None else "-"
        print(f"{r['mode']:9} {r['patches']:8d} {r['tokens']:7d} {r['s_per_image']:9.4f} {r['encoder_mb']:11.0f} {floor:>13} {peak:>13}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def cmd_bench_cpu(args) -> int:
    import torch

    from sluice.benchmarks.cpu_kernels import bench_cpu
    from sluice.benchmarks.kernels import FORMATS, format_table

    if args.calls or args.pairs:
        from sluice.benchmarks.cpu_kernels import bench_calls, bench_pairs, format_calls, format_pairs
        from sluice.benchmarks.kernels import SHAPES, expert_layout

        what = "--pairs" if args.pairs else "--calls"
        shape, fmt = (args.shape or ["nano"])[0], (args.format or ["nvfp4"])[0]
        if shape not in SHAPES or fmt not in FORMATS:
            raise SystemExit(f"bench cpu {what}: unknown shape {shape!r} or format {fmt!r}")
        block_mb = expert_layout(SHAPES[shape][0], fmt, SHAPES[shape][1], SHAPES[shape][2], "cpu")[3] / 1e6
        for threads in args.threads or [None]:
            if threads:
                torch.set_num_threads(threads)
            print(f"{shape} {fmt}{', int8 activations' if args.int8 else ''}, {block_mb:.2f} MB a block, threads {torch.get_num_threads()}")
            if args.pairs:
                print(format_pairs(*bench_pairs(shape, fmt, int8=args.int8), block_mb), flush=True)
                continue
            ways, h2d = bench_calls(shape, fmt, int8=args.int8)
            print(format_calls(ways, block_mb, h2d), flush=True)
        return 0
    for threads in args.threads or [None]:
        read, rows = bench_cpu(tuple(args.shape or ("nano", "qwen3-30b")), tuple(args.format or FORMATS), threads, not args.eager,
                               int8=args.int8)
        print(f"threads {torch.get_num_threads()}")
        print(format_table({"RAM read": read}, rows), flush=True)
    return 0


def cmd_bench_kernels(args) -> int:
    import json

    import torch

    from sluice.benchmarks import kernels as kbench
    from sluice.benchmarks.kernels import FORMATS, SHAPES, bench, format_table, sweep
    from sluice.benchmarks.rows import bench_rows

    if not torch.cuda.is_available():
        raise SluiceError("bench kernels needs a CUDA GPU")
    kbench.TIMING = "launch" if args.launch_timing else "graph"
    if args.sweep:
        for line in sweep(tuple(args.shape or SHAPES), tuple(args.format or FORMATS), only=tuple(args.only or ()),
                          prefill_rows=args.prefill_rows, prefill_experts=args.prefill_experts):
            print(line, flush=True)
        return 0
    if args.rows is not None:
        ceil, lines = bench_rows((args.shape or ["nano"])[0], (args.format or ["nvfp4"])[0], tuple(args.rows or (2, 8, 16)))
        print(f"{torch.cuda.get_device_name()} | pinned H2D {ceil['h2d']:.1f} GB/s | timing: {kbench.TIMING}")
        print("\n".join(lines))
        return 0
    if args.mixed is not None:
        ceil, lines = kbench.bench_mixed(tuple(args.shape or ("super", "nano")), (args.format or ["nvfp4"])[0], tuple(args.mixed or (0, 1, 2, 4)))
        print(f"{torch.cuda.get_device_name()} | pinned H2D {ceil['h2d']:.1f} GB/s, HBM {ceil['hbm']:.0f} GB/s")
        print("\n".join(lines))
        return 0
    ceil, rows = bench(tuple(args.shape or SHAPES), tuple(args.format or FORMATS), args.live)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | timing: {kbench.TIMING}")
    print(format_table(ceil, rows))
    if args.json:
        args.json.write_text(json.dumps({"ceilings": ceil, "rows": [r.__dict__ for r in rows]}, indent=1))
    return 0
