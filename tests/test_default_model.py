"""The bundled default model (trained, models/default): Sluice gives transformers' greedy tokens."""

from __future__ import annotations

import json

import torch

import sluice
from sluice.models.base import cache_kw
from sluice.models.builtin import DEFAULT_MODEL, default_model_path
from common import DEVICE


def test_default_model_is_the_trained_one():
    assert default_model_path() == DEFAULT_MODEL
    log = json.loads((DEFAULT_MODEL / "train_log.json").read_text())
    assert log["val_ppl"] < log["unigram_ppl"] / 10  # it learned far more than word frequencies


@torch.no_grad()
def test_default_model_golden():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    ids = tok("The meaning of the word")["input_ids"]
    ref = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32, experts_implementation="eager").eval()
    out = ref(torch.tensor([ids]), use_cache=True)
    ref_logits, greedy = out.logits[0].float(), []
    for _ in range(32):
        greedy.append(int(out.logits[0, -1].argmax()))
        out = ref(torch.tensor([[greedy[-1]]]), use_cache=True, **cache_kw(out.past_key_values))
    with sluice.load(DEFAULT_MODEL, device=DEVICE, dtype="float32", progress=False) as engine:
        logits = engine.forward(ids)
        assert (logits - ref_logits).abs().max() < 1e-3 * ref_logits.abs().max()
        assert engine.generate(ids, 32) == greedy
    assert "Webster" in tok.decode(greedy) or len(set(greedy)) > 10  # English-like text, not a stuck token
