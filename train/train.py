"""Train the bundled default model: a small NemotronH MoE (Mamba-2, attention, ReLU^2 experts).

    python train/train.py --data CORPUS_DIR --out OUT_DIR [--minutes 4]

CORPUS_DIR holds tokens.npz and tokenizer/ (train/corpus.py, then train/tokenizer.py). Training
runs for a fixed wall-clock budget on one GPU: AdamW, bf16 autocast, warmup then cosine decay
over the budget. Routers are balanced without an auxiliary loss, the DeepSeek-V3 way NemotronH
was trained: after each step every layer's e_score_correction_bias moves by a small step towards
under-used experts. At the end: validation perplexity next to a unigram baseline, a greedy
sample, and the checkpoint (bf16 safetensors in shards under 15 MB, tokenizer, train_log.json).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch

CONFIG = dict(
    vocab_size=8192, hidden_size=256, hybrid_override_pattern="MEM*EMEM*E", n_routed_experts=32, num_experts_per_tok=4,
    moe_intermediate_size=256, moe_shared_expert_intermediate_size=512, routed_scaling_factor=2.5, norm_topk_prob=True,
    n_group=1, topk_group=1, mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=64, n_groups=2, chunk_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
    bos_token_id=0, eos_token_id=2, pad_token_id=0,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--bias-step", type=float, default=1e-3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, NemotronHConfig

    torch.manual_seed(0)
    dev = torch.device(args.device)
    tokens = torch.from_numpy(np.load(args.data / "tokens.npz")["tokens"].astype(np.int64))
    n_val = len(tokens) // 50
    train, val = tokens[:-n_val].to(dev), tokens[-n_val:].to(dev)
    config = NemotronHConfig(**CONFIG)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager").to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    routers = [b.mixer.gate for b in model.model.layers if b.block_type == "moe"]
    loads = [torch.zeros(config.n_routed_experts, device=dev) for _ in routers]
    for r, load in zip(routers, loads):
        r.register_forward_hook(_count_into(load))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = args.minutes * 60
    g = torch.Generator(device="cpu").manual_seed(1)

    def batch(data):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=g)
        return torch.stack([data[s : s + args.seq] for s in starts.tolist()])

    log, step, t0 = [], 0, time.time()
    while (elapsed := time.time() - t0) < budget:
        frac = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        x = batch(train)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing: nudge biases towards under-used experts
            for r, load in zip(routers, loads):
                r.e_score_correction_bias.add_(args.bias_step * torch.sign(load.mean() - load))
                load.zero_()
        if step % 50 == 0:
            log.append({"step": step, "loss": float(loss), "lr": lr, "s": round(time.time() - t0, 1)})
            print(log[-1], flush=True)
        step += 1

    model.eval()
    val_loss = evaluate(model, val, args, dev)
    counts = torch.bincount(train, minlength=config.vocab_size).double() + 1
    unigram = float(-(counts / counts.sum()).log()[val].mean())
    tok = AutoTokenizer.from_pretrained(args.data / "tokenizer")
    prompt = tok("The meaning of the word", return_tensors="pt")["input_ids"].to(dev)
    with torch.no_grad():
        sample = model.generate(prompt, max_new_tokens=60, do_sample=False)
    result = {
        "params": n_params, "steps": step, "tokens_seen": step * args.batch * args.seq, "minutes": round((time.time() - t0) / 60, 2),
        "val_tokens": len(val), "val_loss": val_loss, "val_ppl": math.exp(val_loss), "unigram_ppl": math.exp(unigram),
        "sample": tok.decode(sample[0]), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "log": log,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "log"}, indent=1))
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="15MB")
    for f in (args.data / "tokenizer").iterdir():
        shutil.copy(f, out / f.name)
    (out / "train_log.json").write_text(json.dumps(result, indent=1))


def _count_into(load: torch.Tensor):
    def hook(module, inputs, out) -> None:  # out = (router_logits, topk_weights, topk_indices)
        if module.training:
            load.add_(torch.bincount(out[2].flatten(), minlength=load.numel()))

    return hook


@torch.no_grad()
def evaluate(model, val, args, dev, batches: int = 50) -> float:
    losses = []
    span = args.seq + 1
    for i in range(min(batches, (len(val) - 1) // (span * args.batch))):
        x = val[i * span * args.batch : (i + 1) * span * args.batch].view(args.batch, span)[:, : args.seq]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            losses.append(float(model(input_ids=x, labels=x).loss))
    return sum(losses) / len(losses)


if __name__ == "__main__":
    main()
