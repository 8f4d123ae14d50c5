"""The input embedding in pinned RAM (`--embed-on-host`, kernels/embed.py): the gather is F.embedding bit for bit
(interpreted on a CPU, the pinned table read by the GPU on CUDA), and an engine with it gives the same logits as
one without, its table off the device; a head tied to the embedding keeps it."""
from __future__ import annotations

import pytest
import torch

import sluice
from sluice.kernels.embed import HostEmbedding, embed, embed_ref
from common import DEVICE, PROMPT, VARIANTS, greedy_logits


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 2)])
def test_embed_is_f_embedding(shape):
    """Rows gathered as F.embedding gathers them, the last row of the table too; the must-fail: the next row's ids."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 1100, generator=g).to(torch.bfloat16)  # wider than one program's block
    if DEVICE.startswith("cuda"):
        table = table.pin_memory()
    ids = torch.randint(0, 49, shape, generator=g)
    ids.view(-1)[0] = 49
    ids = ids.to(DEVICE)
    got = embed(table, ids)
    assert got.device == ids.device and got.shape == (*shape, 1100)
    assert torch.equal(got.cpu(), embed_ref(table, ids).cpu())
    assert not torch.equal(got.cpu(), embed_ref(table, (ids + 1) % 50).cpu())
    outside = embed(table, torch.tensor([[50, -1]], device=DEVICE))  # outside the table: zero rows, no stray read
    assert not outside.any()


@pytest.mark.parametrize("variant", ["nemotron_h", "qwen3_moe", *(pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS
                                                              if v not in ("nemotron_h", "qwen3_moe"))])
def test_an_engine_with_its_embedding_on_the_host_gives_the_same_logits(variant, stores):
    with sluice.load(stores[variant], device=DEVICE, schedule="direct") as engine:
        want = greedy_logits(engine, PROMPT, 4)
    with sluice.load(stores[variant], device=DEVICE, schedule="direct", embed_on_host=True) as engine:
        emb = engine.model.hf.get_input_embeddings()
        calls, forward = [], emb.forward
        emb.forward = lambda ids: calls.append(ids.shape) or forward(ids)
        got = greedy_logits(engine, PROMPT, 4)
    assert isinstance(emb, HostEmbedding) and emb.table.device.type == "cpu"
    assert calls[0] == (1, len(PROMPT)) and (1, 1) in calls  # the prompt and a one-token step (a replay calls no Python)
    assert not any(p.data_ptr() == emb.table.data_ptr() for p in engine.model.hf.parameters())
    assert torch.equal(got, want)


def test_batched_steps_with_the_embedding_on_the_host(stores):
    """Batched decode steps read their rows from the host's table too (on CUDA inside a batched step's capture):
    each sequence's logits are those of its steps with the table on the device."""
    from test_batch import PROMPTS, together

    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule="direct") as engine:
        want = together(engine, PROMPTS)
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule="direct", embed_on_host=True) as engine:
        got = together(engine, PROMPTS)
        assert isinstance(engine.model.hf.get_input_embeddings(), HostEmbedding)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_the_embedding_goes_to_the_host_by_default_only_beside_a_vram_budget():
    """On by default where a VRAM budget shares the GPU with expert slots (CUDA); as asked otherwise."""
    from sluice.pipeline.config import EngineConfig

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert EngineConfig(vram_budget=8 << 30).embeds_on_host(cuda)
    assert not EngineConfig().embeds_on_host(cuda) and not EngineConfig(vram_budget=8 << 30).embeds_on_host(cpu)
    assert not EngineConfig(vram_budget=8 << 30, embed_on_host=False).embeds_on_host(cuda)
    assert EngineConfig(embed_on_host=True).embeds_on_host(cpu)


def test_a_head_tied_to_the_embedding_keeps_it(stores):
    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule="direct") as engine:
        hf = engine.model.hf
        hf.get_output_embeddings().weight = hf.get_input_embeddings().weight
        assert engine.model.embed_on_host(pin=False) is False
        assert type(hf.get_input_embeddings()) is torch.nn.Embedding


def test_a_token_outside_the_vocabulary_is_refused(stores):
    """A token id past the embedding's rows (or negative) is a one-line error naming it, before any step (on a GPU the
    lookup would abort the process's CUDA context); the last row is a token like any other (the must-fail side)."""
    from sluice.errors import SluiceError

    with sluice.load(stores["qwen3_moe"], device=DEVICE, schedule="direct") as engine:
        V = engine.model.vocab
        for bad in (V, -1):
            with pytest.raises(SluiceError, match=f"token id {bad} is outside the model's vocabulary \\(0..{V - 1}\\)"):
                engine.generate([1, bad], 1)
        seq = engine.new_sequence()
        with pytest.raises(SluiceError, match=f"token id {V} is outside"):
            engine.extend(seq, [1, V])
        assert len(seq.tokens) == 0 and len(engine.generate([1, V - 1], 1)) == 1
