"""The user API's `Submissions.submit` with no NATS server: an in-memory bus and owners' KV stand in for the
few calls it makes, and record them; what the API decided is read from what they recorded."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec
import nats
import pytest
from nats.js import api as js_api

from services.api.endpoints import ENDPOINTS
from services.api.service import Api, add_arguments
from services.api.submissions import Problem, Submissions, Turns
from services.api.who import Who
from shared import subjects
from shared.bus import Bus
from shared.bus.kv import KVEntry, RevisionConflict
from shared.schema.jobs import JobOwner, JobSpec, Rejected, submission_msg_id
from shared.schema.records import JobRecords

CODEC = Bus(nats.NATS())  # never connected: only its encoding, the API's own


@dataclass
class RecordingBus:
    """What the API's handlers ask of a Bus, in memory: every JetStream publish is recorded and stored as a
    new message (its sequence the count so far); the jobs stream holds nothing else; the executors'
    records are empty (no executor has read a submission yet)."""

    published: list[tuple[str, Any, str | None]] = field(default_factory=list)
    requests: list[tuple[str, Any]] = field(default_factory=list)
    infos: list[tuple[str, str | None]] = field(default_factory=list)

    @property
    def js(self) -> RecordingBus:
        return self

    def decode(self, data: bytes, msg_type: type) -> Any:
        return CODEC.decode(data, msg_type)

    def encode(self, msg: Any, json: bool = False) -> bytes:
        return CODEC.encode(msg, json)

    async def js_publish(self, subject: str, msg: Any, *, msg_id: str | None = None, **_: Any) -> js_api.PubAck:
        self.published.append((subject, msg, msg_id))
        return js_api.PubAck(stream=subjects.JOBS_STREAM, seq=len(self.published))

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> SimpleNamespace:
        self.infos.append((name, subjects_filter))
        return SimpleNamespace(
            state=SimpleNamespace(subjects={}, bytes=0), config=SimpleNamespace(max_bytes=1024 * 1024 * 1024)
        )

    async def request(self, subject: str, message: Any, answer_type: type, **_: Any) -> Any:
        self.requests.append((subject, message))
        assert answer_type is JobRecords, answer_type
        return JobRecords(())

    def stored(self) -> list[tuple[str, Any, str | None]]:
        """The publishes on a login's stored-submissions subject."""
        return [p for p in self.published if subjects.of_login(p[0])[0] == subjects.STORED]


@dataclass
class MemoryKV:
    """A KV bucket in memory, with a KV's revisions: create, get, update and delete as TypedKV does them."""

    entries: dict[str, tuple[Any, int]] = field(default_factory=dict)
    revision: int = 0

    def _write(self, key: str, value: Any) -> int:
        self.revision += 1
        self.entries[key] = (value, self.revision)
        return self.revision

    async def create(self, key: str, value: Any) -> int:
        if key in self.entries:
            raise RevisionConflict
        return self._write(key, value)

    async def get(self, key: str) -> KVEntry | None:
        found = self.entries.get(key)
        return None if found is None else KVEntry(key, *found)

    async def update(self, key: str, value: Any, revision: int) -> int:
        if key not in self.entries or self.entries[key][1] != revision:
            raise RevisionConflict
        return self._write(key, value)

    async def delete(self, key: str, revision: int | None = None) -> None:
        if revision is not None and (key not in self.entries or self.entries[key][1] != revision):
            raise RevisionConflict
        self.entries.pop(key, None)


def gate(problem: Problem = lambda spec: None) -> tuple[Submissions, RecordingBus, MemoryKV]:
    bus, owners = RecordingBus(), MemoryKV()
    return Api(bus, owners, problem).submissions, bus, owners


def test_every_endpoint_has_a_handler_and_every_handler_an_endpoint() -> None:
    assert set(Api(RecordingBus(), MemoryKV(), lambda spec: None).handlers()) == {e.name for e in ENDPOINTS}


async def test_a_malformed_body_is_answered_with_the_reason_and_nothing_is_stored() -> None:
    judge, bus, owners = gate()
    body = b'{"id": "typo-1", "application": "cifar10", "requestd_gpus": 2}'
    answer = await judge.submit(body, Who("alice"))
    assert not answer.accepted and answer.state == "rejected" and answer.id == "typo-1", answer
    assert "unknown field `requestd_gpus`" in answer.reason and "did you mean `requested_gpus`" in answer.reason
    assert bus.stored() == [] and owners.entries == {}
    # The refusal is recorded for its login, with the reason it was answered.
    [(subject, record, _)] = bus.published
    assert subject == subjects.refused(subjects.DEFAULT_TEAM, "alice") and isinstance(record, Rejected)
    assert (record.job_id, record.reason, record.subject) == ("typo-1", answer.reason, subjects.API_SUBMIT)


