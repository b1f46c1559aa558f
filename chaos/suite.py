"""The fault-injection suite behind `goodput chaos` (docs/chaos.md).

Each fault is one replay of the same workload over the embedded stack (a NATS server of its own,
the six services as processes, two policy replicas, simulated executors, the zoo's jobs, sia on
sia-hetero-64), disturbed once the run has logged a third of the undisturbed run's rounds. Its
record says whether anything was lost:

- every submitted job completed exactly once: finished in the executors' JobRecords and in the run
  log's finished lists, and in no two rounds of the log (or the run failed, with its reason);
- no allocation exceeded capacity: each decided round's placements (watched in the run's
  checkpoint) and the executors' own placements (sampled while the run goes) never put more GPUs
  on a node than it has, nor a job on unknown or mixed nodes;
- the average JCT within 10% of the undisturbed run's (`avg_jct_ratio`), and how many jobs'
  outcomes (finish, restarts, GPU time) differ from it at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from nats import micro

from launcher.nats import EmbeddedNats, free_loopback_port, nats_from_binary, server_config
from launcher.replay import replay, replay_prefix, replay_records
from launcher.stack import Stack, running_services, service_arguments
from shared import subjects
from shared.bus import Bus
from shared.bus.encoding import is_json
from shared.cluster import Cluster, load_cluster
from shared.schema.base import Ack, Spots
from shared.schema.estimates import ObservedAll, ProfilesAll
from shared.schema.jobs import JobSpec
from shared.schema.records import JobRecord, JobRecords, JobsQuery
from shared.schema.rounds import (
    AdvanceRequest,
    ApplyRequest,
    FactsRequest,
    LiveJobsRequest,
    ModelsRequest,
    PlaceRequest,
)
from shared.schema.runs import RunCheckpoint, RunStep
from shared.settings import ROUND_S, settings_for
from sim.reference import WorkloadJob, load_workload

CLUSTER = "sia-hetero-64"
WORKLOAD = Path(__file__).resolve().parent.parent / "examples" / "workloads" / "mixed-40.csv"
QUICK_JOBS = 16
LEASE_TTL_S = 1.0
REQUEST_TIMEOUT_S = 2.0
JCT_TOLERANCE = 0.10
SAMPLE_S = 0.2  # how often the executors' placements are sampled
WATCH_IDLE_S = 1.0  # a watch silent this long is started again (the server may have restarted)
REPEATED = 200  # the latest genuine requests that bad-messages sends again
RUN_TIMEOUT_S = 300.0
FIELDS = (
    "fault",
    "jobs_submitted",
    "jobs_completed",
    "jobs_lost",
    "jobs_duplicated",
    "capacity_violations",
    "avg_jct_ratio",
)
# What each request subject takes: the invalid messages are made from these types.
REQUESTS: dict[str, type] = {
    subjects.FACTS: FactsRequest,
    subjects.MODELS: ModelsRequest,
    subjects.PLACE: PlaceRequest,
    subjects.APPLY: ApplyRequest,
    subjects.ADVANCE: AdvanceRequest,
    subjects.LIVE_JOBS: LiveJobsRequest,
    subjects.OBSERVE: ObservedAll,
    subjects.PROFILES: ProfilesAll,
    subjects.RECORDS: JobsQuery,
    subjects.EXECUTOR_STATUS: JobsQuery,
    subjects.ESTIMATOR_STATUS: Ack,
    subjects.POLICY_STATUS: Ack,
}


class Nats:
    """One trial's NATS server, which a fault may stop and start again on the same port and store."""

    def __init__(self, folder: Path):
        self.folder, self.port = folder, free_loopback_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        # Without authentication: the faults act as any service would (bad-messages listens to and
        # sends every request subject), which the per-role permissions exist to forbid.
        self.embedded = EmbeddedNats(self.url, None)
        self._server = contextlib.ExitStack()

    def start(self) -> None:
        self._server.enter_context(nats_from_binary(self.folder, self.port, server_config(None)))

    def stop(self) -> None:
        self._server.close()


