"""What the estimator learns of a job: its bootstrap profiles from the profiler (JobProfiles), the
configurations it ran from the executors (Observed), and what the estimator keeps of both in KV."""

from __future__ import annotations

import msgspec

from goodput_train.goodput import Observation
from goodput_train.protocol import NonNegativeFloat, PositiveInt, ProfilePoint


class Profile(msgspec.Struct, frozen=True):
    """A job's bootstrap profile on one GPU type: ~10 batch sizes on one replica (Sia §3.3): one
    GPU, or for a hybrid-parallel job its model-parallel group of `group_gpus` GPUs on one node.

    max_local is the largest per-replica batch that fits in memory; gpu_seconds what profiling cost.
    """

    job_id: str
    model: str
    gpu_type: str
    points: tuple[ProfilePoint, ...]
    min_local: PositiveInt
    max_local: PositiveInt
    gpu_seconds: NonNegativeFloat = 0.0
    group_gpus: PositiveInt = 1
    # Not measured: what a job that is not profiled declares (a torchrun script's), which what it
    # reports (`goodput_train.report`) replaces, on its type and, until they report, on the others.
    declared: bool = False


class JobProfiles(msgspec.Struct, frozen=True):
    """Profiler -> estimator: a job's bootstrap profiles, one per GPU type it can run on."""

    job_id: str
    profiles: tuple[Profile, ...]


class ProfilesAll(msgspec.Struct, frozen=True):
    """Profiler -> estimator: the profiles of jobs judged at once, a job's at most once."""

    jobs: tuple[JobProfiles, ...]


class Observed(msgspec.Struct, frozen=True):
    """A configuration a job ran, and its measured iteration time."""

    job_id: str
    gpu_type: str
    observation: Observation


class ObservedAll(msgspec.Struct, frozen=True):
    """Executors -> estimator: configurations jobs ran, each job's in the order it ran them."""

    observed: tuple[Observed, ...]


class StoredAll(msgspec.Struct, frozen=True):
    """Estimator -> executors (ObservedAll) or profiler (ProfilesAll): for each observation or job's
    profiles, in order, the revision of its job's record that holds it, or 0 where it could not be
    stored (its job's reason in `refused`)."""

    revisions: tuple[int, ...]
    refused: dict[str, str] = {}


class EstimateRecord(msgspec.Struct, frozen=True):
    """What the estimator keeps of a job in KV: enough to rebuild its models after a restart."""

    job_id: str
    profiles: tuple[Profile, ...]
    observations: dict[str, tuple[Observation, ...]]  # per GPU type, in the order they came
