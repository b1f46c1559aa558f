"""`goodput simulate --bus nats`: the six services over a real NATS server give the schedule that
the direct wiring gives, job for job."""

import contextlib
import dataclasses

import pytest

from launcher.replay import replay_over_nats
from services.simulated.truth import job_sources
from shared import subjects
from shared.teams import parse_team_file
from sim.reference import WorkloadJob
from sim.run import Simulation, simulate

ZOO = job_sources(use_zoo=True)
WORKLOAD = [
    WorkloadJob("cifar10-0", 0, "cifar10", 2, 256),
    WorkloadJob("bert-1", 30, "bert", 1, 12),
    WorkloadJob("cifar10-2", 200, "cifar10", 4, 512),
    WorkloadJob("deepspeech2-3", 400, "deepspeech2", 2, 40),
    WorkloadJob("ncf-4", 500, "ncf", 1, 32768),
]


@pytest.mark.e2e
def test_nats_wiring_reproduces_the_direct_schedule():
    direct = simulate(Simulation(WORKLOAD, "sia-hetero-64", "sia"), sources=ZOO)
    over_nats = simulate(Simulation(WORKLOAD, "sia-hetero-64", "sia"), sources=ZOO, over=replay_over_nats)
    assert direct["jobs_unfinished"] == 0
    assert over_nats["jobs"] == direct["jobs"]  # same JCTs, restarts, GPU time, feedback
    assert over_nats["rounds"] == direct["rounds"]
    assert [r["gpus"] for r in over_nats["timeline"]] == [r["gpus"] for r in direct["timeline"]]


@pytest.mark.e2e
def test_nats_wiring_reproduces_the_direct_schedule_with_teams():
    """The team file travels in the replay's request to the leader: the same guarantees, the same
    schedule, the same per-team results."""
    teams = parse_team_file("teams: {a: {quota: {T4: 8}}, b: {quota: {A100: 8}, borrow: {T4: 4}}}")
    jobs = [dataclasses.replace(job, team="ab"[i % 2], priority=i % 3) for i, job in enumerate(WORKLOAD)]
    direct = simulate(Simulation(jobs, "sia-hetero-64", "goodput", teams=teams), sources=ZOO)
    over_nats = simulate(Simulation(jobs, "sia-hetero-64", "goodput", teams=teams), sources=ZOO, over=replay_over_nats)
    assert direct["jobs_unfinished"] == 0 and set(direct["teams"]) == {"a", "b"}
    assert over_nats["jobs"] == direct["jobs"] and over_nats["teams"] == direct["teams"]
    assert [r["gpus"] for r in over_nats["timeline"]] == [r["gpus"] for r in direct["timeline"]]


@pytest.mark.e2e
def test_profiling_at_the_request_is_the_same_over_nats_and_direct():
    """The simulated executors report each job's measurements at its request before it joins a
    round, as direct wiring gives them to the estimator at the start (reference truth: there the
    1-GPU profiles alone mislead gavel's matrix, so the measurements change the schedule)."""
    workload = [
        WorkloadJob("cifar10-0", 0, "cifar10", 8, 1024),
        WorkloadJob("bert-1", 30, "bert", 4, 48),
        WorkloadJob("deepspeech2-2", 200, "deepspeech2", 8, 160),
        WorkloadJob("yolov3-3", 400, "yolov3", 8, 64),
    ]
    learned = simulate(Simulation(workload, "sia-hetero-64", "gavel"), fairness=False)
    direct = simulate(Simulation(workload, "sia-hetero-64", "gavel", profile_request=True), fairness=False)
    over_nats = simulate(
        Simulation(workload, "sia-hetero-64", "gavel", profile_request=True), fairness=False, over=replay_over_nats
    )
    assert direct["truth"].startswith("reference:") and direct["jobs_unfinished"] == 0
    assert direct["profiled_at_request"] and over_nats["profiled_at_request"] and not learned["profiled_at_request"]
    assert [j["jct_s"] for j in direct["jobs"]] != [j["jct_s"] for j in learned["jobs"]]
    assert over_nats["jobs"] == direct["jobs"]
    assert [r["gpus"] for r in over_nats["timeline"]] == [r["gpus"] for r in direct["timeline"]]