@dataclass
class Trial:
    """A replay under way, as a fault sees it."""

    stack: Stack
    bus: Bus
    nats: Nats
    cluster: Cluster
    steps: list[RunStep] = field(default_factory=list)  # the run's log as stored, repeats included
    over: bool = False
    killed: set[str] = field(default_factory=set)  # instances the fault stopped on purpose
    notes: list[str] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return max((s.round + 1 for s in self.steps), default=0)

    async def at_round(self, n: int) -> None:
        """Until the log has `n` rounds (or the run is over)."""
        while self.rounds < n and not self.over:
            await asyncio.sleep(0.02)

    async def leader(self) -> str:
        """The policy instance leading now, waiting out a hand-over."""
        while True:
            with contextlib.suppress(RuntimeError, nats.errors.Error, micro.request.ServiceError):
                return await self.stack.policy_leader(self.bus)
            await asyncio.sleep(0.1)

    def kill(self, name: str) -> None:
        self.killed.add(name)
        self.stack.kill(name)


# ---- the faults: each disturbs a running replay once it has logged `at` rounds --------------------


async def kill_restart(trial: Trial, at: int, service: str, away_s: float = 0.5) -> None:
    """kill -9 a service (the policy leader for "policy"), start it again `away_s` later."""
    await trial.at_round(at)
    name = await trial.leader() if service == "policy" else service
    trial.kill(name)
    await asyncio.sleep(away_s)
    trial.stack.start(name)
    trial.notes.append(f"killed {name} at round {trial.rounds}")


async def kill_leader_twice(trial: Trial, at: int) -> None:
    """kill -9 the leader, and the next leader once it has logged a round."""
    await kill_restart(trial, at, "policy")
    await kill_restart(trial, trial.rounds + 1, "policy")


async def restart_nats(trial: Trial, at: int) -> None:
    """Stop the NATS server and start it again on the same port and JetStream store."""
    await trial.at_round(at)
    trial.nats.stop()
    await asyncio.sleep(1.0)
    trial.nats.start()
    trial.notes.append(f"NATS restarted at round {trial.rounds}")


async def pause_leader(trial: Trial, at: int) -> None:
    """SIGSTOP the leader past its lease; SIGCONT once a standby leads and has logged a round. The old
    leader must step down at its next checkpoint write (compare-and-set), not carry on."""
    await trial.at_round(at)
    name = await trial.leader()
    process = trial.stack.processes[name]
    process.send_signal(signal.SIGSTOP)
    try:
        while await trial.leader() == name:
            await asyncio.sleep(0.1)
        await trial.at_round(trial.rounds + 1)
    finally:
        process.send_signal(signal.SIGCONT)
    for _ in range(30):  # it notices at its next renewal or checkpoint
        log = trial.stack.log(name)
        fenced = "stepping down" in log or "lost the lease" in log
        if fenced:
            break
        await asyncio.sleep(0.1)
    trial.notes.append(
        f"{name} paused past its lease; "
        + ("it stepped down on waking" if fenced else "it did not report stepping down")
    )


async def drop_executor(trial: Trial, at: int) -> None:
    """The simulated executors hold every node: kill -9 them and keep them away for three request
    time-outs, so that rounds find no executor at all, then bring them back (their state is in KV)."""
    await kill_restart(trial, at, "executor", away_s=3 * REQUEST_TIMEOUT_S)


