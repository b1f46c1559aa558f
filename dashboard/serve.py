"""Serve the dashboard's app with uvicorn inside the caller's asyncio loop, beside its NATS client:
on a socket bound before anything else starts (a taken port is a clear error, port 0 any free one),
stopped by the caller (its own signal handling, not uvicorn's)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import socket

import uvicorn

STOP_GRACE_S = 2.0  # a request still being answered at stop gets this long


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the caller's loop owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: any free port); ValueError when it cannot be had."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a port is 0 (any free one) to 65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as error:
        raise ValueError(f"--host {host}: not an address of this machine ({error.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is taken; choose another with --port (0: any free one)") from None
        raise ValueError(f"cannot serve on {host}:{port}: {error.strerror}") from None
    sock.setblocking(False)
    return sock


def is_loopback(sock: socket.socket) -> bool:
    return ipaddress.ip_address(sock.getsockname()[0]).is_loopback


def _address(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return (f"[{host}]" if ":" in host else host), port


def page_url(sock: socket.socket, token: str) -> str:
    """The URL that opens the dashboard: its address, and the token that lets its holder in, in the
    fragment: the browser sends it to no server (not in a request, a log or a Referer); the page's
    script reads it, keeps it in the tab's sessionStorage and sends it as `Authorization`."""
    host, port = _address(sock)
    return f"http://{host}:{port}/#token={token}"


def page_hosts(sock: socket.socket) -> frozenset[str] | None:
    """The Host headers a dashboard on `sock` answers: on loopback its address and `localhost`, with
    its port, so that a page of another name resolving to 127.0.0.1 (DNS rebinding) is refused;
    beyond loopback any name of the machine (None), its token guarding it."""
    if not is_loopback(sock):
        return None
    host, port = _address(sock)
    return frozenset({f"{host}:{port}", f"localhost:{port}"})


@contextlib.asynccontextmanager
async def serving(app, sock: socket.socket):
    """Serve `app` (a `dashboard.app.create_app`) on `sock` while the block runs; then end its
    event streams and stop, closing the socket."""
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=STOP_GRACE_S,
        proxy_headers=False,
    )
    server = _Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        yield server
    finally:
        app.closing.set()
        server.should_exit = True
        await task
