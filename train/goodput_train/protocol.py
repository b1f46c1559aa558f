"""What the executor (and the profiler) and a job's processes tell each other, besides torchrun's
environment: the variables they set for the job, the lines the job prints for them, and the
messages in those lines. It imports neither PyTorch nor the bus: the services read it, and
`shared.schema` takes these messages from here (they are written once)."""

from __future__ import annotations

import base64
from typing import Annotated

import msgspec

from goodput_train.goodput import Observation

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]


JOB_ENV = "GOODPUT_JOB_ID"
GPU_TYPE_ENV = "GOODPUT_GPU_TYPE"
REPORT_ENV = "GOODPUT_REPORT_S"  # seconds: print JobStats that often
REPORT_EVERY_S = 30.0  # the default for that
ADAPTIVE_ENV = "GOODPUT_ADAPTIVE"  # "0": keep the batch (a rigid job, or a policy that does not adapt)
CHECKPOINT_ENV = "GOODPUT_CHECKPOINT_S"  # seconds between periodic checkpoints (the executor's choice)
PROFILE_ENV = "GOODPUT_PROFILE"  # set: profile instead of training (goodput_train.profiling)
SLOT_MEMORY_ENV = "GOODPUT_SLOT_MEMORY_MB"
# "1": the worker's stdin is its executor's lifeline. Its end (the node agent died) makes the job
# checkpoint and stop at the next step, so no worker outlives the agent that started it.
LIFELINE_ENV = "GOODPUT_LIFELINE"
# Seconds a collective may wait for a peer (gloo's timeout, NCCL's watchdog): a lost peer fails the
# step within this, and the job restarts from its checkpoint instead of hanging (torch's default: 30 min).
COLLECTIVE_TIMEOUT_ENV = "GOODPUT_COLLECTIVE_TIMEOUT_S"
COLLECTIVE_TIMEOUT_S = 60.0  # a CPU slot's memory, for the profiling run

# The file a job checkpoints to and resumes from (the agent's choice; `AdaptiveTraining` reads it),
# and the folder it is in, the job's own, for a script that keeps more (a torchrun script's).
CHECKPOINT_PATH_ENV = "GOODPUT_CHECKPOINT"
CHECKPOINT_DIR_ENV = "GOODPUT_CHECKPOINT_DIR"

# Lines on the job's stdout: the prefix, then a schema message as base64 msgpack (it keeps NaN).
STATS_PREFIX = "goodput-stats "  # JobStats, from rank 0
PROFILE_PREFIX = "goodput-profile "  # ProfileRun
# Optional, then JSON: how the run ended; its numbers and short strings become the job's metrics.
OUTCOME_PREFIX = "goodput-outcome "
METRICS_PREFIX = "goodput-metrics "  # then JSON: {name: number or short string}, from rank 0
# The library stopped the job (SIGTERM, or its lifeline's end), checkpointed: a worker that exits 0
# after this line is resumed, not finished. Exit 0 without it is the job's end; non-zero, a crash.
STOPPED_MARK = "goodput-stopped"
# Every line above is the executor's, not the job's output: the agent keeps only the others (`goodput logs`).
PROTOCOL_PREFIXES = (STATS_PREFIX, PROFILE_PREFIX, OUTCOME_PREFIX, METRICS_PREFIX, STOPPED_MARK)

MAX_METRICS = 32  # names kept per job: a job's metrics are a summary, not a log
MAX_METRIC_NAME = 64
MAX_METRIC_TEXT = 128  # a string value's length


def clean_metrics(values: dict) -> tuple[dict[str, float | str], list[str]]:
    """The metrics to keep of `values` (numbers as floats, short strings), and what was dropped,
    each with why. Names past MAX_METRICS are dropped in their order."""
    kept: dict[str, float | str] = {}
    dropped = []
    for name, value in values.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_METRIC_NAME:
            dropped.append(f"{str(name)[:MAX_METRIC_NAME]!r}: a name is 1-{MAX_METRIC_NAME} characters")
        elif isinstance(value, bool) or not isinstance(value, (int, float, str)):
            dropped.append(f"{name}: {type(value).__name__} is neither a number nor a string")
        elif isinstance(value, str) and len(value) > MAX_METRIC_TEXT:
            dropped.append(f"{name}: a string value is at most {MAX_METRIC_TEXT} characters")
        elif len(kept) >= MAX_METRICS and name not in kept:
            dropped.append(f"{name}: a job keeps at most {MAX_METRICS} metrics")
        else:
            kept[name] = value if isinstance(value, str) else float(value)
    return kept, dropped


class ProfilePoint(msgspec.Struct, frozen=True):
    """One measured step of one replica (one GPU, unless hybrid-parallel) at a per-replica batch size."""

    local_bsz: PositiveInt
    step_time: PositiveFloat  # seconds per optimizer step
    sync_time: NonNegativeFloat = 0.0


class JobStats(msgspec.Struct, frozen=True):
    """A training job -> its executor, every 30 s (configurable): what it measured. Its
    observations feed the throughput fit, its gradient statistics the efficiency model."""

    job_id: str
    gpu_type: str
    observations: tuple[Observation, ...]  # each configuration run, with its median step time
    grad_sqr: float | None  # |G|², None before the first usable step
    grad_var: float | None  # the variance of a gradient over M0 examples
    epochs: NonNegativeFloat  # statistical progress, in epochs at M0
    steps: int
    m: PositiveInt
    s: int
    skipped: int = 0  # steps with a non-finite gradient, never learned from
    target_epochs: NonNegativeFloat | None = None  # where it stops (None: it has no target)


class ProfileRun(msgspec.Struct, frozen=True):
    """A job's profiling run on one GPU (slot) -> the profiler: its step time at each per-GPU batch
    that fitted, smallest first, and the first that ran out of memory (None: every one fitted)."""

    points: tuple[ProfilePoint, ...]
    init_batch: PositiveInt  # the job's own M0 and largest total batch
    max_batch: PositiveInt
    out_of_memory: int | None = None
    gpu_seconds: NonNegativeFloat = 0.0


def protocol_line(prefix: str, message: msgspec.Struct) -> str:
    """One line for the executor: the prefix, then the message as base64 msgpack (it keeps NaN)."""
    return prefix + base64.b64encode(msgspec.msgpack.encode(message)).decode()
