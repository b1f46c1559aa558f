"""Every message on the bus, one place: msgspec Structs, validated on decode.

Ranges are part of the type (msgspec `Meta`), so a negative batch size never reaches a core.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]


class ProfilePoint(msgspec.Struct, frozen=True):
    """One measured 1-GPU step at a per-GPU batch size."""

    local_bsz: PositiveInt
    step_time: PositiveFloat      # seconds per optimizer step
    sync_time: NonNegativeFloat = 0.0


class Profile(msgspec.Struct, frozen=True):
    """A job's bootstrap profile on one GPU type: ~10 batch sizes on one GPU (Sia §3.3).

    max_local is the largest per-GPU batch that fits in memory; gpu_seconds what profiling cost.
    """

    job_id: str
    model: str
    gpu_type: str
    points: tuple[ProfilePoint, ...]
    min_local: PositiveInt
    max_local: PositiveInt
    gpu_seconds: NonNegativeFloat = 0.0
