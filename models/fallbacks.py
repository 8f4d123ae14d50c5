"""transformers' notices that an optional kernel package is missing, said once at load instead of mid-text.

transformers logs "`fn` is falling back to its reference PyTorch implementation because `pkg` is not
installed ... install `pkg`" the first time each such function runs: during the first prompt, in the
middle of the text a terminal is streaming. Those packages (mamba_ssm, causal_conv1d, flash-linear-attention)
are CUDA builds, so on a CPU the advice is wrong. `announce_fallbacks` drops the notices and, on a GPU,
names the missing packages in one log line while the model loads.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import re

import torch
from torch import nn

from sluice.log import get_logger

NOTICE = "is falling back to its reference PyTorch implementation"
HUB_LOGGER = "transformers.integrations.hub_kernels"  # where transformers logs the notice
# how transformers' modeling files declare such a function: the decorator names the function and its package
DECLARED = re.compile(r"use_kernel_func_from_hub_with_fallback\(\s*[\"'](\w+)[\"']\s*,\s*[\"'](\w+)[\"']")


class DropFallbackNotices(logging.Filter):
    """Refuses the log records of transformers' kernel-fallback notice; lets every other record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return NOTICE not in record.getMessage()


def missing_kernels(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The optional packages `model`'s modeling file would use and that are not installed: package -> functions."""
    try:
        source = inspect.getsource(inspect.getmodule(type(model)))
    except (OSError, TypeError):  # no source to read (a frozen install): nothing to name
        return {}
    found: dict[str, list[str]] = {}
    for fn, package in DECLARED.findall(source):
        if importlib.util.find_spec(package) is None:
            found.setdefault(package, []).append(fn)
    return {p: tuple(dict.fromkeys(fns)) for p, fns in found.items()}


def announce_fallbacks(model: nn.Module, device: torch.device) -> None:
    """Silence the mid-generation notices (idempotent); on a GPU, log the missing packages now, before any text."""
    hub = logging.getLogger(HUB_LOGGER)
    if not any(isinstance(f, DropFallbackNotices) for f in hub.filters):
        hub.addFilter(DropFallbackNotices())  # the logger is transformers' process-wide one: one filter for all engines
    if device.type != "cuda":
        return  # the packages are CUDA builds: naming them on a CPU would be wrong advice
    missing = missing_kernels(model)
    if missing:
        get_logger().info("optional kernel packages not installed; transformers' PyTorch reference runs where Sluice's "
                          "kernels do not replace it", packages=", ".join(sorted(missing)),
                          functions=", ".join(f for fns in missing.values() for f in fns))
