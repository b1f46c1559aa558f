"""The live service as a user meets it: `goodput up` serving, a client with nats-py alone (none of
the project's code) logging in with what DATA/user.env says and publishing msgpack JobSpecs, bad
ones among a burst of good ones, then a stop with Ctrl-C and a start again on the same data folder;
and the same stack probed as an attacker with the user's login would."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import nats
import pytest

from launcher.nats import free_loopback_port

pytestmark = pytest.mark.e2e  # every test here starts `goodput up` as a process

ROOT = Path(__file__).resolve().parent.parent
GOODPUT = [sys.executable, "-m", "cli.main"]
SUBMIT = "goodput.jobs.submit.user"  # the documented subject, the login's own, as a user writes it
BURST = 300
# Each bad submission and a word its rejection must say.
BAD = {
    "h100-1": ({"id": "h100-1", "application": "cifar10", "gpu_types": ["h100"]}, "h100"),
    "huge-1": ({"id": "huge-1", "application": "cifar10", "requested_gpus": 2**64 - 1}, "requested_gpus"),
    "late-1": ({"id": "late-1", "application": "cifar10", "submit_s": 5.0}, "submit_s"),
    "typo-1": ({"id": "typo-1", "application": "cifar10", "requested_gpu": 2}, "requested_gpu"),
    "nosuch-1": ({"id": "nosuch-1", "application": "resnet9000"}, "resnet9000"),
    "wide-1": ({"id": "wide-1", "application": "cifar10", "rigid": True, "requested_gpus": 100}, "64 GPUs"),
}
NEWLINE_ID = "newline-1\n"  # never becomes a job, but is answered: a rejection with no id


def user_env(data: Path) -> dict[str, str]:
    """The settings DATA/user.env holds (KEY=VALUE lines), as a user's shell would source them."""
    lines = (data / "user.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def user_login(data: Path) -> dict:
    """nats-py connect options for the user role, from user.env (its password file, the role's inboxes)."""
    env = user_env(data)
    return {
        "servers": env["GOODPUT_NATS_URL"],
        "user": env["GOODPUT_NATS_USER"],
        "password": Path(env["GOODPUT_NATS_PASSWORD_FILE"]).read_text().strip(),
        "inbox_prefix": "_INBOX_user",
    }


def command_env(data: Path | None) -> dict[str, str]:
    """Our environment without NATS settings, plus user.env's when `data` is given (None: the command
    is to find the default data folder's by itself)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("GOODPUT_NATS_")}
    env["PYTHONPATH"] = str(ROOT)
    return {**env, **(user_env(data) if data is not None else {})}


async def publish(data: Path, documents: list[dict], in_flight: int = 64) -> None:
    """As users' clients would: msgpack bodies, and every third one JSON (as a Go or TypeScript client
    writes it), Nats-Msg-Id = the id, `in_flight` awaiting their ack at a time."""
    nc = await nats.connect(**user_login(data))
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int, doc: dict) -> None:
        async with gate:
            await js.publish(
                SUBMIT,
                json.dumps(doc).encode() if i % 3 == 2 else msgspec.msgpack.encode(doc),
                headers={"Nats-Msg-Id": doc["id"]},
                timeout=30,
            )

    try:
        js = nc.jetstream()
        await asyncio.gather(*(one(i, doc) for i, doc in enumerate(documents)))
    finally:
        await nc.close()


async def json_status(data: Path) -> dict:
    """The first page of the login's jobs, asked in JSON with nats-py alone."""
    nc = await nats.connect(**user_login(data))
    try:
        return json.loads((await nc.request("goodput.api.jobs", b'{"limit": 1}', timeout=10)).data)
    finally:
        await nc.close()


