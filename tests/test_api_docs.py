"""The API's schemas agree with the code, and `goodput schemas` prints them; the API's pure parts."""

import argparse
import json
import math

import msgspec
import pytest

from cli import schemas as schemas_command
from services.api.endpoints import ENDPOINTS, schemas
from services.api.queries import cut
from shared.schema.api import JobStatus, job_statuses
from shared.schema.jobs import JobSpec
from shared.schema.records import JobRecord, JobsQuery, select
from shared.submissions import malformed_reason


def goodput_schemas(*argv: str) -> int:
    """`goodput schemas ARGV`, run in this process through its parser."""
    parser = argparse.ArgumentParser(prog="goodput")
    schemas_command.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["schemas", *argv])
    return args.func(args)


def test_every_endpoint_has_its_messages_schemas():
    document = schemas()
    for endpoint in ENDPOINTS:
        assert endpoint.subject.startswith("goodput.api.")
        for kind in (endpoint.request, endpoint.response):
            assert kind is dict or kind.__name__ in document["$defs"], kind
    assert set(document["$defs"]["JobSpec"]["required"]) == {"id"}  # application, or code and entrypoint


def test_goodput_schemas_prints_every_endpoints_messages_or_writes_them_to_a_file(capsys, tmp_path):
    assert goodput_schemas() == 0
    printed = json.loads(capsys.readouterr().out)
    assert goodput_schemas("--out", str(tmp_path / "api.json")) == 0 and capsys.readouterr().out == ""
    written = json.loads((tmp_path / "api.json").read_text())
    for document in (printed, written):
        assert document == json.loads(json.dumps(schemas()))  # goodput.api.schemas's very answer
        for endpoint in ENDPOINTS:
            described = document["endpoints"][endpoint.subject]
            for kind in ("request", "response"):
                assert described[kind] == "object" or described[kind] in document["$defs"], (endpoint.name, kind)


def test_a_page_is_one_logins_filtered_then_paged_in_order_and_cut_to_its_bytes():
    records = [
        JobRecord(
            f"j{i}",
            "cifar10" if i < 6 else "bert",
            0.0,
            None,
            0,
            0.0,
            None,
            state="finished" if i % 2 else "running",
            owner="alice" if i < 8 else "bob",
        )
        for i in range(10)
    ]
    first = select(records, JobsQuery(owner="alice", state="finished", limit=2))
    assert [j.name for j in first.jobs] == ["j1", "j3"] and first.total == 4
    last = select(records, JobsQuery(owner="alice", state="finished", offset=2, limit=2))
    assert [j.name for j in last.jobs] == ["j5", "j7"]
    assert select(records, JobsQuery(owner="bob")).jobs == tuple(records[8:])  # another login's: none of alice's
    assert len(select(records, JobsQuery()).jobs) == 10  # the operator's: every one
    assert select(records, JobsQuery(application="bert", owner="alice")).total == 2
    statuses = tuple(JobStatus(f"j{i}", "failed", reason="x" * 100_000) for i in range(5))
    page = cut(statuses, 10, 15, msgspec.msgpack.encode)  # a page past PAGE_BYTES is cut short, and says so
    assert len(page.jobs) == 2 and page.next_offset == 12 and page.total == 15, page.next_offset


def test_a_job_is_listed_once_as_its_own_record_not_a_refusal_of_another_body_under_its_id():
    records = [
        JobRecord("a", "cifar10", 0.0, None, 0, 0.0, None, state="running"),
        JobRecord("a", "", math.nan, None, 0, 0.0, None, failure="already exists", state="rejected"),
        JobRecord("", "", math.nan, None, 0, 0.0, None, failure="unreadable", state="rejected"),
        JobRecord("b", "", math.nan, None, 0, 0.0, None, failure="no such GPU", state="rejected"),
        JobRecord("", "", math.nan, None, 0, 0.0, None, failure="unreadable too", state="rejected"),
        JobRecord("b", "cifar10", 5.0, None, 0, 0.0, None, state="queued"),
    ]  # a corrected body took b
    rows = [(j.id, j.state) for j in job_statuses(records)]
    assert rows == [("a", "running"), (None, "rejected"), ("b", "queued"), (None, "rejected")], rows


def test_a_field_typo_gets_the_field_it_may_have_meant():
    with pytest.raises(msgspec.ValidationError) as error:
        msgspec.convert({"id": "a", "application": "cifar10", "requestd_gpus": 2}, JobSpec)
    reason = malformed_reason(error.value)
    assert "did you mean `requested_gpus`" in reason and "min_gpus" in reason, reason
