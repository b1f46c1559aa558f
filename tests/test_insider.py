"""An insider holding an ordinary login, probing `goodput up --workload none` with nats-py alone, as
the attacker would: replies pointed at streams, KV keys and the jobs stream through every responder;
another login's jobs and replies; a flood of large submissions; pages as large as allowed; JSON nested
20,000 deep. Each probe changes nothing it should not, and another login is still served."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import nats
import nats.errors
import pytest
from test_live_service import GOODPUT, ROOT, Up, command_env, stack, user_login, wait_for  # noqa: F401 - stack: the fixture

SERVICES = ("api", "profiler", "estimator", "policy", "placer", "executor")


def operator_login(data: Path) -> dict:
    """nats-py connect options for the operator, whose password `goodput up` keeps in DATA/secrets."""
    return {
        **user_login(data),
        "user": "operator",
        "password": (data / "secrets" / "operator").read_text().strip(),
        "inbox_prefix": "_INBOX_operator",
    }


# Where an insider points a service's answer: the live run's checkpoint, a job's owner and estimate,
# the jobs stream's subjects, the JetStream API.
TARGETS = (
    "$KV.goodput_runs.live",
    "$KV.goodput_job_owners.x",
    "$KV.goodput_estimates.x",
    "goodput.jobs.submit",
    "goodput.jobs.cancel",
    "goodput.jobs.stored.default.user",
    "$JS.API.STREAM.DELETE.GOODPUT_JOBS",
)


def login_file(path: Path) -> dict:
    """nats-py connect options from a login's file (DATA/logins/NAME.env), as a client not ours reads it."""
    env = dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return {
        "servers": env["GOODPUT_NATS_URL"],
        "user": env["GOODPUT_NATS_USER"],
        "password": env["GOODPUT_NATS_PASSWORD"],
        "inbox_prefix": f"_INBOX_{env['GOODPUT_NATS_USER']}",
    }


async def ask(options: dict, subject: str, body: dict | bytes, timeout: float = 30.0) -> tuple[dict, dict]:
    """One request in JSON, as a client in another language sends it: (answer, headers)."""
    nc = await nats.connect(**options)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        reply = await nc.request(subject, data, timeout=timeout)
        return (json.loads(reply.data) if reply.data else {}), dict(reply.headers or {})
    finally:
        await nc.close()


async def stored(data: Path) -> dict[str, int]:
    """Messages per subject of the jobs stream, and of the keys the tricks aim at, as the operator sees them."""
    nc = await nats.connect(
        user_login(data)["servers"],
        user="operator",
        inbox_prefix="_INBOX_operator",
        password=(data / "secrets" / "operator").read_text().strip(),
    )
    try:
        js = nc.jetstream()
        counts = dict((await js.stream_info("GOODPUT_JOBS", subjects_filter=">")).state.subjects or {})
        for bucket, key in (("goodput_job_owners", "x"), ("goodput_estimates", "x")):
            info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.{key}")
            counts[f"$KV.{bucket}.{key}"] = sum((info.state.subjects or {}).values())
        return counts
    finally:
        await nc.close()


