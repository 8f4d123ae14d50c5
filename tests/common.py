"""Constants the tests share (imported as tests.common)."""

import os

# name -> (architecture, config overrides). Experts and routers are scaled so experts decide the output.
VARIANTS = {
    "nemotron_h": ("nemotron_h", {}),
    "nemotron_h_latent": ("nemotron_h", {"moe_latent_size": 32}),
    "nemotron_h_groups": ("nemotron_h", {"n_group": 4, "topk_group": 2, "moe_latent_size": 48}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_next": ("qwen3_next", {}),
    "mixtral": ("mixtral", {}),
    "deepseek_v3": ("deepseek_v3", {}),
}
PROMPT = [5, 17, 42, 98, 3, 25, 77, 8, 61, 13, 12, 20]  # ids < VOCAB_SIZE (99) of the tiny tokenizer
from sluice.models.tiny import VOCAB_SIZE  # noqa: E402

assert all(0 <= i < VOCAB_SIZE for i in PROMPT), "PROMPT must be valid ids of the tiny tokenizer"

# The engine's device in tests: CPU in CI; SLUICE_TEST_DEVICE=cuda runs the same tests on a GPU.
DEVICE = os.environ.get("SLUICE_TEST_DEVICE", "cpu")
