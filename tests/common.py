"""Constants the tests share (imported as `common`: pytest puts tests/ on the path)."""

import os

# name -> (architecture, make_tiny_checkpoint keywords: config overrides or experts_format). Experts and routers
# are scaled so experts decide the output.
VARIANTS = {
    "nemotron_h": ("nemotron_h", {}),
    "nemotron_h_latent": ("nemotron_h", {"moe_latent_size": 32}),
    "nemotron_h_groups": ("nemotron_h", {"n_group": 4, "topk_group": 2, "moe_latent_size": 48}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_next": ("qwen3_next", {}),
    "mixtral": ("mixtral", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "gpt_oss": ("gpt_oss", {"experts_format": "mxfp4"}),  # fused MXFP4 experts, as gpt-oss ships
    "gpt_oss_unquantized": ("gpt_oss", {}),  # fused [in, out] fp32 experts
    "qwen3_5_moe": ("qwen3_5_moe", {}),  # the vision-language checkpoint: LM under model.language_model, vision tower beside
    "qwen3_5_moe_text": ("qwen3_5_moe_text", {}),
    "deepseek_v4": ("deepseek_v4", {}),
}
PROMPT = [5, 17, 42, 98, 3, 25, 77, 8, 61, 13, 12, 20]  # ids < VOCAB_SIZE (99) of the tiny tokenizer
from sluice.models.tiny import VOCAB_SIZE  # noqa: E402

assert all(0 <= i < VOCAB_SIZE for i in PROMPT), "PROMPT must be valid ids of the tiny tokenizer"

# The engine's device in tests: CPU in CI; SLUICE_TEST_DEVICE=cuda runs the same tests on a GPU.
DEVICE = os.environ.get("SLUICE_TEST_DEVICE", "cpu")


def greedy_logits(engine, prompt: list[int], n: int) -> "torch.Tensor":
    """Last-position logits [n, V] (CPU) of a prompt and then n - 1 one-token steps, each feeding the argmax back."""
    import torch

    seq = engine.new_sequence()
    logits = [engine.extend(seq, prompt)[-1]]
    for _ in range(n - 1):
        logits.append(engine.extend(seq, [int(logits[-1].argmax())])[-1])
    return torch.stack(logits).cpu()