@pytest.mark.e2e
async def test_one_trace_per_round_across_the_services(monkeypatch):
    """The services export to a real OTLP/HTTP receiver: a round's spans share its trace."""
    import asyncio
    import socket

    import oteltap

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")  # the services inherit it
    settings = oteltap.OtelTapHttpProtobufReceiverSettings(http_port=port)
    wanted = ("policy.solve", "estimator.goodput", "placer.place", "executor.apply")
    async with oteltap.OtelTapHttpProtobufReceiver(settings) as receiver:
        waits = {
            name: asyncio.ensure_future(receiver.await_trace(lambda span, n=name: span.name == n))
            for name in ("round",) + wanted
        }
        await asyncio.sleep(0)
        await asyncio.to_thread(
            simulate, Simulation(WORKLOAD[:2], "sia-hetero-64", "sia"), sources=ZOO, over=replay_over_nats
        )
        spans = dict(zip(waits, await asyncio.wait_for(asyncio.gather(*waits.values()), 20)))
    # The first span of each name belongs to the first round; all hang from that round's root span.
    root = spans["round"]
    assert not root.parent_span_id
    for name in wanted:
        assert spans[name].trace_id == root.trace_id, name
    assert spans["placer.place"].parent_span_id == root.span_id
    assert spans["estimator.goodput"].parent_span_id == root.span_id


