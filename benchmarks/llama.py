"""llama.cpp's llama-bench on the same shape as a Sluice store, for ratios measured in the same run.

Placements, as llama.cpp users run a MoE larger than the card: every weight on the GPU; every routed expert on the CPU
(`-ot exps=CPU`); and `-ncmoe N` (the routed experts of the first N blocks on the CPU, the rest on the GPU), N chosen so
that llama.cpp's VRAM fits the same budget as Sluice's: the GGUF's own tensor sizes give each block's expert bytes,
and the all-on-CPU run's measured VRAM gives what is not weights (KV cache, compute buffers, the CUDA context).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass

from sluice.errors import SluiceError

EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(?:up|down|gate|gate_up)_exps\.")


@dataclass(frozen=True)
class GGUFSizes:
    """A GGUF's weight bytes: routed experts per block index, and everything else."""

    experts: dict[int, int]  # block index -> its routed experts' bytes
    other: int  # every other tensor's bytes

    @property
    def blocks(self) -> int:
        return max(self.experts) + 1 if self.experts else 0

    def on_gpu(self, ncmoe: int) -> int:
        """Weight bytes on the GPU under `-ncmoe ncmoe` (blocks 0..ncmoe-1 keep their experts on the CPU)."""
        return self.other + sum(b for i, b in self.experts.items() if i >= ncmoe)


def gguf_sizes(path: str) -> GGUFSizes:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise SluiceError("bench peer: the gguf package is needed to read the GGUF (pip install gguf, or llama.cpp's "
                          "gguf-py on PYTHONPATH)") from None
    experts: dict[int, int] = {}
    other = 0
    for t in GGUFReader(path).tensors:
        m = EXPERTS.match(t.name)
        if m:
            experts[int(m[1])] = experts.get(int(m[1]), 0) + int(t.n_bytes)
        else:
            other += int(t.n_bytes)
    return GGUFSizes(experts, other)


def ncmoe_for(sizes: GGUFSizes, budget: int, overhead: int) -> int:
    """The fewest blocks whose experts go to the CPU so that weights on the GPU plus `overhead` fit `budget`."""
    for n in range(sizes.blocks + 1):
        if sizes.on_gpu(n) + overhead <= budget:
            return n
    return sizes.blocks


@dataclass(frozen=True)
class LlamaRun:
    """One placement's figures: tok/s by test ("pp512", "pp2048", "tg64")."""

    placement: str
    args: tuple[str, ...]
    tok_s: dict[str, float]
    vram_peak: int | None  # bytes, as nvidia-smi saw the device during the run


def run_llama_bench(binary: str, gguf: str, placement: str, args: list[str], prompts: list[int], decode: int,
                    threads: int, reps: int, memory) -> LlamaRun:
    """llama-bench on `gguf` with placement `args`, its JSON output read; `memory`: a PeakMemory sampler."""
    cmd = [binary, "-m", gguf, "-ngl", "99", "-fa", "on", "-t", str(threads), "-r", str(reps),
           "-p", ",".join(map(str, prompts)), "-n", str(decode), "-o", "json", *args]
    with memory as peak:
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SluiceError(f"llama-bench ({placement}) failed with code {done.returncode}: {done.stderr.strip()[-400:]}")
    try:
        rows = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise SluiceError(f"llama-bench ({placement}) printed no JSON: {done.stdout[-200:]!r}") from None
    tok_s = {}
    for r in rows:
        name = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        tok_s[name] = float(r["avg_ts"])
    return LlamaRun(placement, tuple(args), tok_s, peak.bytes)
