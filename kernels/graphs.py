"""CUDA graphs of one engine: their memory pools, resident layers' one-token steps whose state is updated in place
(`DecodeGraphs`), and the pure functions around a MoE layer's experts (`FnGraphs`).

Pools. The memory pools of the CUDA graphs one engine captures: one per stream, shared by all of that stream's graphs.

A graph's temporaries are dead once its replay ends, and replays on one stream never overlap, so graphs may reuse
each other's temporary memory (a pool per graph costs ~12 MB: a full Nemotron-3-Nano's graphs then outgrow an 8 GiB
budget). What must outlive a replay (outputs that later work reads) is copied inside the graph into buffers allocated
outside the pool; an output read only before the stream's next replay may stay in the pool.

Replays. A decode step of a Mamba-2 mixer is ~40 small kernels launched one by one from Python, each a few
microseconds of GPU work behind tens of microseconds of host work; replayed as one graph it is one
launch. A layer opts in through `Layer.decode_state(ctx)`: the tensors its one-token step reads and
writes in place (conv and SSM state), or None when that step cannot be replayed (attention over a
growing cache, a first step that allocates its state). A graph is captured right after an eager
step (which warms the layer up and gives that step's output; capture itself runs nothing) and
replayed while the state tensors stay where they were; a new sequence (new state tensors) captures
anew. Replays read the same weights and state the eager step would and run the same kernels, so
their output is bit-identical (tested on CUDA). A layer whose capture fails runs eagerly from then on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from sluice.log import get_logger


class GraphPools:
    """Invariant: one pool per (device, stream), alive as long as this object (a one-op graph keeps each: a pool whose
    last graph is freed cannot be used again). Owned by the engine's Runtime; every capture of that engine uses it."""

    def __init__(self) -> None:
        self._pools: dict[tuple, tuple[Any, torch.cuda.CUDAGraph]] = {}

    def current(self) -> Any:
        """The pool for graphs captured on the current stream."""
        s = torch.cuda.current_stream()
        key = (s.device, s.cuda_stream)
        found = self._pools.get(key)
        if found is None:
            pool, keeper = torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(keeper, pool=pool, capture_error_mode="thread_local"):
                torch.zeros(1, device=s.device)
            found = self._pools[key] = (pool, keeper)
        return found[0]





def capturing() -> bool:
    """Whether a graph is being captured on the current stream: a graph around these (pipeline/whole.py) takes their
    functions' kernels into itself, so they neither replay nor capture one of their own meanwhile."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _outside(like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Buffers for a graph's outputs, allocated before its capture (so not in the shared pool)."""
    return [torch.empty_like(t) for t in like]


@dataclass
class _Graph:
    key: tuple[int, ...]  # data_ptr of each state tensor at capture
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # static input
    y: torch.Tensor  # static output


class DecodeGraphs:
    def __init__(self, pools: GraphPools) -> None:
        self.pools = pools  # the engine's graph memory pools (kernels/graphs.py)
        self._graphs: dict[int, _Graph] = {}
        self._eager: set[int] = set()  # layers whose capture failed
        self.replays = 0
        self.captures = 0

    def run(self, i: int, layer, h: torch.Tensor, ctx) -> torch.Tensor:
        """Layer i on a one-token h [1,1,D]: replay its graph, or run it eagerly (and capture one)."""
        state = layer.decode_state(ctx) if i not in self._eager and not capturing() else None
        if state is None:
            return layer.forward(h, ctx)
        key = tuple(t.data_ptr() for t in state)
        g = self._graphs.get(i)
        if g is not None and g.key == key and g.x.shape == h.shape and g.x.dtype == h.dtype:
            g.x.copy_(h)
            g.graph.replay()
            self.replays += 1
            return g.y  # the static output: overwritten by this layer's next replay (the next token's), after its uses
        y = layer.forward(h, ctx)  # this step, eagerly: also the warm-up the capture needs
        self._graphs.pop(i, None)
        try:
            x = h.clone()
            (out,) = _outside([y])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pools.current(), capture_error_mode="thread_local"):
                out.copy_(layer.forward(x, ctx))
        except Exception as e:  # a layer that cannot be captured runs eagerly from then on
            self._eager.add(i)
            get_logger().warning("resident layer runs eagerly: its one-token step cannot be captured", layer=i, error=str(e)[:200])
            return y
        if tuple(t.data_ptr() for t in state) != key:  # the step moved its state: not replayable
            self._eager.add(i)
            return y
        self._graphs[i] = _Graph(key, graph, x, out)
        self.captures += 1
        return y

    def clear(self) -> None:
        self._graphs.clear()


class FnGraphs:
    """One-token calls of pure tensor functions (a MoE block's router, expert input, finish, shared term; the layer's
    MoE input) replayed as CUDA graphs, one per (name, argument shapes and dtypes).

    The first call runs eagerly (the warm-up), then the function is captured on static copies of its
    arguments. Replays return the graph's static outputs, valid until that graph's next replay: callers
    use them within the step (the next replay of the same name is the next token's). A function whose
    capture fails runs eagerly from then on."""

    def __init__(self, pools: GraphPools) -> None:
        self.pools = pools  # the engine's graph memory pools (kernels/graphs.py)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Any]] = {}
        self._eager: set[str] = set()
        self.replays = 0

    def wrap(self, fn: Callable, name: str) -> Callable:
        def call(*args: torch.Tensor):
            if name in self._eager or capturing():
                return fn(*args)
            key = (name,) + tuple((a.shape, a.dtype) for a in args)
            g = self._graphs.get(key)
            if g is not None:
                graph, static, out = g
                for s, a in zip(static, args):
                    s.copy_(a)
                graph.replay()
                self.replays += 1
                return out
            result = fn(*args)
            if all(_is_input(r, args) for r in _tensors(result)):
                self._eager.add(name)  # an identity (e.g. no latent projection): nothing to replay
                return result
            try:
                static = [a.clone() for a in args]
                keep = _outside(_tensors(result))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pools.current(), capture_error_mode="thread_local"):
                    for k, o in zip(keep, _tensors(fn(*static))):
                        k.copy_(o)
                out = tuple(keep) if isinstance(result, (tuple, list)) else keep[0]
            except Exception as e:
                self._eager.add(name)
                get_logger().warning("runs eagerly: its one-token call cannot be captured", fn=name, error=str(e)[:200])
                return result
            self._graphs[key] = (graph, static, out)
            return result

        return call

    def block(self, block, role: str):
        """`block` with its router, guess, expert input, finish and shared term replayed as graphs under names of this role."""
        tag = f"{role}:{block.layer}"
        shared = block.shared and self.wrap(block.shared, f"shared/{tag}")
        guess = block.guess and self.wrap(block.guess, f"guess/{tag}")
        return replace(block, router=self.wrap(block.router, f"router/{tag}"), guess=guess,
                       expert_input=self.wrap(block.expert_input, f"expert_input/{tag}"),
                       finish=self.wrap(block.finish, f"finish/{tag}"), shared=shared)


def _tensors(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _is_input(t: torch.Tensor, args) -> bool:
    return any(t.data_ptr() == a.data_ptr() and t.shape == a.shape for a in args)
