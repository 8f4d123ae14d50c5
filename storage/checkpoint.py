"""A Hugging Face checkpoint folder, read from its headers: config, tensor index, side files.

Nothing here loads weights. `Checkpoint.open` validates what a repack needs up front (config.json,
every shard's header against its file size, the index's weight map) so a malformed checkpoint
fails before any output is written, with an error naming the file and tensor.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from sluice.errors import CheckpointError
from sluice.storage.safetensors_io import TensorInfo, read_header

# Files copied verbatim next to resident.safetensors so a store is a complete model folder.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "hf_quant_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "preprocessor_config.json",
    "processor_config.json",
)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict
    tensors: dict[str, TensorInfo]
    shards: tuple[Path, ...]

    @classmethod
    def open(cls, path: str | Path, headers_only: bool = False) -> "Checkpoint":
        """Read config.json and every shard's header. headers_only: shards may be truncated after their header."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory")
        if not (path / "manifest.json").exists() and ((path / "resident.safetensors").is_file() or (path / "experts").is_dir()):
            raise CheckpointError(f"{path}: an expert store whose manifest.json is missing (damaged, or its repack did not "
                                  "finish); repack it from its checkpoint with --force")
        config = read_config(path)
        shards = _shard_files(path)
        tensors: dict[str, TensorInfo] = {}
        for shard in shards:
            found, _ = read_header(shard, headers_only)
            for name, info in found.items():
                if name in tensors:
                    raise CheckpointError(f"{shard}: tensor {name!r} also appears in {tensors[name].file}")
                tensors[name] = info
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = _read_json(index).get("weight_map", {})
            for name, fname in weight_map.items():
                if name not in tensors:
                    raise CheckpointError(f"{index}: lists {name!r} in {fname}, but no shard holds it")
        return cls(path, config, tensors, tuple(shards))

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    def hf_config(self):
        """The config as transformers reads it (attribute maps and defaults applied)."""
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.path)
        except Exception as e:  # transformers raises many types for a bad config
            raise CheckpointError(f"{self.path / 'config.json'}: transformers cannot read it: {e}") from None

    def side_files(self) -> list[Path]:
        return [self.path / n for n in SIDE_FILES if (self.path / n).is_file()]

    def fingerprint(self) -> dict:
        """Identity of the source: shard names and sizes plus a hash of every header, cheap to recompute."""
        h = hashlib.sha256()
        files = []
        for shard in self.shards:
            st = shard.stat()
            with open(shard, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                h.update(f.read(n))
            files.append({"name": shard.name, "size": st.st_size})
        h.update(json.dumps(self.config, sort_keys=True).encode())
        return {"path": str(self.path.resolve()), "files": files, "sha256": h.hexdigest()}


def read_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{path}: no config.json (is this a Hugging Face checkpoint folder?)")
    config = _read_json(cfg)
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{cfg}: has no 'model_type'")
    return config


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
        return [path / n for n in names]
    shards = sorted(path.glob("*.safetensors"))
    shards = [s for s in shards if s.name != "resident.safetensors"]
    if not shards:
        raise CheckpointError(f"{path}: no *.safetensors files (only safetensors checkpoints are supported)")
    return shards


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
