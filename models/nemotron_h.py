"""NemotronH: Mamba-2, attention and MoE layers; ReLU^2 non-gated experts, optional latent MoE.

Checkpoint names: backbone.layers.L.mixer.experts.E.{up_proj,down_proj}.weight are routed experts
(up [I, Dx], down [Dx, I]; Dx = moe_latent_size or hidden_size). Everything else (mixers, router
with e_score_correction_bias, shared expert, fc1/fc2 latent projections, norms, head) is resident
and runs as transformers' own modules. A layer is residual + mixer(norm(h)); for MoE layers the
mixer is: router on x, fc1_latent(x) -> routed experts -> fc2_latent, plus shared_experts(x).
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.models.base import (
    Architecture,
    ExpertSpec,
    LanguageModelOf,
    Layer,
    MoEBlock,
    ResidentModel,
    attention_kv_bytes,
    cache_kw,
    expert_names,
)
from sluice.models.build import StreamedExperts, build_hf_model, swap_modules
from sluice.models.decoder import Ctx, layer_masks
from sluice.models.rows import packed_call


class NemotronH(Architecture):
    model_type = "nemotron_h"
    renames = ((r"^backbone\.", "model."),)
    reverse_renames = ((r"^model\.", "backbone."),)

    def expert_spec(self, config) -> ExpertSpec:
        return ExpertSpec(
            kind="relu2",
            **expert_names("backbone.", "mixer.experts"),
            proj_names={"up_proj": "up", "down_proj": "down"},
            moe_layers=tuple(i for i, t in enumerate(config.layers_block_type) if t == "moe"),
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
        )

    def kv_bytes_per_token(self, config, dtype_bytes: int) -> int:
        n = sum(t == "full_attention" for t in config.layers_block_type)
        head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        return attention_kv_bytes(n, config.num_key_value_heads, head_dim, dtype_bytes)

    def recurrent_bytes(self, config, dtype_bytes: int) -> int:
        """Per Mamba-2 layer: the SSM state (heads x head_dim x state, in mamba_ssm_cache_dtype) and the
        conv state (conv_dim x conv_kernel, in the model dtype), as transformers' cache holds them."""
        n = sum(t == "linear_attention" for t in config.layers_block_type)
        ssm_bytes = 4 if str(getattr(config, "mamba_ssm_cache_dtype", "float32")) in ("float32", "torch.float32") else 2
        ssm = config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size * ssm_bytes
        conv_dim = config.mamba_num_heads * config.mamba_head_dim + 2 * config.n_groups * config.ssm_state_size
        return n * (ssm + conv_dim * config.conv_kernel * dtype_bytes)

    def prefill_scratch_bytes(self, config, tokens: int, broadcast: bool | None = None, fused: bool = False) -> int:
        """transformers' PyTorch Mamba-2 prefill (without mamba_ssm's kernels) contracts C and B per chunk through
        a broadcast product [chunks, chunk, chunk, heads, state] in fp32 in versions before its `mamba2_chunk_scan`
        (5.17: 2 GiB for a 512-token prompt of a Nemotron-3-Nano layer, more than an 8 GiB budget leaves;
        docs/benchmarks/2026-11-30.md); with it (einsums), three [chunks, chunk, chunk, heads] fp32 tensors; with
        `fused` (kernels/mamba.py's scan in its place: `scan_swapped`) none. `broadcast` None: the installed version's."""
        if not any(t in MAMBA for t in config.layers_block_type):
            return 0
        if broadcast is None:
            from transformers.models.nemotron_h import modeling_nemotron_h

            broadcast = not hasattr(modeling_nemotron_h, "mamba2_chunk_scan")
        if fused and not broadcast:  # the scan to swap is there: one launch, state in registers, no chunk tensors
            return 0
        cs = config.chunk_size
        per_chunk = cs * cs * config.mamba_num_heads * 4
        return -(-tokens // cs) * per_chunk * (config.ssm_state_size if broadcast else 3)

    def build(self, hf_config, tensors, device, dtype) -> ResidentModel:
        def strip(model: nn.Module) -> None:
            for block in model.model.layers:
                if block.block_type == "moe":
                    block.mixer.experts = StreamedExperts()

        return NemotronHResident(build_hf_model(self, hf_config, tensors, strip, device, dtype))


MAMBA = ("mamba", "linear_attention")  # a Mamba-2 mixer's block type: "mamba"; "linear_attention" in later transformers
NO_MIXING = ("mlp", "moe")  # block types whose mixer does not mix tokens


_SCAN_SWAP = threading.RLock()
_SCAN_KWARGS = {"chunk_size", "D", "dt_bias", "initial_states", "dt_softplus", "dt_limit", "return_final_states"}


@contextmanager
def _swapped(mixer, name: str, make):
    """The global `name` of the mixer's module (a function of transformers') replaced by make(original) for the
    duration of a call; a module without it keeps its own. One thread at a time swaps (a lock), and a transformers
    Mamba-2 model run by another thread meanwhile would get the swap too (the engine runs its layers on one thread)."""
    module = sys.modules[type(mixer).__module__]
    with _SCAN_SWAP:
        original = getattr(module, name, None)
        if original is None:
            yield
            return
        setattr(module, name, make(original))
        try:
            yield
        finally:
            setattr(module, name, original)


def scan_swapped(mixer):
    """transformers' Mamba-2 mixer with its chunked scan (`mamba2_chunk_scan` of its module, many small kernels a
    call in PyTorch, no mamba_ssm installed; docs/benchmarks/2026-12-01.md) replaced by kernels/mamba.py's
    one-launch scan for the duration of a call: the projections, the conv and its state, the gated norm and the cache's
    updates stay transformers' own. The same call in the transformers versions we run (5.17-5.25); a batch, a gate z
    inside the scan, or arguments it does not know (packed sequences) keep the original."""
    from sluice.kernels import triton_runs_on
    from sluice.kernels.mamba import chunk_scan

    def make(original):
        def scan(hidden_states, dt, A, B, C, *args, z=None, **kwargs):
            if (hidden_states.shape[0] != 1 or z is not None or args or not triton_runs_on(hidden_states.device)
                    or any(v is not None for k, v in kwargs.items() if k not in _SCAN_KWARGS)):
                return original(hidden_states, dt, A, B, C, *args, z=z, **kwargs)
            return chunk_scan(hidden_states, dt, A, B, C, **{k: v for k, v in kwargs.items() if k in _SCAN_KWARGS})
        return scan

    return _swapped(mixer, "mamba2_chunk_scan", make)


def conv_in_fp32(mixer):
    """transformers' causal depthwise conv of a prompt (`causal_conv1d_fn` of the mixer's module: F.conv1d in the
    model's dtype) given fp32 inputs for the duration of a call, its output rounded where transformers' conv rounds
    (before the activation; bit for bit): on a CPU a bf16 depthwise conv takes ~15 ms a call, ~200 ms off the main
    thread (as the server's worker runs it), fp32 ~0.1 ms. The same function in transformers 5.17-5.25."""
    from transformers.activations import ACT2FN

    def make(original):
        def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
            out = original(hidden_states.float(), weight.float(), None if bias is None else bias.float(), None, **kwargs)
            out = out.to(weight.dtype)
            return (ACT2FN[activation](out) if activation is not None else out).to(hidden_states.dtype)
        return conv

    return _swapped(mixer, "causal_conv1d_fn", make)


class _MixerLayer(Layer):
    def __init__(self, block):
        self.block = block

    def forward(self, h, ctx: Ctx):
        mask, n, T = ctx.masks.get(self.block.block_type), self.prefill_piece, h.shape[1]
        if T == 1 and (self.fused_decode or self.torch_mixer):
            states = self.decode_state(ctx)
            if states is not None:
                return self._one_step(h, *states)
        if n is None or T <= n or self.block.block_type not in MAMBA or (mask is not None and mask.dim() != 2):
            return self._call(h, mask, ctx.position_ids, ctx)
        # a Mamba-2 prefill in pieces (its scan's scratch grows with the prompt), the state carried between them
        return torch.cat([self._call(h[:, s : s + n], None if mask is None else mask[:, s : s + n], ctx.position_ids[:, s : s + n], ctx)
                          for s in range(0, T, n)], dim=1)

    def _call(self, h, mask, position_ids, ctx: Ctx):
        call = lambda: self.block(h, attention_mask=mask, position_ids=position_ids, use_cache=True, **cache_kw(ctx.cache))  # noqa: E731
        if self.fused_prefill and h.shape[1] > 1 and self.block.block_type in MAMBA:
            with scan_swapped(self.block.mixer):
                return call()
        if self.torch_mixer and self.block.block_type in MAMBA:
            with conv_in_fp32(self.block.mixer):
                return call()
        return call()

    def forward_rows(self, hs, ctxs):
        """Several sequences' rows at once. A Mamba-2 block's one-token steps: its norm and projections once over all
        their rows (one read of the weights), each sequence's conv and SSM step on its own states (updated in place,
        as a one-token step updates them), a prompt piece beside them as alone; an attention or MLP block's rows
        packed (`_packed`)."""
        if self.block.block_type not in MAMBA:
            return self._packed(hs, ctxs)
        states = [self.decode_state(ctx) if h.shape[1] == 1 else None for h, ctx in zip(hs, ctxs)]
        steps = [b for b, s in enumerate(states) if s is not None]
        if len(steps) < 2:
            return None
        from sluice.kernels.mamba import mamba_steps, mamba_steps_ref

        blk, m = self.block, self.block.mixer
        h = torch.cat([hs[b] for b in steps], dim=1)
        zx = m.in_proj(blk.norm(h.to(dtype=blk.norm.weight.dtype)))[0]
        conv, ssm = ([states[b][i] for b in steps] for i in (0, 1))
        # the states gathered for one launch (a copy each way: the caches hold them apart)
        many = torch.cat(conv), torch.cat(ssm)
        y = self._mix(mamba_steps if self.fused_decode else mamba_steps_ref, zx.contiguous(), *many)
        torch._foreach_copy_(conv + ssm, [*many[0].split(1), *many[1].split(1)])
        out = dict(zip(steps, (h + m.out_proj(y.view(1, len(steps), -1))).split(1, dim=1)))
        return [out[b] if b in out else self.forward(x, ctx) for b, (x, ctx) in enumerate(zip(hs, ctxs))]

    def _packed(self, hs, ctxs):
        """An attention or MLP block once over several sequences' rows packed together (models/rows.py), attention
        per sequence on its own cache; one sequence goes as alone (None)."""
        if len(hs) == 1:
            return None
        attention = self.block.mixer if self.block.block_type not in NO_MIXING else None
        return list(packed_call(self.block, attention, hs, ctxs, self.block.block_type).split([h.shape[1] for h in hs], dim=1))

    def _one_step(self, h, conv_state, ssm_state):
        """The block's one-token step with its Mamba-2 mixer between the projections in two Triton launches
        (kernels/mamba.py; `fused_decode`) or in its plain-torch step (`torch_mixer`), reading the module's own
        weights and the cache's states (updated in place)."""
        from sluice.kernels.gemv import linear_add
        from sluice.kernels.mamba import mamba_steps, mamba_steps_ref

        blk, m = self.block, self.block.mixer
        x = blk.norm(h.to(dtype=blk.norm.weight.dtype))
        zx = m.in_proj(x).reshape(-1)
        if not self.fused_decode:
            return h + m.out_proj(self._mix(mamba_steps_ref, zx[None], conv_state, ssm_state).view(1, 1, -1))
        return linear_add(m.out_proj, self._mix(mamba_steps, zx[None], conv_state, ssm_state).view(1, 1, -1), h)

    def _mix(self, steps, zx, conv_state, ssm_state):
        """The mixer between its projections for R tokens' zx [R, Z] of R sequences (kernels/mamba.py `mamba_steps` or
        its reference), on their conv and SSM states [R, ...], updated in place."""
        m = self.block.mixer
        return steps(zx, conv_state, m.conv1d.weight.squeeze(1), m.conv1d.bias, m.dt_bias, m.A_log, m.D, ssm_state,
                     m.norm.weight, m.norm.variance_epsilon, m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size,
                     m.intermediate_size // m.norm.group_size)

    def decode_state(self, ctx):
        """A Mamba-2 mixer's one-token step updates its conv and SSM states in place (kernels/graphs.py)."""
        i, kind = self.block.layer_idx, self.block.block_type
        if kind not in MAMBA or ctx.masks.get(kind) is not None or not ctx.cache.has_previous_state(i):
            return None
        states = ctx.cache.layers[i]
        if getattr(states, "record_past", False):
            return None
        return states.conv_states[0], states.recurrent_states[0]


class _MoELayer(Layer):
    def __init__(self, block, moe_index: int, config):
        from transformers.activations import ACT2FN

        self.block = block
        mixer = block.mixer
        self.moe = MoEBlock(
            layer=block.layer_idx,
            index=moe_index,
            kind="relu2",
            top_k=config.num_experts_per_tok,
            num_experts=config.n_routed_experts,
            router=_router(mixer.gate, config),
            ranked=_ranked(mixer.gate, config),
            expert_input=lambda x: mixer.fc1_latent_proj(x),  # looked up per call: fuse_linears may replace it
            finish=lambda routed, x: mixer.fc2_latent_proj(routed),
            shared=lambda x: mixer.shared_experts(x),  # looked up per call: fuse_linears may replace it
            act=ACT2FN[config.mlp_hidden_act],
            act_name=config.mlp_hidden_act,
            combine_dtype=torch.float32,
            graph_safe=True,
        )

    def moe_input(self, h, ctx):
        x = self.block.norm(h.to(dtype=self.block.norm.weight.dtype))
        return x.view(-1, x.shape[-1]), h

    def moe_input_rows(self, hs, ctxs):
        return self.moe_input(torch.cat(hs, dim=1), None)  # a norm: nothing mixes tokens


def _router(gate, config):
    """transformers' NemotronHTopkRouter as (weights, ids); with a single expert group (Nano, Super) its
    group mask keeps every expert, so the same arithmetic runs without the masking ops (fewer
    launches per call, identical results)."""
    if config.n_group != 1:
        return lambda x: gate(x)[1:]
    k, scale, norm = config.num_experts_per_tok, config.routed_scaling_factor, config.norm_topk_prob

    def route(x):
        scores = _scores(gate, x)
        ids = torch.topk(scores + gate.e_score_correction_bias, k=k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * scale, ids

    return route


def _fused_router(gate, config):
    """`_router` of a single expert group in two Triton launches (kernels/router.py): ids best first."""
    from sluice.kernels.router import sigmoid_router

    k, scale, norm = config.num_experts_per_tok, config.routed_scaling_factor, config.norm_topk_prob
    weight, bias = gate.weight.float(), gate.e_score_correction_bias.float()
    return lambda x: sigmoid_router(x.view(-1, gate.hidden_dim), weight, bias, k, scale, norm)


def _ranked(gate, config):
    """The n experts the router ranks first (its selection score, sigmoid plus the correction bias), best first; None
    with expert groups (their mask ranks within the chosen groups)."""
    if config.n_group != 1:
        return None

    def ranked(x, n):
        return torch.topk(_scores(gate, x) + gate.e_score_correction_bias, k=n, dim=-1, sorted=True)[1]

    return ranked


def _scores(gate, x):
    """The router's sigmoid scores [T, E], fp32."""
    return F.linear(x.view(-1, gate.hidden_dim).float(), gate.weight.float()).sigmoid()


class NemotronHResident(ResidentModel):
    whole_checked = True  # on an H100, 2026-12-06

    def __init__(self, hf_model):
        super().__init__(hf_model)
        self.layers = []
        moe_index = 0
        for block in hf_model.model.layers:
            if block.block_type == "moe":
                self.layers.append(_MoELayer(block, moe_index, self.config))
                moe_index += 1
            else:
                self.layers.append(_MixerLayer(block))

    def fuse(self) -> None:
        """Its RMSNorms in one launch each (kernels/norm.py), a one-token step's attention in one (models/one_query.py)
        and, with one expert group, its routers in two (kernels/router.py)."""
        from sluice.kernels.norm import RMSNorm
        from sluice.models.one_query import use_one_query_attention

        swap_modules(self.hf, lambda m: type(m).__name__ == "NemotronHRMSNorm", RMSNorm)
        use_one_query_attention(self.hf)
        if self.config.n_group == 1:
            for layer in self.layers:
                if layer.moe is not None:
                    layer.moe = replace(layer.moe, router=_fused_router(layer.block.mixer.gate, self.config))

    def fuse_linears(self) -> None:
        """The base's GEMVs, and each shared expert's ReLU^2 in its up projection's launch (kernels/gemv.py `Relu2MLP`)."""
        from sluice.kernels.gemv import Relu2MLP

        super().fuse_linears()
        swap_modules(self.hf, lambda m: type(m).__name__ == "NemotronHMLP"
                     and type(m.act_fn).__name__ == "ReLUSquaredActivation", Relu2MLP)

    def begin(self, ids, cache, past) -> tuple[torch.Tensor, Any]:
        h = self.hf.model.embeddings(ids)
        position_ids = (torch.arange(ids.shape[1], device=ids.device) + past).unsqueeze(0)
        masks = layer_masks(self.config, self.config.layers_block_type, h, position_ids, cache)
        return h, Ctx(cache, position_ids, masks, None)

    def head(self, h):
        h = self.hf.model.norm_f(h)
        return self.hf.lm_head(h[0]).float()


class NemotronHOmni(LanguageModelOf, NemotronH):
    """A NemotronH vision-language checkpoint (`nemotron_h_omni`, transformers 5.23+): the LM's tensors
    under language_model.backbone. / language_model.lm_head, routed experts streamed as in nemotron_h.
    The RADIO vision tower and its projector (checkpoint names vision_model.*, mlp1.*,
    vision_projector.*) are the image encoder, kept in the store's encoder.safetensors and run by
    models/vision.py. An audio tower, if any, is left out (audio input is not supported)."""

    model_type = "nemotron_h_omni"
    renames = ((r"^language_model\.backbone\.", "model."), (r"^language_model\.", ""))
    reverse_renames = ((r"^model\.", "language_model.backbone."), (r"^lm_head\.", "language_model.lm_head."))

    def expert_spec(self, config) -> ExpertSpec:
        text = config.get_text_config()
        return replace(super().expert_spec(text), **expert_names("language_model.backbone.", "mixer.experts"))

    ENCODER_PREFIXES = ("vision_model.", "mlp1.", "vision_projector.", "multi_modal_projector.", "vision_final_layernorm.")

    def encoder(self, config):
        return lambda name: name.startswith(self.ENCODER_PREFIXES)

    def ignored(self, config):
        lm = super().ignored(config)  # the LM's rule, on names within the LM
        return lambda name: not name.startswith("language_model.") or lm(name.removeprefix("language_model."))

    def build(self, hf_config, tensors, device, dtype) -> ResidentModel:
        return super().build(hf_config.get_text_config(), tensors, device, dtype)
