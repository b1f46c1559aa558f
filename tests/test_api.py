"""The user API as an integrator in another language meets it: nats-py alone and JSON bodies, on
`goodput up` serving (logged in with what DATA/user.env says). A JSON submission to the JetStream
subject finishes; `goodput.api.submit` answers a bad body with the reason and takes the corrected
one under the same id; a running job is cancelled with `goodput cancel` and stays cancelled across
a restart; `goodput.api.schemas` describes the messages, and `$SRV.INFO` is not a login's to ask."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import uuid

import nats
import nats.errors
import pytest
from test_live_service import (
    GOODPUT,
    ROOT,
    Up,
    command_env,
    stack,  # noqa: F401 - the fixture: `goodput up` serving
    user_login,
    wait_for,
)

from services.api import service as api
from shared import storage, subjects
from shared.cluster import load_cluster
from shared.schema.api import JobRequest, JobStatus, SubmitAnswer
from shared.schema.jobs import JobOwner, JobSpec, Rejected
from shared.schema.nodes import NodeInfo
from shared.schema.records import JobRecord, JobRecords, JobsQuery

SUBMIT = "goodput.jobs.submit.user"  # the subjects as the docs write them: the login's own
API = "goodput.api"


async def ask(nc, subject: str, document: dict) -> tuple[dict, dict]:
    """A JSON request: (its JSON answer, its headers)."""
    reply = await nc.request(subject, json.dumps(document).encode(), timeout=30)
    return json.loads(reply.data), dict(reply.headers or {})


async def until(nc, job_id: str, states: set[str], timeout_s: float = 300.0) -> dict:
    """`goodput.api.job` until the job is in one of `states`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        job, _ = await ask(nc, f"{API}.job", {"id": job_id})
        if job.get("state") in states:
            return job
        assert asyncio.get_running_loop().time() < deadline, (job_id, job)
        await asyncio.sleep(0.5)