def status(data: Path | None, cwd: Path = ROOT) -> dict:
    out = subprocess.run(
        [*GOODPUT, "status", "--json"], cwd=cwd, env=command_env(data), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_for(data: Path | None, done, what: str, timeout_s: float = 600.0, cwd: Path = ROOT) -> dict:
    """`goodput status --json` until `done(document)`; fails with the last document after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        document = status(data, cwd)
        if done(document):
            return document
        if time.monotonic() > deadline:
            states = {}
            for job in document["jobs"]:
                states[job["state"]] = states.get(job["state"], 0) + 1
            raise AssertionError(f"{what}: not after {timeout_s:.0f} s; states {states}, run {document['run']}")
        time.sleep(1.0)


class Up:
    """`goodput up` serving, as a process of its own."""

    def __init__(self, port: int, data: Path | None, *extra: str, cwd: Path = ROOT):
        """`data` None: the default data folder, under `cwd`."""
        self.log = (data.parent if data is not None else cwd) / f"up-{time.monotonic_ns()}.log"
        self.output = self.log.open("w")
        folder = ["--data", str(data)] if data is not None else []
        self.process = subprocess.Popen(
            [
                *GOODPUT,
                "up",
                "--workload",
                "none",
                "--port",
                str(port),
                *folder,
                "--round",
                "2",
                "--speed",
                "600",
                *extra,
            ],
            cwd=cwd,
            env=command_env(None),
            stdout=self.output,
            stderr=subprocess.STDOUT,
        )

    def wait_serving(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "serving:" not in self.log.read_text():
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)

    def interrupt(self) -> float:
        """Ctrl-C; the seconds until it was down."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=60)
        self.output.close()
        return time.monotonic() - started

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # its services stop with it
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.output.close()


@pytest.fixture
def stack(tmp_path):
    port, data = free_loopback_port(), tmp_path / "data"
    up = Up(port, data)
    try:
        up.wait_serving()
        yield port, data, up
    finally:
        up.kill()


def test_bad_submissions_are_rejected_with_reasons_a_burst_finishes_and_a_restart_keeps_every_job(stack):
    port, data, up = stack
    bad = [doc for doc, _ in BAD.values()] + [{"id": NEWLINE_ID, "application": "cifar10"}]
    # JSON clients cannot tell 2 from 2.0: an integral float is a GPU count.
    good = [{"id": f"burst-{i}", "application": "cifar10", "requested_gpus": 2.0 if i % 2 else 1} for i in range(BURST)]
    asyncio.run(publish(data, bad + good))

    def settled(document):
        jobs = {j["id"]: j for j in document["jobs"]}
        return all(jobs.get(f"burst-{i}", {}).get("state") == "finished" for i in range(BURST)) and all(
            jobs.get(name, {}).get("state") == "rejected" for name in BAD
        )

    document = wait_for(data, settled, "every good job finished and every bad one rejected")
    jobs = {j["id"]: j for j in document["jobs"]}
    for name, (_, word) in BAD.items():
        assert word in jobs[name]["reason"], (name, jobs[name]["reason"])
    unnamed = [j for j in document["jobs"] if j["id"] is None]
    assert len(unnamed) == 1 and unnamed[0]["state"] == "rejected" and "id" in unnamed[0]["reason"]
    assert document["run"]["state"] == "running" and document["run"]["leader"]
    assert asyncio.run(json_status(data))["total"] >= BURST  # a request in JSON, answered in JSON
    assert set(jobs["burst-1"]) >= {"id", "state", "reason", "application", "gpu_type", "gpus", "nodes", "batch"}

    # One job, for people and for scripts; the table piped into a reader that stops early is no error.
    one = subprocess.run(
        [*GOODPUT, "status", "burst-7", "--json"],
        env=command_env(data),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(one.stdout)["id"] == "burst-7"
    two = subprocess.run(
        [*GOODPUT, "status", "burst-7", "burst-1", "--json"],
        env=command_env(data),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert [j["id"] for j in json.loads(two.stdout)["jobs"]] == ["burst-7", "burst-1"]
    unknown = subprocess.run(
        [*GOODPUT, "status", "burst-7", "nosuch"], env=command_env(data), cwd=ROOT, capture_output=True, text=True
    )
    assert unknown.returncode == 2 and "no job of yours is known to the executors as 'nosuch'" in unknown.stderr
    # The simulated cluster's nodes, for the operator: all alive, each with the jobs running there.
    operator = ["--nats-user", "operator", "--nats-password-file", str(data / "secrets" / "operator")]
    listed = subprocess.run(
        [*GOODPUT, "nodes", "--json", *operator], env=command_env(data), cwd=ROOT, capture_output=True, text=True
    )
    nodes = json.loads(listed.stdout)["nodes"]
    assert {n["state"] for n in nodes} == {"alive"} and sum(n["gpus"] for n in nodes) == 64, nodes
    piped = subprocess.run(
        f"{sys.executable} -m cli.main status | head -1",
        env=command_env(data),
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert piped.returncode == 0 and "Traceback" not in piped.stderr, piped.stderr

    # A second stack on the same data folder, or on the same port, is refused; nothing is touched.
    for other in (
        ["--port", str(free_loopback_port()), "--data", str(data)],
        ["--port", str(port), "--data", str(data.parent / "other")],
    ):
        refused = subprocess.run(
            [*GOODPUT, "up", "--workload", "none", *other], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 2 and ("in use" in refused.stderr or "taken" in refused.stderr), refused.stderr
    assert not (data.parent / "other").exists()  # the one refused for its port made no folder

    stopped_in = up.interrupt()
    assert up.process.returncode == 0 and stopped_in < 30, stopped_in
    logs = {path.name: path.read_text() for path in data.glob("*.log") if path.name != "nats-server.log"}
    assert not [name for name, text in logs.items() if "Traceback" in text or " ERROR " in text], logs

    again = Up(port, data)
    try:
        again.wait_serving()
        asyncio.run(publish(data, [{"id": "after-restart", "application": "cifar10"}]))
        document = wait_for(
            data,
            lambda d: any(j["id"] == "after-restart" and j["state"] == "finished" for j in d["jobs"]),
            "the job submitted after the restart finished",
        )
        states = {j["id"]: j["state"] for j in document["jobs"]}
        assert all(states[f"burst-{i}"] == "finished" for i in range(BURST))
        assert all(states[name] == "rejected" for name in BAD)
    finally:
        again.kill()


# What a login may ask of the services, besides the user API.
STATUS_SUBJECTS = ("goodput.policy.status",)
# Where an attacker asks a service to answer: deleting the submissions and the runs, the live run's checkpoint.
EVIL_REPLIES = ("$JS.API.STREAM.DELETE.GOODPUT_JOBS", "$JS.API.STREAM.DELETE.GOODPUT_RUNS", "$KV.goodput_runs.live")


async def attack(data: Path) -> list[str]:
    """Every trick the user's login allows, as a client that is not ours; what the server said back."""
    url = user_env(data)["GOODPUT_NATS_URL"]
    errors: list[str] = []

    async def collect(error: Exception) -> None:
        errors.append(str(error).lower())

    with pytest.raises(Exception):  # no login: refused
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=1, error_cb=collect)
    assert any("authorization violation" in error for error in errors), errors

    nc = await nats.connect(**user_login(data), error_cb=collect)
    try:
        await nc.publish("goodput.executor.apply", msgspec.msgpack.encode({"now_s": 1e6, "placements": {}}))
        await nc.publish("$SRV.STATS", b"")  # every instance would answer: not a login's to ask
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await nc.request(
                "$JS.API.STREAM.CREATE.GOODPUT_JOBS",
                json.dumps(
                    {"name": "GOODPUT_JOBS", "subjects": ["goodput.executor.apply"], "storage": "memory"}
                ).encode(),
                timeout=2,
            )
        for subject in STATUS_SUBJECTS:
            for reply in EVIL_REPLIES:
                for body in (msgspec.msgpack.encode({}), b"\xc1"):  # a valid request, and an invalid one
                    await nc.publish(subject, body, reply=reply)
        # A request in parts on a status endpoint is refused at once: it never waits for parts.
        refusals = [
            await nc.request("goodput.policy.status", b"", timeout=10, headers={"Goodput-Chunk": "0/256"})
            for _ in range(6)
        ]
        assert all(r.headers.get("Nats-Service-Error-Code") == "400" for r in refusals), [r.headers for r in refusals]
        # Each service has taken the tricks before these answers (one subscription, in order).
        for subject in STATUS_SUBJECTS:
            await nc.request(subject, msgspec.msgpack.encode({}), timeout=10)
        await nc.flush()
    finally:
        await nc.close()
    return errors


async def stored_streams(data: Path) -> dict[str, int]:
    """Each stream's message count, as the operator (whose password `goodput up` keeps in DATA/secrets) sees it."""
    nc = await nats.connect(
        user_env(data)["GOODPUT_NATS_URL"],
        user="operator",
        inbox_prefix="_INBOX_operator",
        password=(data / "secrets" / "operator").read_text().strip(),
    )
    try:
        js = nc.jetstream()
        return {
            name: (await js.stream_info(name)).state.messages
            for name in ("GOODPUT_JOBS", "GOODPUT_RUNS", "KV_goodput_runs")
        }
    finally:
        await nc.close()


def test_a_user_cannot_act_through_a_service_and_the_stack_goes_on(tmp_path):
    """`goodput up` on its default data folder: anonymous clients are refused; with user.env, an
    allocation or a stream of one's own is a permissions violation; status requests and pings whose
    replies name the JetStream API or the live run's key change nothing (the answers stay in the
    logins' account); `goodput submit` and `goodput
    status`, given no server or login, find user.env by themselves and a job is scheduled to finished."""
    port = free_loopback_port()
    up = Up(port, None, cwd=tmp_path)
    data = tmp_path / "out" / "stack"
    try:
        up.wait_serving()
        assert (data / "user.env").stat().st_mode & 0o777 == 0o600
        errors = asyncio.run(attack(data))
        for refused in (
            'publish to "goodput.executor.apply"',
            'publish to "$js.api.stream.create.goodput_jobs"',
            'publish to "$srv.stats"',
        ):
            assert any("permissions violation" in error and refused in error for error in errors), errors
        job = tmp_path / "job.yaml"
        job.write_text("id: after-tricks\napplication: cifar10\n")
        submitted = subprocess.run(
            [*GOODPUT, "submit", str(job)],
            cwd=tmp_path,
            env=command_env(None),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert submitted.returncode == 0 and submitted.stdout.strip() == "after-tricks: accepted (profiling)", (
            submitted.stderr
        )
        document = wait_for(
            None,
            lambda d: any(j["id"] == "after-tricks" and j["state"] == "finished" for j in d["jobs"]),
            "the job submitted after the tricks finished",
            cwd=tmp_path,
        )
        assert document["run"]["state"] == "running" and document["run"]["id"] == "live"
        assert all(messages > 0 for messages in asyncio.run(stored_streams(data)).values())
    finally:
        up.kill()
    logs = {path.name: path.read_text() for path in data.glob("*.log") if path.name != "nats-server.log"}
    assert not [name for name, text in logs.items() if "Traceback" in text or "ermissions Violation" in text], logs


def test_goodput_up_killed_its_services_stop_by_themselves_and_the_next_one_takes_over(tmp_path):
    """kill -9 of `goodput up` gives it no chance to stop its services: each, and its NATS server,
    stops on its own (none is left running, holding the port's stack for no one), and the next
    `goodput up` on the folder serves on the same port with the jobs it had."""
    port, data = free_loopback_port(), tmp_path / "data"
    up = Up(port, data)
    try:
        up.wait_serving()
        started = _pids(f"--server nats://127.0.0.1:{port}")
        assert len(started) >= 6, started  # the six services
        assert len(_pids(str(data / "jetstream"))) == 1  # its NATS server
        up.process.kill()
        up.process.wait()
        deadline = time.monotonic() + 60
        while left := _pids(f"--server nats://127.0.0.1:{port}") + _pids(str(data / "jetstream")):
            assert time.monotonic() < deadline, f"still running: {left}"
            time.sleep(0.2)
        logs = "".join(path.read_text() for path in data.glob("*.log") if path.name != "nats-server.log")
        assert "Traceback" not in logs, logs[-3000:]
        up = Up(port, data)
        up.wait_serving()
        assert "stopped the NATS server" not in up.log.read_text(), up.log.read_text()  # none was left
    finally:
        up.kill()
        for pid in _pids(str(data / "jetstream")):  # on a failure: nothing left behind
            os.kill(pid, signal.SIGTERM)


def _pids(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split() if int(pid) != os.getpid()]
