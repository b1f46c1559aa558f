"""The real profiler (Sia §3.3): a submitted job's own script, run on one GPU (a CPU slot standing
in for one) of a type, times a few steps at ~10 batch sizes and finds the largest that fits memory
(`AdaptiveTraining.profile`). The run happens on a node of that type, through its agent
(`services.node.agent`): the profiler measures where the job would train, never on its own
machine. Its result becomes the job's bootstrap profile.

Every way it can go wrong ends in a `ProfilingFailed` with the reason the job is refused for: the
script raised, it printed no profile, it ran too long, no batch size fits the GPU's memory, or no
node of the type was served for NODE_WAIT_S. A node that goes away mid-run is not the job's
fault: the run is watched through the node's membership (the KV entry its agent renews, as the
executor reads it), and once the entry lapses or another agent serves the node the run is given
up and started again on a live node of the type — within the membership's time to live, not the
run's timeout. With no such node for LOST_NODE_WAIT_S after a loss, or MAX_NODE_LOSSES lost in
one run, the job is refused saying so.

`NodeTurns` gives each profiling run a node of its own: runs of several submissions at once go to
different nodes (a second run on a node's one GPU would distort both measurements), and one run
waits only for a node of its type, never behind another job's run elsewhere. Runs waiting for a
type's nodes take them in turn by whose they are (a team's, or a login's of the default team): the
one whose last turn is oldest first, so one team's many submissions delay another's by one run
each, not by all of theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Collection

import msgspec
import nats.errors
from nats.micro.request import ServiceError
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from goodput_train.protocol import ProfilePoint, ProfileRun
from shared import subjects
from shared.bus import Bus
from shared.bus.kv import TypedKV
from shared.runtime import ENVIRONMENT_MAX_S
from shared.schema.estimates import Profile
from shared.schema.jobs import JobSpec
from shared.schema.nodes import NodeInfo, ProfileAnswer, ProfileRequest

PROFILE_TIMEOUT_S = 300.0
NODE_WAIT_S = 120.0  # how long a job waits for a node of a type to profile on before it is refused
LOST_NODE_WAIT_S = subjects.NODE_TTL_S  # after its node was lost: how long it waits for another of the type
MAX_NODE_LOSSES = 3  # nodes lost under one job's run on a type before it is refused
TRACER_NAME = "goodput.profiler"
log = logging.getLogger(__name__)


class ProfilingFailed(Exception):
    """The job cannot run here; the message says why."""


class ProfilingCancelled(Exception):
    """Its user cancelled the job: no run of it starts (one under way runs to its end)."""


class NodeUnavailable(RuntimeError):
    """The node profiling the job went away (its membership lapsed, or another agent serves it)."""


class NodeTurns:
    """The live nodes (the membership KV), each lent to one profiling run at a time; of those,
    a node that trains no job first (`training`: the nodes training jobs now, as the executor says),
    so a run takes an idle GPU rather than share a busy node's."""

    def __init__(self, members: TypedKV[NodeInfo], training: Callable[[], Awaitable[Collection[str]]] | None = None):
        self.members = members
        self.training = training
        self.busy: set[str] = set()
        self._freed = asyncio.Condition()
        self._waiting: dict[str, list[tuple[str, int]]] = {}  # type -> (whose, ticket) of each waiting run
        self._tickets = itertools.count()
        self._last_turn: dict[str, int] = {}  # whose -> the ticket count at its last turn

    async def take(self, gpu_type: str, wait_s: float = NODE_WAIT_S, after: str = "", whose: str = "") -> NodeInfo:
        """A live node of `gpu_type` that profiles nothing now (at random among them), taken until
        `give_back`. Nodes of the type busy with other runs are waited for as long as they take, in
        turn by `whose` run it is (the one whose last turn is oldest first, then the longest
        waiting); no node of the type served at all, for `wait_s`: ProfilingFailed (`after`: what
        happened before, for its reason)."""
        deadline = asyncio.get_running_loop().time() + wait_s
        mine = (whose, next(self._tickets))
        waiting = self._waiting.setdefault(gpu_type, [])
        waiting.append(mine)
        try:
            while True:
                nodes = [info for info in (await self.members.values()).values() if info.gpu_type == gpu_type]
                idle = [info for info in nodes if info.name not in self.busy]
                if idle and mine in sorted(waiting, key=self._turn)[: len(idle)]:
                    training = await self._training() if len(idle) > 1 else set()
                    info = random.choice([info for info in idle if info.name not in training] or idle)
                    self.busy.add(info.name)
                    self._last_turn[whose] = next(self._tickets)
                    return info
                if nodes:
                    deadline = asyncio.get_running_loop().time() + wait_s  # served, only busy
                elif asyncio.get_running_loop().time() > deadline:
                    raise ProfilingFailed(
                        f"{after}no node of type {gpu_type} has been served for {wait_s:.0f} s to profile it on"
                    )
                async with self._freed:  # a run ends or takes its turn, or a second passes (a node joins)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._freed.wait(), 1.0)
        finally:
            waiting.remove(mine)
            async with self._freed:  # the next in turn may take what is idle
                self._freed.notify_all()

    def _turn(self, waiter: tuple[str, int]) -> tuple[int, int]:
        whose, ticket = waiter
        return self._last_turn.get(whose, -1), ticket

    async def _training(self) -> Collection[str]:
        """The nodes training jobs now; none known when the executor does not say (any node will do)."""
        if self.training is None:
            return set()
        try:
            return await self.training()
        except (nats.errors.Error, ServiceError, TimeoutError) as error:  # the executor away: any node will do
            log.info("which nodes train jobs is not known (%s): any idle node profiles", error)
            return set()

    async def give_back(self, node: str) -> None:
        self.busy.discard(node)
        async with self._freed:
            self._freed.notify_all()

    async def lost(self, info: NodeInfo) -> None:
        """Once the node's membership lapses or another agent serves it: NodeUnavailable. Read as
        often as its agent renews it."""
        while True:
            await asyncio.sleep(subjects.NODE_HEARTBEAT_S)
            try:
                entry = await self.members.get(info.name)
            except Exception as error:  # noqa: BLE001 - NATS away for a moment: the run goes on; read again
                log.warning("reading node %s's membership failed: %s", info.name, error)
                continue
            finally:
                # Cancelled as the read came back, Python 3.11's asyncio.wait_for (in nats-py's request)
                # may return the entry and drop the cancel: the watch must end all the same, or the
                # run that waits for it to end waits for ever.
                if asyncio.current_task().cancelling():
                    raise asyncio.CancelledError
            if entry is None:
                raise NodeUnavailable(f"node {info.name} was lost (its agent stopped renewing its membership)")
            if entry.value.agent != info.agent:
                raise NodeUnavailable(f"node {info.name}'s agent was restarted (the run died with the old one)")


