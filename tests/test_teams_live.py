"""Two teams share a live `goodput up --teams`, each through its own login (DATA/teams/<team>.env): one
fills the cluster, the other's job within its guarantee runs on its guaranteed GPUs within two
rounds while the first team's jobs shrink, and neither team sees, looks up or cancels the other's
jobs. Team a's client is nats-py alone; team b uses goodput's commands.

The rounds are counted on the run's own log (each round's step, as the policy leader records it),
not between two `goodput status` calls: on a busy machine one call takes longer than a round (2 s),
so the round a status shows is late by a round or two, whatever the scheduler did."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import msgspec
import nats
import pytest

from launcher.nats import free_loopback_port
from launcher.stack import follow_run_steps
from shared.bus import Bus
from shared.credentials import connect_options, read_env
from shared.schema.runs import RunStep
from tests.test_live_service import GOODPUT, ROOT, Up, command_env

pytestmark = pytest.mark.e2e

TEAMS = """\
teams:
  a: {quota: {T4: 12, A100: 8, RTX 2080 Ti: 8}}
  b: {quota: {T4: 12, A100: 8, RTX 2080 Ti: 16}}
"""
FILL = 10  # team a's jobs of 8 GPUs each: more than the 64 the cluster holds


def login_env(login: Path) -> dict[str, str]:
    return {**command_env(None), "GOODPUT_LOGIN": str(login)}


def goodput(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([*GOODPUT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert not check or out.returncode == 0, out.stderr
    return out


def status(env: dict[str, str], *args: str) -> dict:
    return json.loads(goodput(env, "status", "--json", *args).stdout)


async def publish_as(login: Path, documents: list[dict]) -> None:
    """As a team's own client would, with nats-py alone: its login file's URL, user and password, its
    own inboxes, msgpack bodies on its own intake subject."""
    env = read_env(login)
    user = env["GOODPUT_NATS_USER"]
    nc = await nats.connect(
        env["GOODPUT_NATS_URL"], user=user, password=env["GOODPUT_NATS_PASSWORD"], inbox_prefix=f"_INBOX_{user}"
    )
    try:
        js = nc.jetstream()
        for doc in documents:
            await js.publish(
                f"goodput.jobs.submit.{user}", msgspec.msgpack.encode(doc), headers={"Nats-Msg-Id": doc["id"]}
            )
    finally:
        await nc.close()


async def steps_until(operator: dict[str, str], run_id: str, done, idle_s: float = 60.0) -> list[RunStep]:
    """The run's steps from its first, as the leader logged them, through the first for which
    `done(step)` (read as the operator, who may follow the run's log)."""
    bus = await Bus.connect_once(operator["GOODPUT_NATS_URL"], "test-run-log", **connect_options(environ=operator))
    steps: list[RunStep] = []
    try:
        async for step in follow_run_steps(bus, run_id, idle_timeout_s=idle_s):
            steps.append(step)
            if done(step):
                return steps
    finally:
        await bus.close()
    raise AssertionError(f"the run's log ended before the step looked for: {steps[-3:]}")


def wait_until(env: dict[str, str], done, what: str, rounds: int = 150) -> dict:
    """`goodput status --json` as `env`'s login until `done(document)`, for at most `rounds` of the run's
    rounds (the run's own clock, not the wall's)."""
    first = None
    while True:
        document = status(env)
        if done(document):
            return document
        now = document["run"].get("round") or 0
        first = now if first is None else first
        assert now - first <= rounds, f"{what}: not after {rounds} rounds: {document}"


def test_a_team_gets_its_guarantee_back_within_two_rounds_and_sees_only_its_own_jobs(tmp_path):
    port, data = free_loopback_port(), tmp_path / "data"
    team_file = tmp_path / "teams.yaml"
    team_file.write_text(TEAMS)
    up = Up(port, data, "--teams", str(team_file), "--speed", "30")
    try:
        up.wait_serving()
        a, b = login_env(data / "teams" / "a.env"), login_env(data / "teams" / "b.env")
        operator = {
            **command_env(None),
            "GOODPUT_NATS_URL": read_env(data / "teams" / "a.env")["GOODPUT_NATS_URL"],
            "GOODPUT_NATS_USER": "operator",
            "GOODPUT_NATS_PASSWORD_FILE": str(data / "secrets" / "operator"),
        }
        fill = [{"id": f"fill-{i}", "application": "imagenet", "requested_gpus": 8} for i in range(FILL)]
        asyncio.run(publish_as(data / "teams" / "a.env", fill))

        def whole_cluster(document) -> bool:
            return sum(j["gpus"] for j in document["jobs"] if j["state"] == "running") == 64

        wait_until(a, whole_cluster, "team a's jobs hold the whole cluster")
        borrowing = json.loads(goodput(a, "status", "--teams", "--json").stdout)
        [row] = borrowing["teams"]  # a team sees its own row only
        assert row["team"] == "a" and sum(t["borrowed"] for t in row["gpus"]) > 0, row

        job = tmp_path / "b.yaml"  # the same id as one of team a's: ids are unique per team
        job.write_text("id: fill-0\napplication: imagenet\nrequested_gpus: 8\ngpu_types: [A100]\n")
        goodput(b, "submit", str(job))
        running = wait_until(b, lambda d: d["jobs"] and d["jobs"][0]["state"] == "running", "b's job running")
        [mine] = running["jobs"]
        assert (mine["id"], mine["team"], mine["gpus"], mine["gpu_type"]) == ("fill-0", "b", 8, "A100"), mine
        assert mine["borrowed"] == 0, mine

        # The rounds, from the run's log: b's job joins the rounds (profiled) in `arrived` and holds
        # GPUs from `started`, its own round or the next; every GPU taken back from a's jobs for it
        # is taken in that round.
        steps = asyncio.run(
            steps_until(operator, running["run"]["id"], lambda s: s.record is not None and "b.fill-0" in s.record.gpus)
        )
        arrived = next(s.round for s in steps if s.total > FILL)
        started = steps[-1].round
        waits = [e for s in steps for e in s.events if "b.fill-0" in e]
        assert started - arrived <= 1, (
            f"b's job joined the rounds in round {arrived}, held GPUs from {started}: {waits}"
        )
        assert steps[-1].record.gpus["b.fill-0"] == 8, steps[-1].record

        theirs = status(a)["jobs"]
        assert {j["id"] for j in theirs} == {f"fill-{i}" for i in range(FILL)}  # b's fill-0 is not a's
        reclaimed = [r for j in theirs for r in j["reclaims"]]
        assert reclaimed and {(r["by_team"], r["round"]) for r in reclaimed} == {("b", started)}, theirs

        # Neither team sees, looks up or cancels the other's jobs, not even by the name the cluster knows.
        for env, other in ((b, "fill-5"), (b, "a.fill-5"), (a, "b.fill-0")):
            assert "no job" in goodput(env, "status", other, check=False).stderr
            cancel = goodput(env, "cancel", other, check=False)
            assert cancel.returncode != 0 and "no job" in cancel.stderr, cancel
        assert status(b, "fill-0")["state"] == "running"

        everyone = json.loads(goodput(operator, "status", "--teams", "--json").stdout)
        rows = {row["team"]: row for row in everyone["teams"]}
        assert {"a", "b"} <= set(rows), everyone
        a100 = {team: next(t for t in rows[team]["gpus"] if t["gpu_type"] == "A100") for team in ("a", "b")}
        assert a100["b"]["quota"] == 8 and a100["b"]["used"] == 8 and a100["b"]["borrowed"] == 0, a100
        assert a100["a"]["used"] <= 8, a100  # a gave b's A100s back
        assert os.stat(data / "teams" / "b.env").st_mode & 0o777 == 0o600
    finally:
        up.kill()
