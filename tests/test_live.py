"""The live round loop: jobs submitted while the stack serves are scheduled on the wall clock."""

import asyncio
import time

from cli.main import main
from deploy.nats import nats_from_binary
from deploy.stack import create_run, follow_run_steps, running_services, service_arguments
from shared import streams, subjects
from shared.bus import Bus
from shared.schema import Ack, JobRecords, JobSpec, RunRequest

ROUND_S, SPEED = 60.0, 1200.0          # a 60-s round every 50 ms of wall time


async def test_jobs_submitted_live_are_scheduled_and_finish(tmp_path, capsys):
    arguments = service_arguments("sia-hetero-64", None, True, None, 1, None)
    # A server of its own: a live run never ends, and would keep any later leader on this server busy.
    with nats_from_binary(tmp_path) as url, running_services(url, arguments, tmp_path) as stack:
        bus = await Bus.connect(url, "live-test")
        try:
            await stack.wait_ready(bus)
            await streams.ensure_jobs(bus)
            await create_run(bus, RunRequest("live-test", "sia", {}, "sia", (), ROUND_S, live=True, speed=SPEED))
            started = time.monotonic()
            await bus.js_publish(subjects.SUBMIT, JobSpec("ncf-live", "ncf"), msg_id="ncf-live")
            steps, late_submitted = [], False
            async for step in follow_run_steps(bus, "live-test", idle_timeout_s=60):
                steps.append(step)
                if not late_submitted and step.record and "ncf-live" in step.record.gpus:
                    # A second job, submitted while the first runs, joins at a later round.
                    await bus.js_publish(subjects.SUBMIT, JobSpec("cifar10-live", "cifar10"), msg_id="cifar10-live")
                    late_submitted = True
                finished = {job for s in steps for job in s.finished}
                if finished >= {"ncf-live", "cifar10-live"}:
                    break
            wall_s = time.monotonic() - started
            records = {r.name: r for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords, timeout=10)).jobs}
            assert await asyncio.to_thread(main, ["status", "--server", url]) == 0
            status = capsys.readouterr().out
        finally:
            await bus.close()
    assert records["ncf-live"].finish_s is not None and records["cifar10-live"].finish_s is not None
    assert "2 jobs: 2 finished" in status and "ncf-live" in status and "cifar10-live" in status
    # Each arrived at the live round that first saw it: the second after the first had started.
    assert records["cifar10-live"].submit_s > records["ncf-live"].submit_s
    assert all(s.now_s % ROUND_S == 0 for s in steps) and not any(s.over for s in steps)
    # Rounds keep the wall clock's pace: the virtual time covered took at least its scaled wall time.
    assert wall_s >= (steps[-1].now_s - steps[0].now_s) / SPEED
