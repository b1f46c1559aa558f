"""Teams through the user API's handlers and the real executors' bookkeeping, with no NATS server: a
job is its team's (stored under `team.id`, answered by the id the team knows), ids are unique per
team, another team's job is not found exactly as an unknown id is, a body naming another team is
refused, a team that floods fills only its own share, `goodput.api.teams` shows a login its own
team and the operator every team, and the executors' records carry the round's word on teams."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec
import nats.js.errors
import pytest
from test_api_handlers import CODEC, MemoryKV, RecordingBus
from test_executor_handlers import NoBus, RecordingKV, RecordingNodes

from cli.job_view import job_lines, job_table, teams_lines
from services.api.service import Api, as_requested
from services.api.submissions import Kept
from services.api.who import OPERATOR, Who, login
from services.executor.local import LocalExecutors
from services.executor.real import MAX_RECLAIMS, RealExecutors, RealExecutorService
from shared import subjects
from shared.bus.encoding import NotFound
from shared.bus.requesters import Requester
from shared.cluster import Cluster
from shared.lifecycle import JobState
from shared.schema.api import JobRequest, JobsRequest, TeamsRequest, job_status
from shared.schema.base import MAX_ID, Node
from shared.schema.jobs import Cancel, JobSpec, Profiled, Rejected
from shared.schema.logs import LogsRequest
from shared.schema.records import JobRecord, JobRecords, select
from shared.schema.rounds import ApplyRequest, Reclaim
from shared.schema.teams import TeamFile, TeamSpec
from shared.storage import LoginLimits, TeamLimits

ANN, BOB = Who("ann", "nlp"), Who("bob", "nlp")  # team-mates
VIC = Who("vic", "vision")
ALICE = Who("alice")  # a login of DEFAULT_TEAM


def body(job_id: str, **fields: Any) -> bytes:
    return msgspec.json.encode({"id": job_id, "application": "cifar10", **fields})


def matches(pattern: str, subject: str) -> bool:
    """Whether a NATS subject filter (`*` a token, `>` the rest) matches a subject."""
    want, have = pattern.split("."), subject.split(".")
    for n, token in enumerate(want):
        if token == ">":
            return len(have) > n
        if n >= len(have) or token not in ("*", have[n]):
            return False
    return len(want) == len(have)


@dataclass
class ExecutorsBus(RecordingBus):
    """The API's bus, with executors that read every stored submission at once (queued, for its login
    and team) and every cancel, and answer a query for records as the real ones do (`select`); the
    jobs stream counts what was published under a subject filter, as JetStream does; the logs
    stream holds nothing."""

    jobs: dict[str, JobRecord] = field(default_factory=dict)
    logs_asked: list[str] = field(default_factory=list)

    async def js_publish(self, subject: str, msg: Any, **options: Any) -> Any:
        ack = await super().js_publish(subject, msg, **options)
        base, team, login = subjects.owner_of(subject)
        if base == subjects.STORED:
            self.jobs[msg.id] = JobRecord(msg.id, msg.application, 0.0, None, 0, 0.0, None, state="queued")
            self.jobs[msg.id] = msgspec.structs.replace(self.jobs[msg.id], owner=login, team=msg.team)
        elif base == subjects.REFUSED and msg.job_id is not None:  # listed apart, as the executors do
            self.jobs[f"apart.{len(self.jobs)}"] = JobRecord(
                msg.job_id, "", 0.0, None, 0, 0.0, None, failure=msg.reason, state="rejected", owner=login, team=team
            )
        elif subject == subjects.CANCEL:
            self.jobs[msg.job_id] = msgspec.structs.replace(self.jobs[msg.job_id], state=JobState.CANCELLED)
        return ack

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> SimpleNamespace:
        self.infos.append((name, subjects_filter))
        counts: dict[str, int] = {}
        for subject, _, _ in self.published:
            if subjects_filter is None or matches(subjects_filter, subject):
                counts[subject] = counts.get(subject, 0) + 1
        return SimpleNamespace(
            state=SimpleNamespace(subjects=counts, bytes=0), config=SimpleNamespace(max_bytes=1 << 30)
        )

    async def request(self, subject: str, message: Any, answer_type: type, **_: Any) -> Any:
        self.requests.append((subject, message))
        assert subject == subjects.RECORDS and answer_type is JobRecords
        return select(self.jobs.values(), message)

    async def get_msg(self, stream: str, seq: int, subject: str, next: bool) -> Any:
        self.logs_asked.append(subject)
        raise nats.js.errors.NotFoundError


@dataclass
class CountingKV(MemoryKV):
    """The owners' KV, counting the reads: a lookup's work is the same for any id it does not find."""

    gets: list[str] = field(default_factory=list)

    async def get(self, key: str):
        self.gets.append(key)
        return await super().get(key)


def gate(**options: Any) -> tuple[Api, ExecutorsBus, CountingKV]:
    bus, owners = ExecutorsBus(), CountingKV()
    return Api(bus, owners, lambda spec: None, **options), bus, owners


def team_file_kv(**teams: TeamSpec) -> MemoryKV:
    kv = MemoryKV()
    kv.entries[subjects.TEAMS_KEY] = (TeamFile(teams), 1)
    return kv


NLP_AND_VISION = {
    "nlp": TeamSpec(quota={"T4": 8, "A100": 8}, borrow={"A100": 8}, weight=2.0),
    "vision": TeamSpec(quota={"T4": 4, "A100": 8}),
}


# ---- whose request ----------------------------------------------------------------------------------


def test_the_requesters_team_is_its_accounts_and_the_services_own_account_is_the_operator(monkeypatch) -> None:
    for account, user, expected in [
        ("TEAM_nlp", "ann", ANN),
        ("LOGINS", "alice", ALICE),
        ("GOODPUT", "api", OPERATOR),
        ("", "", OPERATOR),  # a header a client of the services' account wrote itself
    ]:
        monkeypatch.setattr("services.api.who.requester", lambda a=account, u=user: Requester(a, u))
        assert login() == expected, account
    monkeypatch.setattr("services.api.who.requester", lambda: None)  # within the services' own account
    assert login() == OPERATOR and OPERATOR.everyone and not ANN.everyone


async def test_every_handler_and_a_bad_bodys_answer_are_given_the_requester_the_server_names(monkeypatch) -> None:
    monkeypatch.setattr("services.api.who.requester", lambda: Requester("TEAM_nlp", "ann"))
    asked = []

    async def handler(*arguments: Any) -> None:
        asked.append(arguments)

    await as_requested(handler)(JobRequest("bert-1"))
    await as_requested(handler)("goodput.api.submit", b"{", ValueError("unreadable"))  # on_invalid's
    assert asked == [(JobRequest("bert-1"), ANN), ("goodput.api.submit", b"{", asked[1][2], ANN)]


# ---- a job is its team's ----------------------------------------------------------------------------


async def test_a_job_is_stored_as_its_teams_under_its_id_within_the_team_and_ids_are_unique_per_team() -> None:
    judge, bus, owners = gate()
    answer = await judge.submissions.submit(body("bert-1"), ANN)
    assert answer.accepted and answer.id == "bert-1", answer  # the id as the team knows it
    [(subject, spec, _)] = bus.stored()
    assert subject == subjects.stored("nlp", "ann") and (spec.id, spec.team) == ("nlp.bert-1", "nlp")
    assert owners.entries["nlp.bert-1"][0].subject == subjects.stored("nlp", "ann")
    # Team vision, and DEFAULT_TEAM's alice, use the same id: three jobs.
    assert (await judge.submissions.submit(body("bert-1"), VIC)).accepted
    assert (await judge.submissions.submit(body("bert-1"), ALICE)).accepted
    assert [(s.id, s.team) for _, s, _ in bus.stored()] == [
        ("nlp.bert-1", "nlp"),
        ("vision.bert-1", "vision"),
        ("bert-1", "default"),
    ]
    # A team-mate's other body under the id is refused as the id is taken; the same body is a repeat.
    taken = await judge.submissions.submit(body("bert-1", requested_gpus=2), BOB)
    assert not taken.accepted and "job bert-1 already exists" in taken.reason, taken
    again = await judge.submissions.submit(body("bert-1"), ANN)
    assert again.accepted and "not stored again" in again.reason and len(bus.stored()) == 3, again
    # The refusal is recorded for bob's team, under its id within the cluster.
    [(refused, record, _)] = [p for p in bus.published if subjects.owner_of(p[0])[0] == subjects.REFUSED]
    assert refused == subjects.refused("nlp", "bob") and record.job_id == "nlp.bert-1"


async def test_a_body_naming_another_team_is_refused_and_its_own_team_is_taken() -> None:
    judge, bus, _ = gate()
    other = await judge.submissions.submit(body("bert-1", team="vision"), ANN)
    assert not other.accepted and other.reason == "job bert-1 names team vision; your login belongs to team nlp"
    assert bus.stored() == []
    operator = await judge.submissions.submit(body("bert-2", team="nlp"), OPERATOR)  # the operator's are DEFAULT_TEAM's
    assert not operator.accepted and "your login belongs to team default" in operator.reason
    own = await judge.submissions.submit(body("bert-1", team="nlp", priority=7), ANN)
    assert own.accepted, own
    [(_, spec, _)] = bus.stored()
    assert (spec.id, spec.team, spec.priority) == ("nlp.bert-1", "nlp", 7)


async def test_an_id_too_long_within_its_team_and_a_default_id_in_a_teams_name_are_refused_clearly() -> None:
    judge, bus, _ = gate(teams=team_file_kv(**NLP_AND_VISION))
    longest = "x" * (MAX_ID - len("nlp."))
    assert (await judge.submissions.submit(body(longest), ANN)).accepted
    too_long = await judge.submissions.submit(body(longest + "y"), ANN)
    assert not too_long.accepted and f"your team's ids are at most {MAX_ID - 4}" in too_long.reason, too_long
    assert (await judge.submissions.submit(body("x" * MAX_ID), ALICE)).accepted  # DEFAULT_TEAM's ids stay as they are
    squatting = await judge.submissions.submit(body("nlp.bert-1"), ALICE)
    assert not squatting.accepted and "ids beginning nlp. are team nlp's" in squatting.reason, squatting
    assert (await judge.submissions.submit(body("other.bert-1"), ALICE)).accepted  # no team of that name
    assert [s.id for _, s, _ in bus.stored()] == [f"nlp.{longest}", "x" * MAX_ID, "other.bert-1"]


async def test_a_job_names_the_other_bodies_refused_under_its_id_and_the_list_shows_it_once() -> None:
    judge, _, _ = gate()
    assert (await judge.submissions.submit(body("bert-1"), ANN)).accepted
    other = await judge.submissions.submit(body("bert-1", requested_gpus=2), BOB)  # another body under a taken id
    assert not other.accepted
    found = await judge.queries.job(JobRequest("bert-1"), ANN)
    assert (found.state, found.refusals) == ("queued", (other.reason,))
    assert [j.id for j in (await judge.queries.jobs(JobsRequest(), ANN)).jobs] == ["bert-1"]
    assert (await judge.submissions.submit(body("bert-1"), VIC)).accepted  # vision's bert-1 is another job
    assert (await judge.queries.job(JobRequest("bert-1"), VIC)).refusals == ()


async def test_team_mates_see_follow_and_cancel_each_others_jobs_and_no_one_else_does() -> None:
    judge, bus, owners = gate()
    for who, job_id in ((ANN, "bert-1"), (BOB, "gpt-2"), (VIC, "bert-1"), (ALICE, "lm-1"), (Who("al"), "lm-2")):
        assert (await judge.submissions.submit(body(job_id), who)).accepted
    # Lookups: bob finds ann's job by the id the team knows; vision's bert-1 is vision's own.
    found = await judge.queries.job(JobRequest("bert-1"), BOB)
    assert (found.id, found.team, found.state) == ("bert-1", "nlp", "queued")
    assert (await judge.queries.job(JobRequest("bert-1"), VIC)).id == "bert-1"
    # Lists: each team its own, by the ids it knows; DEFAULT_TEAM's logins each their own; the operator all.
    listed = {who: [j.id for j in (await judge.queries.jobs(JobsRequest(), who)).jobs] for who in (ANN, VIC, ALICE)}
    assert listed == {ANN: ["bert-1", "gpt-2"], VIC: ["bert-1"], ALICE: ["lm-1"]}
    everyone = await judge.queries.jobs(JobsRequest(), OPERATOR)
    assert [(j.id, j.team) for j in everyone.jobs] == [
        ("nlp.bert-1", "nlp"),
        ("nlp.gpt-2", "nlp"),
        ("vision.bert-1", "vision"),
        ("lm-1", "default"),
        ("lm-2", "default"),
    ]
    assert [j.id for j in (await judge.queries.jobs(JobsRequest(prefix="g"), ANN)).jobs] == ["gpt-2"]
    assert (await judge.queries.job(JobRequest("nlp.gpt-2"), OPERATOR)).id == "nlp.gpt-2"

    # Another team's job is not found, as an id no one holds, with the same work behind the answer.
    answers = []
    for job_id in ("gpt-2", "gpt-9"):  # nlp's; no one's
        bus.requests.clear()
        owners.gets.clear()
        with pytest.raises(NotFound) as refused:
            await judge.queries.job(JobRequest(job_id), VIC)
        answers.append((str(refused.value).replace(job_id, "ID"), len(bus.requests), owners.gets))
    assert answers[0][:2] == answers[1][:2] and len(answers[0][2]) == len(answers[1][2]) == 1, answers
    assert answers[0][0] == "no job 'ID' of yours: none was submitted under this id by team vision"
    for lookup in (
        lambda: judge.queries.cancel(JobRequest("gpt-2"), VIC),
        lambda: judge.queries.logs(LogsRequest("gpt-2"), VIC),
        lambda: judge.queries.job(JobRequest("lm-1"), ANN),
        lambda: judge.queries.job(JobRequest("lm-2"), ALICE),  # DEFAULT_TEAM's logins are not team-mates
    ):
        with pytest.raises(NotFound):
            await lookup()
    assert bus.jobs["nlp.gpt-2"].state == "queued" and bus.logs_asked == []

    # A team-mate follows and cancels it: by its id within the cluster.
    page = await judge.queries.logs(LogsRequest("gpt-2", rank=0), ANN)
    assert bus.logs_asked == [subjects.job_logs("nlp", "nlp.gpt-2")] and page.lines == ()
    cancelled = await judge.queries.cancel(JobRequest("gpt-2"), ANN)
    assert (cancelled.cancelled, cancelled.id, cancelled.state) == (True, "gpt-2", JobState.CANCELLED)
    [(_, order, msg_id)] = [p for p in bus.published if p[0] == subjects.CANCEL]
    assert order == Cancel("nlp.gpt-2") and msg_id == "nlp.gpt-2.cancel"
    assert bus.jobs["vision.bert-1"].state == "queued"  # vision's job of the same id is untouched


async def test_a_teams_flood_fills_only_its_share_and_another_teams_logins_still_submit() -> None:
    kept_limits = dict(limits=LoginLimits(submissions=3, refusals=100), team_limits=TeamLimits(submissions=4))
    bus, owners = ExecutorsBus(), CountingKV()
    judge = Api(bus, owners, lambda spec: None, kept=Kept(bus, **kept_limits))
    answers = [await judge.submissions.submit(body(f"a-{n}"), ANN) for n in range(4)]
    assert [a.accepted for a in answers] == [True, True, True, False]
    assert answers[-1].reason.startswith("over your limit: login ann keeps 3 submissions"), answers[-1]
    assert (await judge.submissions.submit(body("b-0"), BOB)).accepted  # the team's fourth
    flood = await judge.submissions.submit(body("b-1"), BOB)
    assert not flood.accepted and flood.reason.startswith("over your team's limit: team nlp's logins keep 4"), flood
    # The intake stream's submissions are their subject's team's: held to the same share.
    delivery = SimpleNamespace(subject=subjects.intake("nlp", "carl"))
    await judge.submissions.judge(msgspec.Raw(body("c-0")), delivery)
    assert bus.published[-1][0] == subjects.refused("nlp", "carl")
    assert "over your team's limit" in bus.published[-1][1].reason
    # Another team, and DEFAULT_TEAM's logins, still submit; the operator is held to no share.
    await judge.submissions.judge(msgspec.Raw(body("v-0")), SimpleNamespace(subject=subjects.intake("vision", "vic")))
    assert (await judge.submissions.submit(body("v-1"), VIC)).accepted and (
        await judge.submissions.submit(body("l-1"), ALICE)
    ).accepted
    assert [(await judge.submissions.submit(body(f"o-{n}"), OPERATOR)).accepted for n in range(5)] == [True] * 5
    assert [s.id for subject, s, _ in bus.stored() if subjects.owner_of(subject)[1] == "vision"] == [
        "vision.v-0",
        "vision.v-1",
    ]
    # JetStream counted each team's records under the team's subjects.
    assert (subjects.JOBS_STREAM, subjects.of_team("nlp")) in bus.infos


# ---- goodput.api.teams ------------------------------------------------------------------------------

CLUSTER = Cluster(
    "two-types",
    tuple(Node(f"a{n}", "aws", 4) for n in range(4)) + tuple(Node(f"d{n}", "dgx-ext", 8) for n in range(2)),
)


def running(name: str, team: str, gpu_type: str, spots: tuple, borrowed: int = 0) -> JobRecord:
    return JobRecord(
        name,
        "cifar10",
        0.0,
        None,
        0,
        0.0,
        None,
        spots,
        state="running",
        gpu_type=gpu_type,
        team=team,
        borrowed=borrowed,
    )


def by_type(row) -> dict[str, tuple]:
    return {g.gpu_type: (g.quota, g.used, g.borrowed, g.lent, g.borrow_limit) for g in row.gpus}


async def cluster_now() -> Cluster:
    return CLUSTER


async def test_the_teams_endpoint_shows_a_login_its_teams_row_and_the_operator_every_teams() -> None:
    judge, bus, _ = gate(teams=team_file_kv(**NLP_AND_VISION), cluster=cluster_now)
    for record in (
        running("nlp.a", "nlp", "dgx-ext", (("d0", 8),)),
        running("nlp.b", "nlp", "dgx-ext", (("d1", 4),), borrowed=4),  # beyond nlp's 8 A100
        running("vision.c", "vision", "aws", (("a0", 4), ("a1", 4), ("a2", 4)), borrowed=8),
        running("vision.d", "vision", "dgx-ext", (("d1", 4),)),
        running("e", "default", "aws", (("a3", 4),), borrowed=4),
        JobRecord("nlp.q", "cifar10", 0.0, None, 0, 0.0, None, state="queued", team="nlp"),
    ):
        bus.jobs[record.name] = record
    everyone = await judge.queries.teams(TeamsRequest(), OPERATOR)
    assert [row.team for row in everyone.teams] == ["nlp", "vision", "default"] and everyone.note == ""
    rows = {row.team: by_type(row) for row in everyone.teams}
    # T4: 16, 12 guaranteed; 12 borrowed by vision and default, 4 of them what no one is guaranteed,
    # the other 8 nlp's idle guarantee. A100: all 16 guaranteed; nlp borrows vision's idle 4.
    assert rows == {
        "nlp": {"T4": (8, 0, 0, 8, None), "A100": (8, 12, 4, 0, 8)},
        "vision": {"T4": (4, 12, 8, 0, None), "A100": (8, 4, 0, 4, None)},
        "default": {"T4": (0, 4, 4, 0, None), "A100": (0, 0, 0, 0, None)},
    }
    assert everyone.teams[0].weight == 2.0 and everyone.teams[0].gpus[1].gpu_alias == "dgx-ext"
    mine = await judge.queries.teams(TeamsRequest(), ANN)
    assert [row.team for row in mine.teams] == ["nlp"] and mine.teams[0] == everyone.teams[0]
    assert [row.team for row in (await judge.queries.teams(TeamsRequest(), ALICE)).teams] == ["default"]
    table = teams_lines(msgspec.to_builtins(everyone))
    assert any(
        line.split() == ["nlp", "(weight", "2)", "T4", "(aws)", "8", "0", "0", "8", "any", "idle"] for line in table
    )


async def test_without_a_team_file_the_teams_endpoint_answers_one_team_with_no_guarantees() -> None:
    judge, bus, _ = gate(teams=MemoryKV(), cluster=cluster_now)
    bus.jobs["lm-1"] = running("lm-1", "default", "aws", (("a0", 2),))
    for who in (OPERATOR, ALICE):
        answer = await judge.queries.teams(TeamsRequest(), who)
        assert [row.team for row in answer.teams] == ["default"] and "no team file" in answer.note
        assert by_type(answer.teams[0]) == {"T4": (0, 2, 0, 0, None), "A100": (0, 0, 0, 0, None)}


# ---- what the status says ---------------------------------------------------------------------------


def test_a_jobs_status_names_its_team_what_it_holds_of_the_guarantee_and_each_reclaim() -> None:
    reclaims = (Reclaim(12, 600.0, "nlp", "dgx-ext", 8, 4), Reclaim(15, 750.0, "nlp", "dgx-ext", 4, 0))
    record = running("vision.c", "vision", "dgx-ext", (("d0", 4),), borrowed=1)
    status = msgspec.to_builtins(job_status(msgspec.structs.replace(record, reclaims=reclaims)))
    assert (status["team"], status["borrowed"], len(status["reclaims"])) == ("vision", 1, 2)
    assert job_lines(status)[:3] == [
        "team vision: holds 4 A100, 3 of its team's guarantee and 1 borrowed",
        "round 12: shrunk from 8 to 4 A100 so that team nlp got its guaranteed GPUs back",
        "round 15: gave up its 4 A100 (stopped, or moved) so that team nlp got its guaranteed GPUs back",
    ]
    queued = msgspec.to_builtins(job_status(msgspec.structs.replace(record, state="queued")))
    assert queued["borrowed"] == 0 and job_lines(queued)[0] == "team vision"
    plain = {"id": "lm-1", "application": "cifar10", "state": "queued", "reason": "", "team": "default"}
    assert job_lines(plain) == []  # a cluster without teams says nothing of them
    assert "vision" not in job_table([plain, {**plain, "id": "lm-2"}])[0]
    assert [row.split()[1] for row in job_table([plain, {**plain, "team": "vision"}])] == ["default", "vision"]


# ---- the real executors -----------------------------------------------------------------------------


class DecodingBus(NoBus):
    def decode(self, data: bytes, kind: type) -> Any:
        return CODEC.decode(data, kind)


async def test_the_executors_facts_and_records_carry_the_team_and_what_the_round_said_of_borrowing() -> None:
    agent = RealExecutors(LocalExecutors(RecordingNodes(), None, Cluster("local-4", (Node("local-0", "cpu", 4),))))
    service = RealExecutorService(DecodingBus(), agent, RecordingKV(), RecordingKV(), RecordingKV())
    agent.submitted(JobSpec("nlp.lm", "mlp_blobs", team="nlp", priority=5), 1, owner="ann", team="nlp")
    agent.submitted(JobSpec("mlp", "mlp_blobs"), 2)  # a replay's: DEFAULT_TEAM's
    for sequence, name in enumerate(("nlp.lm", "mlp"), start=1):
        agent.profiled(Profiled(name, 16, 256, submission=sequence))
    agent.arrive(0.0)
    facts = {f.job_id: (f.team, f.priority) for f in agent.facts(0.0, ["nlp.lm", "mlp"]).facts}
    assert facts == {"nlp.lm": ("nlp", 5), "mlp": ("default", 0)}

    first = Reclaim(3, 30.0, "vision", "cpu", 4, 2)
    request = ApplyRequest(
        0.0, {"nlp.lm": (("local-0", 2),)}, {}, adaptive=False, borrowed={"nlp.lm": 1}, reclaims={"nlp.lm": first}
    )
    await service.on_apply(request)
    await service.on_apply(request)  # the same round asked again: its reclaim kept once
    records = {r.name: r for r in agent.records()}
    assert (records["nlp.lm"].team, records["nlp.lm"].borrowed, records["nlp.lm"].reclaims) == ("nlp", 1, (first,))
    assert (records["mlp"].team, records["mlp"].borrowed, records["mlp"].reclaims) == ("default", 0, ())
    later = [Reclaim(4 + n, 40.0 + n, "vision", "cpu", 2, 1) for n in range(MAX_RECLAIMS)]
    for n, reclaim in enumerate(later, start=1):
        await service.on_apply(
            ApplyRequest(float(n), {"nlp.lm": (("local-0", 1),)}, {}, False, reclaims={"nlp.lm": reclaim})
        )
    record = next(r for r in agent.records() if r.name == "nlp.lm")
    assert record.reclaims == tuple(later) and record.borrowed == 0  # the last round borrowed nothing for it

    # The API's record of a refused body is listed for the team of its subject.
    refusal = Rejected(subjects.API_SUBMIT, "malformed submission: ...", "nlp.typo-1")
    delivery = SimpleNamespace(
        raw=SimpleNamespace(subject=subjects.refused("nlp", "bob")), stream_sequence=9, traceparent=""
    )
    await service.on_event(msgspec.Raw(msgspec.json.encode(refusal)), delivery)
    typo = next(r for r in agent.records() if r.name == "nlp.typo-1")
    assert (typo.team, typo.owner, typo.state) == ("nlp", "bob", JobState.REJECTED)
