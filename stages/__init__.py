"""The stages of a MoE layer, one per file; a schedule picks and wires them by name."""

from sluice.stages.base import Stage, StageIO
from sluice.stages.combine import Combine
from sluice.stages.compute import Compute
from sluice.stages.direct import Direct
from sluice.stages.fetch import Fetch
from sluice.stages.h2d import H2D
from sluice.stages.predict import Predict
from sluice.stages.route import Route

STAGES: dict[str, type[Stage]] = {s.name: s for s in (Route, Predict, Fetch, H2D, Compute, Combine, Direct)}
REQUIRED = ("route", "fetch", "h2d", "compute", "combine")  # a streaming schedule's
ALONE = ("direct",)  # stages that run a MoE layer's whole step by themselves

__all__ = ["STAGES", "REQUIRED", "ALONE", "Stage", "StageIO"]
