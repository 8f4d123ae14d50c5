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
from tiny import VOCAB_SIZE  # noqa: E402

assert all(0 <= i < VOCAB_SIZE for i in PROMPT), "PROMPT must be valid ids of the tiny tokenizer"

# The engine's device in tests: CPU in CI; SLUICE_TEST_DEVICE=cuda runs the same tests on a GPU.
DEVICE = os.environ.get("SLUICE_TEST_DEVICE", "cpu")

# The golden tolerance: max |dlogit| against transformers (fp32, CPU), per model. Set from the error measured on
# 2026-12-04 (the value in each comment): the largest over the prompt's logits and 32 teacher-forced decode steps, every
# bundled schedule, RAM caches of one block to all, the torch, Triton (interpreted) and hybrid CPU expert paths, 1 and 4
# threads; the bound is about 3-5 x that, rounded up, and no lower than 1e-6 (~16 ulp of the logits' ~0.6). Both sides run
# the same fp32 modules; they differ in the order the routed outputs are summed and in BLAS blocking. What it must
# catch (tests/mutants.py): a routed sum 0.1% off in decode moves the logits by 4.4e-6 (deepseek_v3), 4.8e-6
# (nemotron_h), 1.9e-5 (qwen3_5_moe), 3e-5 to 6e-4 (the rest);
# a dropped expert or a wrong block by 1e-2 and more (MUST_DIFFER).
LOGIT_ATOL = {
    # the tiny variants (VARIANTS); Triton's error where it is the larger
    "nemotron_h": 1e-6,  # 1.6e-7; Triton 3.5e-7
    "nemotron_h_latent": 1e-6,  # 2.1e-7
    "nemotron_h_groups": 1e-6,  # 2.2e-7
    "qwen3_moe": 1e-5,  # 5.1e-7; Triton 8.2e-7; 3.8e-6 with the fused decoder ops on an AMD EPYC's BLAS (2026-12-07)
    "qwen3_next": 1.5e-5,  # 1.0e-6; Triton 5.2e-6 (a prompt's; its decode steps 7e-7)
    "mixtral": 5e-6,  # 0 (the same sums in the same order); Triton 1.1e-6
    "deepseek_v3": 1e-6,  # 1.8e-7; Triton 2.8e-7
    "gpt_oss": 5e-6,  # 1.5e-6
    "gpt_oss_unquantized": 6e-6,  # 1.8e-6
    "qwen3_5_moe": 5e-6,  # 1.8e-6
    "qwen3_5_moe_text": 1e-5,  # 2.2e-6
    "deepseek_v4": 5e-6,  # 1.5e-6
    "nemotron_h_omni": 2e-6,  # 4.5e-7 (tests/test_images.py, test_golden.py: its language model)
    # tests/test_quantized.py's cases, against transformers on the dequantised weights (torch and Triton)
    "nemotron_nvfp4_all": 1e-6,  # 2.1e-7
    "nemotron_fp8": 1e-6,  # 3.3e-7
    "nemotron_fp8_row": 1e-6,  # 2.4e-7
    "qwen_nvfp4_ct": 3e-6,  # 9.0e-7
    "qwen_fp8_block_all": 5e-6,  # 1.3e-6
    "deepseek_v4_release": 3e-6,  # 9.5e-7
}
# SLUICE_MEASURED_LOGITS=FILE: each comparison appends "name, max |dlogit|, where" to FILE (how the table was measured:
# `make test ARGS="-m ''"` with it set, then the largest per name)
MEASURED = os.environ.get("SLUICE_MEASURED_LOGITS")
# a GPU's kernels were not measured against this table: there the bound stays the one it replaced
CUDA_LOGIT_ATOL = 1e-4
# a wrong expert, weight or layout moves logits by O(0.1): what must-fail tests ask of the difference
MUST_DIFFER = 1e-2


def logit_atol(name: str) -> float:
    """The golden tolerance of model `name` (a VARIANTS name or another entry of LOGIT_ATOL) on this run's device."""
    return max(LOGIT_ATOL[name], CUDA_LOGIT_ATOL) if DEVICE.startswith("cuda") else LOGIT_ATOL[name]


def assert_logits_close(name: str, got, want, where: str) -> None:
    """got and want (logits [..., V]) within model `name`'s golden tolerance; the message names where and the step."""
    assert got.shape == want.shape, f"{where}: logits {tuple(got.shape)}, want {tuple(want.shape)}"
    err = (got.float() - want.float()).abs()
    diff, atol = err.max().item(), logit_atol(name)
    if MEASURED:  # re-measuring the table: every comparison's error, appended
        with open(MEASURED, "a") as f:
            f.write(f"{name}\t{diff:.3g}\t{where}\n")
    if diff > atol:
        row = int(err.reshape(-1, err.shape[-1]).amax(-1).argmax())
        raise AssertionError(f"{where}: max |dlogit| {diff:.3g} > {atol:.1g} (first at row {row})")


def teacher_forced(engine, prompt: list[int], tokens: list[int]) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(the prompt's logits [T, V], step logits [n, V]) on CPU: the prompt, then one-token steps on tokens[:-1] (the
    reference's greedy tokens), so every step's logits compare with the reference's whatever this engine's argmax;
    step row 0 is the prompt's last position."""
    import torch

    seq = engine.new_sequence()
    first = engine.extend(seq, prompt).cpu()
    steps = [first[-1]] + [engine.extend(seq, [t])[-1].cpu() for t in tokens[:-1]]
    return first, torch.stack(steps)


def greedy_logits(engine, prompt: list[int], n: int, release: bool = False) -> "torch.Tensor":
    """Last-position logits [n, V] (CPU) of a prompt and then n - 1 one-token steps, each feeding the argmax back;
    `release`: the sequence's state then handed back to the engine (Engine.release)."""
    import torch

    seq = engine.new_sequence()
    logits = [engine.extend(seq, prompt)[-1]]
    for _ in range(n - 1):
        logits.append(engine.extend(seq, [int(logits[-1].argmax())])[-1])
    out = torch.stack(logits).cpu()
    if release:
        engine.release(seq)
    return out
