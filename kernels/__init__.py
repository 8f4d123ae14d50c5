"""Expert kernels. Each kernel has a plain-torch reference (`*_ref`) beside it and a test against it."""


def triton_runs_on(device) -> bool:
    """Whether Triton kernels can run on `device`: CUDA, or a CPU under the interpreter (TRITON_INTERPRET=1)."""
    import os

    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
