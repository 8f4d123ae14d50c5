"""What grammar-constrained decoding costs per token: `python -m sluice.benchmarks.grammar [--model PATH] [--tokens N]`.

Decodes the same chat prompt greedily three ways, as the server's worker does: free, under a JSON schema with the
mask computed before each step, and under the schema with the mask computed beside the step (the server's way).
Prints the median ms per decode token of each and the mask's own cost (compute, and apply on the device).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SCHEMA = {"type": "array", "items": {"type": "object", "additionalProperties": False, "required": ["word", "count"],
                                     "properties": {"word": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}}}}


def decode(engine, ids: list[int], n: int, constraint=None, overlap: bool = True) -> tuple[float, list[int]]:
    """Seconds per decode token (the prompt's step excluded) and the tokens."""
    seq, out = engine.new_sequence(), []
    logits = engine.extend(seq, ids, last=True)[-1]
    t = None
    for _ in range(n):
        if constraint is not None:
            logits = constraint.apply(logits)
        token = int(torch.argmax(logits))
        out.append(token)
        if constraint is not None:
            constraint.advance(token)
            if constraint.done:
                break
            if overlap:
                constraint.start()
        t = t or time.perf_counter()
        logits = engine.extend(seq, [token])[-1]
    return (time.perf_counter() - t) / max(1, len(out) - 1), out


def main(argv: list[str] | None = None) -> int:
    import sluice
    from sluice.api.grammar import Grammars
    from sluice.api.toolcalls import Xml
    from sluice.models.builtin import default_model_path

    p = argparse.ArgumentParser(prog="python -m sluice.benchmarks.grammar", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint or store (default: the bundled model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="runs of each way; the median is printed")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    with sluice.load(args.model or default_model_path(), device=args.device, progress=False) as engine:
        tok = AutoTokenizer.from_pretrained(engine.store.path)
        ids = tok.apply_chat_template([{"role": "user", "content": "List words and counts."}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        grammars = Grammars(tok, engine.model.config.vocab_size, engine.device)
        grammars.constraint(SCHEMA, None, Xml(), False)  # llguidance's tokenizer view, built once per server
        decode(engine, ids, 8)  # warm
        runs: dict[str, list[float]] = {"free": [], "before": [], "beside": []}
        for _ in range(args.repeat):  # interleaved, so that a busy machine slows each alike
            runs["free"].append(decode(engine, ids, args.tokens)[0])
            t, out = decode(engine, ids, args.tokens, grammars.constraint(SCHEMA, None, Xml(), False), overlap=False)
            runs["before"].append(t)
            runs["beside"].append(decode(engine, ids, args.tokens, grammars.constraint(SCHEMA, None, Xml(), False))[0])
        free, before, beside = (statistics.median(runs[k]) for k in ("free", "before", "beside"))
        c = grammars.constraint(SCHEMA, None, Xml(), False)
        compute = apply = 0.0
        logits = torch.randn(engine.model.config.vocab_size, device=engine.device)
        for token in out[:-1]:
            t0 = time.perf_counter()
            c.start()
            c._pending.result()
            t1 = time.perf_counter()
            masked = c.apply(logits)
            float(masked[0])  # the device's work done
            apply += time.perf_counter() - t1
            compute += t1 - t0
            c.advance(token)
        k = max(1, len(out) - 1)
        grammars.close()
    print(f"{engine.store.path.name} on {args.device}: {len(out)} constrained tokens ({tok.decode(out)[:60]!r}...)")
    print(f"free {free * 1e3:.2f} ms/token | schema, mask before the step {before * 1e3:.2f} ms/token | "
          f"schema, mask beside the step {beside * 1e3:.2f} ms/token")
    print(f"mask compute {compute / k * 1e6:.0f} us/token, apply {apply / k * 1e6:.0f} us/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
