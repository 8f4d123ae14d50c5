"""How a resident model is built: transformers' model class on the meta device, its routed experts stripped
(`StreamedExperts`), its resident weights (plain or quantised linears) loaded on the device; and the module swap
the fused kernels use to stand in place of transformers' modules."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from sluice.errors import CheckpointError
from sluice.kernels.formats import detect_format
from sluice.kernels.linear import GroupedQuantLinear, QuantLinear
from sluice.models.fallbacks import announce_fallbacks
from sluice.storage.safetensors_io import TORCH_TO_ST

if TYPE_CHECKING:
    from sluice.models.base import Architecture


class StreamedExperts(nn.Module):
    """Stands where transformers' fused experts were: routed experts come from the stage graph."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("routed experts are streamed by the Sluice stage graph, not called as a module")


def build_hf_model(
    arch: Architecture,
    hf_config: Any,
    tensors: dict[str, torch.Tensor],
    strip: Callable[[nn.Module], None],
    device: torch.device,
    dtype: torch.dtype | None,
) -> nn.Module:
    """transformers' model class on `device` with routed experts stripped and resident weights loaded.

    The model is built on the meta device (no expert memory is ever allocated), `strip` replaces
    each routed-expert module by `StreamedExperts`, the rest is materialised on `device` and
    filled from `tensors` (checkpoint names). Dtypes follow transformers' from_pretrained: the
    model dtype, except modules it keeps in fp32.
    """
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = _config_dtype(hf_config)
    state = {arch.module_name(k): v for k, v in tensors.items()}
    quantized = _pop_quantized(state)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=arch.attn_implementation)
    strip(model)
    linears = {name: _swap(model, name, nn.Identity()) for name in quantized}  # no dense copy is ever allocated
    keep_fp32 = [re.compile(p) for p in model._get_dtype_plan(dtype)]
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if any(k.search(name) for k in keep_fp32) and p.dtype != torch.float32:
            p.data = p.data.to(torch.float32)
    model.to_empty(device=device)

    expected = set(model.state_dict().keys())
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing:
        raise CheckpointError(f"resident weights missing from the checkpoint: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        raise CheckpointError(f"checkpoint tensors the {arch.model_type} model does not have: {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    for name, value in state.items():
        target = model.get_parameter(name) if _is_param(model, name) else model.get_buffer(name)
        if tuple(target.shape) != tuple(value.shape):
            raise CheckpointError(f"tensor {name!r}: checkpoint shape {list(value.shape)} != model shape {list(target.shape)}")
        with torch.no_grad():
            target.copy_(value)
    for name, parts in quantized.items():
        old = linears[name]
        bias = parts.pop("bias", None)
        where = f"resident {name}"
        fmt = detect_format({sfx: (TORCH_TO_ST[t.dtype], tuple(t.shape)) for sfx, t in parts.items()}, where)
        if type(old) is nn.Linear:
            new = QuantLinear(fmt, parts, bias, old.out_features, old.in_features)
        elif isinstance(old, nn.Linear) and hasattr(old, "n_groups") and bias is None:
            new = GroupedQuantLinear(fmt, parts, old.n_groups, old.out_features, old.in_features, where)
        else:
            raise CheckpointError(f"{where}: quantised weights for a {type(old).__name__}, which Sluice cannot run quantised")
        _swap(model, name, new.to(device))
    _init_non_persistent_buffers(model)
    model.eval()
    model.requires_grad_(False)
    announce_fallbacks(model, device)
    return model


QUANT_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "weight_packed", "weight_global_scale",
                  "input_scale", "input_global_scale")


QUANT_DTYPES = (torch.float8_e4m3fn, torch.uint8, torch.int8)


def _pop_quantized(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Take the tensors of quantised linears out of `state`: module name -> suffix -> tensor (bias included).

    DeepSeek-V4 names a quantised weight's scale plainly `scale`, a name other modules use for
    parameters of their own: it marks a quantised linear only beside an FP8 / packed `weight`."""
    groups: dict[str, dict[str, str]] = {}
    for key in state:
        module, _, suffix = key.rpartition(".")
        groups.setdefault(module, {})[suffix] = key

    def quantized_weight(g):
        return "scale" in g and "weight" in g and state[g["weight"]].dtype in QUANT_DTYPES

    quantized = [m for m, g in groups.items() if any(s in QUANT_SUFFIXES for s in g) or quantized_weight(g)]
    return {m: {sfx: state.pop(key) for sfx, key in groups[m].items()} for m in quantized}


def _swap(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = getattr(owner, attr)
    setattr(owner, attr, new)
    return old


def swap_modules(model: nn.Module, match: Callable[[nn.Module], bool], make: Callable[[nn.Module], nn.Module]) -> None:
    """Every submodule of `model` that `match`es stands replaced by `make(it)` (a fused kernel's module in its place)."""
    for name, module in list(model.named_modules()):
        if name and match(module):
            _swap(model, name, make(module))


def _is_param(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
        return True
    except AttributeError:
        return False


def _init_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute buffers not stored in checkpoints (rotary inv_freq) with transformers' own init."""
    for mod_name, module in model.named_modules():
        if not getattr(module, "_non_persistent_buffers_set", None) or isinstance(module, QuantLinear):
            continue
        if "RotaryEmbedding" not in type(module).__name__:
            raise CheckpointError(f"module {mod_name} ({type(module).__name__}) has non-persistent buffers Sluice cannot initialise")
        model._init_weights(module)


def _config_dtype(hf_config: Any) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype
