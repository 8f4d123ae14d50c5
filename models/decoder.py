"""The common shape of transformers' decoder LMs: model.embed_tokens -> model.layers -> model.norm -> lm_head.

Architectures of this shape (Qwen3-MoE, Mixtral, DeepSeek-V3, Qwen3-Next) differ in their token
mixers, which layers are sparse and what surrounds the routed experts; those live in their own
files. Every layer, dense or sparse, runs as transformers' own decoder layer: in a sparse layer the
MoE module is swapped for `MoECapture`, which records the MoE input and returns zeros, so the
layer returns residual + mixer output and the stage graph supplies the MoE output.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from sluice.models.base import Layer, MoEBlock, ResidentModel, cache_kw
from sluice.models.rows import RowsStates, packed_call, recurrent_rows


class MoECapture(nn.Module):
    """Stands in a decoder layer where its MoE module was: keeps the input, adds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.x: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.x = x
        return torch.zeros_like(x)


class Ctx:
    __slots__ = ("cache", "position_ids", "masks", "position_embeddings")

    def __init__(self, cache, position_ids, masks, position_embeddings):
        self.cache, self.position_ids, self.masks, self.position_embeddings = cache, position_ids, masks, position_embeddings


class DecoderLayer(Layer):
    """A decoder layer called as transformers calls it; sparse layers carry their MoEBlock."""

    def __init__(self, layer: nn.Module, layer_type: str, moe: MoEBlock | None = None, capture: MoECapture | None = None):
        self.layer, self.layer_type, self.moe, self.capture = layer, layer_type, moe, capture
        self.parts = False  # its MoE input from the layer's parts (`fuse`: PARTS_LAYERS), not a call of the whole layer

    def forward(self, h, ctx: Ctx):
        out = self.layer(h, **self._kwargs(ctx))
        return out[0] if isinstance(out, tuple) else out

    def _kwargs(self, ctx: Ctx) -> dict:
        kwargs = dict(attention_mask=ctx.masks[self.layer_type], position_ids=ctx.position_ids, use_cache=True, **cache_kw(ctx.cache))
        if ctx.position_embeddings is not None:
            kwargs["position_embeddings"] = ctx.position_embeddings
        return kwargs

    def moe_input(self, h, ctx: Ctx):
        if self.parts:  # transformers' order: norm, attention, residual add, norm; the add in the attention's last launch
            layer = self.layer
            h = layer.self_attn(hidden_states=layer.input_layernorm(h), residual=h, **self._kwargs(ctx))[0]
            return layer.post_attention_layernorm(h).reshape(-1, h.shape[-1]), h
        residual = self.forward(h, ctx)  # = h + mixer(h): the captured MoE added zeros
        return self._moe_x(), residual

    def forward_rows(self, hs, ctxs):
        rows = self._rows(hs, ctxs)
        return None if rows is None else [h for h, _ in rows]

    def moe_input_rows(self, hs, ctxs):
        rows = self._rows(hs, ctxs)
        return None if rows is None else (torch.cat([x for _, x in rows]), torch.cat([h for h, _ in rows], dim=1))

    def _rows(self, hs, ctxs) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        """The layer over several sequences' rows in one call where it can: (its output h [1, T_b, D], the MoE input
        x [T_b, D] or None) per sequence. An attention layer takes the rows packed together (models/rows.py); a
        linear-attention layer its decode rows batched over their own states, a prompt piece beside them as alone.
        One sequence goes as alone (None)."""
        if len(hs) == 1:
            return None
        if self.layer_type in ATTENTION:
            h = packed_call(self.layer, self.layer.self_attn, hs, ctxs, self.layer_type)
            n = [x.shape[1] for x in hs]
            return list(zip(h.split(n, dim=1), self._taken(n)))
        i = getattr(self.layer.linear_attn, "layer_idx", None) if self.layer_type == "linear_attention" else None
        steps = [b for b, h in enumerate(hs) if h.shape[1] == 1]
        if i is None or len(steps) < 2 or not RowsStates.takes([ctxs[b].cache for b in steps], i):
            return None
        h = recurrent_rows(self.layer, i, [hs[b] for b in steps], [ctxs[b] for b in steps])
        got = dict(zip(steps, zip(h.split(1), self._taken([1] * len(steps)))))
        return [got[b] if b in got else (self.forward(x, ctx), self._taken([x.shape[1]])[0])
                for b, (x, ctx) in enumerate(zip(hs, ctxs))]

    def _taken(self, lengths: list[int]) -> list:
        """The captured MoE input, per sequence (None in a layer without routed experts)."""
        return [None] * len(lengths) if self.capture is None else list(self._moe_x().split(lengths))

    def _moe_x(self) -> torch.Tensor:
        """The MoE input the capture kept [T, D], taken from it."""
        x, self.capture.x = self.capture.x, None
        return x.reshape(-1, x.shape[-1])