async def bad_messages(trial: Trial, at: int, examples: int = 20) -> None:
    """Invalid messages (hypothesis, from each subject's type) on every request subject and on the
    submissions, then the genuine requests and submissions seen so far again: duplicated, and in
    reverse order."""
    seen: list[tuple[str, bytes]] = []

    async def capture(raw) -> None:
        seen.append((raw.subject, raw.data))

    captures = [await trial.bus.nc.subscribe(s, cb=capture) for s in (*REQUESTS, *subjects.SUBMISSIONS)]
    await trial.at_round(at)
    for capture_ in captures:
        await capture_.unsubscribe()
    if trial.over:  # nothing left to disturb: the trial says so rather than wait on answers
        trial.notes.append(f"the run ended before round {at}: no bad messages were sent")
        return
    trial.notes.append(f"at round {trial.rounds}:")
    answers: Counter[str] = Counter()
    for subject, message_type in REQUESTS.items():
        for data in invalid_payloads(message_type, examples):
            answers[await _answer(trial.bus, subject, data)] += 1
    for data in invalid_payloads(JobSpec, examples):
        await trial.bus.js.publish(subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR), data)
    genuine = [(s, d) for s, d in seen if not subjects.is_submission(s)][-REPEATED:]
    for subject, data in genuine + genuine[::-1]:
        await _answer(trial.bus, subject, data)
    for subject, data in [(s, d) for s, d in seen if subjects.is_submission(s)] * 2:
        await trial.bus.js.publish(subject, data)  # without the id: stored again, not de-duplicated
    trial.notes.append(
        f"{sum(answers.values())} invalid requests on {len(REQUESTS)} subjects answered "
        + ", ".join(f"{k}: {v}" for k, v in sorted(answers.items()))
        + f"; {examples} invalid submissions; {len(genuine)} genuine requests sent twice more, "
        f"the second time in reverse order"
    )


