"""The live round loop: jobs submitted while the stack serves are scheduled on the wall clock."""

import asyncio
import contextlib
import time

import pytest

from cli.main import main
from launcher.nats import embedded_nats
from launcher.stack import create_run, follow_run_steps, running_services, service_arguments
from shared import subjects
from shared.schema.base import Ack
from shared.schema.jobs import JobSpec
from shared.schema.records import JobRecords
from shared.schema.runs import RunRequest

pytestmark = pytest.mark.e2e  # every test here starts NATS and the services as processes

ROUND_S, SPEED = 60.0, 1200.0  # a 60-s round every 50 ms of wall time


@contextlib.asynccontextmanager
async def live_stack(tmp_path, **request):
    """The six services serving a live run; (NATS URL, the stack, a bus)."""
    arguments = service_arguments("sia-hetero-64", None, True, None, 1, None)
    # A server of its own: a live run never ends, and would keep any later leader on this server busy.
    with embedded_nats(tmp_path) as nats, running_services(nats, arguments, tmp_path) as stack:
        bus = await nats.connect("live-test")
        try:
            await stack.wait_ready(bus)
            await create_run(
                bus, RunRequest(subjects.LIVE_RUN, "sia", {}, "sia", (), ROUND_S, live=True, speed=SPEED, **request)
            )
            yield nats, stack, bus
        finally:
            await bus.close()


async def test_jobs_submitted_live_are_scheduled_and_finish(tmp_path, capsys):
    async with live_stack(tmp_path) as (nats, stack, bus):
        started = time.monotonic()
        await bus.js_publish(
            subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR), JobSpec("ncf-live", "ncf"), msg_id="ncf-live"
        )
        steps, late_submitted = [], False
        async for step in follow_run_steps(bus, subjects.LIVE_RUN, idle_timeout_s=60):
            steps.append(step)
            if not late_submitted and step.record and "ncf-live" in step.record.gpus:
                # A second job, submitted while the first runs, joins at a later round.
                await bus.js_publish(
                    subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR),
                    JobSpec("cifar10-live", "cifar10"),
                    msg_id="cifar10-live",
                )
                late_submitted = True
            finished = {job for s in steps for job in s.finished}
            if finished >= {"ncf-live", "cifar10-live"}:
                break
        wall_s = time.monotonic() - started
        records = {r.name: r for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords, timeout=10)).jobs}
        # The operator's jobs, as the operator sees them (the login `user` has none of its own here).
        assert (
            await asyncio.to_thread(
                main,
                [
                    "status",
                    "--server",
                    nats.url,
                    "--nats-user",
                    "operator",
                    "--nats-password-file",
                    str(nats.access.password_file("operator")),
                ],
            )
            == 0
        )
        status = capsys.readouterr().out
    assert records["ncf-live"].finish_s is not None and records["cifar10-live"].finish_s is not None
    assert "2 jobs: 2 finished" in status and "ncf-live" in status and "cifar10-live" in status
    # Each arrived at the live round that first saw it: the second after the first had started.
    assert records["cifar10-live"].submit_s > records["ncf-live"].submit_s
    assert all(s.now_s % ROUND_S == 0 for s in steps) and not any(s.over for s in steps)
    # Rounds keep the wall clock's pace: the virtual time covered took at least its scaled wall time.
    assert wall_s >= (steps[-1].now_s - steps[0].now_s) / SPEED


async def test_a_live_run_that_cannot_go_on_says_why_and_resumes_when_it_can(tmp_path):
    """The estimator gone: no round can be decided. The live run does not end: `goodput status` and
    the policy's readiness probe say why while it is retried, and once the estimator is back it goes
    on and the job finishes."""
    from deploy.probe import ProbeFailed, ping
    from shared.schema.runs import PolicyStatus

    async with live_stack(tmp_path, request_timeout_s=1.0) as (nats, stack, bus):
        await bus.js_publish(
            subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR),
            JobSpec("imagenet-live", "imagenet"),
            msg_id="imagenet-live",
        )
        while await _state(bus, "imagenet-live") != "running":
            await asyncio.sleep(0.1)
        stack.kill("estimator")

        async def run_state() -> tuple[str, str]:
            run = (await bus.request(subjects.POLICY_STATUS, Ack(), PolicyStatus, timeout=10)).run
            return run.state, run.reason

        while (await run_state())[0] != "stalled":
            await asyncio.sleep(0.1)
        state, reason = await run_state()
        assert subjects.MODELS in reason, reason  # the stage no one answers is named
        try:
            await ping("policy", nats.url, 5.0, ready=True, **nats.options("policy"))
            raise AssertionError("the readiness probe passed while the live run was stalled")
        except ProbeFailed as failure:
            assert "stalled" in str(failure) and subjects.MODELS in str(failure)
        await ping("policy", nats.url, 5.0, **nats.options("policy"))  # alive all the same

        stack.start("estimator")
        while await _state(bus, "imagenet-live") != "finished":
            await asyncio.sleep(0.2)
        assert (await run_state())[0] == "running"
        await ping("policy", nats.url, 5.0, ready=True, **nats.options("policy"))


async def _state(bus, job: str) -> str | None:
    records = {r.name: r for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords, timeout=10)).jobs}
    return records[job].state if job in records else None
