"""DeepSeek-V4: attention then MoE in every layer, on `hc_mult` parallel residual streams h [1,T,H,D]
mixed by manifold-constrained hyper-connections (mHC). Attention is shared-KV MQA with learned sinks
over a sliding window plus, in CSA / HCA layers, compressed KV entries (one per compress_rates tokens;
CSA keeps the top-k its Lightning Indexer picks), all in transformers' own V4 cache layers. Layers
marked hash_moe route by a frozen token id -> experts table (tid2eid), the others by a sqrtsoftplus
router with a correction bias; each MoE adds a shared expert.

Checkpoint names are DeepSeek's (embed.weight, layers.L.attn.wq_a.weight, layers.L.ffn.gate.tid2eid,
hc_head_fn, head.weight, ...), bare or under model. as save_pretrained writes them; transformers' own
conversion table renames them to modules. Routed experts: [model.]layers.L.ffn.experts.E.{w1,w3,w2}.weight
(gate, up [I, D]; down [D, I]). The multi-token-prediction layers (mtp.*) are skipped.

A layer is transformers' own decoder layer with its MoE captured (zero output) and its ffn_hc wrapped
to keep `post`: the layer then returns comb^T h, the residual, and `finish` adds the MoE's share,
post [T,H,1] * (routed + shared(x)) [T,1,D], as the layer would.

The routed experts clamp gate <= swiglu_limit and |up| <= swiglu_limit before SiLU(gate) * up: their
MoEBlock carries that gate ("silu_clamped" in the Triton kernels, `glu` for the torch backend).
The released formats are read as shipped (kernels/formats.py): FP4 experts as I8 `weight` + F8_E8M0
`scale` [out, in/32] (MXFP4), FP8 linears as `weight` + block `scale` (E8M0 in the FP4 releases, F32 in
the FP8 ones), the grouped output projection wo_a as one QuantLinear per group. Unquantised weights
in BF16 / FP16 fail in transformers' own model as in Sluice (norms it keeps in fp32 feed
half-precision linears): they run in float32.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from functools import cache

import torch
from torch import nn

from sluice.models.base import Architecture, ExpertSpec, MoEBlock, ResidentModel, cache_kw
from sluice.models.build import build_hf_model
from sluice.models.decoder import Ctx, DecoderResident, strip_routed, swiglu_block

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


class DeepseekV4(Architecture):
    model_type = "deepseek_v4"
    attn_implementation = "eager"  # transformers' only V4 attention (sinks, compressed entries)

    def expert_spec(self, config) -> ExpertSpec:
        return ExpertSpec(
            kind="swiglu",
            pattern=re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.ffn\.experts\.(?P<expert>\d+)\."
                               r"(?P<proj>\w+?)\.(?P<suffix>weight\w*|input_\w+|scale)$"),
            template="layers.{layer}.ffn.experts.{expert}.{proj}.{suffix}",
            proj_names={"w1": "gate", "w3": "up", "w2": "down"},
            moe_layers=tuple(range(config.num_hidden_layers)),
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
        )

    def module_name(self, checkpoint_name: str) -> str:
        """transformers' renames (conversion_mapping.py), then under model. but for the head:
        layers.0.attn.wq_a.weight -> model.layers.0.self_attn.q_a_proj.weight, head.weight -> lm_head.weight."""
        name = checkpoint_name.removeprefix("model.")
        for renaming in _renamings():
            name = renaming.rename_source_key(name)[0]
        return name if name.startswith("lm_head.") else f"model.{name}"

    def kv_bytes_per_token(self, config, dtype_bytes: int) -> int:
        """Compressed entries: a CSA layer keeps a head_dim entry and an index_head_dim indexer key per
        compress_rates[CSA] tokens, an HCA layer a head_dim entry per compress_rates[HCA] tokens."""
        rates = config.compress_rates
        per_token = {CSA: (config.head_dim + config.index_head_dim) / rates[CSA], HCA: config.head_dim / rates[HCA]}
        return math.ceil(sum(per_token.get(t, 0) for t in config.layer_types) * dtype_bytes)

    def recurrent_bytes(self, config, dtype_bytes: int) -> int:
        """Per layer the sliding window's keys (K = V, one head, window - 1 tokens); per compressing layer at
        most rate - 1 source tokens waiting for their window (kv and gate: 2 x head_dim for HCA, 2 x 2 x
        (head_dim + index_head_dim) for CSA and its indexer) and CSA's previous-window overlap (kv and gate,
        rate x (head_dim + index_head_dim) each)."""
        hd, ihd, rates = config.head_dim, config.index_head_dim, config.compress_rates
        total = config.num_hidden_layers * (config.sliding_window - 1) * hd
        for t in config.layer_types:
            if t == HCA:
                total += (rates[t] - 1) * 2 * hd
            elif t == CSA:
                total += ((rates[t] - 1) * 4 + rates[t] * 2) * (hd + ihd)
        return total * dtype_bytes

    def build(self, hf_config, tensors, device, dtype) -> ResidentModel:
        return DeepseekV4Resident(build_hf_model(self, hf_config, tensors, strip_routed(lambda i: True), device, dtype))


@cache
def _renamings() -> tuple:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    return tuple(t for t in get_checkpoint_conversion_mapping("deepseek_v4") if isinstance(t, WeightRenaming))


class PostCapture(nn.Module):
    """Stands where a layer's ffn_hc was: runs it and keeps `post` [1,T,H], the weights that place the
    MoE output on the streams."""

    def __init__(self, hc: nn.Module):
        super().__init__()
        self.hc = hc
        self.post: torch.Tensor | None = None

    def forward(self, h: torch.Tensor):
        post, comb, collapsed = self.hc(h)
        self.post = post
        return post, comb, collapsed


class DeepseekV4Resident(DecoderResident):
    """Layers run on streams h [1,T,H,D]; the hash routers read the step's token ids (kept by `begin`)."""

    batchable = False  # those ids and each layer's `post` are one sequence's

    def __init__(self, hf_model):
        self.ids: torch.Tensor | None = None
        for layer in hf_model.model.layers:
            layer.ffn_hc = PostCapture(layer.ffn_hc)
        dt = hf_model.lm_head.weight.dtype
        super().__init__(hf_model, lambda i: True, lambda moe, i, k: self._block(moe, i, k, dt))

    def _block(self, moe: nn.Module, i: int, k: int, dtype: torch.dtype) -> MoEBlock:
        hc, shared, streams = self.hf.model.layers[i].ffn_hc, moe.shared_experts, self.config.hc_mult

        def finish(routed, x):
            post, hc.post = hc.post, None
            return post.to(dtype).view(-1, streams, 1) * (routed + shared(x)).unsqueeze(1)

        block = swiglu_block(moe, i, k, self.config, dtype, finish=finish)
        limit = float(self.config.swiglu_limit)
        if math.isfinite(limit):  # the routed experts clamp gate above and up both ways (DeepseekV4Experts._apply_gate)
            act = block.act

            def glu(g, u):
                return act(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)

            block = replace(block, act_name="silu_clamped", glu=glu, act_args=(0.0, limit))
        if moe.is_hash:
            gate = moe.gate
            block = replace(block, router=lambda x: gate(x, self.ids)[1:])
        return block

    def begin(self, ids, cache, past):
        """The embedding on every stream: h [1,T,H,D]."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        e = self.hf.model.embed_tokens(ids)
        position_ids = (torch.arange(ids.shape[1], device=ids.device) + past).unsqueeze(0)
        # every V4 layer type attends through the sliding window (compressed entries bring their own bias)
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=e, attention_mask=None,
                                                 position_ids=position_ids, **cache_kw(cache))
        self.ids = ids
        h = e.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        return h, Ctx(cache, position_ids, dict.fromkeys(self.layer_types, mask), self.position_embeddings(e, position_ids))

    def position_embeddings(self, h, position_ids):
        """A rotary (cos, sin) per rope type: "main" for sliding layers, "compress" for CSA / HCA ones."""
        rotary = self.hf.model.rotary_emb
        return {t: rotary(h, position_ids=position_ids, layer_type=t) for t in rotary.layer_types}

    def head(self, h):
        model = self.hf.model
        return self.hf.lm_head(model.norm(model.hc_head(h))[0]).float()
