"""Repack, the store format, verify, resume, --force, and malformed checkpoints."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open

from sluice.errors import CheckpointError, StoreError
from sluice.storage import repack as repack_mod
from sluice.storage.repack import repack
from sluice.storage.store import CHECKSUM, PAGE, ExpertStore, relay, unrelay
from sluice.storage.verify import verify


def test_blocks_are_page_aligned_and_hold_the_checkpoint_bytes(checkpoints, stores):
    store = ExpertStore.open(stores["nemotron_h_latent"])
    assert store.block_bytes % PAGE == 0
    layer = store.moe_layers[-1]
    expert = 5
    with open(store.file(layer), "rb") as f:
        f.seek(store.offset(expert))
        block = torch.frombuffer(bytearray(f.read(store.block_bytes)), dtype=torch.uint8)
    views = store.views(block)
    with safe_open(checkpoints["nemotron_h_latent"] / "model.safetensors", "pt") as f:
        up = f.get_tensor(f"backbone.layers.{layer}.mixer.experts.{expert}.up_proj.weight")
        down = f.get_tensor(f"backbone.layers.{layer}.mixer.experts.{expert}.down_proj.weight")
    I, Dx = up.shape
    assert views["up.weight"].shape == (I, Dx) and torch.equal(views["up.weight"], up)
    # ReLU^2 down [Dx, I] is stored neuron-major [I, Dx]: neuron i's weights are one contiguous row.
    assert views["down.weight"].shape == (I, Dx) and torch.equal(views["down.weight"], down.t())
    assert views["down.weight"][7].is_contiguous()


def test_swiglu_blocks_keep_the_checkpoint_layout(stores):
    store = ExpertStore.open(stores["qwen3_moe"])
    assert [s.name for s in store.manifest.slots] == ["gate.weight", "up.weight", "down.weight"]
    assert not any(s.relaid for s in store.manifest.slots)


def test_relay_is_a_byte_permutation():
    from sluice.storage.store import TensorSlot

    for dtype, st in ((torch.float32, "F32"), (torch.bfloat16, "BF16"), (torch.uint8, "U8")):
        t = (torch.randn(6, 10) * 50).to(dtype)
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        slot = TensorSlot("down.weight", "down", "weight", 0, len(data), (6, 10), st, True)
        stored = relay(data, slot)
        assert len(stored) == len(data) and sorted(stored) == sorted(data)
        assert torch.equal(torch.frombuffer(bytearray(stored), dtype=torch.uint8).view(dtype).view(10, 6), t.t())
        assert unrelay(stored, slot) == data


def test_verify_passes_then_names_a_flipped_byte(stores, tmp_path):
    assert verify(stores["qwen3_moe"], progress=False) == []
    bad = tmp_path / "bad"
    shutil.copytree(stores["qwen3_moe"], bad)
    m = json.loads((bad / "manifest.json").read_text())
    layer, n = m["layers"][1], m["block_bytes"]
    f = bad / layer["file"]
    data = bytearray(f.read_bytes())
    data[3 * n + 17] ^= 1
    f.write_bytes(data)
    problems = verify(bad, progress=False)
    assert f"layer {layer['layer']}, expert 3: checksum mismatch" in problems
    assert any(p.startswith(f"layer {layer['layer']}, expert 3: gate.weight differs") for p in problems)


def test_a_version_2_store_with_xxh64_checksums_still_reads_and_an_unknown_checksum_is_named(stores, tmp_path):
    """New stores name their checksum (xxh3_64); a version 2 store (xxh64, from before) opens, reads and verifies as
    it was, and a flipped byte in it still fails its checksum. A checksum this code does not know is refused by name."""
    import xxhash

    from sluice.errors import CorruptBlockError
    from sluice.storage.reader import BlockReader, HostArena

    store = ExpertStore.open(stores["qwen3_moe"])
    assert store.manifest.checksum == CHECKSUM == "xxh3_64"
    layer, n = store.moe_layers[0], store.block_bytes
    block = (store.path / store.manifest.layers[0].file).read_bytes()[2 * n : 3 * n]
    assert store.checksum(layer, 2) == xxhash.xxh3_64_intdigest(block) != xxhash.xxh64_intdigest(block)

    old = tmp_path / "old"
    shutil.copytree(stores["qwen3_moe"], old)
    m = json.loads((old / "manifest.json").read_text())
    m["version"] = 2
    del m["checksum"]  # version 2 manifests wrote "xxh64" or nothing at all
    for entry in m["layers"]:
        data = (old / entry["file"]).read_bytes()
        entry["checksums"] = [xxhash.xxh64(data[e * n : (e + 1) * n]).hexdigest() for e in range(m["num_experts"])]
    (old / "manifest.json").write_text(json.dumps(m))
    assert ExpertStore.open(old).manifest.checksum == "xxh64"
    assert verify(old, progress=False) == []
    arena = HostArena(1, n, pin=False)
    reader = BlockReader(ExpertStore.open(old), threads=1)
    assert reader.read_into(layer, 2, arena.slot(0)) == n
    reader.close()
    f = old / m["layers"][0]["file"]
    data = bytearray(f.read_bytes())
    data[2 * n + 5] ^= 1
    f.write_bytes(data)
    reader = BlockReader(ExpertStore.open(old), threads=1)
    with pytest.raises(CorruptBlockError, match=f"layer {layer}, expert 2: checksum mismatch"):
        reader.read_into(layer, 2, arena.slot(0))
    reader.close()

    m.update(version=3, checksum="md5")
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="unknown block checksum 'md5'"):
        ExpertStore.open(old)
    del m["checksum"]  # version 3 names it
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="malformed manifest.*no block checksum"):
        ExpertStore.open(old)


def test_rerun_is_a_no_op_and_refuses_other_sources(checkpoints, stores, tmp_path):
    target = tmp_path / "store"
    repack(checkpoints["qwen3_moe"], target, progress=False)
    mtime = (target / "manifest.json").stat().st_mtime_ns
    repack(checkpoints["qwen3_moe"], target, progress=False)  # up to date: nothing rewritten
    assert (target / "manifest.json").stat().st_mtime_ns == mtime
    with pytest.raises(StoreError, match="already exists.*--force"):
        repack(checkpoints["nemotron_h"], target, progress=False)
    assert ExpertStore.open(target).manifest.architecture == "qwen3_moe"  # untouched
    store = repack(checkpoints["nemotron_h"], target, force=True, progress=False)
    assert store.manifest.architecture == "nemotron_h"
    assert not list(tmp_path.glob("store.*"))  # no partial or old folder left behind


@pytest.mark.parametrize("older", [False, True])
def test_interrupted_repack_resumes(checkpoints, tmp_path, monkeypatch, older):
    """An interrupted repack resumes after its finished layers; work left by one whose checksums were another kind
    (`older`: xxh64, before they were named) is not mixed in: every layer is built again."""
    target = tmp_path / "store"
    real = repack_mod.build_block
    calls = {"n": 0}

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 20:  # in the second MoE layer (16 experts per layer)
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(repack_mod, "build_block", failing)
    with pytest.raises(KeyboardInterrupt):
        repack(checkpoints["nemotron_h"], target, progress=False)
    progress = tmp_path / "store.partial" / "progress.json"
    assert not target.exists() and progress.exists()
    if older:
        state = json.loads(progress.read_text())
        del state["checksum"]  # as an older Sluice left it
        progress.write_text(json.dumps(state))

    calls["n"] = 0
    monkeypatch.setattr(repack_mod, "build_block", lambda *a, **k: (calls.__setitem__("n", calls["n"] + 1), real(*a, **k))[1])
    store = repack(checkpoints["nemotron_h"], target, progress=False)
    # the finished first layer was not rebuilt, unless its checksums were of another kind
    assert calls["n"] == store.total_blocks - (0 if older else 16)
    assert verify(target, progress=False) == []


def test_malformed_checkpoints_are_named(checkpoints, tmp_path):
    src = checkpoints["qwen3_moe"]

    def copy(name):
        d = tmp_path / name
        shutil.copytree(src, d)
        return d

    no_config = copy("noconfig")
    (no_config / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        repack(no_config, tmp_path / "s1", progress=False)

    unknown = copy("unknown")
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["model_type"] = "llama"
    (unknown / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'llama'"):
        repack(unknown, tmp_path / "s2", progress=False)

    truncated = copy("truncated")
    f = truncated / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model.safetensors.*past the end of the file"):
        repack(truncated, tmp_path / "s3", progress=False)

    garbage = copy("garbage")
    (garbage / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        repack(garbage, tmp_path / "s4", progress=False)

    assert not any(p.name.startswith("s") for p in tmp_path.iterdir())  # nothing written


def test_missing_expert_tensor_is_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "missing"
    shutil.copytree(checkpoints["qwen3_moe"], d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.3.mlp.experts.7.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="layer 3 expert 7: tensor up.weight is missing"):
        repack(d, tmp_path / "s", progress=False)


def test_truncated_store_is_named(stores, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(stores["nemotron_h"], bad)
    m = json.loads((bad / "manifest.json").read_text())
    f = bad / m["layers"][0]["file"]
    f.write_bytes(f.read_bytes()[:-PAGE])
    with pytest.raises(StoreError, match=r"layer_\d+\.bin.*truncated"):
        ExpertStore.open(bad)


def test_multi_token_prediction_layers_are_left_out(checkpoints, tmp_path):
    """DeepSeek-V3 checkpoints carry MTP layers past num_hidden_layers; they are not part of the LM."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "mtp"
    shutil.copytree(checkpoints["deepseek_v3"], d)
    tensors = load_file(d / "model.safetensors")
    n = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    tensors[f"model.layers.{n}.mlp.experts.0.gate_proj.weight"] = torch.randn(32, 64)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    store = repack(d, tmp_path / "s", progress=False)
    from sluice.storage.safetensors_io import read_header

    resident, _ = read_header(store.path / "resident.safetensors")
    assert not any(f"layers.{n}." in k for k in resident) and n not in store.moe_layers


def test_qwen3_5_moe_keeps_only_its_language_model(checkpoints, tmp_path):
    """A Qwen3.5-MoE vision-language checkpoint: the vision tower and the MTP head are not part of the LM."""
    from safetensors.torch import load_file, save_file

    from sluice.storage.safetensors_io import read_header

    d = tmp_path / "vl"
    shutil.copytree(checkpoints["qwen3_5_moe"], d)
    tensors = load_file(d / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(32, 64)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    store = repack(d, tmp_path / "s", progress=False)
    resident, _ = read_header(store.path / "resident.safetensors")
    assert any(k.startswith("model.visual.") for k in tensors)
    assert all(k.startswith(("model.language_model.", "lm_head.")) for k in resident)