def test_a_json_client_submits_is_answered_cancels_and_discovers_the_api(stack):
    port, data, up = stack

    async def session() -> None:
        nc = await nats.connect(**user_login(data))
        try:
            # The durable, fire-and-forget path: JSON on the JetStream subject, as docs/api.md says; a
            # message id another login used drops nothing (the intake keeps them for 100 ms only).
            body = json.dumps({"id": "json-1", "application": "cifar10", "requested_gpus": 2.0}).encode()
            ack = await nc.jetstream().publish(SUBMIT, body, headers={"Nats-Msg-Id": "json-1"})
            assert ack.seq > 0
            await nc.jetstream().publish(SUBMIT, b"not json at all")  # listed as refused, "id": null

            # The answering path: a bad body is refused with the reason, and reserves nothing.
            bad, _ = await ask(nc, f"{API}.submit", {"id": "api-1", "application": "cifar10", "requested_gpus": "four"})
            assert bad["accepted"] is False and bad["id"] == "api-1" and "requested_gpus" in bad["reason"], bad
            typo, _ = await ask(nc, f"{API}.submit", {"id": "api-2", "application": "cifar10", "requestd_gpus": 2})
            assert typo["accepted"] is False and "did you mean `requested_gpus`" in typo["reason"], typo
            good, _ = await ask(nc, f"{API}.submit", {"id": "api-1", "application": "cifar10", "requested_gpus": 4})
            assert good["accepted"] is True and good["state"] == "profiling", good
            assert any("hint" in note for note in good["notes"]), good
            again, _ = await ask(nc, f"{API}.submit", {"id": "api-1", "application": "cifar10", "requested_gpus": 4})
            assert again["accepted"] is True and "not stored again" in again["reason"], again
            other, _ = await ask(nc, f"{API}.submit", {"id": "api-1", "application": "bert"})
            assert other["accepted"] is False and "already exists" in other["reason"], other

            # Different bodies racing under one id: one is the job, the others are told, and the job is
            # the one its answer said.
            racing = await asyncio.gather(
                *(
                    ask(nc, f"{API}.submit", {"id": "race-1", "application": "cifar10", "requested_gpus": n})
                    for n in range(1, 9)
                )
            )
            won = [n for n, (answer, _) in enumerate(racing, start=1) if answer["accepted"]]
            assert len(won) == 1 and all("already exists" in a["reason"] for a, _ in racing if not a["accepted"])
            race = await until(nc, "race-1", {"queued", "running", "finished"})
            assert race["state"] != "rejected", race

            # A long job, cancelled once it runs.
            big, _ = await ask(nc, f"{API}.submit", {"id": "big-1", "application": "imagenet", "requested_gpus": 8})
            assert big["accepted"], big
            running = await until(nc, "big-1", {"running"})
            assert running["gpus"] >= 1 and running["gpu_type"], running

            for name in ("json-1", "api-1"):
                done = await until(nc, name, {"finished", "failed", "rejected"})
                assert done["state"] == "finished" and done["jct_s"] > 0, done
            # The same message id again, once the first ran: stored, and the API's to call a repeat.
            again = await nc.jetstream().publish(SUBMIT, body, headers={"Nats-Msg-Id": "json-1"})
            assert again.seq > ack.seq and not again.duplicate

            # Lists, filtered and paged; the schemas; an unknown id is a 404 with the reason.
            page, _ = await ask(nc, f"{API}.jobs", {"state": "finished", "limit": 1})
            assert page["total"] >= 2 and len(page["jobs"]) == 1 and page["next_offset"] == 1, page
            assert page["jobs"][0]["state"] == "finished"
            wrong, headers = await ask(nc, f"{API}.jobs", {"state": "done"})
            assert headers.get("Nats-Service-Error-Code") == "400" and "finished" in wrong["error"], (wrong, headers)
            missing, headers = await ask(nc, f"{API}.job", {"id": "no-such-job"})
            assert headers.get("Nats-Service-Error-Code") == "404" and "no-such-job" in missing["error"]
            missing, headers = await ask(nc, f"{API}.cancel", {"id": "no-such-job"})
            assert headers.get("Nats-Service-Error-Code") == "404", (missing, headers)
            # Whatever the body, the answer is JSON: not an object, or empty (every field its default).
            for body, word in (
                (b'"hello"', "JSON object"),
                (b"[1, 2]", "JSON object"),
                (b"", "field `id`; a submission names at least its id and application"),
            ):
                answer = json.loads((await nc.request(f"{API}.submit", body, timeout=30)).data)
                assert answer["accepted"] is False and word in answer["reason"], (body, answer)
            everything = json.loads((await nc.request(f"{API}.jobs", b"", timeout=30)).data)
            named = [j["id"] for j in everything["jobs"] if j["id"] is not None]  # one row per id
            assert everything["total"] >= 3 and len(set(named)) == len(named), named
            # A refused body is listed with what could be read of it: the id and application of a typo'd
            # one; a body that is no JSON object under "id": null, saying what a submission is.
            listed = {j["id"]: j for j in everything["jobs"] if j["id"] is not None}
            assert (listed["api-2"]["state"], listed["api-2"]["application"]) == ("rejected", "cifar10"), listed[
                "api-2"
            ]
            assert any(
                j["id"] is None and "not json at all" in j["reason"] and "a message is a JSON object" in j["reason"]
                for j in everything["jobs"]
            ), everything["jobs"]
            schemas, _ = await ask(nc, f"{API}.schemas", {})
            assert {"JobSpec", "SubmitAnswer", "JobStatus", "CancelAnswer"} <= set(schemas["$defs"])
            assert "requested_gpus" in schemas["$defs"]["JobSpec"]["properties"]

            # The NATS service API is not a login's: every instance of every service would answer.
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await nc.request("$SRV.INFO.api", b"", timeout=2)
        finally:
            await nc.close()

    asyncio.run(session())

    # `goodput cancel`, as a user runs it with the stack's address and login; twice is harmless.
    for _ in range(2):
        cancelled = subprocess.run(
            [*GOODPUT, "cancel", "big-1", "--server", f"nats://127.0.0.1:{port}"],
            cwd=ROOT,
            env=command_env(data),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr
    ended = subprocess.run(
        [*GOODPUT, "cancel", "json-1"], cwd=ROOT, env=command_env(data), capture_output=True, text=True, timeout=120
    )
    assert ended.returncode == 2 and "has ended" in ended.stderr, ended.stderr

    def gave_back(document):  # the next round has its GPUs back: it is in no placement
        jobs = {j["id"]: j for j in document["jobs"]}
        return jobs["big-1"]["state"] == "cancelled" and jobs["big-1"]["gpus"] == 0

    listed = [j["id"] for j in wait_for(data, gave_back, "big-1 cancelled, holding no GPUs", timeout_s=120)["jobs"]]
    said = wait_for(
        data,
        lambda _: "big-1 was cancelled by its user" in up.log.read_text(),
        "the live output saying big-1 was cancelled",
        timeout_s=60,
    )
    assert said["run"]["state"] == "running"
    up.interrupt()
    again = Up(port, data)
    try:
        again.wait_serving()
        document = wait_for(data, lambda d: d["run"]["state"] == "running", "the live run resumed", timeout_s=120)
        states = {j["id"]: j["state"] for j in document["jobs"]}
        assert states["big-1"] == "cancelled" and states["api-1"] == "finished", states
        assert [j["id"] for j in document["jobs"]] == listed  # in the order they came, as before
    finally:
        again.kill()


async def test_a_corrected_body_is_not_hidden_by_the_refusal_of_the_one_before(connect_bus):
    """The executors read a stored submission only once it is profiled; until then they still show
    the refusal of a bad body sent under the same id before. The API answers for the corrected one."""
    await storage.provision(await connect_bus("operator"))
    bus = await connect_bus()
    job_id = f"corrected-{uuid.uuid4().hex[:8]}"
    refused = JobRecord(
        job_id,
        "cifar10",
        math.nan,
        None,
        0,
        0.0,
        None,
        state="rejected",
        failure="malformed submission: Expected `int`, got `str` - at `$.requested_gpus`",
    )
    # The executors' record endpoint, standing still at that moment (no executor runs here).
    await bus.subscribe(subjects.RECORDS, JobsQuery, lambda query: JobRecords((refused,)))
    owners = await storage.open_kv(bus, subjects.JOB_OWNERS_BUCKET, JobOwner)
    await api.serve(bus, owners, lambda spec: None)
    spec = JobSpec(job_id, "cifar10", requested_gpus=4)

    stored = await bus.request(subjects.API_SUBMIT, spec, SubmitAnswer)
    assert stored.accepted and stored.state == "profiling", stored
    again = await bus.request(subjects.API_SUBMIT, spec, SubmitAnswer)
    assert again.accepted and "not stored again" in again.reason, again
    status = await bus.request(subjects.API_JOB, JobRequest(job_id), JobStatus)
    assert status.state == "profiling", status
    # What the stored submission says, before any executor has read it.
    assert (status.application, status.reason) == ("cifar10", "stored: the profiler reads it next"), status


async def serve_api(connect_bus, problem=lambda spec: None):
    """The API on its own bus, the executors' records standing still (none here): the refusals it
    records, as they pass on the jobs stream."""
    await storage.provision(await connect_bus("operator"))
    bus = await connect_bus()
    await bus.subscribe(subjects.RECORDS, JobsQuery, lambda query: JobRecords(()))
    recorded: asyncio.Queue[Rejected] = asyncio.Queue()
    await bus.subscribe(f"{subjects.REFUSED}.*.*", Rejected, recorded.put_nowait)  # each team and login's refusals
    await api.serve(bus, await storage.open_kv(bus, subjects.JOB_OWNERS_BUCKET, JobOwner), problem)
    return bus, recorded


async def test_every_refusal_is_error_400_with_its_answer_and_recorded_with_what_could_be_read(
    connect_bus, nats_server
):
    """Whatever is wrong with a body (not JSON, empty, too large, a typo'd field, a bad value), a
    nats-py client gets the same: error 400 in the headers, the SubmitAnswer with the reason as the
    body; the refusal is recorded with the id and application when they can be read."""
    _, recorded = await serve_api(connect_bus)
    tag = uuid.uuid4().hex[:8]
    bodies = {
        "not JSON": (b"hello there", None, None, "a message is a JSON object"),
        "empty": (b"", None, None, "field `id`"),
        "too large": (
            json.dumps({"id": f"big-{tag}", "application": "cifar10", "gpu_types": ["x" * 100_000]}).encode(),
            f"big-{tag}",
            "cifar10",
            "at most 64 KiB",
        ),
        "typo": (
            json.dumps({"id": f"typo-{tag}", "application": "cifar10", "requestd_gpus": 2}).encode(),
            f"typo-{tag}",
            "cifar10",
            "did you mean `requested_gpus`",
        ),
        "bad value": (
            json.dumps({"id": f"bad-{tag}", "application": "bert", "requested_gpus": "four"}).encode(),
            f"bad-{tag}",
            "bert",
            "$.requested_gpus",
        ),
        # As the published schema says: a number in a string is no number, 1 is no boolean.
        "number as text": (
            json.dumps({"id": f"text-{tag}", "application": "bert", "requested_gpus": "2"}).encode(),
            f"text-{tag}",
            "bert",
            "Expected `int`, got `str` - at `$.requested_gpus`",
        ),
        "1 for true": (
            json.dumps({"id": f"flag-{tag}", "application": "bert", "rigid": 1}).encode(),
            f"flag-{tag}",
            "bert",
            "Expected `bool`, got `int` - at `$.rigid`",
        ),
        # Nested 20,000 deep: refused before it is read, so nothing of it is.
        "nested deep": (b'{"id": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", None, None, "nests at most 64 levels deep"),
    }
    nc = await nats.connect(nats_server)
    try:
        for name, (body, job_id, application, words) in bodies.items():
            reply = await nc.request(f"{API}.submit", body, timeout=30)
            answer, headers = json.loads(reply.data), dict(reply.headers or {})
            assert answer["accepted"] is False and answer["id"] == job_id and words in answer["reason"], (name, answer)
            assert headers.get("Nats-Service-Error-Code") == "400", (name, headers)
            assert headers.get("Nats-Service-Error") == answer["reason"], (name, headers)
            refusal = await asyncio.wait_for(recorded.get(), 10)
            assert (refusal.job_id, refusal.application, refusal.reason) == (job_id, application, answer["reason"])
        good = await nc.request(
            f"{API}.submit", json.dumps({"id": f"good-{tag}", "application": "cifar10"}).encode(), timeout=30
        )
        assert json.loads(good.data)["accepted"] and "Nats-Service-Error-Code" not in (good.headers or {}), good
        whole = await nc.request(
            f"{API}.submit",
            b'{"id": "whole-%s", "application": "cifar10", "requested_gpus": 2.0}' % tag.encode(),
            timeout=30,
        )  # 2.0 is 2 to a JSON client
        assert json.loads(whole.data)["accepted"], whole.data
    finally:
        await nc.close()


async def test_an_unknown_application_is_refused_at_once_from_what_the_node_agents_run(connect_bus, nats_server):
    """Real executors: the application is checked against the jobs the live agents say they run,
    on the answer, as the reference profiles are on a simulated cluster; not accepted and then
    refused by its profiling run. The API as `python -m services.api --executors real` starts it."""
    cluster = load_cluster("local")
    await storage.provision(await connect_bus("operator"))
    members = await storage.open_kv(await connect_bus("agent"), subjects.NODES_BUCKET, NodeInfo)
    node = cluster.nodes[0]
    await members.put(
        f"n-{uuid.uuid4().hex[:8]}",
        NodeInfo(node.name, node.gpu_type, node.gpus, "127.0.0.1", applications=("mlp_blobs", "tiny_lm")),
    )
    parser = argparse.ArgumentParser()
    api.add_arguments(parser)
    bus = await connect_bus()
    await bus.subscribe(subjects.RECORDS, JobsQuery, lambda query: JobRecords(()))
    service = await api.start(bus, parser.parse_args(["--cluster", "local", "--executors", "real"]))
    await service.start()
    bus.on_close(service.stop)
    tag = uuid.uuid4().hex[:8]
    nc = await nats.connect(nats_server)
    try:
        unknown = await nc.request(
            f"{API}.submit", json.dumps({"id": f"unk-{tag}", "application": "nosuchjob"}).encode(), timeout=30
        )
        answer = json.loads(unknown.data)
        assert answer["accepted"] is False and "unknown application 'nosuchjob'" in answer["reason"], answer
        assert "tiny_lm" in answer["reason"] and (unknown.headers or {}).get("Nats-Service-Error-Code") == "400"
        known = json.loads(
            (
                await nc.request(
                    f"{API}.submit", json.dumps({"id": f"lm-{tag}", "application": "tiny_lm"}).encode(), timeout=30
                )
            ).data
        )
        assert known["accepted"] is True, known
    finally:
        await nc.close()
