"""Measure the default model's routing and ReLU^2 sparsity on held-out text (CPU is enough).

    python train/measure.py CORPUS_DIR [--tokens 1024]

Teacher-forced decode through Sluice, one real token per step (the way a chat decodes), with a
routing trace: expert popularity skew per layer, the predict stage's next-layer recall, and the
LRU hit rate with 25% of the experts cached (replayed from the trace). ReLU^2 sparsity from
transformers' own model on the same tokens: the share of zero neurons after ReLU^2 among routed
(token, expert) pairs, and the share of 16-neuron groups that are entirely zero.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data", type=Path)
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    import sluice
    from sluice.models.builtin import DEFAULT_MODEL
    from sluice.storage.simulate import simulate
    from sluice.storage.trace import read_trace

    tokens = np.load(args.data / "tokens.npz")["tokens"]
    ids = [int(t) for t in tokens[-args.tokens:]]  # the validation split's tail
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "routing.jsonl"
        with sluice.load(DEFAULT_MODEL, device="cpu", record_routing=str(trace_path), progress=False) as engine:
            seq = engine.new_sequence()
            engine.extend(seq, ids[:16])
            for t in ids[16:]:
                engine.extend(seq, [t])
            stats = engine.rt.stats.snapshot()
            total_blocks = engine.store.total_blocks
        trace = read_trace(trace_path)
    per_layer: dict[int, Counter] = {}
    for r in trace.records:
        if r.tokens == 1:
            per_layer.setdefault(r.layer, Counter()).update(r.ids)
    E = trace.header["num_experts"]
    print("| MoE layer | most used expert / mean | top 25% of experts' share of routings | experts never used |")
    print("|---|---:|---:|---:|")
    for layer, c in sorted(per_layer.items()):
        counts = np.array([c.get(e, 0) for e in range(E)], dtype=float)
        top = np.sort(counts)[::-1][: E // 4].sum() / counts.sum()
        print(f"| {layer} | {counts.max() / counts.mean():.2f} | {top:.1%} | {int((counts == 0).sum())} |")
    recall = stats["predicted_right"] / stats["predicted"]
    lru = simulate(trace, total_blocks // 4, decode_only=True)
    print(f"\npredict stage recall (guesses the next layer then routed to): {recall:.1%}")
    print(f"LRU hit rate with 25% of experts cached ({total_blocks // 4} of {total_blocks} blocks, replayed, decode steps): {lru.hit_rate:.1%}")
    zero, groups = relu2_sparsity(DEFAULT_MODEL, ids[:512])
    print(f"ReLU^2 zeros among routed experts' neurons: {zero:.1%}; all-zero 16-neuron groups: {groups:.1%}")


@torch.no_grad()
def relu2_sparsity(path: Path, ids: list[int]) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager", use_kernels=False).eval()
    totals = {"n": 0, "zero": 0, "groups": 0, "dead": 0}

    def hook(module, inputs):
        x, top_k_index = inputs[0], inputs[1]
        for t in range(x.shape[0]):
            for e in top_k_index[t].tolist():
                h = torch.relu(x[t] @ module.up_proj[e].t()) ** 2
                totals["n"] += h.numel()
                totals["zero"] += int((h == 0).sum())
                g = h.view(-1, 16)
                totals["groups"] += g.shape[0]
                totals["dead"] += int((g == 0).all(dim=1).sum())

    for block in model.model.layers:
        if block.block_type == "moe":
            block.mixer.experts.register_forward_pre_hook(hook)
    model(torch.tensor([ids]))
    return totals["zero"] / totals["n"], totals["dead"] / totals["groups"]


if __name__ == "__main__":
    main()
