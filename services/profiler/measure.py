"""The real profiler (Sia §3.3): a submitted job's own script, run on one GPU (a CPU slot standing
in for one) of a type, times a few steps at ~10 batch sizes and finds the largest that fits memory
(`AdaptiveTraining.profile`). The run happens on a node of that type, through its agent
(`services.executor.node`): the profiler measures where the job would train, never on its own
machine. Its result becomes the job's bootstrap profile.

Every way it can go wrong ends in a `ProfilingFailed` with the reason the job is refused for: the
script raised, it printed no profile, it ran too long, no batch size fits the GPU's memory, or no
node of the type was served for NODE_WAIT_S. A node that goes away mid-run is not the job's
fault: `NodeUnavailable`, and the submission is tried again.
"""

from __future__ import annotations

import asyncio
import random

import nats.errors
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from shared import subjects
from shared.bus import Bus, TypedKV
from shared.schema import NodeInfo, Profile, ProfileAnswer, ProfileRequest, ProfileRun

PROFILE_TIMEOUT_S = 300.0
NODE_WAIT_S = 120.0          # how long a job waits for a node of a type to profile on before it is refused
TRACER_NAME = "goodput.profiler"


class ProfilingFailed(Exception):
    """The job cannot run here; the message says why."""


class NodeUnavailable(RuntimeError):
    """The node profiling the job went away: the job is profiled again, elsewhere."""


async def node_of_type(members: TypedKV[NodeInfo], gpu_type: str, wait_s: float = NODE_WAIT_S) -> str:
    """A live node of `gpu_type` (any, at random: profiling runs spread over them), waiting for one
    to be served for up to `wait_s`."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        nodes = [name for name, info in (await members.values()).items() if info.gpu_type == gpu_type]
        if nodes:
            return random.choice(nodes)
        if asyncio.get_running_loop().time() > deadline:
            raise ProfilingFailed(f"no node of type {gpu_type} has been served for {wait_s:.0f} s to profile it on")
        await asyncio.sleep(1.0)


async def profiling_run(bus: Bus, members: TypedKV[NodeInfo], job_id: str, application: str, gpu_type: str,
                        slot_memory_mb: float | None = None, timeout_s: float = PROFILE_TIMEOUT_S,
                        node_wait_s: float = NODE_WAIT_S,
                        tracer_provider: trace.TracerProvider | None = None) -> ProfileRun:
    """Run the job's script in profiling mode on one GPU of a node of `gpu_type`; what it measured.
    The run is a `profiler.run` span with what it measured or why it failed."""
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
    with tracer.start_as_current_span("profiler.run", record_exception=False, set_status_on_exception=False,
                                      attributes={"job.id": job_id, "job.application": application,
                                                  "gpu.type": gpu_type, "timeout_s": timeout_s}) as span:
        try:
            node = await node_of_type(members, gpu_type, node_wait_s)
            span.set_attribute("node", node)
            try:
                answer = await bus.request(subjects.node_subject(node, "profile"),
                                           ProfileRequest(job_id, application, slot_memory_mb, timeout_s),
                                           ProfileAnswer, timeout=timeout_s + 30)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as error:
                raise NodeUnavailable(f"node {node} did not finish profiling {job_id}: {type(error).__name__}") \
                    from None
            if answer.run is None:
                raise ProfilingFailed(answer.failure)
            run = answer.run
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


def measured_profile(job_id: str, application: str, gpu_type: str, run: ProfileRun,
                     memory: str = "memory") -> Profile:
    """The bootstrap profile of what the run measured; ProfilingFailed if no batch size fitted."""
    if not run.points:
        raise ProfilingFailed(f"it does not fit in the {memory} of one {gpu_type} GPU at any batch size "
                              f"(out of memory at per-GPU batch {run.out_of_memory})")
    sizes = [p.local_bsz for p in run.points]
    return Profile(job_id, application, gpu_type, run.points, min(sizes), max(sizes), run.gpu_seconds)
