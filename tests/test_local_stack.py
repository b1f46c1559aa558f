"""Real jobs end to end on this machine: NATS, the five services and node agents, CPU slots
standing in for GPUs.

`goodput up --executors local --nodes 2 --once` submits the three example jobs together to two
node agents; the real profiler measures each on one slot through an agent, the scheduler allocates
and re-allocates slots as jobs arrive and finish, jobs span both nodes, every moved job
checkpoints, restarts at its new world size and re-tunes its batch, and every job reaches its
target. Then the bad inputs: a script that breaks, a job too big for a slot, a job naming no code
there is, a submission with an unknown field — each ends failed with its reason, the others
unaffected. And the executor killed -9 mid-training: its successor takes the jobs back from KV,
the workers it left on the node checkpoint and stop (their checkpoints in JetStream's object store,
as on a cluster without a shared folder), and every job still reaches its target.
"""

import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys

import msgspec

from deploy.nats import embedded_nats, free_loopback_port
from deploy.stack import (create_run, local_node_arguments, local_service_arguments, records_once_ended,
                          running_services)
from shared import subjects
from shared.schema import Ack, CancelAnswer, JobRecords, JobRequest, JobSpec, RunRequest

TARGETS = {"mlp-blobs": 0.95, "cnn-shapes": 0.95, "tiny-lm": 0.75}    # each job's own metric at its end


def test_three_example_jobs_share_the_slots_adapt_and_reach_their_targets(tmp_path):
    out = tmp_path / "up.json"
    run = subprocess.run([sys.executable, "-m", "cli.main", "up", "--executors", "local", "--nodes", "2", "--once",
                          "--round", "3", "--port", str(free_loopback_port()), "--data", str(tmp_path), "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    jobs = {job["name"]: job for job in json.loads(out.read_text())["jobs"]}
    assert set(jobs) == set(TARGETS)
    for name, job in jobs.items():
        assert job["failure"] is None and job["finish_s"] is not None, job
        assert job["metric"] >= TARGETS[name], job
    moved = [job for job in jobs.values() if job["restarts"] >= 1]
    assert moved, f"the scheduler changed no job's allocation mid-training: {jobs}"
    # A moved job resumed at its new world size and re-tuned: it trained at more than one total batch.
    assert any(len(job["batches"]) > 1 for job in moved), jobs
    assert "finished" in run.stdout and " x CPU slot" in run.stdout   # the changes were shown as they came, by type
    spread = [job["name"] for job in jobs.values() for placed in job["placements"] if len(placed["nodes"]) == 2]
    assert spread, f"no job ran on both nodes at once: {[job['placements'] for job in jobs.values()]}"
    assert " x CPU slot on 2 nodes" in run.stdout                    # and the live lines said so
    assert {node for job in jobs.values() for placed in job["placements"] for node, _ in placed["nodes"]} == \
        {"cpu-0", "cpu-1"}


@contextlib.asynccontextmanager
async def _live_stack(folder, **options):
    """NATS, the five services and the node agent of the local cluster's slots (real jobs), a live
    run of sia every 2 s; a bus to submit on."""
    agents = local_node_arguments("local", folder / "work", options.get("jobs_package"))
    with embedded_nats(folder) as nats:
        with running_services(nats, local_service_arguments("local", folder / "work", 1.0, **options), folder,
                              agents=agents) as stack:
            bus = await nats.connect("test")
            try:
                await stack.wait_ready(bus)
                await create_run(bus, RunRequest("live", "sia", {"round_s": 2.0}, "none", (), 2.0, live=True))
                yield bus, stack, nats
            finally:
                await bus.close()


async def _submit(bus, jobs: dict[str, str]) -> None:
    for job_id, application in jobs.items():
        await bus.js_publish(subjects.SUBMIT, JobSpec(job_id, application), msg_id=job_id)


async def _bad_inputs(folder):
    async with _live_stack(folder, slot_memory_mb=64, jobs_package="tests.jobs") as (bus, stack, _):
        await _submit(bus, {"breaks": "raises", "too-big": "huge", "no-code": "nosuchjob", "good": "quick"})
        unknown_field = {"id": "typo", "application": "quick", "requested_gpu": 2}
        await bus.nc.publish(subjects.SUBMIT, msgspec.msgpack.encode(unknown_field))
        await records_once_ended(bus, ["breaks", "too-big", "no-code", "good", "typo"], timeout_s=300)
        records = {r.name: r for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords)).jobs}
        alive = [name for name, process in stack.processes.items() if process.poll() is None]
        return records, alive


