"""Errors Sluice raises for bad input. Each message names the culprit (file, key, layer, expert)."""


class SluiceError(Exception):
    """Base class: a problem with the user's input or environment, reported without a traceback."""


class CheckpointError(SluiceError):
    """A checkpoint folder is missing files, has malformed headers, or lacks expected tensors."""


class StoreError(SluiceError):
    """An expert store is missing, incomplete, from another source, or fails verification."""


class CorruptBlockError(StoreError):
    """An expert block read from the store does not match its checksum."""

    def __init__(self, layer: int, expert: int, detail: str):
        super().__init__(f"corrupt expert block: layer {layer}, expert {expert}: {detail}")
        self.layer = layer
        self.expert = expert


class ScheduleError(SluiceError):
    """A schedule YAML file is invalid: unknown keys, cycles, or inputs nothing produces."""


class ConfigError(SluiceError):
    """A user setting (size, device, budget) is invalid."""


class StepCancelled(SluiceError):
    """A step stopped part-way because its request was cancelled (the client left); its sequence is broken."""