def invalid_payloads(message_type: type, n: int, seed: int = 0) -> list[bytes]:
    """`n` payloads that do not decode as `message_type`: its fields (some missing, one unknown)
    with values of any kind, or bytes that need not be msgpack at all (hypothesis)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    names = [f.encode_name for f in msgspec.structs.fields(message_type)] + ["unknown"]
    value = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda inner: st.lists(inner, max_size=3),
        max_leaves=4,
    )
    shaped = st.dictionaries(st.sampled_from(names), value, max_size=len(names)).map(msgspec.msgpack.encode)
    payloads: list[bytes] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=n, database=None, phases=[Phase.generate], deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given((shaped | st.binary(max_size=64)).filter(lambda data: not _decodes(data, message_type)))
    def collect(data: bytes) -> None:
        payloads.append(data)

    collect()
    return payloads


def _decodes(data: bytes, message_type: type) -> bool:
    body = data or b"{}"  # as an endpoint takes an empty request: the empty object
    try:
        (msgspec.json.decode if is_json(body) else msgspec.msgpack.decode)(body, type=message_type, strict=False)
    except (msgspec.DecodeError, ValueError, TypeError):
        return False
    return True


async def _answer(bus: Bus, subject: str, data: bytes) -> str:
    """How a service answered a raw request: "ok", "error <code>" or "no answer"."""
    try:
        reply = await bus.nc.request(subject, data, timeout=REQUEST_TIMEOUT_S)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return "no answer"
    code = (reply.headers or {}).get(micro.request.ERROR_CODE_HEADER)
    return f"error {code}" if code else "ok"


def solver_fault(how: str) -> Callable[[int], tuple[str, dict]]:
    """The `chaos` policy around sia, its solve failing (`how`) in the given decision round."""
    return lambda round_: ("chaos", {"policy": "sia", "fail_round": round_, "how": how, "stall_s": 2 * LEASE_TTL_S})


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    disturb: Callable[[Trial, int], Awaitable[None]] | None = None
    policy: Callable[[int], tuple[str, dict]] | None = None  # the policy, given the round to fail


def _kill(service: str) -> Fault:
    what = "kill -9 the policy leader, restart it" if service == "policy" else f"kill -9 the {service}, restart it"
    return Fault(f"kill-{service}", what, lambda trial, at: kill_restart(trial, at, service))


FAULTS = (
    *(_kill(service) for service in ("profiler", "estimator", "placer", "executor", "policy")),
    Fault("kill-leader-twice", "kill -9 the leader, then the next leader", kill_leader_twice),
    Fault("restart-nats", "stop the NATS server, start it on the same port and store", restart_nats),
    Fault("pause-leader", f"SIGSTOP the leader past its {LEASE_TTL_S:g} s lease, then SIGCONT", pause_leader),
    Fault("drop-executor", "the executors (all the nodes) gone for 3 request time-outs", drop_executor),
    Fault("bad-messages", "invalid, duplicated and reordered messages on every subject", bad_messages),
    Fault("solver-raises", "the policy's solve raises in one round", policy=solver_fault("raise")),
    Fault("solver-timeout", "the policy's solve hangs, then times out, in one round", policy=solver_fault("timeout")),
)
BASELINE = Fault("baseline", "undisturbed")


# ---- one replay, watched -------------------------------------------------------------------------


@dataclass
class Outcome:
    records: list[JobRecord]
    steps: list[RunStep]
    capacity_violations: int
    rounds_checked: int
    failure: str
    crashed: list[str]
    notes: list[str]


async def run_trial(jobs: list[WorkloadJob], fault: Fault, fail_round: int, at: int, folder: Path) -> Outcome:
    """Replay `jobs` on a fresh stack under `fault`."""
    arguments = service_arguments(CLUSTER, None, True, None, 1, None)
    policy, options = fault.policy(fail_round) if fault.policy else ("sia", {})
    nats = Nats(folder)
    nats.start()
    try:
        with running_services(nats.embedded, arguments, folder, {"policy": 2}, lease_ttl_s=LEASE_TTL_S) as stack:
            bus = await nats.embedded.connect("chaos")
            try:
                await stack.wait_ready(bus)
                trial = Trial(stack, bus, nats, load_cluster(CLUSTER))
                return await _watched(trial, jobs, fault, policy, options, at)
            finally:
                await bus.close()
    finally:
        nats.stop()


async def _watched(trial: Trial, jobs, fault: Fault, policy: str, options: dict, at: int) -> Outcome:
    run_id = f"chaos-{uuid.uuid4().hex[:12]}"
    prefix = replay_prefix(run_id)
    checked: dict[float, int] = {}  # decided round (its time) -> nodes over capacity
    sampled = [0]  # samples of the executors' placements over capacity
    watchers = [
        asyncio.ensure_future(w)
        for w in (_follow(trial, run_id), _watch_decisions(trial, run_id, checked), _sample_executors(trial, sampled))
    ]
    disturbance = asyncio.ensure_future(fault.disturb(trial, at)) if fault.disturb else None
    failure = ""
    try:
        _, records = await asyncio.wait_for(
            replay(
                trial.bus,
                trial.stack,
                jobs,
                policy,
                options,
                settings_for(None, CLUSTER).name,
                request_timeout_s=REQUEST_TIMEOUT_S,
                run_id=run_id,
            ),
            RUN_TIMEOUT_S,
        )
        jobs_seen = list(records.jobs)
    except (RuntimeError, asyncio.TimeoutError) as error:
        failure = str(error).splitlines()[0] or type(error).__name__
        jobs_seen = list((await replay_records(trial.bus, prefix, 30)).jobs)
    if disturbance:
        try:
            await asyncio.wait_for(disturbance, RUN_TIMEOUT_S)
        except asyncio.TimeoutError:
            failure = failure or f"the fault's disturbance did not end within {RUN_TIMEOUT_S:.0f} s"
    await asyncio.sleep(0.2)  # the log's last step reaches the follower
    for watcher in watchers:
        watcher.cancel()
    await asyncio.gather(*watchers, return_exceptions=True)
    # The replay's jobs have ids of its own (`<run>.<name>`): its log names them so.
    trial.steps = [
        msgspec.structs.replace(s, finished=tuple(n.removeprefix(prefix) for n in s.finished)) for s in trial.steps
    ]
    crashed = [
        name
        for name, process in trial.stack.processes.items()
        if process.poll() is not None and name not in trial.killed
    ]
    kept = sum("previous allocation kept" in e for s in {s.round: s for s in trial.steps}.values() for e in s.events)
    if kept:
        trial.notes.append(f"{kept} round(s) kept the previous allocation")
    return Outcome(
        jobs_seen, trial.steps, sum(checked.values()) + sampled[0], len(checked), failure, crashed, trial.notes
    )


async def _follow(trial: Trial, run_id: str) -> None:
    """Every step stored on the run's log, repeats included; read again from the first when the
    log falls silent (a consumer lost with a restarted server)."""
    while not trial.over:
        steps: list[RunStep] = []
        with contextlib.suppress(asyncio.TimeoutError, nats.errors.Error):
            async for step in trial.bus.follow(subjects.run_log(run_id), RunStep, idle_timeout=WATCH_IDLE_S):
                steps.append(step)
                if len(steps) > len(trial.steps):
                    trial.steps = list(steps)
                trial.over = trial.over or step.over
                if trial.over:
                    break


async def _watch_decisions(trial: Trial, run_id: str, checked: dict[float, int]) -> None:
    """Each decided round's placements, as the leader checkpoints them; watched afresh when silent."""
    while True:
        with contextlib.suppress(nats.errors.Error):
            store = await trial.bus.js.key_value(subjects.RUNS_BUCKET)
            watcher = await store.watch(run_id)
            try:
                while True:
                    entry = await watcher.updates(WATCH_IDLE_S)
                    decided = (
                        trial.bus.decode(entry.value, RunCheckpoint).clock.decided if entry and entry.value else None
                    )
                    if decided is not None:
                        checked[decided.apply.now_s] = overfilled(trial.cluster, decided.apply.placements)
            finally:
                with contextlib.suppress(nats.errors.Error):
                    await watcher.stop()
        await asyncio.sleep(0.1)