ATTENTION = ("full_attention", "sliding_attention")  # the layer types whose token mixer is attention


def layer_masks(config, layer_types, h: torch.Tensor, position_ids: torch.Tensor, cache) -> dict[str, Any]:
    """The attention mask of each layer type present (a model slice may lack a type, and transformers
    cannot build an attention mask over a cache without attention layers)."""
    from transformers import masking_utils as mu

    kw = dict(config=config, inputs_embeds=h, attention_mask=None, position_ids=position_ids, **cache_kw(cache))
    # without sliding layer types, a sliding_window applies to every attention layer (Qwen3-MoE, Mixtral)
    slide_all = getattr(config, "sliding_window", None) is not None and "sliding_attention" not in layer_types
    masks = {}
    for t in set(layer_types):
        if t == "linear_attention":
            masks[t] = mu.create_recurrent_attention_mask(**kw)
        elif t in ("moe", "mlp"):
            continue  # no token mixing, no mask
        elif t == "sliding_attention" or slide_all:
            masks[t] = mu.create_sliding_window_causal_mask(**kw)
        else:
            masks[t] = mu.create_causal_mask(**kw)
    return masks


def strip_routed(sparse: Callable[[int], bool], attr: str = "mlp") -> Callable[[nn.Module], None]:
    """The `strip` for build_hf_model: routed experts of sparse layers give way to StreamedExperts."""
    from sluice.models.build import StreamedExperts

    def strip(model: nn.Module) -> None:
        for i, layer in enumerate(model.model.layers):
            if sparse(i):
                getattr(layer, attr).experts = StreamedExperts()

    return strip


def attention_layers_kv(config, dtype_bytes: int, n_layers: int | None = None) -> int:
    """KV bytes per token of `n_layers` (default: all) standard attention layers."""
    from sluice.models.base import attention_kv_bytes

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return attention_kv_bytes(config.num_hidden_layers if n_layers is None else n_layers, config.num_key_value_heads, head_dim, dtype_bytes)


def swap_moe(layer: nn.Module, attr: str, capture_cls: type[MoECapture] = MoECapture) -> tuple[nn.Module, MoECapture]:
    """Put a MoECapture where layer.<attr> (the MoE module) was; return the MoE module and the capture."""
    moe = getattr(layer, attr)
    capture = capture_cls()
    setattr(layer, attr, capture)
    return moe, capture


# transformers' RMSNorm classes of these models whose formula kernels/norm.py computes -> its `round_first` (Llama's
# form: the normalised row rounded to the input's dtype before the weight; else the product rounded once); the
# (1 + weight) form of Qwen3-Next and Qwen3.5 stays transformers'
NORM_FORMS = {"Qwen3MoeRMSNorm": True, "MixtralRMSNorm": True, "DeepseekV3RMSNorm": True, "GptOssRMSNorm": False,
              "DeepseekV4RMSNorm": False}


# transformers' softmax top-k routers that kernels/router.py `softmax_router` computes: the logits in the router
# weight's dtype, softmax in fp32, top-k, normalised (Qwen3-MoE: as `norm_topk_prob` says); the weights returned in the
# logits' dtype (Qwen3-MoE) or fp32 (Mixtral)
SOFTMAX_ROUTERS = {"Qwen3MoeTopKRouter": True, "MixtralTopKRouter": False}


# transformers' decoder layers that are input_layernorm -> self_attn -> residual add -> post_attention_layernorm -> mlp ->
# residual add, each part a submodule of that name (their forward, transformers 5.2x): a sparse one's MoE input is taken
# from the parts where its attention is fused (`DecoderLayer.parts`)
PARTS_LAYERS = ("Qwen3MoeDecoderLayer", "MixtralDecoderLayer")


def _softmax_router(gate: nn.Module) -> Callable:
    from sluice.kernels.router import softmax_router

    in_logits_dtype = SOFTMAX_ROUTERS[type(gate).__name__]
    norm = getattr(gate, "norm_topk_prob", True)

    def route(x):
        out = torch.promote_types(x.dtype, gate.weight.dtype) if in_logits_dtype else torch.float32
        return softmax_router(x.reshape(-1, gate.hidden_dim), gate.weight, gate.top_k, norm, out)
    return route


