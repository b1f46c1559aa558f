"""The embedded stack: the five services as child processes of this one, on one NATS server."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import nats.errors

from shared import subjects
from shared.bus import Bus
from shared.reference import WorkloadJob
from shared.schema import Ack, Count, JobRecords, JobSpec, RunReport, RunRequest

SERVICES = ("profiler", "estimator", "policy", "placer", "executor")
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


class Stack:
    def __init__(self, commands: Mapping[str, list[str]], logs: Path):
        self.commands = dict(commands)
        self.logs = logs
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> None:
        """Start (or start again) one service; its log is appended to."""
        with open(self.logs / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(self.commands[name], stdout=log, stderr=subprocess.STDOUT)

    def kill(self, name: str) -> None:
        """kill -9: the service gets no chance to clean up."""
        self.processes[name].kill()
        self.processes[name].wait()

    async def wait_ready(self, bus: Bus, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every service answers the NATS service API's ping; a clear error if one died."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        waiting = set(self.processes)
        while waiting:
            for name in sorted(waiting):
                if self.processes[name].poll() is not None:
                    raise RuntimeError(f"service {name} exited with {self.processes[name].returncode}:\n"
                                       + self.log(name))
                try:
                    await bus.nc.request(f"$SRV.PING.{name}", b"", timeout=0.25)
                    waiting.discard(name)
                except Exception:  # noqa: BLE001 - not answering yet
                    pass
            if waiting and asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"services {sorted(waiting)} did not answer ping within {timeout_s:.0f} s")
            if waiting:
                await asyncio.sleep(0.1)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def running_services(server: str, arguments: Mapping[str, Sequence[str]], logs: Path) -> Iterator[Stack]:
    """Start `python -m services.<name> --server URL <arguments>` for each service; stop them all after."""
    stack = Stack({name: [sys.executable, "-m", f"services.{name}", "--server", server, *arguments.get(name, ())]
                   for name in SERVICES}, logs)
    try:
        for name in SERVICES:
            (logs / f"{name}.log").unlink(missing_ok=True)
            stack.start(name)
        yield stack
    finally:
        stack.stop()


async def _count(bus: Bus, subject: str) -> int:
    """A service's count; -1 while its endpoint is not answering yet (a service answers ping as soon
    as it registers, a moment before its endpoints do)."""
    try:
        return (await bus.request(subject, Ack(), Count, timeout=10)).n
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return -1


def service_arguments(cluster: str, reference: str | None, use_zoo: bool, calibration: str | None,
                      feedback_iterations: int, restart_delay_s: float | None) -> dict[str, list[str]]:
    """Each service's options for a simulated cluster (its jobs' truth, its calibration)."""
    truth = (["--reference", reference] if reference else []) + (["--zoo"] if use_zoo else [])
    calib = ["--calibration", calibration] if calibration else []
    delay = ["--restart-delay", str(restart_delay_s)] if restart_delay_s is not None else []
    return {
        "profiler": ["--cluster", cluster, *truth],
        "estimator": ["--cluster", cluster, *calib],
        "policy": ["--cluster", cluster],
        "placer": ["--cluster", cluster],
        "executor": ["--cluster", cluster, *truth, *calib, "--feedback-iterations", str(feedback_iterations), *delay],
    }


async def replay(bus: Bus, stack: Stack, jobs: Sequence[WorkloadJob], policy: str, policy_options: dict,
                 calibration: str, round_s: float | None = None, horizon_s: float | None = None,
                 request_timeout_s: float = 10.0) -> tuple[RunReport, JobRecords]:
    """Submit a workload through JetStream, wait until every job is profiled and known to the
    executors, and have the policy leader replay it on the virtual clock."""
    await bus.ensure_stream(subjects.JOBS_STREAM, subjects.JOBS_STREAM_SUBJECTS,
                            duplicate_window=subjects.DEDUP_WINDOW_S)
    for job in jobs:
        spec = JobSpec(job.name, job.application, requested_gpus=job.num_replicas,
                       requested_batch=job.batch_size, submit_s=job.time)
        await bus.js_publish(subjects.SUBMIT, spec, msg_id=job.name)
    for status in (subjects.ESTIMATOR_STATUS, subjects.EXECUTOR_STATUS):
        while await _count(bus, status) < len(jobs):
            await asyncio.sleep(0.05)
    request = RunRequest(policy, policy_options, calibration, tuple((j.name, j.time) for j in jobs), round_s,
                         horizon_s, request_timeout_s)
    try:
        for attempt in range(100):      # the leader answers ping a moment before its endpoint
            try:
                report = await bus.request(subjects.RUN, request, RunReport, timeout=24 * 3600)
                break
            except nats.errors.NoRespondersError:
                if attempt == 99:
                    raise
                await asyncio.sleep(0.1)
    except Exception as error:  # noqa: BLE001 - say which service failed and why
        logs = "\n".join(f"--- {name}\n{stack.log(name)}" for name in stack.processes)
        raise RuntimeError(f"the replay over NATS failed ({error!r}); the services' logs end with:\n{logs}") from None
    return report, await bus.request(subjects.RECORDS, Ack(), JobRecords, timeout=60)
