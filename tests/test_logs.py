"""A job's output: lines cut and batched (pure functions), held by a node agent until stored (each
job's wait bounded on its own) and read back a page at a time from its team's stream;
goodput.api.logs answers only the job's team. No server here: tests/test_team_logs.py stores teams'
floods in a real JetStream, and tests/test_job_output.py runs a job end to end."""

from __future__ import annotations

import asyncio
import io
import math
import time
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from services.api.logs import read_page, stream_reader
from services.node import agent as node
from services.node.output import Output, Storing, copy_lines
from shared import subjects
from shared.bus.encoding import NotFound
from shared.schema.jobs import JobOwner
from shared.schema.logs import BATCH_BYTES, BATCH_LINES, MAX_LINE_BYTES, LogBatch, LogsRequest, OutputLine, batches, cut
from shared.schema.records import JobRecord, JobRecords
from tests.test_api_handlers import MemoryKV, RecordingBus

# ---- cut and batched ---------------------------------------------------------------------------


def test_a_line_within_the_limit_is_kept_whole_and_a_longer_one_is_cut_saying_so() -> None:
    assert cut("hello") == "hello"
    long = "é" * 5000  # two bytes each: cut on a character's boundary
    kept = cut(long)
    assert len(kept.encode()) <= MAX_LINE_BYTES
    assert kept.endswith(f"[goodput: line cut at {MAX_LINE_BYTES} bytes of 10000]")
    assert kept.startswith("é" * 100)


