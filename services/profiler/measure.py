"""The real profiler (Sia §3.3): a submitted job's own script, run on one GPU (a CPU slot here) of a
type, times a few steps at ~10 batch sizes and finds the largest that fits memory
(`goodput_train.profiling`); here that run is started and its result made a bootstrap profile.

Every way it can go wrong ends in a `ProfilingFailed` with the reason the job is refused for: the
script raised, it printed no profile, it ran too long, or no batch size fits the GPU's memory.
"""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import msgspec
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from services.executor.local import job_module, last_error, torchrun_env, worker
from goodput_train.protocol import PROFILE_ENV, PROFILE_PREFIX, SLOT_MEMORY_ENV
from shared.schema import Profile, ProfileRun

PROFILE_TIMEOUT_S = 300.0
TRACER_NAME = "goodput.profiler"


class ProfilingFailed(Exception):
    """The job cannot run here; the message says why."""


def profiling_run(job_id: str, application: str, gpu_type: str, workdir: Path, jobs_package: str,
                  slot_memory_mb: float | None = None, timeout_s: float = PROFILE_TIMEOUT_S,
                  running: set[subprocess.Popen] | None = None,
                  tracer_provider: trace.TracerProvider | None = None) -> ProfileRun:
    """Run the job's script in profiling mode on one slot of `gpu_type`; what it measured. The
    process is in `running` while it runs (for whoever must stop it). The run is a `profiler.run`
    span (a child of the current one: asyncio.to_thread carries the context) with what it measured
    or why it failed."""
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
    with tracer.start_as_current_span("profiler.run", record_exception=False, set_status_on_exception=False,
                                      attributes={"job.id": job_id, "job.application": application,
                                                  "gpu.type": gpu_type, "timeout_s": timeout_s}) as span:
        try:
            run = _profiling_run(job_id, application, gpu_type, workdir, jobs_package, slot_memory_mb, timeout_s,
                                 running)
        except ProfilingFailed as error:
            span.set_attributes({"outcome": "failed", "reason": str(error)})
            span.set_status(Status(StatusCode.ERROR, str(error)))
            raise
        except BaseException as error:
            span.set_attributes({"outcome": "error", "reason": f"{type(error).__name__}: {error}"})
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, str(error)))
            raise
        sizes = [p.local_bsz for p in run.points]
        span.set_attributes({"outcome": "measured" if sizes else "no batch size fits", "batch_sizes": sizes,
                             "batch_sizes.count": len(sizes), "gpu_seconds": run.gpu_seconds,
                             "job.init_batch": run.init_batch, "job.max_batch": run.max_batch})
        if run.out_of_memory is not None:
            span.set_attribute("out_of_memory.batch", run.out_of_memory)
        return run


def _profiling_run(job_id: str, application: str, gpu_type: str, workdir: Path, jobs_package: str,
                   slot_memory_mb: float | None, timeout_s: float, running: set[subprocess.Popen] | None) -> ProfileRun:
    running = set() if running is None else running
    try:
        module = job_module(application, jobs_package)
    except ValueError as error:
        raise ProfilingFailed(str(error)) from None
    env = {**torchrun_env(0, 1, 1, 0, job_id, gpu_type), PROFILE_ENV: "1"}
    if slot_memory_mb is not None:
        env[SLOT_MEMORY_ENV] = str(slot_memory_mb)
    log_path = workdir / f"{job_id}.profile-{gpu_type}.log"
    with open(log_path, "w") as log:
        process = worker(module, [], env, log)
        running.add(process)
        try:
            out, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise ProfilingFailed(f"its profiling run on {gpu_type} took longer than {timeout_s:.0f} s") from None
        finally:
            running.discard(process)
    if process.returncode != 0:
        raise ProfilingFailed(f"its script failed while profiling on {gpu_type} (exit code {process.returncode}): "
                              f"{last_error(log_path)}")
    for line in out.splitlines():
        if line.startswith(PROFILE_PREFIX):
            try:
                return msgspec.msgpack.decode(base64.b64decode(line[len(PROFILE_PREFIX):]), type=ProfileRun)
            except (ValueError, msgspec.DecodeError) as error:
                raise ProfilingFailed(f"its profiling run printed an unreadable profile: {error}") from None
    raise ProfilingFailed(f"its script printed no profile on {gpu_type}: it must train through "
                          "AdaptiveTraining.run (goodput_train.trainer)")


def measured_profile(job_id: str, application: str, gpu_type: str, run: ProfileRun,
                     memory: str = "memory") -> Profile:
    """The bootstrap profile of what the run measured; ProfilingFailed if no batch size fitted."""
    if not run.points:
        raise ProfilingFailed(f"it does not fit in the {memory} of one {gpu_type} GPU at any batch size "
                              f"(out of memory at per-GPU batch {run.out_of_memory})")
    sizes = [p.local_bsz for p in run.points]
    return Profile(job_id, application, gpu_type, run.points, min(sizes), max(sizes), run.gpu_seconds)
