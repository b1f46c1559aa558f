"""goodput.api.explain and goodput.api.rounds over a real NATS server: the policy leader's recorder
stores each round's decisions in the decisions stream, the API's handlers read a job's last ones
back and say why it has what it has, naming only the jobs the asker may know; and `goodput explain`
of a live stack names why a job waits. (The pure parts: tests/test_explain.py.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import msgspec
import pytest
from test_api_handlers import MemoryKV

from services.api.queries import Queries
from services.api.who import OPERATOR, Who
from services.policy.recorder import DecisionRecorder
from shared import storage, subjects
from shared.bus.encoding import NotFound
from shared.schema.base import Node
from shared.schema.decisions import ExplainRequest, Holder, JobDecision, RoundsRequest, RoundSummary
from shared.schema.jobs import JobOwner
from shared.schema.records import JobRecord, select

ANN, VIC, ALICE = Who("ann", "nlp"), Who("vic", "vision"), Who("alice")
NODES = (Node("dgx-0", "dgx", 8),)


class Records:
    """The executors' records, as their `records` endpoint answers a query."""

    def __init__(self, *records: JobRecord) -> None:
        self.jobs = {r.name: r for r in records}

    async def __call__(self, query):
        return select(self.jobs.values(), query)


def queued(job: str, team: str = "default", owner: str = "") -> JobRecord:
    return JobRecord(job, "cifar10", 0.0, None, 0, 0.0, None, state="queued", owner=owner, team=team)


async def recorded(bus, rounds: list[tuple[RoundSummary, list[JobDecision]]]) -> None:
    """Store the rounds as the policy leader does, and wait for their acks."""
    stream = storage.STREAMS[subjects.DECISIONS_STREAM]
    await bus.ensure_stream(stream.name, stream.subjects, **stream.limits)
    recorder = DecisionRecorder(bus)
    for summary, decisions in rounds:
        await recorder.decided(summary, decisions)
    await asyncio.gather(*recorder.in_flight)
    assert not recorder.failing


def summary(number: int) -> RoundSummary:
    return RoundSummary(
        number, 60.0 * number, "goodput", 2, 1, 1, 0, 8, nodes=NODES, events=(f"round {number}",),
        team_gpus={"nlp": {"dgx": 4}, "vision": {"dgx": 4}}, team_borrowed={"nlp": 0, "vision": 4},
        team_reclaimed={"nlp": 1},
    )  # fmt: skip


async def test_explain_reads_a_jobs_last_decisions_and_names_only_the_jobs_the_asker_may_know(
    connect_bus, name_prefix
) -> None:
    bus = await connect_bus("api")
    waiting, holder = f"nlp.{name_prefix}-w", f"vision.{name_prefix}-b"
    held = Holder(holder, "vision", "dgx", 8, 5000.0)
    rounds = [
        (
            summary(n),
            [
                JobDecision(n, 60.0 * n, waiting, "nlp", change="waiting", holders=(held,), usable_types=("dgx",)),
                JobDecision(n, 60.0 * n, holder, "vision", "allocated", "same", gpus=8, gpu_type="dgx", goodput=5e3),
            ],
        )
        for n in range(1, 8)
    ]
    await recorded(bus, rounds)
    queries = Queries(bus, MemoryKV())
    queries.records = Records(queued(waiting, "nlp", "ann"), queued(holder, "vision", "vic"))

    # A team-mate reads the last three: the holder is another team's, named by its team only.
    answer = await queries.explain(ExplainRequest(f"{name_prefix}-w", rounds=3), ANN)
    assert [d.round for d in answer.decisions] == [5, 6, 7] and answer.state == "queued"
    assert answer.sentences == (
        "Waiting since round 5 or earlier: the cluster's A100 GPUs are all held — a job of team vision holds 8 A100.",
    )
    assert all(d.job == f"{name_prefix}-w" and d.holders[0].job == "" for d in answer.decisions)
    # The operator reads them all, by the ids within the cluster.
    everything = await queries.explain(ExplainRequest(waiting), OPERATOR)
    assert [d.round for d in everything.decisions] == list(range(1, 8))
    assert everything.sentences == (
        f"Waiting since round 1: the cluster's A100 GPUs are all held — job {holder} holds 8 A100.",
    )
    # Another team's job and an unknown id: the same 404.
    for job_id, who in ((f"{name_prefix}-w", VIC), (f"{name_prefix}-nosuch", ANN)):
        with pytest.raises(NotFound, match=f"no job '{job_id}' of yours"):
            await queries.explain(ExplainRequest(job_id), who)

    # The last rounds: a login gets no events (they name jobs) and the nodes once, the operator all.
    page = await queries.rounds(RoundsRequest(limit=2), ANN)
    assert [s.round for s in page.rounds] == [6, 7] and page.nodes == NODES
    assert all(s.events == () and s.nodes == () for s in page.rounds)
    # ... and of the teams' use its own team's only, as goodput.api.teams shows it.
    assert all((s.team_gpus, s.team_borrowed, s.team_reclaimed) == ({"nlp": {"dgx": 4}}, {"nlp": 0}, {"nlp": 1})
               for s in page.rounds)  # fmt: skip
    operator = await queries.rounds(RoundsRequest(limit=2), OPERATOR)
    assert [s.events for s in operator.rounds] == [("round 6",), ("round 7",)]
    assert all(set(s.team_gpus) == {"nlp", "vision"} for s in operator.rounds)


