"""Shared fixtures: tiny random checkpoints (saved by transformers' save_pretrained), their stores,
and transformers reference models in fp32 with eager experts."""

from __future__ import annotations

import os
from collections.abc import Mapping

# Triton kernels run on the CPU through the interpreter; it must be chosen before triton is imported.
if os.environ.get("SLUICE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# references are transformers' own modules, never Hub kernels (none can be fetched; where the `kernels` package is
# missing, this repo's kernels/ folder on sys.path passes for it and transformers refuses to load)
os.environ.setdefault("USE_HUB_KERNELS", "0")
os.environ.setdefault("SLUICE_CHECK_STREAMS", "1")  # on a GPU: every stream switch `Streams.use` skips is checked
from pathlib import Path

import pytest
import torch

from sluice.models.base import cache_kw
from tiny import make_tiny_checkpoint
from sluice.storage.repack import repack
from common import VARIANTS



@pytest.fixture(scope="session", autouse=True)
def _sluice_home(tmp_path_factory):
    os.environ["SLUICE_HOME"] = str(tmp_path_factory.mktemp("sluice-home"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # pytest-xdist's worker processes share the cores
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // workers)))


class Made(Mapping):
    """VARIANTS' name -> what `make(name)` makes, made on first use: a run of a few tests (a worker's share, or
    tests/mutants.py against one variant) makes only the checkpoints it reads."""

    def __init__(self, make):
        self._make, self._made = make, {}

    def __getitem__(self, name: str) -> Path:
        if name not in VARIANTS:
            raise KeyError(name)
        if name not in self._made:
            self._made[name] = self._make(name)
        return self._made[name]

    def __iter__(self):
        return iter(VARIANTS)

    def __len__(self) -> int:
        return len(VARIANTS)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Mapping[str, Path]:
    seeds = {name: i for i, name in enumerate(VARIANTS)}  # each variant's own seed, whichever is made first

    def make(name):
        arch, over = VARIANTS[name]
        return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / name, arch, seed=seeds[name], **over)

    return Made(make)


@pytest.fixture(scope="session")
def stores(checkpoints, tmp_path_factory) -> Mapping[str, Path]:
    return Made(lambda name: repack(checkpoints[name], tmp_path_factory.mktemp("stores") / name, progress=False).path)


class References:
    """transformers' own models on the same checkpoints, fp32 on CPU, eager experts; loaded once."""

    def __init__(self, checkpoints):
        self.checkpoints = checkpoints
        self._models = {}
        self._decoded = {}

    def load(self, name):
        """A fresh transformers model on the checkpoint: fp32, eager experts. MXFP4 experts go through
        transformers' own dequantisation (to bf16, exact for E2M1 x 2^k values), then fp32."""
        import json

        from transformers import AutoModelForCausalLM, Mxfp4Config

        path = self.checkpoints[name]
        quant = json.loads((path / "config.json").read_text()).get("quantization_config", {})
        kw = {"quantization_config": Mxfp4Config(dequantize=True)} if quant.get("quant_method") == "mxfp4" else {}
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager", **kw).float().eval()

    def model(self, name):
        if name not in self._models:
            self._models[name] = self.load(name)
        return self._models[name]

    @torch.no_grad()
    def logits(self, name, ids) -> torch.Tensor:
        return self.model(name)(torch.tensor([ids])).logits[0].float()

    @torch.no_grad()
    def decode(self, name, ids, n=32) -> tuple[list[int], torch.Tensor]:
        """Greedy decoding one token per step from transformers' own cache (no EOS handling): the n tokens and the
        logits [n, V] (fp32, CPU) each is the argmax of; row 0 is the prompt's last position."""
        key = (name, tuple(ids), n)
        if key not in self._decoded:
            model, new, logits = self.model(name), [], []
            out = model(torch.tensor([ids]), use_cache=True)
            for i in range(n):
                logits.append(out.logits[0, -1].float())
                new.append(int(logits[-1].argmax()))
                if i < n - 1:
                    out = model(torch.tensor([[new[-1]]]), use_cache=True, **cache_kw(out.past_key_values))
            self._decoded[key] = new, torch.stack(logits)
        return self._decoded[key]

    def greedy(self, name, ids, n=32) -> list[int]:
        return self.decode(name, ids, n)[0]


@pytest.fixture(scope="session")
def refs(checkpoints) -> References:
    return References(checkpoints)