@pytest.mark.e2e
def test_goodput_up_replays_a_workload_and_stops(tmp_path, capsys):
    from cli.main import main
    from launcher.nats import free_loopback_port

    workload = tmp_path / "w.csv"
    workload.write_text(
        "name,time,application,num_replicas,batch_size\ncifar10-0,0,cifar10,2,256\nbert-1,60,bert,1,12\n"
    )
    out = tmp_path / "up.json"
    assert (
        main(
            [
                "up",
                "--once",
                "--port",
                str(free_loopback_port()),
                "--workload",
                str(workload),
                "--data",
                str(tmp_path / "stack"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "goodput is up" in printed and "goodput is down" in printed
    import json

    result = json.loads(out.read_text())
    assert result["jobs_unfinished"] == 0 and len(result["jobs"]) == 2
    assert all(j["rho"] is not None for j in result["jobs"]) and "finish-time fairness" in printed
    assert (tmp_path / "stack" / "policy.log").exists()


def test_status_without_a_stack_is_a_clear_error(capsys, monkeypatch, tmp_path, no_login):
    from cli.main import main

    monkeypatch.chdir(tmp_path)  # no out/stack/user.env: no login, so where to find one is said
    assert main(["status", "--server", "nats://127.0.0.1:1"]) == 2
    error = capsys.readouterr().err
    assert "is `goodput up` running?" in error and ". DATA/user.env" in error, error


async def test_bad_submissions_are_recorded_with_a_reason_and_lose_nothing(nats_server, connect_bus, tmp_path):
    import asyncio

    import msgspec

    from launcher.stack import running_services, service_arguments
    from shared import subjects
    from shared.schema.base import Ack, Count
    from shared.schema.jobs import JobSpec, Rejected

    arguments = service_arguments("sia-hetero-64", None, True, None, 1, None)
    bus = await connect_bus("client")
    with running_services(nats_server, arguments, tmp_path) as stack:
        await stack.wait_ready(bus)
        before = (await bus.request(subjects.ESTIMATOR_STATUS, Ack(), Count, timeout=5)).n
        await bus.js.publish(subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR), b"\x93 not a job")  # malformed
        await bus.js_publish(
            subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR),
            JobSpec("alexnet-1", "alexnet"),
            msg_id="alexnet-1",
        )  # unknown model
        await bus.js_publish(
            subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR), JobSpec("ok-1", "cifar10"), msg_id="ok-1"
        )  # fine
        for _ in range(100):
            if (await bus.request(subjects.ESTIMATOR_STATUS, Ack(), Count, timeout=5)).n == before + 1:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the valid job was never profiled")
        rejected = []
        for _ in range(100):
            info = await bus.js.stream_info(subjects.JOBS_STREAM)
            messages = [await bus.js.get_msg(subjects.JOBS_STREAM, seq) for seq in range(1, info.state.last_seq + 1)]
            rejected = [
                msgspec.msgpack.decode(m.data, type=Rejected) for m in messages if m.subject == subjects.REJECTED
            ]
            if len(rejected) >= 2:
                break
            await asyncio.sleep(0.05)
        reasons = " | ".join(r.reason for r in rejected)
        assert "malformed submission" in reasons and "unknown application 'alexnet'" in reasons
        assert all(p.poll() is None for p in stack.processes.values())  # nobody crashed


async def _replay_with(tmp_path, jobs, replicas, disturb=None):
    """Replay `jobs` with sia through the services (`replicas` per service); `disturb(stack, bus)`
    runs once the leader has checkpointed a few rounds of the replay, while it is still going.
    Each job's (finish, restarts, GPU-seconds)."""
    import asyncio

    from launcher.nats import embedded_nats
    from launcher.replay import replay
    from launcher.stack import running_services, service_arguments
    from shared.settings import settings_for

    arguments = service_arguments("sia-hetero-64", None, True, None, 1, None)
    with (
        embedded_nats(tmp_path) as nats,
        running_services(nats, arguments, tmp_path, replicas, lease_ttl_s=1.0) as stack,
    ):
        bus = await nats.connect("driver")
        try:
            await stack.wait_ready(bus)
            run = asyncio.ensure_future(
                replay(bus, stack, jobs, "sia", {}, settings_for(None, "sia-hetero-64").name, request_timeout_s=2.0)
            )
            if disturb:
                await _rounds_checkpointed(bus, DISTURB_AFTER_ROUNDS)
                assert not run.done(), "the replay ended before the disturbance: make the workload longer"
                await disturb(stack, bus)
            _, records = await asyncio.wait_for(run, 120)
            served = await _requests_served(bus, "estimator", "models")
        finally:
            await bus.close()
    return {r.name: (r.finish_s, r.restarts, round(r.gpu_seconds, 3)) for r in records.jobs}, served


DISTURB_AFTER_ROUNDS = 3


async def _rounds_checkpointed(bus, rounds: int) -> None:
    """Until a run's checkpoint in KV has `rounds` rounds run (a signal, not a guess of time)."""
    import asyncio

    from shared.schema.runs import RunCheckpoint

    kv = await bus.kv(subjects.RUNS_BUCKET, RunCheckpoint)
    while True:
        for key in await kv.keys():
            entry = await kv.get(key)
            if entry is not None and entry.value.clock.round >= rounds:
                return
        await asyncio.sleep(0.05)


async def _requests_served(bus, service, endpoint):
    """Requests each replica of `service` answered on `endpoint` (the service API's stats)."""
    import json

    import nats.errors

    inbox = bus.nc.new_inbox()
    subscription = await bus.nc.subscribe(inbox)
    await bus.nc.publish(f"$SRV.STATS.{service}", b"", reply=inbox)
    served = []
    try:
        while True:
            data = (await subscription.next_msg(timeout=0.5)).data
            if data:  # not the server's "no responders"
                served += [e["num_requests"] for e in json.loads(data)["endpoints"] if e["name"] == endpoint]
    except nats.errors.TimeoutError:
        return sorted(served)


async def _direct(jobs):
    import asyncio

    direct = await asyncio.to_thread(simulate, Simulation(jobs, "sia-hetero-64", "sia"), sources=ZOO)
    return {j["name"]: (j["finish_s"], j["restarts"], j["gpu_seconds"]) for j in direct["jobs"]}


def _mixed(n):
    from sim.reference import load_workload

    return load_workload("examples/workloads/mixed-40.csv")[:n]


@pytest.mark.e2e
async def test_replicas_share_the_work_and_change_nothing(tmp_path):
    """Two estimators answer rounds for jobs the other learned (read through KV), two policy
    replicas (one leads): the schedule is the one-process direct run's."""
    jobs = _mixed(10)
    outcome, served = await _replay_with(tmp_path, jobs, {"estimator": 2, "policy": 2})
    assert outcome == await _direct(jobs)
    assert len(served) == 2 and min(served) > 0, f"both estimator replicas answer rounds: {served}"


@pytest.mark.e2e
@pytest.mark.parametrize("victim", ["profiler", "placer", "estimator", "executor"])
async def test_a_service_killed_mid_run_and_restarted_changes_nothing(victim, tmp_path):
    """kill -9 of a service in the middle of a replay, then a restart: the placer holds no state, the
    estimator and the executors rebuild theirs from KV; the clock asks again until the service is
    back, and every job's outcome is the undisturbed run's."""
    import asyncio

    async def kill_and_restart(stack, bus):
        stack.kill(victim)
        await asyncio.sleep(0.5)
        stack.start(victim)

    jobs = _mixed(12)
    outcome, _ = await _replay_with(tmp_path, jobs, {}, kill_and_restart)
    assert outcome == await _direct(jobs)
    assert (tmp_path / f"{victim}.log").read_text().count("ready on") == 2  # it really started again


@pytest.mark.e2e
async def test_the_policy_leader_killed_mid_run_a_standby_resumes_it(tmp_path):
    """kill -9 of the leader: the standby takes the lease when it expires and resumes the run from
    its checkpoint; the driver, following the run's log, never notices. Every outcome unchanged."""
    killed = []

    async def kill_leader(stack, bus):
        killed.append(await stack.policy_leader(bus))
        stack.kill(killed[0])
        stack.start(killed[0])  # back: it campaigns again

    jobs = _mixed(12)
    outcome, _ = await _replay_with(tmp_path, jobs, {"policy": 2}, kill_leader)
    assert outcome == await _direct(jobs)
    # Whichever replica took the lease next (the standby, or the killed one back first) resumed.
    assert any("resumed from round" in (tmp_path / f"{name}.log").read_text() for name in ("policy", "policy-2"))


@pytest.mark.e2e
async def test_an_unreadable_run_in_kv_is_skipped_and_the_next_one_still_runs(tmp_path):
    """Garbage under a key of the runs bucket (a stranger, a bug) must not stop the leader."""
    from shared import subjects

    jobs = _mixed(3)
    import asyncio

    from launcher.nats import embedded_nats
    from launcher.replay import replay
    from launcher.stack import running_services, service_arguments
    from shared.settings import settings_for

    arguments = service_arguments("sia-hetero-64", None, True, None, 1, None)
    with embedded_nats(tmp_path) as nats, running_services(nats, arguments, tmp_path) as stack:
        bus = await nats.connect("driver")
        try:
            await stack.wait_ready(bus)
            store = await bus.js.key_value(subjects.RUNS_BUCKET)
            await store.put("aaa-garbage", b"\x93 not a checkpoint")  # listed before the real run
            _, records = await asyncio.wait_for(
                replay(bus, stack, jobs, "sia", {}, settings_for(None, "sia-hetero-64").name), 120
            )
        finally:
            await bus.close()
    assert all(r.finish_s is not None for r in records.jobs)
    assert "unreadable checkpoint" in (tmp_path / "policy.log").read_text()


def test_the_setup_refuses_a_lease_that_never_expires():
    from launcher.setup import main

    with pytest.raises(SystemExit):
        main(["--lease-ttl", "0"])


@pytest.mark.e2e
async def test_a_rigid_submission_runs_only_at_its_requested_gpus(tmp_path):
    """A rigid JobSpec reaches the simulated executors, which report it rigid as a node agent does:
    the policy gives it exactly its requested GPUs or none; the adaptive job beside it is rescaled."""
    import asyncio

    import nats.errors

    from launcher.nats import embedded_nats
    from launcher.replay import replay_prefix
    from launcher.stack import create_run, follow_run, running_services, service_arguments
    from shared.schema.base import Count
    from shared.schema.jobs import JobSpec
    from shared.schema.records import JobsQuery
    from shared.schema.runs import RunRequest

    prefix = replay_prefix("rigid-run")
    specs = [
        JobSpec(f"{prefix}rigid", "cifar10", requested_gpus=4, requested_batch=512, rigid=True, submit_s=0.0),
        JobSpec(f"{prefix}adaptive", "cifar10", requested_gpus=4, requested_batch=512, submit_s=0.0),
    ]
    with (
        embedded_nats(tmp_path) as server,
        running_services(server, service_arguments("sia-hetero-64", None, True, None, 1, None), tmp_path) as stack,
    ):
        bus = await server.connect("driver")
        try:
            await stack.wait_ready(bus)
            for spec in specs:
                await bus.js_publish(subjects.REPLAY_SUBMIT, spec, msg_id=spec.id)
            for _ in range(200):
                with contextlib.suppress(nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    if (await bus.request(subjects.EXECUTOR_STATUS, JobsQuery(prefix), Count, timeout=5)).n == 2:
                        break
                await asyncio.sleep(0.05)
            await create_run(bus, RunRequest("rigid-run", "sia", {}, "sia", tuple((s.id, 0.0) for s in specs)))
            report = await asyncio.wait_for(follow_run(bus, "rigid-run"), 120)
        finally:
            await bus.close()

    def gpus(name: str) -> set[int]:
        return {r.gpus[prefix + name] for r in report.rounds if prefix + name in r.gpus}

    assert gpus("rigid") == {4}
    assert len(gpus("adaptive")) > 1  # sia starts it small and scales it