def test_bad_inputs_end_as_failed_jobs_with_their_reason_and_nothing_else_is_affected(tmp_path):
    records, alive = asyncio.run(_bad_inputs(tmp_path))
    assert set(records) == {"breaks", "too-big", "no-code", "good", "typo"}, records
    breaks, too_big, good, typo = (records[name] for name in ("breaks", "too-big", "good", "typo"))
    assert breaks.finish_s is None and "crashed 3 times" in breaks.failure, breaks       # restarted twice
    assert "RuntimeError: the data loader broke at step 3" in breaks.failure
    assert "does not fit in the 64 MB memory of one cpu GPU at any batch size" in too_big.failure, too_big
    assert math.isnan(too_big.submit_s) and too_big.gpu_seconds == 0         # it never ran
    assert "unknown field `requested_gpu`" in typo.failure, typo
    assert "no job 'nosuchjob' in tests.jobs" in records["no-code"].failure, records["no-code"]
    assert good.failure is None and good.finish_s is not None and good.metric >= 0.9, good
    assert len(alive) == 6, f"a service died: only {alive} still run"


async def _executor_killed(folder):
    async with _live_stack(folder, checkpoints="jetstream:") as (bus, stack, _):     # no folder shared
        await _submit(bus, {"tiny-lm": "tiny_lm", "cnn-shapes": "cnn_shapes"})
        for _ in range(240):                     # both training
            records = (await bus.request(subjects.RECORDS, Ack(), JobRecords)).jobs
            if len(records) == 2 and all(r.placement for r in records):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(3)
        stack.kill("executor")                   # kill -9: its workers are left behind on the node
        await asyncio.sleep(1)
        stack.start("executor")
        records = await records_once_ended(bus, ["tiny-lm", "cnn-shapes"], timeout_s=300)
        return records, stack.log("executor")


def test_the_executor_killed_mid_training_its_successor_finishes_the_jobs(tmp_path):
    records, log = asyncio.run(_executor_killed(tmp_path))
    assert log.count("ready on") == 2                                   # it really started again
    for name, record in records.items():
        assert record.failure is None and record.metric >= TARGETS[name], record
        assert record.restarts >= 1, record                  # started again from its checkpoint
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True, text=True).stdout
    assert leftover == "", f"workers left running: {leftover}"


async def _cancelled_mid_training(folder):
    async with _live_stack(folder) as (bus, stack, nats):
        await _submit(bus, {"tiny-lm": "tiny_lm", "mlp-blobs": "mlp_blobs"})
        for _ in range(240):                     # tiny-lm training: its workers have reported steps
            records = {r.name: r for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords)).jobs}
            if "tiny-lm" in records and records["tiny-lm"].batch is not None:
                break
            await asyncio.sleep(0.5)
        answer = await bus.request(subjects.API_CANCEL, JobRequest("tiny-lm"), CancelAnswer, timeout=60)
        workers = subprocess.run(["pgrep", "-f", f"{folder / 'work'}.*tiny-lm.pt"], capture_output=True,
                                 text=True).stdout
        ended = await records_once_ended(bus, ["mlp-blobs"], timeout_s=300)
        records = {r.name: r for r in (await bus.request(subjects.RECORDS, Ack(), JobRecords)).jobs}
        # The operator drains the node, then uses it again; a user may not.
        operator = {**{k: v for k, v in os.environ.items() if not k.startswith("GOODPUT_NATS")}, **nats.env("operator")}
        user = {**operator, **nats.env("user")}
        drains = [await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cli.main", "drain", *args,
                                                                  "--server", nats.url],
                                          capture_output=True, text=True, env=env, timeout=120)
                  for args, env in ((["cpu-0"], operator), (["cpu-0", "--undo"], operator), (["cpu-0"], user))]
        return answer, workers, records, ended, drains


def test_a_real_job_cancelled_mid_training_checkpoints_stops_and_the_others_go_on(tmp_path):
    answer, workers, records, ended, (drained, undone, refused) = asyncio.run(_cancelled_mid_training(tmp_path))
    assert answer.cancelled and answer.state == "cancelled", answer
    assert workers == "", f"its workers still run after the cancel was answered: {workers}"
    cancelled = records["tiny-lm"]
    assert cancelled.state == "cancelled" and cancelled.placement == () and cancelled.finish_s is None, cancelled
    assert list((tmp_path / "work").rglob("tiny-lm.pt")), "it stopped without a checkpoint"
    assert ended["mlp-blobs"].failure is None and ended["mlp-blobs"].metric >= TARGETS["mlp-blobs"], ended
    assert drained.returncode == 0 and "node cpu-0: drained, nothing new is placed there" in drained.stdout, drained
    assert undone.returncode == 0 and "node cpu-0: used again" in undone.stdout, undone
    assert refused.returncode != 0 and "operator" in refused.stderr, refused