async def profiling_run(
    bus: Bus,
    members: TypedKV[NodeInfo] | NodeTurns,
    job_id: str,
    application: str,
    gpu_type: str,
    slot_memory_mb: float | None = None,
    timeout_s: float = PROFILE_TIMEOUT_S,
    node_wait_s: float = NODE_WAIT_S,
    cancelled: Callable[[], bool] = lambda: False,
    tracer_provider: trace.TracerProvider | None = None,
    code: tuple[str, str, tuple[str, ...]] = ("", "", ()),
    user: int | None = None,
    whose: str = "",
    team: str = subjects.DEFAULT_TEAM,
) -> ProfileRun:
    """Run the job's script in profiling mode on one GPU of a node of `gpu_type`; what it measured.
    A node lost under the run: it starts again on another of the type (`members`: the nodes'
    turns, shared by the runs of one profiler, or the membership alone). A job `cancelled()` once
    its turn on a node comes: ProfilingCancelled, and the node goes to the next run. The run is a
    `profiler.run` span with what it measured or why it failed. `code`: the job's own (archive,
    entrypoint, args), which the node agent fetches and runs; none: `application`, a job module.
    `user`: the number of the job's user on the node (its submission's, as the executor gives it);
    `whose`: the team (or the default team's login) the run's turn on a node is counted to; `team`:
    the job's (its output is stored in that team's logs)."""
    turns = members if isinstance(members, NodeTurns) else NodeTurns(members)
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
    with tracer.start_as_current_span(
        "profiler.run",
        record_exception=False,
        set_status_on_exception=False,
        attributes={"job.id": job_id, "job.application": application, "gpu.type": gpu_type, "timeout_s": timeout_s},
    ) as span:
        try:
            lost: dict[str, str] = {}  # node -> how it was lost
            while True:
                after = f"{'; '.join(lost.values())}; then " if lost else ""
                info = await turns.take(gpu_type, LOST_NODE_WAIT_S if lost else node_wait_s, after, whose)
                span.set_attribute("node", info.name)
                try:
                    if cancelled():
                        raise ProfilingCancelled(f"job {job_id} was cancelled before its profiling run on {gpu_type}")
                    request = ProfileRequest(
                        job_id, application, slot_memory_mb, timeout_s, *code, user=user, team=team
                    )
                    answer = await _run_on(bus, turns, info, request)
                    break
                except NodeUnavailable as error:
                    lost[info.name] = str(error)
                    span.set_attribute("nodes.lost", list(lost))
                    log.warning(
                        "job %s: %s during its profiling run; %s",
                        job_id,
                        error,
                        "refused" if len(lost) >= MAX_NODE_LOSSES else "run again on a live node",
                    )
                    if len(lost) >= MAX_NODE_LOSSES:
                        raise ProfilingFailed(
                            f"{len(lost)} nodes of type {gpu_type} were lost under its profiling "
                            f"run: {'; '.join(lost.values())}"
                        ) from None
                finally:
                    await turns.give_back(info.name)
            if answer.run is None:
                raise ProfilingFailed(answer.failure)
            run = answer.run
        except ProfilingCancelled as error:
            span.set_attributes({"outcome": "cancelled", "reason": str(error)})
            raise
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
        span.set_attributes(
            {
                "outcome": "measured" if sizes else "no batch size fits",
                "batch_sizes": sizes,
                "batch_sizes.count": len(sizes),
                "gpu_seconds": run.gpu_seconds,
                "job.init_batch": run.init_batch,
                "job.max_batch": run.max_batch,
            }
        )
        if run.out_of_memory is not None:
            span.set_attribute("out_of_memory.batch", run.out_of_memory)
        return run


