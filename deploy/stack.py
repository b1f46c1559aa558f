"""The embedded stack: the five services as child processes of this one, on one NATS server."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from shared.bus import Bus

SERVICES = ("profiler", "estimator", "policy", "placer", "executor")
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


class Stack:
    def __init__(self, processes: dict[str, subprocess.Popen], logs: Path):
        self.processes = processes
        self.logs = logs

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
    processes = {}
    try:
        for name in SERVICES:
            with open(logs / f"{name}.log", "wb") as log:
                processes[name] = subprocess.Popen(
                    [sys.executable, "-m", f"services.{name}", "--server", server, *arguments.get(name, ())],
                    stdout=log, stderr=subprocess.STDOUT)
        stack = Stack(processes, logs)
        yield stack
    finally:
        Stack(processes, logs).stop()