async def test_a_login_without_a_team_knows_its_own_other_jobs_by_id_and_no_one_elses(connect_bus, name_prefix) -> None:
    bus = await connect_bus("api")
    mine, own, bobs = (f"{name_prefix}-{n}" for n in ("w", "x", "y"))
    holders = (Holder(own, "default", "aws", 4, 700.0), Holder(bobs, "default", "aws", 4, 600.0))
    decision = JobDecision(3, 180.0, mine, change="waiting", holders=holders, usable_types=("aws",))
    await recorded(bus, [(summary(3), [decision])])
    owners = MemoryKV()
    for job, login in ((mine, "alice"), (own, "alice"), (bobs, "bob")):
        await owners.create(job, JobOwner(1, "digest", subjects.stored(subjects.DEFAULT_TEAM, login)))
    queries = Queries(bus, owners)
    queries.records = Records(queued(mine, owner="alice"), queued(own, owner="alice"), queued(bobs, owner="bob"))
    answer = await queries.explain(ExplainRequest(mine), ALICE)
    assert answer.sentences == (
        f"Waiting since round 3: the cluster's T4 GPUs are all held — job {own} holds 4 T4, another job holds 4 T4.",
    )
    assert [h.job for h in answer.decisions[0].holders] == [own, ""]


async def test_a_refused_submission_under_another_teams_id_reads_none_of_its_decisions(
    connect_bus, name_prefix
) -> None:
    # A login of the default team submits an id of team nlp's form: refused, and listed as its own
    # under that very id. Explaining it must not read the nlp job's decisions.
    bus = await connect_bus("api")
    theirs = f"nlp.{name_prefix}-run"
    decision = JobDecision(4, 240.0, theirs, "nlp", "allocated", "started", gpus=2, gpu_type="dgx", goodput=400.0)
    await recorded(bus, [(summary(4), [decision])])
    queries = Queries(bus, MemoryKV())
    refused = JobRecord(theirs, "imagenet", 0.0, None, 0, 0.0, None, failure="ids beginning nlp. are team nlp's")
    running = JobRecord(theirs, "imagenet", 0.0, None, 0, 0.0, None, state="running", owner="ann", team="nlp")
    both = (msgspec.structs.replace(refused, state="rejected", owner="alice"), running)

    async def records(query):
        return select(both, query)

    queries.records = records
    answer = await queries.explain(ExplainRequest(theirs), ALICE)
    assert answer.state == "rejected" and answer.decisions == ()
    assert not any("2 A100" in sentence or "400" in sentence for sentence in answer.sentences)
    operator = await queries.explain(ExplainRequest(theirs), OPERATOR)
    assert [d.goodput for d in operator.decisions] == [400.0]


async def test_a_job_with_no_decision_recorded_yet_says_so(connect_bus, name_prefix) -> None:
    bus = await connect_bus("api")
    await recorded(bus, [])
    queries = Queries(bus, MemoryKV())
    queries.records = Records(queued(f"{name_prefix}-new", owner="alice"))
    answer = await queries.explain(ExplainRequest(f"{name_prefix}-new"), ALICE)
    assert answer.sentences == ("No round has decided for it yet (queued).",) and answer.decisions == ()


# ---- a live stack --------------------------------------------------------------------------------


@pytest.mark.e2e
def test_goodput_explain_names_why_a_job_waits_on_a_live_stack(tmp_path) -> None:
    from test_live_service import GOODPUT, ROOT, Up, command_env

    from launcher.nats import free_loopback_port

    cluster = tmp_path / "four-t4.yaml"
    cluster.write_text("name: four-t4\nnodes: [{gpu_type: aws, count: 1, gpus_per_node: 4}]\n")
    jobs = []
    for name in ("first", "second"):  # each the whole cluster: one runs, one waits for hours of its clock
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"id: {name}\napplication: cifar10\nrequested_gpus: 4\nrigid: true\n")
        jobs.append(str(path))
    data = tmp_path / "data"
    up = Up(free_loopback_port(), data, "--cluster", str(cluster), "--speed", "1")

    def goodput(*words: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*GOODPUT, *words], cwd=ROOT, env=command_env(data), capture_output=True, text=True, timeout=60
        )

    try:
        up.wait_serving()
        submitted = goodput("submit", *jobs)
        assert submitted.returncode == 0, submitted.stderr
        deadline = time.monotonic() + 180
        while True:  # until a round has decided for both: one of them waits, and says why
            answers = {
                name: json.loads(goodput("explain", name, "--json").stdout or "{}") for name in ("first", "second")
            }
            waiting = [
                n for n, a in answers.items() if any(s.startswith("Waiting since") for s in a.get("sentences", ()))
            ]
            if waiting:
                break
            assert time.monotonic() < deadline, answers
            time.sleep(1.0)
        name = waiting[0]
        other = "second" if name == "first" else "first"
        sentence = next(s for s in answers[name]["sentences"] if s.startswith("Waiting since"))
        assert f"the cluster's T4 GPUs are all held — job {other} holds 4 T4" in sentence, sentence
        shown = goodput("explain", name)
        assert shown.returncode == 0 and f"{name}: queued" in shown.stdout and "Waiting since" in shown.stdout
        unknown = goodput("explain", "nosuch")
        assert unknown.returncode == 2 and "no job 'nosuch' of yours" in unknown.stderr, unknown.stderr
    finally:
        up.kill()