async def _run_on(bus: Bus, turns: NodeTurns, info: NodeInfo, request: ProfileRequest) -> ProfileAnswer:
    """The node's answer to the request, or NodeUnavailable as soon as the node is gone."""
    timeout_s = request.timeout_s + 30 + (ENVIRONMENT_MAX_S if request.requirements else 0.0)  # built first
    asked = asyncio.ensure_future(
        bus.request(subjects.node_subject(info.name, "profile"), request, ProfileAnswer, timeout=timeout_s)
    )
    watching = asyncio.ensure_future(turns.lost(info))
    try:
        await asyncio.wait((asked, watching), return_when=asyncio.FIRST_COMPLETED)
        if not asked.done():
            watching.result()  # raises NodeUnavailable
        try:
            return asked.result()
        except nats.errors.NoRespondersError:
            await watching  # its agent is gone: lost once its membership lapses
            raise
        except nats.errors.TimeoutError:
            raise NodeUnavailable(
                f"node {info.name} did not finish profiling {request.job_id} in {timeout_s:.0f} s"
            ) from None
    finally:
        for task in (asked, watching):
            task.cancel()
        await asyncio.gather(asked, watching, return_exceptions=True)


def declared_run(spec: JobSpec) -> ProfileRun:
    """What a job that is not profiled (a torchrun script) is taken to run as until it reports: its
    declared batch (the global batch it asks for, at least one sample a GPU at its most GPUs), each
    sample costing one second a GPU. The flat curve makes K GPUs worth K times one: the policies
    place it at requested_gpus of its types (an elastic one, as many as its range and the others
    leave it)."""
    batch = max(spec.requested_batch or 1, spec.requested_gpus, spec.gpu_range[1] or 1)
    points = (ProfilePoint(1, 1.0), ProfilePoint(batch, float(batch))) if batch > 1 else (ProfilePoint(1, 1.0),)
    return ProfileRun(points, batch, batch)


def declared_profile(job_id: str, application: str, gpu_type: str, run: ProfileRun) -> Profile:
    """The profile of what a job that is not profiled declares (`declared_run`), marked so."""
    return msgspec.structs.replace(measured_profile(job_id, application, gpu_type, run), declared=True)


def measured_profile(job_id: str, application: str, gpu_type: str, run: ProfileRun, memory: str = "memory") -> Profile:
    """The bootstrap profile of what the run measured; ProfilingFailed if no batch size fitted."""
    if not run.points:
        raise ProfilingFailed(
            f"it does not fit in the {memory} of one {gpu_type} GPU at any batch size "
            f"(out of memory at per-GPU batch {run.out_of_memory})"
        )
    sizes = [p.local_bsz for p in run.points]
    return Profile(job_id, application, gpu_type, run.points, min(sizes), max(sizes), run.gpu_seconds)
