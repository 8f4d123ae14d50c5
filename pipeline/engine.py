"""The engine: resident model + stage graph + sequences; forward, generate, stream.

One token step (`_step`) reads as its docstring: embed, run each layer (resident modules for
mixers; the stage graph for MoE layers), head. The engine owns one asyncio event loop; public
methods are synchronous and drive it, so the engine is used from one thread at a time (the
server runs it on a worker thread of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

from sluice.errors import SluiceError, StepCancelled
from sluice.kernels.graphs import DecodeGraphs, FnGraphs
from sluice.log import get_logger
from sluice.models.base import ResidentModel
from sluice.pipeline.batch import check_batch, step_many
from sluice.pipeline.assemble import assemble
from sluice.pipeline.budget import MAX_PREFILL_CHUNK, cuda_index
from sluice.pipeline.config import EngineConfig
from sluice.pipeline.coordinator import Coordinator
from sluice.pipeline.routing import RoutingControl
from sluice.pipeline.runtime import Runtime
from sluice.pipeline.sampling import Sampler
from sluice.pipeline.sequence import Sequence
from sluice.pipeline.snapshot import Snapshot, take
from sluice.pipeline.states import StatePool
from sluice.pipeline.whole import WholeStep
from sluice.storage.store import ExpertStore


class Engine:
    def __init__(self, store: ExpertStore, model: ResidentModel, rt: Runtime, coordinator: Coordinator, config: EngineConfig,
                 prefill_chunk: int | None = None, routing: RoutingControl | None = None):
        self.store, self.model, self.rt, self.coordinator, self.config = store, model, rt, coordinator, config
        self.routing = routing  # controlled routing (`--routing`), or None: the model's own routers
        self.prefill_chunk = prefill_chunk or MAX_PREFILL_CHUNK  # longest prompt piece one step runs (`extend`)
        self.device = model.device
        graphs = self.device.type == "cuda" and config.resident_graphs
        self.graphs = DecodeGraphs(rt.pools) if graphs else None
        self._loop = asyncio.new_event_loop()
        self._images = None  # the ImageEncoder, built on first use
        # released sequences' caches, reset and handed out again: their graphs replay at once (pipeline/states.py)
        self.states = StatePool(lambda: model.new_cache(config.static_kv), self.device)
        # one-token steps: graph-safe MoE blocks as views whose pure functions replay CUDA graphs
        self.fn_graphs = FnGraphs(rt.pools) if graphs else None
        coordinator.bind(model, self.fn_graphs)
        # one-token steps replayed whole as one graph where nothing in them needs the host (pipeline/whole.py)
        refusal = "off" if config.whole_step is False else "CUDA graphs are off here (no GPU, or --eager)" if not graphs \
            else WholeStep.refusal(model, coordinator, rt, config.static_kv, config.whole_step)
        self.whole = WholeStep(model, coordinator, rt, routing) if refusal is None else None
        if refusal not in (None, "off"):  # a warning where it was asked for (--whole-step)
            log = get_logger().warning if config.whole_step else get_logger().debug
            log("one-token steps run layer by layer, not whole", why=refusal)

    @classmethod
    def open(cls, path: str | Path, progress: bool = True, **settings) -> "Engine":
        """Open a store, or a checkpoint (repacked once into SLUICE_HOME/stores). Settings: EngineConfig fields;
        sizes may be strings ('8GiB')."""
        store, model, rt, coordinator, config, routing = assemble(path, progress, settings)
        return cls(store, model, rt, coordinator, config, config.prefill_chunk, routing)

    # -- public, synchronous API ------------------------------------------------------------

    def new_sequence(self) -> Sequence:
        return Sequence(self.states.take(), [])

    def release(self, seq: Sequence) -> None:
        """Done with seq: its state's tensors go to the next sequence (reset), so that the graphs captured over them
        replay at once; seq can take no more steps. A broken sequence's state (a step failed in it) is only dropped."""
        if seq.cache is not None and not seq.broken:
            self.rt.streams.synchronize()  # its last step has finished with the tensors
            self.states.give(seq.cache)
        seq.cache = None

    def snapshot(self, seq: Sequence, device: str = "cpu") -> "Snapshot":
        """A copy of seq's state in host RAM (or `device`), restorable with `restore`."""
        return take(seq.tokens, seq.cache, device)

    def restore(self, snap: "Snapshot") -> Sequence:
        """A new sequence continuing exactly from a snapshot."""
        return Sequence(self.states.restore(snap), list(snap.tokens))

    def forward(self, input_ids: list[int]) -> torch.Tensor:
        """Logits [T, V] (fp32, CPU) for a fresh sequence of input_ids."""
        return self.extend(self.new_sequence(), input_ids).cpu()

    def extend(self, seq: Sequence, ids: list[int], images: torch.Tensor | None = None, last: bool = False,
               cancel: threading.Event | None = None) -> torch.Tensor:
        """Append ids to seq; returns their logits [T, V] fp32 on the device, or with `last` only the last
        position's [1, V] (what generation needs: the head then runs on one row). images: `encode_images`
        rows, one per image token in ids, in order; they replace those tokens' embeddings. A prompt longer
        than `prefill_chunk` runs as several steps of at most that many tokens (bounded activation memory; each
        step reads its experts once). Inside a step a Mamba-2 mixer takes the piece in runs of its `prefill_piece`.
        cancel: once set, the step stops at its next layer with StepCancelled (the sequence is then broken)."""
        n = self.prefill_chunk
        if len(ids) <= n:
            return self._run(seq, ids, images, "last" if last else "all", cancel)
        if images is not None:
            self._check_images(ids, images)
        token = self.image_encoder.image_token_id if images is not None else None
        logits = []
        for start in range(0, len(ids), n):
            part = ids[start : start + n]
            rows, images = split_image_rows(part, images, token)
            final = start + n >= len(ids)
            logits.append(self._run(seq, part, rows, "all" if not last else "last" if final else "none", cancel))
        return logits[-1] if last else torch.cat(logits)

    def extend_many(self, seqs: list[Sequence], pieces: list) -> list[torch.Tensor]:
        """Append pieces[b] (a token id, or a list of them: a decode token or a piece of a prompt) to seqs[b] in one
        step whose MoE layers run once over all the rows (pipeline/batch.py); each sequence's last-position logits
        [1, V] fp32 on the device. No image rows: a piece with images goes through `extend`."""
        pieces = [[p] if isinstance(p, int) and not isinstance(p, bool) else list(p) for p in pieces]
        check_batch(self.model, seqs, pieces, self.config.static_kv)
        with self._on_device(), attention_backends():
            try:
                return self._loop.run_until_complete(step_many(self, seqs, pieces))
            except BaseException:
                for s in seqs:
                    s.broken = True
                self._loop.run_until_complete(self.rt.recover())
                raise

    def _run(self, seq: Sequence, ids: list[int], images: torch.Tensor | None, head: str, cancel=None) -> torch.Tensor | None:
        with self._on_device(), attention_backends():
            return self._loop.run_until_complete(self._guarded_step(seq, ids, images, head, cancel))

    def _on_device(self):
        """The engine's GPU as the calling thread's current device (a server's engine thread starts on device 0): Triton
        launches, CUDA graphs and `Streams.use`, which does not switch devices, all take the current one."""
        if self.device.type == "cuda" and self.device.index is not None:
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def encode_images(self, pixel_values: torch.Tensor, image_grid_hw: torch.Tensor) -> torch.Tensor:
        """The image encoder's rows for a prompt's images (models/vision.py); attention without cuDNN, whose plan per
        new length would be built again for every image size (`attention_backends`)."""
        with self._on_device(), attention_backends():
            return self.image_encoder.encode(pixel_values, image_grid_hw)

    @property
    def image_encoder(self):
        """The store's ImageEncoder, built on first use (a SluiceError for a store without one): resident on the
        GPU when it fits twice over in the VRAM left (within the budget), else streamed layer by layer."""
        if self._images is None:
            from sluice.models.vision import ImageEncoder

            free = None
            if self.device.type == "cuda":
                index = cuda_index(self.device)
                limit = self.config.vram_budget or torch.cuda.get_device_properties(index).total_memory
                free = limit - torch.cuda.memory_reserved(index)
            if self.store.manifest.encoder is not None:  # checked against its checksum as the resident file is
                self.store.check_file(self.store.manifest.encoder, self.config.verify_checksums)
            self._images = ImageEncoder(self.store.path, self.store.manifest.encoder, self.device, self.model.dtype,
                                        self.config.image_encoder, free)
        return self._images

    def stream(self, input_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, stop_ids: tuple[int, ...] = (), seq: Sequence | None = None,
               images: torch.Tensor | None = None) -> Iterator[int]:
        """Yield new tokens one at a time: prefill input_ids (with `images` rows at their image tokens), then
        decode one token per step from the cache."""
        _check_ids(input_ids)
        own, seq = seq is None, seq or self.new_sequence()
        limit = self.config.static_kv
        if limit is not None and len(seq.tokens) + len(input_ids) + max_new_tokens - 1 > limit:
            raise SluiceError(f"{len(seq.tokens) + len(input_ids)} prompt tokens and up to {max_new_tokens} new ones need more "
                              f"than the static_kv cache's {limit} tokens (--static-kv)")
        sampler = Sampler(temperature, top_p, seed)
        logits = self.extend(seq, input_ids, images, last=True)
        for i in range(max_new_tokens):
            token = sampler(logits[-1])
            yield token
            if token in stop_ids or i == max_new_tokens - 1:
                break
            logits = self.extend(seq, [token])
        if own:  # a stream left early, or failed, leaves its state to the garbage collector
            self.release(seq)

    def generate(self, input_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop_ids: tuple[int, ...] = (), images: torch.Tensor | None = None) -> list[int]:
        """The new tokens (greedy when temperature is 0)."""
        return list(self.stream(input_ids, max_new_tokens, temperature, top_p, seed, stop_ids, images=images))

    def warm_up(self, prompt_tokens: int = 512, decode_tokens: int = 4) -> float:
        """Run one prompt of random ids and a few one-token steps on a sequence of its own, so that the first request
        does not pay for what a process does once (Triton compiling kernel variants: up to seconds a variant on a fresh
        machine; CUDA graph captures); the VRAM tier is then emptied. Seconds taken. The I/O counters include it. The
        prompt is cut to fit the model's context."""
        t = time.perf_counter()
        g = torch.Generator().manual_seed(0)
        context = getattr(self.model.config, "max_position_embeddings", None)
        n = max(1, min(prompt_tokens, context - decode_tokens if context else prompt_tokens))
        ids = torch.randint(3, self.model.config.vocab_size, (n,), generator=g).tolist()
        for _ in self.stream(ids, decode_tokens):
            pass
        self.empty_vram()
        return time.perf_counter() - t

    def empty_vram(self) -> None:
        """Forget the VRAM tier's blocks but a loaded hot set and leave it as at open (`sluice bench model`: a prompt
        on the tier as opened)."""
        self.rt.streams.synchronize()
        self.coordinator.empty_vram()
        if self.rt.vram is not None:
            self.rt.vram.clear()

    def drop_caches(self) -> None:
        """Empty the expert caches, RAM and VRAM tiers (a loaded hot set and the blocks a schedule holds for good
        stay), after in-flight reads land: the next steps read their blocks from disk (`sluice bench model --cold`)."""
        self.empty_vram()
        self._loop.run_until_complete(self.rt.recover())

    def close(self) -> None:
        self.coordinator.close()
        self.rt.close()
        self._loop.close()
        if self.config.vram_budget is not None and self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, cuda_index(self.device))

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the token step -----------------------------------------------------------------------

    async def _guarded_step(self, seq: Sequence, ids: list[int], images: torch.Tensor | None = None,
                            head: str = "all", cancel=None) -> torch.Tensor | None:
        seq.check(ids, self.config.static_kv, self.model.vocab)
        if images is not None:
            self._check_images(ids, images)
        try:
            return await self._step(seq, ids, images, head, cancel)
        except BaseException:
            seq.broken = True
            await self.rt.recover()
            raise

    def _check_images(self, ids: list[int], images: torch.Tensor) -> None:
        token = self.image_encoder.image_token_id
        n = sum(1 for i in ids if i == token)
        D = self.model.config.hidden_size
        if images.dim() != 2 or images.shape != (n, D):
            raise SluiceError(f"the prompt has {n} image tokens (id {token}); image rows must be [{n}, {D}], got {tuple(images.shape)}")

    async def _step(self, seq: Sequence, ids: list[int], images: torch.Tensor | None = None,
                    head: str = "all", cancel=None) -> torch.Tensor | None:
        """Run ids through the model: a one-token step as one graph replayed whole where it can be (`WholeStep`), else
        layer by layer (`_layers`). Returns logits: every position's [T, V] (`head` "all"), the last one's [1, V]
        ("last"), or None ("none": a prompt piece before the last)."""
        recorder = self.rt.recorder
        if recorder is not None:
            recorder.begin_step(len(ids))
        with torch.inference_mode():
            # a sequence's first step (a one-token prompt) runs as a prompt: a state handed out again holds the graphs of
            # later steps (pipeline/states.py)
            whole = self.whole if len(ids) == 1 and images is None and seq.tokens else None
            logits = whole.run(seq, ids[0]) if whole is not None else None
            if logits is None:
                seq.state_key = None  # a step layer by layer may place its state anew (a prompt's first update)
                logits = await self._layers(seq, ids, images, head, cancel)
        seq.tokens.extend(ids)
        if recorder is not None:
            recorder.end_step()
        self.rt.stats.steps += 1
        self.rt.stats.tokens += len(ids)
        self.rt.tracer.flush()
        return logits

    async def _layers(self, seq: Sequence, ids: list[int], images: torch.Tensor | None, head: str, cancel) -> torch.Tensor | None:
        """Embed ids (image rows in place of image tokens), run every layer (MoE layers through the stage graph), the
        head."""
        model = self.model
        h, ctx = model.begin(torch.tensor([ids], device=self.device), seq.cache, len(seq.tokens))
        if images is not None and images.shape[0]:
            mask = torch.tensor(ids, device=self.device) == self._images.image_token_id
            h[0, mask] = images.to(h.device, h.dtype)
        # a whole step's warm-up (a sequence's first one-token step) captures no per-layer graphs: the whole graph follows
        graphs = self.graphs if len(ids) == 1 and seq.tokens and (self.whole is None or self.whole.off) else None
        for i, layer in enumerate(model.layers):
            if cancel is not None and cancel.is_set():  # its client left: a long prefill stops here, not at its end
                raise StepCancelled(f"step cancelled at layer {i}")
            if layer.moe is not None:
                h = await self.coordinator.moe(i, layer, h, ctx, graphs is not None)
            else:
                h = graphs.run(i, layer, h, ctx) if graphs is not None else layer.forward(h, ctx)
        logits = None if head == "none" else model.head(h[:, -1:] if head == "last" else h)
        if self.routing is not None:
            self.routing.advance(len(ids))
        return logits


def split_image_rows(part: list[int], rows: torch.Tensor | None, token: int | None):
    """(the image rows of prompt piece `part`: the first ones, one per image token in it; the rest)."""
    if rows is None:
        return None, None
    k = sum(1 for i in part if i == token)
    return rows[:k], rows[k:]



def attention_backends():
    """The SDPA backends a step may use: flash, memory-efficient and math, not cuDNN. cuDNN builds an execution
    plan for every new query and key length, milliseconds of host time each, and decode gives every step a key
    length the process has not seen, so every attention layer would pay it every token."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _check_ids(ids: list[int]) -> None:
    if not ids:
        raise SluiceError("input_ids is empty")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise SluiceError("input_ids must be a list of ints")
