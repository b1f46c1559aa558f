"""The live service as a user meets it: `goodput up` serving, a client with nats-py alone (none of
the project's code) publishing msgpack JobSpecs, bad ones among a burst of good ones, then a stop
with Ctrl-C and a start again on the same data folder."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import nats
import pytest

from deploy.nats import free_loopback_port

ROOT = Path(__file__).resolve().parent.parent
GOODPUT = [sys.executable, "-m", "cli.main"]
SUBMIT = "goodput.jobs.submit"           # the documented subject, written here as a user writes it
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
NEWLINE_ID = "newline-1\n"               # never becomes a job, but is answered: a rejection with no id


async def publish(port: int, documents: list[dict]) -> None:
    """As a user's client would: msgpack bodies, Nats-Msg-Id = the id, all at once."""
    nc = await nats.connect(f"nats://127.0.0.1:{port}")
    try:
        js = nc.jetstream()
        acks = [js.publish_async(SUBMIT, msgspec.msgpack.encode(doc), headers={"Nats-Msg-Id": doc["id"]})
                for doc in documents]
        await asyncio.gather(*acks)
    finally:
        await nc.close()


def status(port: int) -> dict:
    out = subprocess.run([*GOODPUT, "status", "--server", f"nats://127.0.0.1:{port}", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_for(port: int, done, what: str, timeout_s: float = 600.0) -> dict:
    """`goodput status --json` until `done(document)`; fails with the last document after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        document = status(port)
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

    def __init__(self, port: int, data: Path, *extra: str):
        self.log = data.parent / f"up-{time.monotonic_ns()}.log"
        self.output = self.log.open("w")
        self.process = subprocess.Popen([*GOODPUT, "up", "--workload", "none", "--port", str(port), "--data", str(data),
                                         "--round", "2", "--speed", "600", *extra],
                                        cwd=ROOT, stdout=self.output, stderr=subprocess.STDOUT)

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
            self.process.send_signal(signal.SIGINT)     # its services stop with it
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
    good = [{"id": f"burst-{i}", "application": "cifar10", "requested_gpus": 2.0 if i % 2 else 1}
            for i in range(BURST)]
    asyncio.run(publish(port, bad + good))

    def settled(document):
        jobs = {j["id"]: j for j in document["jobs"]}
        return (all(jobs.get(f"burst-{i}", {}).get("state") == "finished" for i in range(BURST))
                and all(jobs.get(name, {}).get("state") == "rejected" for name in BAD))

    document = wait_for(port, settled, "every good job finished and every bad one rejected")
    jobs = {j["id"]: j for j in document["jobs"]}
    for name, (_, word) in BAD.items():
        assert word in jobs[name]["reason"], (name, jobs[name]["reason"])
    unnamed = [j for j in document["jobs"] if j["id"] is None]
    assert len(unnamed) == 1 and unnamed[0]["state"] == "rejected" and "id" in unnamed[0]["reason"]
    assert document["run"]["state"] == "running" and document["run"]["leader"]
    assert set(jobs["burst-1"]) >= {"id", "state", "reason", "application", "gpu_type", "gpus", "nodes", "batch"}

    # One job, for people and for scripts; the table piped into a reader that stops early is no error.
    one = subprocess.run([*GOODPUT, "status", "burst-7", "--server", f"nats://127.0.0.1:{port}", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert json.loads(one.stdout)["id"] == "burst-7"
    piped = subprocess.run(f"{sys.executable} -m cli.main status --server nats://127.0.0.1:{port} | head -1",
                           shell=True, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0 and "Traceback" not in piped.stderr, piped.stderr

    # A second stack on the same data folder, or on the same port, is refused; nothing is touched.
    for other in (["--port", str(free_loopback_port()), "--data", str(data)],
                  ["--port", str(port), "--data", str(data.parent / "other")]):
        refused = subprocess.run([*GOODPUT, "up", "--workload", "none", *other], cwd=ROOT, capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode == 2 and ("in use" in refused.stderr or "taken" in refused.stderr), refused.stderr

    stopped_in = up.interrupt()
    assert up.process.returncode == 0 and stopped_in < 30, stopped_in
    logs = {path.name: path.read_text() for path in data.glob("*.log") if path.name != "nats-server.log"}
    assert not [name for name, text in logs.items() if "Traceback" in text or " ERROR " in text], logs

    again = Up(port, data)
    try:
        again.wait_serving()
        asyncio.run(publish(port, [{"id": "after-restart", "application": "cifar10"}]))
        document = wait_for(port, lambda d: any(j["id"] == "after-restart" and j["state"] == "finished"
                                                for j in d["jobs"]), "the job submitted after the restart finished")
        states = {j["id"]: j["state"] for j in document["jobs"]}
        assert all(states[f"burst-{i}"] == "finished" for i in range(BURST))
        assert all(states[name] == "rejected" for name in BAD)
    finally:
        again.kill()
