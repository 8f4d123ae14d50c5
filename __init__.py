"""Sluice: run mixture-of-experts models larger than the GPU by streaming routed experts.

    engine = sluice.load("path/to/checkpoint-or-store", device="cuda", ram_cache="8GiB")
    logits = engine.forward([1, 2, 3])
    tokens = engine.generate([1, 2, 3], max_new_tokens=32)
"""

__version__ = "0.1.0"


def _off_the_path() -> None:
    """The repository root is this package: on sys.path (Python started in it) its kernels/ would shadow the
    `kernels` distribution transformers imports, so the root leaves the path; the package comes by its own name."""
    import os
    import sys

    here = os.path.realpath(os.path.dirname(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]


_off_the_path()


def load(path, **kwargs):
    """Open a checkpoint (repacked once into a store) or a store; see `sluice.pipeline.engine.Engine.open`."""
    from sluice.pipeline.engine import Engine

    return Engine.open(path, **kwargs)


__all__ = ["load", "__version__"]
