"""What an architecture file provides, and the shared code that builds the resident model.

Shape legend (used in every docstring below and in stages/ and kernels/):
    T  tokens in the step            K  routed experts per token (top-k)
    D  hidden size                   Dx expert input size (D, or the latent size for latent MoE)
    I  expert intermediate size      E  routed experts per MoE layer      V  vocabulary

An architecture file says three things: which checkpoint tensors are routed experts (`ExpertSpec`),
how a layer runs around its routed experts (`Layer`, `MoEBlock`), and how the step begins and ends
(`ResidentModel.begin`, `.head`). Everything except routed experts is transformers' own module,
built on the meta device, stripped of its routed experts, then filled from resident.safetensors (models/build.py).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from sluice.errors import ConfigError
from sluice.kernels.add import residual_add
from sluice.models.build import swap_modules

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
ExpertKind = str  # "relu2": down(act(up x)); "swiglu": down(act(gate x) * up x)


@dataclass(frozen=True)
class ExpertSpec:
    """Which checkpoint tensors are routed experts, and the order of projections inside a block.

    `pattern` matches a full checkpoint tensor name and captures `layer`, `expert`, `proj` (the
    checkpoint's projection name) and `suffix` (weight, weight_scale, ...). `proj_names` maps the
    checkpoint's projection names to block names (up, gate, down). `template` writes a name back
    (synthetic checkpoints), with the first checkpoint name `proj_names` gives each projection.
    Checkpoints that fuse all of a layer's experts into one tensor give `split`: (name, tensor) ->
    its per-expert parts [(layer, expert, block proj, suffix, TensorPart)], or None for other tensors.
    """

    kind: ExpertKind
    pattern: re.Pattern
    template: str  # "...layers.{layer}....experts.{expert}.{proj}.{suffix}"
    proj_names: dict[str, str]
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    split: Callable[[str, Any], list[tuple[int, int, str, str, Any]] | None] | None = None

    @property
    def projs(self) -> tuple[str, ...]:
        return ("up", "down") if self.kind == "relu2" else ("gate", "up", "down")

    @property
    def relaid(self) -> frozenset[str]:
        """Projections whose bytes the store re-lays: ReLU^2 `down`, so live 16-neuron groups are contiguous."""
        return frozenset({"down"}) if self.kind == "relu2" else frozenset()

    def name(self, layer: int, expert: int, proj: str, suffix: str = "weight") -> str:
        """The checkpoint name of block projection `proj` (up, gate, down) of one expert."""
        ckpt_proj = next(k for k, v in self.proj_names.items() if v == proj)
        return self.template.format(layer=layer, expert=expert, proj=ckpt_proj, suffix=suffix)


@dataclass(frozen=True)
class MoEBlock:
    """One MoE layer as the stage graph sees it. All callables take and return 2-D tensors [T, ...]."""

    layer: int  # index among all model layers
    index: int  # index among MoE layers (0 .. n_moe-1)
    kind: ExpertKind
    top_k: int
    num_experts: int
    router: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # x [T,D] -> (weights [T,K] as the router makes them, ids [T,K] i64)
    expert_input: Callable[[torch.Tensor], torch.Tensor]  # x [T,D] -> xe [T,Dx]
    finish: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (routed [T,Dx], x [T,D]) -> out [T,D], before the residual
    act: Callable[[torch.Tensor], torch.Tensor]
    act_name: str  # the activation's name in transformers' ACT2FN, or "gpt_oss_glu" (kernels/decode.py ACTS)
    combine_dtype: torch.dtype  # dtype in which weighted expert outputs are summed
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (gate out, up out) -> h, when not act(gate) * up
    act_args: tuple[float, float] = (0.0, 0.0)  # the Triton kernels' (alpha, limit) for "gpt_oss_glu" / "silu_clamped"
    # x [T,D] -> a term of the layer's output that needs x alone (a shared expert, gated or not), added to finish's:
    # out = finish(routed, x) + shared(x). Stages may run it before or beside the routed experts (it waits for none of
    # them): the route stage while the host waits for the ids, the fast path's route (via: table) on a side stream
    shared: Callable[[torch.Tensor], torch.Tensor] | None = None
    # router, expert_input, finish, shared and the layer's moe_input are pure functions of their tensor arguments
    # (no state read or written, no host sync; moe_input does not read its ctx): their one-token calls
    # may be replayed as CUDA graphs (kernels/graphs.py FnGraphs)
    graph_safe: bool = False
    # x [T,D], n -> ids [T,n] i64: the n experts the router ranks first, best first (the top_k it routes to among
    # them, ties aside), for reading guesses beyond the top-k (fetch's `guess_extra`, via: table); None: not offered
    ranked: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    # x [T,D] -> (weights [T,K], ids [T,K] i64) as `router` gives them: this layer's experts guessed from an earlier
    # MoE layer's input (the predict stage, direct's lookahead); None: the router itself on that input (`guessed`)
    guess: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    def guessed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's experts guessed from another layer's input x [T,D]: (weights, ids) as the router gives them."""
        return (self.guess or self.router)(x)

    def output(self, residual: torch.Tensor, routed: torch.Tensor, x: torch.Tensor,
               shared: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output h [1,T,D] from the routed sum [T,Dx]: residual + (finish + the shared term (`shared` where
        a stage has computed it already)), the two adds in one launch on a GPU (kernels/add.py)."""
        if self.shared is not None and shared is None:
            shared = self.shared(x)
        return residual_add(residual, self.finish(routed, x), shared)


class Layer(ABC):
    """One model layer. MoE layers split into `moe_input` (resident) + the stage graph + residual add."""

    moe: MoEBlock | None = None
    # the longest run of a prompt's tokens a layer whose prefill scratch grows with the prompt (a Mamba-2 mixer)
    # takes at once; longer prompts pass through it in pieces, its state carried between them (set by the engine)
    prefill_piece: int | None = None
    # one-token steps of a Mamba-2 mixer through kernels/mamba.py (set by the engine from EngineConfig.fused_mamba)
    fused_decode: bool = False
    # prompts' Mamba-2 selective scan through kernels/mamba.py's one-launch scan (set by the engine with fused_decode)
    fused_prefill: bool = False
    # a Mamba-2 mixer on a CPU (the engine's default there): one-token steps through kernels/mamba.py's plain-torch step
    # and prompts' depthwise conv in fp32, not transformers' bf16 conv (milliseconds a call, ~10 x more off the main
    # thread)
    torch_mixer: bool = False

    def forward(self, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        """A whole non-MoE layer on h [1,T,D]."""
        raise NotImplementedError

    def moe_input(self, h: torch.Tensor, ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before the routed experts. Returns (x [T,D] the MoE input, residual [1,T,D])."""
        raise NotImplementedError

    def forward_rows(self, hs: list[torch.Tensor], ctxs: list) -> list[torch.Tensor] | None:
        """Several sequences' one-token steps h [1,1,D] at once (pipeline/batch.py), each on its own state; None (the
        default) where the layer runs them one sequence at a time."""
        return None

    def moe_input_rows(self, hs: list[torch.Tensor], ctxs: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`moe_input` of several sequences' rows hs [1, T_b, D] at once: (x [sum(T_b), D], residual [1, sum(T_b), D]);
        None (the default) where the layer takes them one sequence at a time."""
        return None

    def decode_state(self, ctx: Any) -> tuple[torch.Tensor, ...] | None:
        """The tensors a one-token `forward` reads and updates in place besides h, when that step may be
        replayed as a CUDA graph (kernels/graphs.py); None (the default) when it may not."""
        return None


class ResidentModel(ABC):
    """The resident part of a model on one device, with routed experts removed."""

    layers: list[Layer]

    def __init__(self, hf_model: nn.Module):
        self.hf = hf_model  # transformers' CausalLM, routed experts stripped
        self.config = hf_model.config
        self.device = hf_model.lm_head.weight.device
        self.dtype = hf_model.lm_head.weight.dtype

    # whether several sequences' one-token steps may share a MoE layer's pass (pipeline/batch.py): False where the
    # model keeps one step's state between a layer's parts (DeepSeek-V4: the token ids, the mHC weights)
    batchable = True
    # whether its one-token step, over a static cache, has been checked on a GPU to replay whole as one CUDA graph with
    # the layer-by-layer step's logits (pipeline/whole.py; tests/test_whole.py with SLUICE_TEST_DEVICE=cuda): where not,
    # whole steps run only when asked for (`whole_step=True`)
    whole_checked = False

    def new_cache(self, static: int | None = None) -> Any:
        """A fresh KV / recurrent-state cache for one sequence (transformers' own, per the config's layer types):
        growing, or with `static` its attention preallocated for that many tokens (StaticCache)."""
        from transformers import DynamicCache, StaticCache

        if static is None:
            return DynamicCache(config=self.config)
        from sluice.models.static_cache import windowed

        try:
            return windowed(StaticCache(config=self.config, max_cache_len=static))
        except KeyError as e:  # a layer type transformers has no static layer for
            raise ConfigError(f"static_kv: transformers' StaticCache cannot hold this model's {e.args[0]} layers "
                              f"({self.config.model_type}); leave static_kv off") from None

    def fuse(self) -> None:
        """Put Triton kernels in place of the small ops this model's one-token steps are made of (its RMSNorms, its
        routers), where it has them; the default has none."""

    def fuse_linears(self) -> None:
        """Every resident nn.Linear of a 16- or 32-bit float weight through the one-launch GEMV for one-row inputs
        (kernels/gemv.py `Gemv`)."""
        from sluice.kernels.gemv import Gemv

        swap_modules(self.hf, lambda m: type(m) is nn.Linear and m.weight.dtype.is_floating_point
                     and m.weight.element_size() >= 2, Gemv)

    @property
    def vocab(self) -> int | None:
        """The input embedding's rows: the token ids a step may take (None where the model has no plain table)."""
        return getattr(self.hf.get_input_embeddings(), "num_embeddings", None)

    def embed_on_host(self, pin: bool) -> bool:
        """The input embedding's table moved to (with `pin`, pinned) RAM (kernels/embed.py `HostEmbedding`), its VRAM
        given back to the device for expert slots (before the budget caps the allocator); False where it stays: a head
        tied to it (the head reads the whole table every token), or no nn.Embedding."""
        from sluice.kernels.embed import HostEmbedding

        emb, head = self.hf.get_input_embeddings(), self.hf.get_output_embeddings()
        if type(emb) is not nn.Embedding or (head is not None and head.weight is emb.weight):
            return False
        self.hf.set_input_embeddings(HostEmbedding(emb, pin))
        if pin:
            torch.cuda.empty_cache()  # the freed segment, which the allocator would otherwise keep
        return True

    @abstractmethod
    def begin(self, ids: torch.Tensor, cache: Any, past: int | torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Embed ids [1,T] at positions past..past+T-1 (`past` a host int, or a device int64 scalar: a step captured
        whole reads it at each replay, pipeline/whole.py). Returns (h [1,T,D], ctx for the layers)."""

    @abstractmethod
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: h [1,T,D] -> logits [T,V] fp32."""

    @property
    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.moe for layer in self.layers if layer.moe is not None]


class Architecture(ABC):
    """One model family. Subclasses live one per file in models/."""

    model_type: str
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint name -> transformers module name (regex, repl)
    reverse_renames: tuple[tuple[str, str], ...] = ()  # transformers module name -> checkpoint name
    attn_implementation: str = "sdpa"  # transformers' attention backend for the resident model

    @abstractmethod
    def expert_spec(self, hf_config: Any) -> ExpertSpec: ...

    @abstractmethod
    def build(self, hf_config: Any, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype | None) -> ResidentModel: ...

    def kv_bytes_per_token(self, hf_config: Any, dtype_bytes: int) -> int:
        """Attention KV cache bytes per token of context (attention layers only)."""
        return 0

    def recurrent_bytes(self, hf_config: Any, dtype_bytes: int) -> int:
        """Recurrent state bytes per sequence (Mamba / DeltaNet conv and SSM states)."""
        return 0

    def prefill_scratch_bytes(self, hf_config: Any, tokens: int, fused: bool = False) -> int:
        """The largest temporary one resident layer allocates for a `tokens`-token prompt chunk, beyond the
        activations' own size (the VRAM budget's reserve must hold it), with Sluice's fused Mamba-2 kernels or
        without them; 0 where nothing stands out."""
        return 0

    def encoder(self, hf_config: Any) -> Callable[[str], bool]:
        """Which checkpoint tensors are a vision-language model's image encoder (the store keeps them in
        encoder.safetensors, models/vision.py runs them); none for a language model."""
        return lambda name: False

    def ignored(self, hf_config: Any) -> Callable[[str], bool]:
        """Which checkpoint tensors are not part of the LM: layers past num_hidden_layers (multi-token
        prediction heads) and what transformers' model class ignores on load (e.g. NemotronH's mtp.*)."""
        from transformers import AutoModelForCausalLM

        cls = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
        patterns = [re.compile(p) for p in (getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or [])]
        n_layers = hf_config.num_hidden_layers

        def ignore(name: str) -> bool:
            m = _LAYER.search(name)
            return (m is not None and int(m[1]) >= n_layers) or any(p.search(name) for p in patterns)

        return ignore

    def module_name(self, checkpoint_name: str) -> str:
        for pattern, repl in self.renames:
            checkpoint_name = re.sub(pattern, repl, checkpoint_name)
        return checkpoint_name

    def checkpoint_name(self, module_name: str) -> str:
        for pattern, repl in self.reverse_renames:
            module_name = re.sub(pattern, repl, module_name)
        return module_name


class LanguageModelOf:
    """Mixin for a vision-language config whose language model is an architecture Sluice runs: the
    memory figures and the ignore rule are the LM's, read from its text config (a text config is its
    own text config, so the same class serves both)."""

    def kv_bytes_per_token(self, hf_config: Any, dtype_bytes: int) -> int:
        return super().kv_bytes_per_token(hf_config.get_text_config(), dtype_bytes)

    def recurrent_bytes(self, hf_config: Any, dtype_bytes: int) -> int:
        return super().recurrent_bytes(hf_config.get_text_config(), dtype_bytes)

    def prefill_scratch_bytes(self, hf_config: Any, tokens: int, fused: bool = False) -> int:
        return super().prefill_scratch_bytes(hf_config.get_text_config(), tokens, fused=fused)

    def ignored(self, hf_config: Any) -> Callable[[str], bool]:
        return super().ignored(hf_config.get_text_config())


def attention_kv_bytes(n_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of every attention layer for one token."""
    return n_layers * 2 * kv_heads * head_dim * dtype_bytes


def cache_kw(cache: Any) -> dict:
    """The cache keyword of transformers' forward functions: `cache` from 5.2x on, `past_key_values` before."""
    return {_CACHE_KW: cache}


def _cache_keyword() -> str:
    import inspect

    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


_CACHE_KW = _cache_keyword()


def expert_names(prefix: str, experts_path: str) -> dict:
    """pattern and template of per-expert tensors named {prefix}layers.L.{experts_path}.E.PROJ.SUFFIX."""
    return dict(
        pattern=re.compile(rf"^{re.escape(prefix)}layers\.(?P<layer>\d+)\.{re.escape(experts_path)}\.(?P<expert>\d+)\."
                           rf"(?P<proj>\w+?)\.(?P<suffix>weight\w*|input_\w+)$"),
        template=f"{prefix}layers.{{layer}}.{experts_path}.{{expert}}.{{proj}}.{{suffix}}",
    )
