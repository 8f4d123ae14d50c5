"""The options commands share (the engine's, sampling's) and what they open with them: used by the CLI (cli.py) and
by `sluice bench` (benchmarks/commands.py), which must not import the CLI that includes it."""

from __future__ import annotations

import argparse
from pathlib import Path

from sluice.errors import SluiceError


def int_in(text: str, low: int, high: float = float("inf")) -> int:
    """argparse type check: an integer in [low, high] (a negative count or length is a mistake, not "all")."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not low <= n <= high:
        raise argparse.ArgumentTypeError(f"must be {'>= %d' % low if high == float('inf') else f'in [{low}, {high}]'}, got {n}")
    return n


def at_least(low: int):
    return lambda text: int_in(text, low)


def counts(flag: str, text: str) -> list[int]:
    """A comma-separated list of counts >= 1 (a benchmark's sizes), or a one-line error naming the flag."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SluiceError(f"{flag} {text!r}: comma-separated counts >= 1, e.g. 1,4,16")
    return values


def seed(text: str) -> int:
    return int_in(text, 0, 2**63 - 1)  # what torch's generator takes


def port(text: str) -> int:
    return int_in(text, 0, 65535)


def out_file(text: str) -> str:
    """argparse type: a file to write, whose folder exists (checked before a model loads, not at the first write)."""
    folder = Path(text).expanduser().absolute().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {folder} does not exist")
    return text


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint or expert store (default: the bundled default model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s: a GPU if there is one)")
    p.add_argument("--ram-cache", help="host RAM for expert blocks, e.g. 8GiB (default: a quarter of free RAM)")
    p.add_argument("--vram-slots", type=int, help="expert slots on the GPU, in place of a budget's")
    p.add_argument("--vram-budget", default="card", help="GPU memory the engine may use, e.g. 8GiB: emulates that card; "
                   "the expert slot bank gets what the resident part, the CUDA context and a reserve leave (default: "
                   "%(default)s: the card's memory less other processes'; ignored with --vram-slots)")
    p.add_argument("--vram-reserve", help="with --vram-budget: GPU memory kept free of expert slots, e.g. 1GiB (default: "
                                          "from the need: a prompt chunk's activations, --max-batch sequences' states, workspaces)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs for one-token steps of resident layers (Mamba mixers, MoE norms, routers, shared experts)")
    p.add_argument("--whole-step", action=argparse.BooleanOptionalAction, default=None,
                   help="replay a one-token step whole, embed to logits, as one CUDA graph where nothing in it needs the "
                        "host (a direct schedule with --static-kv; default: on for models checked on a GPU, --whole-step "
                        "for the others too; --no-whole-step runs it layer by layer)")
    p.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default=None,
                   help="RMSNorms and routers in Triton launches where the model has them (default: on with CUDA; "
                        "--no-fused-ops keeps transformers' ops)")
    p.add_argument("--fused-linears", action=argparse.BooleanOptionalAction, default=None,
                   help="one-row linears of the resident part in one Triton launch each (kernels/gemv.py) instead of "
                        "cuBLAS (default: on with CUDA; --no-fused-linears keeps cuBLAS)")
    p.add_argument("--embed-on-host", action=argparse.BooleanOptionalAction, default=None,
                   help="the input embedding's table in pinned RAM, each token's row read over PCIe (kernels/embed.py): "
                        "its VRAM goes to expert slots (default: on with CUDA and a --vram-budget; a head tied to it "
                        "keeps it on the GPU; --no-embed-on-host keeps it in VRAM)")
    p.add_argument("--fused-mamba", action=argparse.BooleanOptionalAction, default=None,
                   help="one-token Mamba-2 steps in two Triton launches (kernels/mamba.py) instead of transformers' step "
                        "(default: on with CUDA, and a CPU takes kernels/mamba.py's torch step; --no-fused-mamba keeps "
                        "transformers' step)")
    p.add_argument("--schedule", default="auto", help="schedule name (schedules/NAME.yaml) or path, with knob edits "
                   "after it if wanted: NAME:STAGE.KNOB=VALUE[:...], e.g. direct-stream:fetch.depth=2 (default: %(default)s: "
                   "direct where every expert block fits in 75%% of the free RAM or in --ram-cache, direct-hybrid where they do not "
                   "all fit in VRAM too, else direct-stream)")
    p.add_argument("--image-encoder", default="auto", choices=["auto", "resident", "stream"],
                   help="vision-language models on a GPU: keep the image encoder resident, or stream its layers from pinned RAM "
                        "(default: %(default)s: resident when it fits twice over in the VRAM left)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="resident dtype (default: the checkpoint's)")
    p.add_argument("--no-verify", action="store_true", help="skip the checksums of blocks read from disk and of the resident file at load: faster, but a "
                   "damaged store then gives wrong text without an error")
    p.add_argument("--trace", type=out_file, help="write a Chrome trace (Perfetto) to FILE and stage timings as JSON lines to FILE.jsonl")
    p.add_argument("--prefill-chunk", type=int, help="longest prompt piece one step runs, each of its experts read once (the "
                                                     "server also takes turns between requests by it); default: 2048")
    p.add_argument("--static-kv", type=at_least(0), metavar="N", help="attention over a static cache of up to N tokens "
                   "(transformers' StaticCache, allocated as used) instead of one that grows, for whole-step replays; a "
                   "sequence may not grow past it (default: the model's context on CUDA where its whole step is checked, "
                   "else off; 0: off)")
    p.add_argument("--mixer-chunk", type=int, help="longest run of a prompt piece a Mamba-2 mixer prefills at once; default: 512, "
                                                   "or under --vram-budget the largest power of two <= 512 whose scratch fits "
                                                   "what the expert slots leave")
    p.add_argument("--record-routing", type=out_file, metavar="FILE", help="record per-token routing (experts, guesses, tiers) for `sluice simulate`")
    p.add_argument("--routing", default="natural", metavar="SETTING",
                   help="which experts tokens route to: natural (the model's routers; default) | uniform | skewed[:popularity=S,"
                        "reuse=P,recall=Q] | trace:FILE[,recall=Q] (benchmarks: the router runs, its ids are drawn; "
                        "storage/routing.py)")


def sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=at_least(1), default=64, metavar="N",
                   help="tokens to generate at most; --max-tokens is the OpenAI name (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: sample among the likeliest tokens whose "
                                                            "probabilities sum to this; 1 keeps all (default: %(default)s)")
    p.add_argument("--seed", type=seed, help="seed of the sampler (default: a new one each run; greedy needs none)")


def open_engine(args, max_batch: int = 1):
    """The engine the command's flags ask for; max_batch: the sequences one step may hold (their states are planned
    into a VRAM budget)."""
    import sluice
    from sluice.models.builtin import default_model_path

    model = args.model or default_model_path()
    return sluice.load(
        model, device=args.device, ram_cache=args.ram_cache, vram_slots=args.vram_slots, vram_budget=args.vram_budget,
        vram_reserve=args.vram_reserve,
        resident_graphs=not args.eager, whole_step=args.whole_step, schedule=args.schedule, image_encoder=args.image_encoder,
        dtype=args.dtype, verify_checksums=not args.no_verify, trace=args.trace, record_routing=args.record_routing,
        prefill_chunk=args.prefill_chunk, mixer_chunk=args.mixer_chunk, fused_mamba=args.fused_mamba, fused_ops=args.fused_ops,
        fused_linears=args.fused_linears, embed_on_host=args.embed_on_host,
        static_kv=getattr(args, "static_kv", None),
        routing=getattr(args, "routing", "natural"), max_batch=max_batch,
    )


def tokenizer(engine):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(engine.store.path)
    except Exception as e:
        raise SluiceError(f"{engine.store.path}: no usable tokenizer ({e})") from None