async def _sample_executors(trial: Trial, sampled: list[int]) -> None:
    """The placements the executors hold for their unfinished jobs, every SAMPLE_S."""
    while True:
        await asyncio.sleep(SAMPLE_S)
        try:
            records = await trial.bus.request(subjects.RECORDS, Ack(), JobRecords, timeout=REQUEST_TIMEOUT_S)
        except (nats.errors.Error, micro.request.ServiceError):
            continue  # the executors are down: nothing runs
        running = {r.name: r.placement for r in records.jobs if r.finish_s is None and r.placement}
        sampled[0] += overfilled(trial.cluster, running) > 0


def overfilled(cluster: Cluster, placements: Mapping[str, Spots]) -> int:
    """Nodes given more GPUs than they have, plus jobs placed on unknown or mixed nodes."""
    capacity = {n.name: n.gpus for n in cluster.nodes}
    used: Counter[str] = Counter()
    bad = 0
    for spots in placements.values():
        bad += any(node not in capacity for node, _ in spots) or cluster.placement_type(spots) is None
        for node, gpus in spots:
            used[node] += gpus
    return bad + sum(gpus > capacity.get(node, 0) for node, gpus in used.items())


# ---- the record of a fault -----------------------------------------------------------------------


def avg_jct(records: list[JobRecord]) -> float | None:
    done = [r.finish_s - r.submit_s for r in records if r.finish_s is not None]
    return sum(done) / len(done) if done else None