def add_login(data: Path, name: str) -> Path:
    added = subprocess.run(
        [*GOODPUT, "login", "add", name, "--data", str(data)],
        cwd=ROOT,
        env=command_env(None),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert added.returncode == 0, added.stderr
    path = data / "logins" / f"{name}.env"
    assert path.stat().st_mode & 0o777 == 0o600 and str(path) in added.stdout
    return path


def finished(data: Path, job_id: str):
    return lambda document: any(j["id"] == job_id and j["state"] == "finished" for j in document["jobs"])


def wait_finished(options: dict, job_id: str, timeout_s: float = 300.0) -> None:
    """Until the login's job `job_id` has finished, asked through the API as that login."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer, _ = asyncio.run(ask(options, "goodput.api.job", {"id": job_id}))
        if answer.get("state") == "finished":
            return
        assert time.monotonic() < deadline, answer
        time.sleep(1.0)


async def point_replies(data: Path) -> None:
    """Every responder a login may ask asked to answer onto every target: each user API endpoint
    (the NATS service API, `$SRV.*`, is not a login's to ask); then the services found as `nats
    micro ls` does, as the operator."""
    nc = await nats.connect(**user_login(data))
    try:
        for endpoint in ("submit", "job", "jobs", "cancel", "schemas"):
            for target in TARGETS:
                await nc.publish(f"goodput.api.{endpoint}", b'{"id": "x"}', reply=target)  # no job: refused
        await nc.request("goodput.api.schemas", b"{}", timeout=30)  # after the tricks, on their connection
    finally:
        await nc.close()
    nc = await nats.connect(**operator_login(data))
    try:
        # Discovery as `nats micro ls` does it: one ping, every service's answer.
        seen: set[str] = set()
        everyone = asyncio.Event()

        async def answered(msg) -> None:
            seen.add(json.loads(msg.data)["name"])
            if seen >= set(SERVICES):
                everyone.set()

        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=answered)
        await nc.publish("$SRV.PING", b"", reply=inbox)
        await asyncio.wait_for(everyone.wait(), 30)
    finally:
        await nc.close()


def test_no_reply_a_login_names_lands_in_storage_and_a_restart_keeps_every_job(stack):
    port, data, up = stack
    before = asyncio.run(stored(data))
    asyncio.run(point_replies(data))
    answer, _ = asyncio.run(ask(user_login(data), "goodput.api.submit", {"id": "after-1", "application": "cifar10"}))
    assert answer["accepted"] is True, answer
    wait_for(data, finished(data, "after-1"), "the job submitted after the tricks finished")
    after = asyncio.run(stored(data))
    # Only the job's own submission and verdict were stored: no answer reached a stream or a key.
    assert after.get("$KV.goodput_job_owners.x", 0) == after.get("$KV.goodput_estimates.x", 0) == 0, after
    assert after.get("goodput.jobs.cancel", 0) == before.get("goodput.jobs.cancel", 0), after
    assert after.get("goodput.jobs.stored.default.user", 0) == before.get("goodput.jobs.stored.default.user", 0) + 1, (
        after
    )
    logs = {path.name: path.read_text() for path in data.glob("*.log") if path.name != "nats-server.log"}
    for text in ("another leader", "unreadable checkpoint", "Traceback"):
        assert not [name for name, log in logs.items() if text in log], (text, logs)

    up.interrupt()
    again = Up(port, data)
    try:
        again.wait_serving()
        answer, _ = asyncio.run(ask(user_login(data), "goodput.api.submit", {"id": "after-2", "application": "ncf"}))
        assert answer["accepted"] is True, answer
        document = wait_for(data, finished(data, "after-2"), "a job submitted after the restart finished")
        assert {j["id"]: j["state"] for j in document["jobs"]}["after-1"] == "finished"
    finally:
        again.kill()


async def overhear(options: dict, inbox: str) -> list[str]:
    """Errors the server gives a login that subscribes to another's inboxes."""
    errors: list[str] = []

    async def collect(error: Exception) -> None:
        errors.append(str(error).lower())

    nc = await nats.connect(**options, error_cb=collect)
    try:
        await nc.subscribe(inbox)
        await nc.flush()
        for _ in range(100):
            if errors:
                break
            await asyncio.sleep(0.02)
    finally:
        await nc.close()
    return errors


def test_a_login_sees_and_touches_only_its_own_jobs_and_replies(stack):
    _, data, _ = stack
    bob = login_file(add_login(data, "bob"))
    answer, _ = asyncio.run(
        ask(user_login(data), "goodput.api.submit", {"id": "users-1", "application": "imagenet", "requested_gpus": 8})
    )
    assert answer["accepted"] is True, answer
    answer, _ = asyncio.run(ask(bob, "goodput.api.submit", {"id": "bobs-1", "application": "cifar10"}))
    assert answer["accepted"] is True, answer
    for endpoint in ("job", "cancel"):
        answer, headers = asyncio.run(ask(bob, f"goodput.api.{endpoint}", {"id": "users-1"}))
        assert headers.get("Nats-Service-Error-Code") == "404" and "of yours" in answer["error"], (answer, headers)
    page, _ = asyncio.run(ask(bob, "goodput.api.jobs", {}))
    assert [job["id"] for job in page["jobs"]] == ["bobs-1"] and page["total"] == 1, page
    mine, _ = asyncio.run(ask(user_login(data), "goodput.api.job", {"id": "users-1"}))
    assert mine["state"] in ("profiling", "queued", "running"), mine  # untouched by bob's cancel
    assert 'permissions violation for subscription to "_inbox_user.>"' in " ".join(
        asyncio.run(overhear(bob, "_INBOX_user.>"))
    )
    wait_finished(bob, "bobs-1")

    removed = subprocess.run(
        [*GOODPUT, "login", "remove", "bob", "--data", str(data)],
        cwd=ROOT,
        env=command_env(None),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert removed.returncode == 0, removed.stderr
    with pytest.raises(nats.errors.Error, match="(?i)authorization"):
        asyncio.run(ask({**bob, "allow_reconnect": False, "max_reconnect_attempts": 1}, "goodput.api.jobs", {}))


async def flood(options: dict, seconds: float) -> tuple[int, dict[str, int], bytes]:
    """60 KiB submissions to the API as fast as one connection publishes them: how many were sent,
    the answers' error codes ("" for none) as they came, and the body of a 429."""
    body = json.dumps({"id": "flood", "application": "cifar10", "pad": " " * 60_000}).encode()
    sent, codes, deadline = 0, {}, time.monotonic() + seconds
    over: list[bytes] = []
    nc = await nats.connect(**options)

    async def answered(msg) -> None:
        code = (msg.headers or {}).get("Nats-Service-Error-Code", "")
        codes[code] = codes.get(code, 0) + 1
        if code == "429":
            over[:] = [msg.data]

    try:
        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=answered)
        while time.monotonic() < deadline:
            for _ in range(50):
                await nc.publish("goodput.api.submit", body, reply=inbox)
            sent += 50
            await asyncio.sleep(0)
        await nc.flush()
        await asyncio.sleep(1.0)
    finally:
        await nc.close()
    return sent, codes, over[0] if over else b""


async def submit_during(options: dict, other: dict, attack, job_id: str) -> tuple[dict, int]:
    """Bob's submission while `attack(other)` runs: (the answer, what the attack returned)."""
    attacking = asyncio.ensure_future(attack(other))
    await asyncio.sleep(2.0)  # well into it
    answer, _ = await ask(options, "goodput.api.submit", {"id": job_id, "application": "cifar10"})
    return answer, await attacking


def why_not(data: Path) -> list[str]:
    """What the server and the API logged of a failure: the lines a failed assertion shows."""
    server = [line for line in (data / "nats-server.log").read_text().splitlines() if "Slow Consumer" in line]
    api = (data / "api.log").read_text().splitlines()
    return server[-5:] + [line for line in api if "failed" in line or "Error" in line][-10:]


def test_one_login_flooding_or_paging_leaves_another_served(stack):
    _, data, _ = stack
    bob = login_file(add_login(data, "bob"))
    answer, (sent, codes, over) = asyncio.run(
        submit_during(bob, user_login(data), lambda login: flood(login, 20.0), "bobs-flood")
    )
    assert answer["accepted"] is True and sent > 1000, (answer, sent)
    # The flooder was told "over your limit" (429), and kept at most its bound of refusals.
    assert codes.get("429", 0) > 0 and codes.get("500", 0) == 0, (codes, why_not(data))
    assert json.loads(over)["code"] == 429 and "limit" in json.loads(over)["error"], over  # why, in JSON too
    kept = asyncio.run(stored(data))
    assert kept.get("goodput.jobs.refused.default.user", 0) <= 1_000, kept

    async def pages(login: dict) -> int:
        nc = await nats.connect(**login)
        try:
            answers = await asyncio.gather(
                *(
                    nc.request("goodput.api.jobs", json.dumps({"limit": limit}).encode(), timeout=60)
                    for limit in (1000, 500) * 150
                ),
                return_exceptions=True,
            )
            return sum(not isinstance(a, Exception) for a in answers)
        finally:
            await nc.close()

    answer, answered = asyncio.run(submit_during(bob, user_login(data), pages, "bobs-pages"))
    assert answer["accepted"] is True and answered == 300, (answer, answered)
    wait_finished(bob, "bobs-flood")
    wait_finished(bob, "bobs-pages")
    assert "Slow Consumer" not in (data / "nats-server.log").read_text(), why_not(data)


def test_json_nested_20000_deep_is_answered(stack):
    _, data, _ = stack
    deep = b'{"id": "deep-1", "application": "cifar10", "gpu_types": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    for subject in ("goodput.api.submit", "goodput.api.job", "goodput.api.jobs"):
        answer, headers = asyncio.run(ask(user_login(data), subject, deep))
        assert headers.get("Nats-Service-Error-Code") == "400" and "nest" in json.dumps(answer), (subject, answer)
    deadline = time.monotonic() + 60
    while True:  # the refusal is recorded (nothing of the body read, its id neither): the executors list it
        page, _ = asyncio.run(ask(user_login(data), "goodput.api.jobs", {"state": "rejected"}))
        if any(job["id"] is None and "nests at most 64" in job["reason"] for job in page["jobs"]):
            break
        assert time.monotonic() < deadline, page
        time.sleep(0.5)
