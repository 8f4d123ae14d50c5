"""Sluice: run mixture-of-experts models larger than the GPU by streaming routed experts.

    engine = sluice.load("path/to/checkpoint-or-store", device="cuda", ram_cache="8GiB")
    logits = engine.forward([1, 2, 3])
    tokens = engine.generate([1, 2, 3], max_new_tokens=32)
"""

__version__ = "0.1.0"


def load(path, **kwargs):
    """Open a checkpoint (repacked once into a store) or a store; see `sluice.pipeline.engine.Engine.open`."""
    from sluice.pipeline.engine import Engine

    return Engine.open(path, **kwargs)


__all__ = ["load", "__version__"]