async def test_a_submission_larger_than_the_logins_limits_count_is_refused_and_not_stored() -> None:
    # A login's and a team's limits count submissions; each is at most MAX_STORED_BYTES as stored, so
    # neither one login nor one team can fill the logins' share of the jobs stream for everyone.
    from shared.storage import LOGIN_LIMITS, MAX_STORED_BYTES, STREAMS, TEAM_LIMITS, USERS_SHARE

    share = USERS_SHARE * STREAMS[subjects.JOBS_STREAM].limits["max_bytes"]
    assert TEAM_LIMITS.submissions * MAX_STORED_BYTES < share and LOGIN_LIMITS.submissions * MAX_STORED_BYTES < share
    judge, bus, owners = gate()
    fat = {"id": "fat-1", "code": "a" * 64, "entrypoint": "train.py", "args": ["x" * 1000] * 8}
    answer = await judge.submit(msgspec.json.encode(fat), Who("alice"))
    assert not answer.accepted and "as stored, is at most 4 KiB" in answer.reason, answer
    assert bus.stored() == [] and owners.entries == {}
    fine = {**fat, "id": "fine-1", "args": ["x" * 1000] * 3}
    assert "as stored" not in (await judge.submit(msgspec.json.encode(fine), Who("alice"))).reason


async def test_a_submission_the_cluster_cannot_run_is_refused_and_not_stored() -> None:
    judge, bus, owners = gate(lambda spec: f"unknown application {spec.application!r}")
    answer = await judge.submit(msgspec.json.encode(JobSpec("lm-1", "nosuchjob")), Who("alice"))
    assert not answer.accepted and answer.reason == "unknown application 'nosuchjob'", answer
    assert bus.stored() == [] and owners.entries == {}
    assert [subject for subject, _, _ in bus.published] == [subjects.refused(subjects.DEFAULT_TEAM, "alice")]


async def test_a_valid_submission_is_stored_once_on_its_logins_subject() -> None:
    judge, bus, owners = gate()
    spec = JobSpec("lm-1", "cifar10", requested_gpus=2)
    answer = await judge.submit(msgspec.json.encode(spec), Who("alice"))
    assert answer.accepted and answer.state == "profiling" and answer.id == "lm-1", answer
    stored = msgspec.structs.replace(spec, team=subjects.DEFAULT_TEAM)  # the server's word of its team
    assert bus.stored() == [("goodput.jobs.stored.default.alice", stored, submission_msg_id(stored))]
    held = owners.entries["lm-1"][0]  # the id is this submission's: its stream sequence, its login
    assert isinstance(held, JobOwner) and not held.marking
    assert (held.submission, held.subject, held.login) == (1, "goodput.jobs.stored.default.alice", "alice")
    again = await judge.submit(msgspec.json.encode(spec), Who("alice"))  # the same body: a repeat
    assert again.accepted and "not stored again" in again.reason, again
    assert len(bus.stored()) == 1
    other = await judge.submit(msgspec.json.encode(JobSpec("lm-1", "bert")), Who("bob"))  # the id taken
    assert not other.accepted and "already exists" in other.reason, other
    assert len(bus.stored()) == 1 and owners.entries["lm-1"][0] == held


async def test_bodies_under_one_id_are_judged_in_the_order_they_came_and_others_at_once() -> None:
    """The intake judges many submissions at once: under one key in turn (the first holds it), a slow
    one holding up none under another key; a key no one holds any more is forgotten."""
    turns, done, slow = Turns(), [], asyncio.Event()

    async def judge(key: str, name: str, wait: asyncio.Event | None = None) -> None:
        async with turns.turn(key):
            if wait is not None:
                await wait.wait()
            done.append(name)
            if name == "other":
                slow.set()  # the first under "mine" goes on only once another id was judged

    await asyncio.gather(
        judge("mine", "first", slow), judge("mine", "second"), judge("theirs", "other"), judge("mine", "third")
    )
    assert done == ["other", "first", "second", "third"] and turns.held == {}


def test_executors_local_is_read_as_real_with_a_word_on_stderr(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--executors", "local"]).executors == "real"
    assert "`--executors local` means `--executors real`; use `real`" in capsys.readouterr().err
    assert parser.parse_args(["--executors", "real"]).executors == "real"
    assert parser.parse_args([]).executors == "simulated" and capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        parser.parse_args(["--executors", "remote"])
