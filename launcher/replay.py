"""Replays: a workload submitted through JetStream under ids of the replay's own, the run handed to
the policy leader, its log followed to the end and its results made; `goodput simulate --bus nats`
on a stack of its own, `goodput up`'s start-up replay on the stack it serves."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import nats.errors

from launcher.stack import Stack, create_run, follow_run, running_services, service_arguments
from shared import subjects
from shared.bus import Bus
from shared.schema.base import Count
from shared.schema.jobs import JobSpec
from shared.schema.records import JobRecords, JobsQuery
from shared.schema.runs import RunReport, RunRequest
from shared.schema.teams import TeamFile
from sim.reference import WorkloadJob

if TYPE_CHECKING:
    from sim.run import Progress, Simulation


async def replay(
    bus: Bus,
    stack: Stack,
    jobs: Sequence[WorkloadJob],
    policy: str,
    policy_options: dict,
    calibration: str,
    round_s: float | None = None,
    horizon_s: float | None = None,
    request_timeout_s: float = 10.0,
    run_id: str | None = None,
    progress: Callable[[float, int, int], None] | None = None,
    teams: TeamFile | None = None,
) -> tuple[RunReport, JobRecords]:
    """Submit a workload through JetStream, wait for the profiler's verdict on every job, create
    the run for the policy leader and follow its log to the end (whichever replica leads, and
    however often leadership changes on the way). The jobs' ids are the run's own (`<run id>.<name>`),
    so a replay never meets another's jobs or a user's on the same stack; the report and records
    name them as the workload does. `teams`: the team file the leader holds the run to (each job's
    team and priority are the workload's)."""
    run_id = run_id or f"replay-{uuid.uuid4().hex[:12]}"
    prefix = replay_prefix(run_id)
    for job in jobs:
        spec = JobSpec(
            prefix + job.name,
            job.application,
            requested_gpus=job.num_replicas,
            requested_batch=job.batch_size,
            submit_s=job.time,
            team=job.team,
            priority=job.priority,
            target_epochs=job.target_epochs,
        )
        await bus.js_publish(subjects.REPLAY_SUBMIT, spec, msg_id=spec.id)
    while await _count(bus, subjects.EXECUTOR_STATUS, prefix) < len(jobs):
        await asyncio.sleep(0.05)
    request = RunRequest(
        run_id,
        policy,
        policy_options,
        calibration,
        tuple((prefix + j.name, j.time) for j in jobs),
        round_s,
        horizon_s,
        request_timeout_s,
        teams=teams,
    )
    await create_run(bus, request)
    try:
        report = await follow_run(bus, run_id, progress)
    except Exception as error:  # noqa: BLE001 - say which service failed and why
        logs = "\n".join(f"--- {name}\n{stack.log(name)}" for name in stack.processes)
        raise RuntimeError(f"the replay over NATS failed ({error!r}); the services' logs end with:\n{logs}") from None
    rounds = tuple(
        msgspec.structs.replace(r, gpus={j.removeprefix(prefix): g for j, g in r.gpus.items()}) for r in report.rounds
    )
    return RunReport(rounds, tuple(e.replace(prefix, "") for e in report.events)), await replay_records(bus, prefix)


def replay_prefix(run_id: str) -> str:
    """What a replay's job ids begin with: `<run id>.`, then the workload's name."""
    return f"{run_id}."


async def replay_records(bus: Bus, prefix: str, timeout_s: float = 60.0) -> JobRecords:
    """The executors' records of a replay's jobs, under the workload's names."""
    records = await bus.request(subjects.RECORDS, JobsQuery(prefix), JobRecords, timeout=timeout_s)
    return JobRecords(tuple(msgspec.structs.replace(r, name=r.name.removeprefix(prefix)) for r in records.jobs))


async def _count(bus: Bus, subject: str, prefix: str = "") -> int:
    """A service's count (of the jobs whose id begins with `prefix`); -1 while its endpoint is not
    answering yet (a service answers ping as soon as it registers, a moment before its endpoints do)."""
    try:
        return (await bus.request(subject, JobsQuery(prefix), Count, timeout=10)).n
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return -1


async def replay_over_nats(run: Simulation, origin: str, progress: Progress | None) -> tuple[RunReport, JobRecords]:
    """Replay a simulation's jobs (`run.workload`, as it declares them) through the services on a
    NATS server of our own (a virtual clock), held to its team file; `origin`: where the jobs' truth
    comes from (`zoo`, or the reference folder)."""
    import tempfile

    from launcher.nats import embedded_nats

    settings = run.settings
    arguments = service_arguments(
        run.cluster,
        run.reference,
        run.use_zoo or origin == "zoo",
        run.calibration,
        run.feedback_iterations,
        run.restart_delay_s,
        run.interference,
        settings.profile_request,
    )
    with tempfile.TemporaryDirectory() as folder, embedded_nats(Path(folder)) as nats:
        with running_services(nats, arguments, Path(folder)) as stack:
            bus = await nats.connect("goodput-simulate")
            try:
                await stack.wait_ready(bus)
                return await replay(
                    bus,
                    stack,
                    run.workload,
                    run.policy,
                    dict(run.policy_options),
                    settings.name,
                    run.round_s,
                    run.horizon_s,
                    progress=progress,
                    teams=run.teams,
                )
            finally:
                await bus.close()


async def replay_workload(
    bus: Bus, stack: Stack, workload: str, cluster: str, policy: str, options: dict, reference: str | None, out: str
) -> None:
    """`goodput up`'s start-up replay: the workload through the running services, its results (with
    each job's finish-time fairness) printed and written to `out`."""
    from cli.simulate import report
    from services.simulated.truth import job_sources
    from sim.run import Simulation, add_fairness, fairness_reporter, progress_reporter, replay_results

    run = Simulation(workload, cluster, policy, options, reference, use_zoo=reference is None)
    jobs = run.jobs
    print(f"replaying {workload} ({len(jobs)} jobs) with {policy} on {cluster} ...")
    start = time.perf_counter()
    replayed, records = await replay(
        bus, stack, jobs, policy, options, run.settings.name, progress=progress_reporter(len(jobs), label="replay")
    )
    result = replay_results(run, jobs, replayed, records, f"reference:{reference}" if reference else "zoo")
    sources = job_sources(reference, reference is None)
    await asyncio.to_thread(add_fairness, result, run, jobs, sources, fairness_reporter(result))
    report(result, time.perf_counter() - start, out)
