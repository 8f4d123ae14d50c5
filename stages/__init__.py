"""The stages of a MoE layer, one per file; a schedule picks and wires them by name, and each name's variant by `via`.

`via: cache` (the default) is the streaming stages: blocks found through the host's caches, read and copied as they
land, the layer's graph run by the coordinator. `via: table` is the fast path's: each block read where it lies
through a device table (stages/table.py), a one-token step composed from the stages' GPU-only faces and captured
(pipeline/plan.py). combine is the same stage in both.
"""

from sluice.stages.base import Stage, StageIO
from sluice.stages.combine import Combine
from sluice.stages.compute import Compute
from sluice.stages.compute_table import ComputeTable
from sluice.stages.fetch import Fetch
from sluice.stages.fetch_table import FetchTable
from sluice.stages.h2d import H2D
from sluice.stages.h2d_table import H2DTable
from sluice.stages.predict import Predict
from sluice.stages.predict_table import PredictTable
from sluice.stages.route import Route
from sluice.stages.route_table import RouteTable

STAGES: dict[str, type[Stage]] = {s.name: s for s in (Route, Predict, Fetch, H2D, Compute, Combine)}  # the defaults
VARIANTS: dict[tuple[str, str], type[Stage]] = {
    (s.name, s.via): s for s in (*STAGES.values(), RouteTable, PredictTable, FetchTable, H2DTable, ComputeTable)}
SHARED = ("combine",)  # stages whose one class serves every variant
REQUIRED = ("route", "fetch", "h2d", "compute", "combine")

__all__ = ["STAGES", "VARIANTS", "SHARED", "REQUIRED", "Stage", "StageIO"]