def record(fault: Fault, jobs: list[WorkloadJob], outcome: Outcome, baseline: Outcome | None) -> dict[str, Any]:
    submitted = {j.name for j in jobs}
    records = [r for r in outcome.records if r.name in submitted]
    by_round = {s.round: s for s in reversed(outcome.steps)}  # a round logged twice counts once
    finished = Counter(name for step in by_round.values() for name in step.finished)
    completed = {r.name for r in records if r.finish_s is not None and finished[r.name] > 0}
    failed = len(submitted - completed) if outcome.failure else 0
    duplicated = sum(n > 1 for n in finished.values()) + len(records) - len({r.name for r in records})
    jct, base_jct = avg_jct(records), avg_jct(baseline.records) if baseline else None
    reference = {r.name: _result(r) for r in (baseline or outcome).records}
    changed = sum(_result(r) != reference.get(r.name) for r in records)
    row = {
        "fault": fault.name,
        "what": fault.what,
        "jobs_submitted": len(submitted),
        "jobs_completed": len(completed),
        "jobs_lost": len(submitted) - len(completed) - failed,
        "jobs_failed": failed,
        "jobs_duplicated": duplicated,
        "capacity_violations": outcome.capacity_violations,
        "rounds_checked": outcome.rounds_checked,
        "avg_jct_ratio": jct / base_jct if jct and base_jct else None,
        "outcomes_changed": changed,
        "services_crashed": outcome.crashed,
        "failure": outcome.failure,
        "notes": outcome.notes,
    }
    row["ok"] = (
        row["jobs_lost"] == row["jobs_duplicated"] == row["capacity_violations"] == 0
        and not outcome.failure
        and not outcome.crashed
        and row["avg_jct_ratio"] is not None
        and abs(row["avg_jct_ratio"] - 1) <= JCT_TOLERANCE
    )
    return row


def _result(r: JobRecord) -> tuple:
    return r.finish_s, r.restarts, round(r.gpu_seconds, 3)


# ---- the suite -----------------------------------------------------------------------------------


def fault_names() -> list[str]:
    return [f.name for f in FAULTS]


def workload(quick: bool, path: str | os.PathLike | None = None, jobs: int | None = None) -> list[WorkloadJob]:
    loaded = load_workload(path or WORKLOAD)
    return loaded[: jobs or (QUICK_JOBS if quick else len(loaded))]


async def run_suite(
    jobs: list[WorkloadJob], names: list[str] | None = None, progress: Callable[[dict], None] | None = None
) -> list[dict]:
    """The baseline, then each fault (all, or `names`): one record each, the baseline's first."""
    unknown = sorted(set(names or ()) - set(fault_names()))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; choose from {', '.join(fault_names())}")
    with tempfile.TemporaryDirectory(prefix="goodput-chaos-") as folder:

        async def trial(fault: Fault, fail_round: int = 0, at: int = 0) -> Outcome:
            workdir = Path(folder) / fault.name
            workdir.mkdir()
            return await run_trial(jobs, fault, fail_round, at, workdir)

        baseline = await trial(BASELINE)
        rows = [record(BASELINE, jobs, baseline, baseline)]
        if progress:
            progress(rows[-1])
        at = max(len({s.round for s in baseline.steps}) // 3, 1)
        # The solver fails in a decision round of the middle third, as the undisturbed run decided it.
        decided = sorted(round(s.record.now_s / ROUND_S) for s in baseline.steps if s.record is not None)
        fail_round = decided[len(decided) // 2] if decided else 1
        for fault in FAULTS:
            if names and fault.name not in names:
                continue
            rows.append(record(fault, jobs, await trial(fault, fail_round, at), baseline))
            if progress:
                progress(rows[-1])
        return rows


def table(rows: list[dict]) -> str:
    header = ["fault", "submitted", "completed", "lost", "duplicated", "over capacity", "avg JCT ratio", "ok"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        ratio = f"{r['avg_jct_ratio']:.3f}" if r["avg_jct_ratio"] is not None else "—"
        cells = [
            r["fault"],
            r["jobs_submitted"],
            r["jobs_completed"],
            r["jobs_lost"],
            r["jobs_duplicated"],
            r["capacity_violations"],
            ratio,
            "yes" if r["ok"] else "NO",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