def test_lines_are_batched_in_order_by_count_and_by_bytes() -> None:
    lines = [OutputLine(float(n), "stdout", str(n)) for n in range(130)]
    found = batches(3, lines)
    assert [len(b.lines) for b in found] == [BATCH_LINES, BATCH_LINES, 2] and {b.rank for b in found} == {3}
    assert [line.text for b in found for line in b.lines] == [str(n) for n in range(130)]
    heavy = [OutputLine(0.0, "stderr", "x" * 1000) for _ in range(10)]
    assert [len(b.lines) for b in batches(0, heavy, max_bytes=3000)] == [2, 2, 2, 2, 2]
    assert batches(0, []) == []
    # As stored, a full batch of the longest lines is within its bytes: what a job's share counts.
    longest = [OutputLine(1e9, "stderr", "\U0001f600" * (MAX_LINE_BYTES // 4)) for _ in range(BATCH_LINES)]
    assert max(len(msgspec.msgpack.encode(b)) for b in batches("profile", longest)) <= BATCH_BYTES


def test_a_jobs_share_of_its_teams_logs_is_a_quarter_at_most() -> None:
    from shared import storage

    plan = storage.logs_plan("alpha")
    assert (plan.name, plan.subjects) == ("GOODPUT_LOGS_alpha", ("goodput.logs.alpha.>",))
    assert storage.logs_plan(subjects.DEFAULT_TEAM).name == subjects.LOGS_STREAM
    assert storage.STREAMS[subjects.LOGS_STREAM] == storage.logs_plan(subjects.DEFAULT_TEAM)
    share = plan.limits["max_msgs_per_subject"] * BATCH_BYTES  # a job is one subject: its batches
    assert share <= plan.limits["max_bytes"] / 4 and plan.limits["discard"] == "old"


# ---- held by the agent ---------------------------------------------------------------------------


def test_output_holds_lines_per_rank_and_wakes_on_a_full_batch() -> None:
    woken = []
    output = Output(lambda: woken.append(1), clock=lambda: 7.0)
    keep = output.keeper("lm-1", 0, "stdout")
    for n in range(BATCH_LINES):
        keep(f"step {n}")
    assert woken == [1]  # a full batch: stored without waiting for the interval
    output.keeper("lm-1", 1, "stderr")("Traceback")
    output.keeper("bert-1", 0, "stdout", team="nlp")("epoch 1")
    taken = output.take()
    assert [(team, subject, batch.rank) for team, subject, batch in taken] == [
        (subjects.DEFAULT_TEAM, subjects.job_logs(subjects.DEFAULT_TEAM, "lm-1"), 0),
        ("nlp", subjects.job_logs("nlp", "bert-1"), 0),  # the jobs' batches in turn
        (subjects.DEFAULT_TEAM, subjects.job_logs(subjects.DEFAULT_TEAM, "lm-1"), 1),
    ]
    assert [line.text for line in taken[0][2].lines] == [f"step {n}" for n in range(BATCH_LINES)]
    assert [(line.stream, line.text) for line in taken[2][2].lines] == [("stderr", "Traceback")]
    assert output.take() == []  # taken once


def test_a_flooding_job_drops_only_its_own_lines_and_only_its_log_says_so() -> None:
    """The wait is bounded per job: past it, the job that printed loses its lines, and the line
    saying so goes to its own log (the rank that lost them); another job's lines all wait."""
    output = Output(max_pending=100)
    flood = output.keeper("flood-1", 0, "stdout", team="alpha")
    for n in range(250):
        flood(f"spam {n}")
        if n % 10 == 0:
            output.keeper("quiet-1", 0, "stdout", team="beta")(f"epoch {n // 10}")
    output.keeper("flood-1", 1, "stderr", team="alpha")("rank 1 is over the bound too")
    logs: dict[str, list[str]] = {}
    for _, subject, batch in output.take():
        logs.setdefault(subject, []).extend(f"{batch.rank}:{line.text}" for line in batch.lines)
    quiet, flooded = logs[subjects.job_logs("beta", "quiet-1")], logs[subjects.job_logs("alpha", "flood-1")]
    assert quiet == [f"0:epoch {n}" for n in range(25)]  # none dropped, no word of another's
    assert flooded[:100] == [f"0:spam {n}" for n in range(100)]
    assert flooded[100:] == [
        "0:[goodput: 150 lines of this job dropped here: it printed faster than they could be stored]",
        "1:[goodput: 1 lines of this job dropped here: it printed faster than they could be stored]",
    ]
    flood("after the store took them")  # its bound is free again
    assert [line.text for _, _, batch in output.take() for line in batch.lines] == ["after the store took them"]


async def test_the_agent_stores_each_teams_batches_in_its_stream_and_a_store_that_fails_loses_only_those(
    caplog,
) -> None:
    stored: list[tuple[str, LogBatch]] = []
    made: list[str] = []

    class Stream:
        async def js_publish(self, subject: str, batch: LogBatch, **_: Any) -> None:
            if "broken" in subject:
                raise TimeoutError("no answer")
            stored.append((subject, batch))

    async def ensure(_: Any, team: str) -> None:
        made.append(team)
        if team == "gone":
            raise PermissionError("no such team's stream may be made")

    output = Output()
    storing = Storing(Stream(), output, ensure)
    output.keeper("lm-1", 0, "stdout")("epoch 1")
    output.keeper("broken", 0, "stdout")("lost")
    output.keeper("x-1", 0, "stdout", team="gone")("lost too")
    output.keeper("bert-1", 0, "stdout", team="nlp")("kept")
    await storing.store()
    assert [(subject, [line.text for line in batch.lines]) for subject, batch in stored] == [
        (subjects.job_logs(subjects.DEFAULT_TEAM, "lm-1"), ["epoch 1"]),
        (subjects.job_logs("nlp", "bert-1"), ["kept"]),
    ]
    assert made == [subjects.DEFAULT_TEAM, "gone", "nlp"]
    assert "2 lines of jobs' output could not be stored" in caplog.text
    output.keeper("x-1", 0, "stdout", team="gone")("lost again")
    output.keeper("bert-1", 0, "stdout", team="nlp")("kept again")
    await storing.store()
    assert len(stored) == 3  # nothing held twice
    assert made == [subjects.DEFAULT_TEAM, "gone", "nlp"]  # each made once; a failed one not asked at once


async def _made(bus: Any, team: str) -> None:
    """A team's logs stream, there already."""


async def test_the_agent_leaving_stores_the_batch_it_was_publishing_and_the_lines_after() -> None:
    """A stopping agent's last store: the batch being published when it leaves is not cut off, and
    the lines its stopped workers printed last follow it."""
    stored: list[str] = []
    publishing, release = asyncio.Event(), asyncio.Event()

    class SlowStream:
        async def js_publish(self, subject: str, batch: LogBatch, **_: Any) -> None:
            publishing.set()
            await release.wait()
            stored.extend(line.text for line in batch.lines)

    output, woken = Output(), asyncio.Event()
    storing = Storing(SlowStream(), output, _made)
    keeping = asyncio.get_running_loop().create_task(storing.keep_storing(woken, flush_s=0.01))
    output.keeper("lm-1", 0, "stdout")("step 99")
    await publishing.wait()  # that batch is taken and on its way
    output.keeper("lm-1", 0, "stdout")("run returned stopped")
    leaving = asyncio.get_running_loop().create_task(storing.finish(keeping, woken))
    release.set()
    await leaving
    assert stored == ["step 99", "run returned stopped"] and keeping.done()


def test_a_workers_stderr_goes_to_its_file_and_is_kept_a_long_line_in_parts(tmp_path) -> None:
    kept: list[str] = []
    path = tmp_path / "job.rank0.log"
    long = "y" * (MAX_LINE_BYTES + 10)
    copy_lines(io.StringIO(f"warning: slow\n{long}\nlast"), open(path, "w"), kept.append)
    assert path.read_text() == f"warning: slow\n{long}\nlast"
    assert kept == ["warning: slow", "y" * MAX_LINE_BYTES, "y" * 10, "last"]


def test_a_workers_stdout_is_kept_but_the_protocols_lines() -> None:
    process = SimpleNamespace(stdout=io.StringIO("epoch 1 loss 0.5\ngoodput-stats abc\n  indented\ngoodput-stopped\n"))
    workers = SimpleNamespace(stats="", outcome="", stopped=False)
    kept: list[str] = []
    node._forward(process, workers, True, kept.append)
    assert kept == ["epoch 1 loss 0.5", "  indented"]
    assert workers.stats == "goodput-stats abc"


def test_a_real_worker_prints_on_both_streams_and_both_are_kept(tmp_path) -> None:
    """Through NodeWorkers' own readers: a job of tests.jobs that prints, run as an agent runs it."""
    output = Output()
    info = SimpleNamespace(name="cpu-0", gpu_type="cpu", gpus=1, address="127.0.0.1")
    workers = node.NodeWorkers(info, tmp_path, "tests.jobs", output=output)
    from shared.schema.nodes import StartWorkers

    order = StartWorkers("says-1", "says", 1, (0,), 1, 1, "cpu", str(tmp_path / "says-1" / "says-1.pt"))
    lines: list[tuple[str, str]] = []
    deadline = time.monotonic() + 60
    try:
        workers.start(order)
        while not {("stdout", "hello from says"), ("stderr", "a warning from says")} <= set(lines):
            assert time.monotonic() < deadline, lines
            lines += [(line.stream, line.text) for _, _, batch in output.take() for line in batch.lines]
            time.sleep(0.05)
    finally:
        workers.stop_all()
    assert "a warning from says" in workers.log_path("says-1", 0).read_text()  # its file on the node too


# ---- read back a page at a time ------------------------------------------------------------------


class StoredLogs:
    """The logs stream in memory: what `NextMessage` reads, with subject wildcards."""

    def __init__(self) -> None:
        self.messages: list[tuple[int, str, bytes]] = []
        self.asked = 0

    def store(self, job_id: str, rank: int | str, *texts: str, team: str = subjects.DEFAULT_TEAM) -> int:
        batch = LogBatch(rank, tuple(OutputLine(1.0, "stdout", text) for text in texts))
        self.messages.append((len(self.messages) + 1, subjects.job_logs(team, job_id), msgspec.msgpack.encode(batch)))
        return len(self.messages)

    async def next_message(self, sequence: int, subject: str) -> tuple[int, str, bytes] | None:
        self.asked += 1
        return next((m for m in self.messages if m[0] >= sequence and _matches(subject, m[1])), None)

    async def get_msg(self, stream: str, *, seq: int, subject: str, next: bool) -> Any:
        """JetStream's: a stream holds its team's subjects only."""
        assert next
        found = await self.next_message(seq, subject)
        if found is None or subjects.logs_stream(found[1].split(".")[2]) != stream:
            import nats.js.errors

            raise nats.js.errors.NotFoundError
        return SimpleNamespace(seq=found[0], subject=found[1], data=found[2])


def _matches(pattern: str, subject: str) -> bool:
    want, have = pattern.split("."), subject.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have))


def _lm(job_id: str = "lm-1") -> str:
    return subjects.job_logs(subjects.DEFAULT_TEAM, job_id)


async def test_pages_hold_whole_batches_up_to_the_limit_and_the_cursor_goes_on_from_there() -> None:
    logs = StoredLogs()
    logs.store("lm-1", 0, "a", "b")
    logs.store("lm-1.x", 0, "another job's")  # its id begins the same: not this job's
    logs.store("lm-1", 1, "c")
    logs.store("lm-1", "profile", "d", "e")
    lines, cursor, more = await read_page(logs.next_message, _lm(), 0, limit=3)
    assert [(line.rank, line.text) for line in lines] == [(0, "a"), (0, "b"), (1, "c")] and more
    lines, cursor, more = await read_page(logs.next_message, _lm(), cursor, limit=3)
    assert [(line.rank, line.text) for line in lines] == [("profile", "d"), ("profile", "e")] and not more
    assert cursor == 4
    lines, cursor, more = await read_page(logs.next_message, _lm(), cursor, limit=3)
    assert (lines, cursor, more) == ([], 4, False)  # nothing new: the same cursor
    logs.store("lm-1", 1, "f")
    lines, _, _ = await read_page(logs.next_message, _lm(), 0, limit=10, rank=1)
    assert [line.text for line in lines] == ["c", "f"]  # one rank's
    lines, _, _ = await read_page(logs.next_message, _lm(), 0, limit=10, rank="profile")
    assert [line.text for line in lines] == ["d", "e"]
    big = [str(n) for n in range(BATCH_LINES)]
    logs.store("big", 0, *big)
    lines, _, more = await read_page(logs.next_message, _lm("big"), 0, limit=5)
    assert [line.text for line in lines] == big and not more  # a batch over the limit comes whole


async def test_a_rank_whose_lines_are_far_apart_is_read_on_across_pages_of_none() -> None:
    from services.api import logs as api_logs

    logs = StoredLogs()
    logs.store("lm-1", 1, "first")
    for n in range(api_logs.MAX_BATCHES_READ + 5):
        logs.store("lm-1", 0, f"rank 0's {n}")
    logs.store("lm-1", 1, "second")
    lines, cursor, more = await read_page(logs.next_message, _lm(), 0, limit=10, rank=1)
    assert [line.text for line in lines] == ["first"] and more
    lines, cursor, more = await read_page(logs.next_message, _lm(), cursor, limit=10, rank=1)
    assert [line.text for line in lines] == ["second"] and not more


async def test_a_page_is_bounded_in_bytes() -> None:
    logs = StoredLogs()
    for _ in range(5):
        logs.store("lm-1", 0, "z" * 1000)
    lines, cursor, more = await read_page(logs.next_message, _lm(), 0, 100, page_bytes=2500)
    assert len(lines) == 2 and cursor == 2 and more


async def test_a_page_is_bounded_by_its_encoded_reply_where_control_characters_weigh_6_bytes() -> None:
    from shared.schema.logs import LOG_PAGE_BYTES, LogsPage

    logs = StoredLogs()
    for _ in range(30):  # 16 KB of text a batch, 96 KB of JSON
        logs.store("lm-1", 0, *["\x01" * 4000] * 4)
    lines, cursor, more = await read_page(logs.next_message, _lm(), 0, 5000)
    reply = msgspec.json.encode(LogsPage(tuple(lines), cursor, more, False))
    assert more and len(reply) <= LOG_PAGE_BYTES < len(reply) + 100_000  # as full as whole batches allow
    assert len(msgspec.msgpack.encode(LogsPage(tuple(lines), cursor, more, False))) <= len(reply)


# ---- goodput.api.logs: the submitter's only ----------------------------------------------------


class LogsBus(RecordingBus):
    """The API's bus, with the logs stream and the executors' records of `ended` jobs."""

    def __init__(self, logs: StoredLogs, ended: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.logs, self.ended = logs, ended

    async def get_msg(self, *args: Any, **options: Any) -> Any:
        return await self.logs.get_msg(*args, **options)

    async def request(self, subject: str, message: Any, answer_type: type, **_: Any) -> Any:
        owner = getattr(message, "owner", None)
        return JobRecords(
            tuple(
                JobRecord(name, "quick", 0.0, 5.0, 0, 1.0, None, state="finished", owner="alice")
                for name in self.ended
                if owner in (None, "alice")
            )
        )


async def test_only_the_jobs_submitter_reads_its_output_and_the_page_says_when_it_has_ended() -> None:
    from services.api.queries import Queries
    from services.api.who import OPERATOR, Who

    logs = StoredLogs()
    logs.store("lm-1", 0, "epoch 1")
    logs.store("done-1", 0, "finished at epoch 3")
    owners = MemoryKV()
    for job_id in ("lm-1", "done-1"):
        await owners.create(job_id, JobOwner(1, "digest", subjects.stored(subjects.DEFAULT_TEAM, "alice")))
    gate = Queries(LogsBus(logs, ended=("done-1",)), owners)
    page = await gate.logs(LogsRequest("lm-1"), Who("alice"))
    assert [line.text for line in page.lines] == ["epoch 1"] and not page.end and not page.more
    assert page.next == 1
    page = await gate.logs(LogsRequest("done-1"), Who("alice"))
    assert [line.text for line in page.lines] == ["finished at epoch 3"] and page.end
    for job_id in ("lm-1", "done-1", "nosuch"):
        with pytest.raises(NotFound, match=f"no job '{job_id}' of yours"):
            await gate.logs(LogsRequest(job_id), Who("bob"))
    operator = await gate.logs(LogsRequest("lm-1", rank=0), OPERATOR)  # the operator sees all
    assert [line.text for line in operator.lines] == ["epoch 1"]


class TeamLogsBus(LogsBus):
    """The executors' records: team nlp's running bert-1 (ann's)."""

    async def request(self, subject: str, message: Any, answer_type: type, **_: Any) -> Any:
        from shared.schema.records import select

        record = JobRecord("nlp.bert-1", "quick", 0.0, None, 0, 1.0, None, state="running", owner="ann", team="nlp")
        return select([record], message)


async def test_a_teams_job_is_read_from_its_teams_stream_by_its_team_mates_and_the_operator() -> None:
    from services.api.queries import Queries
    from services.api.who import OPERATOR, Who

    logs = StoredLogs()
    logs.store("nlp.bert-1", 0, "nlp's epoch 1", team="nlp")
    owners = MemoryKV()
    await owners.create("nlp.bert-1", JobOwner(1, "digest", subjects.stored("nlp", "ann")))
    gate = Queries(TeamLogsBus(logs), owners)
    for who, job_id in (
        (Who("ann", "nlp"), "bert-1"),
        (Who("nia", "nlp"), "bert-1"),
        (OPERATOR, "nlp.bert-1"),
    ):
        page = await gate.logs(LogsRequest(job_id), who)
        assert [line.text for line in page.lines] == ["nlp's epoch 1"], who
    for who in (Who("vic", "vision"), Who("alice")):
        with pytest.raises(NotFound):
            await gate.logs(LogsRequest("bert-1"), who)


async def test_stream_reader_asks_jetstream_for_the_next_message_on_the_subject() -> None:
    logs = StoredLogs()
    logs.store("lm-1", 0, "a")
    bus = SimpleNamespace(js=logs)
    read = stream_reader(bus, subjects.DEFAULT_TEAM)
    assert (await read(1, _lm()))[0] == 1
    assert await read(2, _lm()) is None
    assert await stream_reader(bus, "nlp")(1, _lm()) is None  # another team's stream holds none of it


def test_a_request_names_a_rank_or_the_profiling_runs() -> None:
    assert msgspec.json.decode(b'{"id": "a", "rank": "profile"}', type=LogsRequest).rank == "profile"
    for bad in (b'{"id": "a", "rank": -1}', b'{"id": "a", "rank": "x"}', b'{"id": "a", "limit": 0}'):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(bad, type=LogsRequest)


def test_goodput_logs_prints_a_jobs_text_without_control_characters_and_json_exactly() -> None:
    import json

    from cli.logs import _shown
    from shared.schema.logs import LogLine

    text = "\x1b]0;owned\x07\x1b[2J\x9b31mred\tok\r\x7f"
    line = LogLine(0, 1.0, "stdout", text)
    assert _shown(line, False, False) == "red\tok"  # each sequence whole (shared.text, tests/test_text.py)
    assert _shown(line, True, False) == "[0] red\tok"
    shown = _shown(line, True, True)
    assert json.loads(shown)["text"] == text and shown.isascii() and shown.isprintable()


class RefusedBus(LogsBus):
    """The records hold alice's running lm-1 and bob's refused submission under the same id."""

    async def request(self, subject: str, message: Any, answer_type: type, **_: Any) -> Any:
        records = (
            JobRecord("lm-1", "quick", 0.0, None, 0, 1.0, None, state="running", owner="alice"),
            JobRecord("lm-1", "quick", math.nan, None, 0, 0.0, None, failure="id taken", state="rejected", owner="bob"),
        )
        owner = getattr(message, "owner", None)
        return JobRecords(tuple(r for r in records if owner in (None, r.owner)))


async def test_a_refused_submission_under_anothers_id_reads_none_of_that_jobs_output() -> None:
    from services.api.queries import Queries
    from services.api.who import Who

    logs = StoredLogs()
    logs.store("lm-1", 0, "alice's secret")
    owners = MemoryKV()
    await owners.create("lm-1", JobOwner(1, "digest", subjects.stored(subjects.DEFAULT_TEAM, "alice")))
    gate = Queries(RefusedBus(logs), owners)
    page = await gate.logs(LogsRequest("lm-1"), Who("bob"))
    assert page.lines == () and page.end and not page.more
    mine = await gate.logs(LogsRequest("lm-1"), Who("alice"))
    assert [line.text for line in mine.lines] == ["alice's secret"]


class ProfiledAndRefusedBus(LogsBus):
    """The executors' records: carol's job refused after its profiling run (it held its id)."""

    async def request(self, subject: str, message: Any, answer_type: type, **_: Any) -> Any:
        failure = "its script failed while profiling on cpu (exit code 1); the end of its stderr:\nSyntaxError"
        record = JobRecord("bad-1", "train.py", 0.0, None, 0, 0.0, None, failure, state="rejected", owner="carol")
        held = msgspec.structs.replace(record, held=True)
        owner = getattr(message, "owner", None)
        return JobRecords(tuple(r for r in (held,) if owner in (None, r.owner)))


async def test_a_job_refused_after_its_profiling_run_shows_that_runs_output_to_its_submitter_only() -> None:
    from services.api.queries import Queries
    from services.api.who import Who

    logs = StoredLogs()
    logs.store("bad-1", "profile", "SyntaxError: invalid syntax")
    gate = Queries(ProfiledAndRefusedBus(logs), MemoryKV())
    page = await gate.logs(LogsRequest("bad-1", rank="profile"), Who("carol"))
    assert [line.text for line in page.lines] == ["SyntaxError: invalid syntax"] and page.end
    with pytest.raises(NotFound):
        await gate.logs(LogsRequest("bad-1"), Who("dave"))


def test_the_agents_may_make_and_the_api_read_the_logs_stream_of_each_team_with_logins_and_none_other() -> None:
    from shared import permissions

    teams = {"ann": "alpha", "bea": "beta"}
    passwords = {role: f"{role}-Secret-9x" for role in ("executor", "api", "estimator")}
    config = permissions.render_accounts(passwords, {login: "login-Secret-9x" for login in teams}, teams=teams)
    lines = config.splitlines()
    # Each user's `publish: {allow: [...]}` line follows its `{user: "NAME", ...` line.
    allowed = {line.split('"')[1]: lines[n + 1] for n, line in enumerate(lines) if "{user:" in line}
    for team in (subjects.DEFAULT_TEAM, "alpha", "beta"):
        stream = subjects.logs_stream(team)
        for op in ("INFO", "CREATE", "UPDATE"):  # DEFAULT_TEAM's the operator makes
            made = f'"$JS.API.STREAM.{op}.{stream}"' in allowed["executor"]
            assert made == (op == "INFO" or team != subjects.DEFAULT_TEAM), (team, op)
        assert f'"$JS.API.STREAM.MSG.GET.{stream}"' in allowed["api"], team
        assert stream not in allowed["estimator"] and stream not in allowed["ann"]
    assert "GOODPUT_LOGS_gamma" not in config and '"$JS.API.STREAM.CREATE.*"' not in config
    assert "$JS.API.STREAM.CREATE" not in allowed["api"]


# ---- the job's team, in the orders its node agents get ---------------------------------------


def test_the_executors_start_orders_name_the_jobs_team_after_a_restore_too() -> None:
    from services.executor.local import LocalExecutors
    from services.executor.real import RealExecutors
    from shared.cluster import Cluster
    from shared.schema.base import Node
    from shared.schema.jobs import JobSpec, Profiled
    from tests.test_executor_handlers import RecordingNodes

    def started(agent: RealExecutors) -> dict[str, str]:
        agent.apply(0.0, {"nlp.lm": (("local-0", 1),), "mlp": (("local-0", 1),)})
        return {order.job_id: order.team for _, order in agent.executors.nodes.started}

    cluster = Cluster("local-4", (Node("local-0", "cpu", 4),))
    agent = RealExecutors(LocalExecutors(RecordingNodes(), None, cluster))
    agent.submitted(JobSpec("nlp.lm", "mlp_blobs", team="nlp"), 1, owner="ann", team="nlp")
    agent.submitted(JobSpec("mlp", "mlp_blobs"), 2)
    for sequence, name in enumerate(("nlp.lm", "mlp"), start=1):
        agent.profiled(Profiled(name, 16, 256, submission=sequence))
    agent.arrive(0.0)
    assert started(agent) == {"nlp.lm": "nlp", "mlp": subjects.DEFAULT_TEAM}
    again = RealExecutors(LocalExecutors(RecordingNodes(), None, cluster))
    for job in agent.jobs.values():
        again.restore(msgspec.structs.replace(job, parts=(), placement=()))
    assert started(again) == {"nlp.lm": "nlp", "mlp": subjects.DEFAULT_TEAM}


async def test_a_profiling_run_asks_its_node_with_the_jobs_team(monkeypatch) -> None:
    from services.profiler import measure
    from shared.schema.nodes import NodeInfo, ProfileAnswer
    from tests.test_profiler_turns import Members

    asked = []

    async def answer(bus: Any, turns: Any, info: Any, request: Any) -> ProfileAnswer:
        asked.append(request)
        return ProfileAnswer(failure="enough")

    monkeypatch.setattr(measure, "_run_on", answer)
    turns = measure.NodeTurns(Members(NodeInfo("cpu-0", "cpu", 1, "127.0.0.1")))
    with pytest.raises(measure.ProfilingFailed, match="enough"):
        await measure.profiling_run(None, turns, "nlp.bert-1", "quick", "cpu", team="nlp")
    assert [(request.job_id, request.team) for request in asked] == [("nlp.bert-1", "nlp")]
