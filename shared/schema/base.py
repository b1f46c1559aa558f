"""What every conversation names: the schema version, ids and the bounds of a submission, the
cluster's shapes (nodes, allocations, placements), and the plain answers (Ack, Count, Stored).

Ranges are part of the type (msgspec `Meta`), so a negative batch size never reaches a core.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from goodput_train.protocol import PositiveInt
from shared.subjects import DEFAULT_TEAM  # noqa: F401 - the schema's default team

SCHEMA_VERSION = 1

MAX_ID = 128
# Ids travel in subjects and KV keys: letters, digits, '-', '_' and single '.' between them (a key's
# tokens), at most MAX_ID. The pattern ends in "nothing follows" rather than `$`, which would also
# match before a final newline.
Identifier = Annotated[
    str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*(?![\s\S])", max_length=MAX_ID)
]
# What one submission may ask for, whatever the cluster (the profiler holds it to the cluster's size).
MAX_GPUS = 65_536
MAX_BATCH = 1 << 24
MAX_GPU_TYPES = 32
MAX_SUBMIT_S = 10 * 365 * 24 * 3600.0  # a replayed workload's span
GpuCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_GPUS)]
# A GPU type as a user names it: the cluster's key (`aws`) or the hardware ("T4", "RTX 2080 Ti").
GpuName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._-]*(?![\s\S])", max_length=64)]
BatchSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH)]
# A team's name (shared/teams.py): a login's and a subject token, lower-case letters, digits, '_', '-'.
TEAM_NAME = r"^[a-z0-9][a-z0-9_-]{0,31}(?![\s\S])"
TeamName = Annotated[str, msgspec.Meta(pattern=TEAM_NAME)]
MAX_PRIORITY = 1000  # a job's priority within its team: -MAX_PRIORITY to MAX_PRIORITY
MAX_TARGET_EPOCHS = 1e6  # the most statistical epochs a job may declare


Spots = tuple[tuple[str, int], ...]  # a physical placement: ((node name, GPUs on it), ...), sorted by node


class Node(msgspec.Struct, frozen=True):
    """One (possibly virtual) node: `gpus` GPUs of one type."""

    name: str
    gpu_type: str
    gpus: PositiveInt


class Config(msgspec.Struct, frozen=True):
    """An allocation, and a column of the goodput matrix: `gpus` GPUs of `gpu_type` on `nodes` nodes."""

    gpu_type: str
    nodes: PositiveInt
    gpus: PositiveInt

    def __str__(self) -> str:
        return f"{self.gpu_type}:{self.nodes}x{self.gpus // self.nodes}"


class Ack(msgspec.Struct, frozen=True):
    ok: bool = True


class Count(msgspec.Struct, frozen=True):
    n: int


class Stored(msgspec.Struct, frozen=True):
    """A write's acknowledgement with the KV revision it made: a later reader asks for at least it."""

    revision: int