class DecoderResident(ResidentModel):
    """Resident part of a model.embed_tokens / model.layers / model.norm / lm_head decoder.

    `sparse(i)` says whether layer i has routed experts; `make_block(moe_module, i, moe_index)`
    builds its MoEBlock from the (stripped) transformers MoE module; `capture` stands in its place."""

    def __init__(self, hf_model, sparse: Callable[[int], bool], make_block: Callable[[nn.Module, int, int], MoEBlock],
                 moe_attr: str = "mlp", capture: type[MoECapture] = MoECapture, whole_checked: bool = False):
        super().__init__(hf_model)
        self.whole_checked = whole_checked  # its architecture's whole step checked on a GPU (ResidentModel.whole_checked)
        types = getattr(self.config, "layer_types", None) or ["full_attention"] * self.config.num_hidden_layers
        self.layer_types = list(types)
        self.layers: list[Layer] = []
        self._gates: dict[int, nn.Module] = {}  # MoE layer -> its router module, for `fuse`
        moe_index = 0
        for i, layer in enumerate(hf_model.model.layers):
            if sparse(i):
                moe, cap = swap_moe(layer, moe_attr, capture)
                self._gates[i] = getattr(moe, "gate", None)
                self.layers.append(DecoderLayer(layer, types[i], make_block(moe, i, moe_index), cap))
                moe_index += 1
            else:
                self.layers.append(DecoderLayer(layer, types[i]))

    def fuse(self) -> None:
        """Its RMSNorms of a form kernels/norm.py has (`NORM_FORMS`) in one launch each, an attention's per-head norms
        and rotation in one (models/norm_rope.py), a one-token step's attention in one where the layer's shapes fit it
        (models/one_query.py; else SDPA as before), and its softmax routers (`SOFTMAX_ROUTERS`) in two
        (kernels/router.py)."""
        from dataclasses import replace

        from sluice.kernels.norm import RMSNorm
        from sluice.models.build import swap_modules
        from sluice.models.norm_rope import NormRopeAttention, use_norm_rope
        from sluice.models.one_query import use_one_query_attention

        swap_modules(self.hf, lambda m: type(m).__name__ in NORM_FORMS, lambda m: RMSNorm(m, NORM_FORMS[type(m).__name__]))
        use_norm_rope(self.hf)  # after the norms: it reads theirs
        use_one_query_attention(self.hf)
        for layer in self.layers:  # a sparse layer's MoE input from its parts, without the capture's zeros and their add
            if isinstance(layer, DecoderLayer):
                layer.parts = (type(layer.layer).__name__ in PARTS_LAYERS and layer.capture is not None
                               and isinstance(layer.layer.self_attn, NormRopeAttention))
        for layer in self.layers:
            gate = self._gates.get(layer.moe.layer) if layer.moe is not None else None
            if type(gate).__name__ in SOFTMAX_ROUTERS:
                layer.moe = replace(layer.moe, router=_softmax_router(gate))

    def begin(self, ids, cache, past) -> tuple[torch.Tensor, Any]:
        h = self.hf.model.embed_tokens(ids)
        position_ids = (torch.arange(ids.shape[1], device=ids.device) + past).unsqueeze(0)
        masks = layer_masks(self.config, self.layer_types, h, position_ids, cache)
        return h, Ctx(cache, position_ids, masks, self.position_embeddings(h, position_ids))

    def position_embeddings(self, h: torch.Tensor, position_ids: torch.Tensor) -> Any:
        """What the layers get as position_embeddings: the model's rotary (cos, sin) at position_ids [1,T],
        None where the layers make their own."""
        rotary = getattr(self.hf.model, "rotary_emb", None)
        return rotary(h, position_ids=position_ids) if rotary is not None else None

    def head(self, h):
        return self.hf.lm_head(self.hf.model.norm(h)[0]).float()


def swiglu_block(moe: nn.Module, layer_idx: int, moe_index: int, config, dtype: torch.dtype, finish=None, shared=None) -> MoEBlock:
    """The MoEBlock of a SwiGLU MoE whose router is `moe.gate` returning (logits, weights, ids) and whose
    routed outputs are summed in the activation dtype, as transformers' *Experts modules do."""
    from transformers.activations import ACT2FN

    gate = moe.gate
    return MoEBlock(
        layer=layer_idx, index=moe_index, kind="swiglu", top_k=config.num_experts_per_tok,
        num_experts=_num_experts(config), router=lambda x: gate(x)[1:], expert_input=lambda x: x,
        finish=finish or (lambda routed, x: routed), act=ACT2FN[config.hidden_act], act_name=config.hidden_act,
        combine_dtype=dtype, shared=shared,
    )


def _num_experts(config) -> int:
    for name in ("num_experts", "n_routed_experts", "num_local_experts"):
        n = getattr(config, name, None)
        if n:
            return n
    raise ValueError("config names no routed expert count")

