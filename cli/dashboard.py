"""`goodput dashboard` — a live web page of the cluster: the nodes and their GPUs coloured by job, the
queue with each job's state and reason, a job's GPUs, type and batch over time with why, and the
last rounds' decisions (docs/dashboard.md).

It logs in to NATS as any user's command does (the same options and login files: it reads only the
user API, what that login may see) and serves the page on a loopback port; its data only to the
page's requests that carry the random token of the URL it prints (its fragment, `#token=`), in a
header: no cookie, so no page of another origin lends it. No NATS credential reaches the page.
`goodput up` serves one too (`start`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import signal
import sys

from cli.submit import add_connection_arguments
from shared import credentials

DEFAULT_HOST = "127.0.0.1"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "dashboard",
        help="serve a live web page of the cluster (nodes, queue, a job's history, rounds) on a loopback port",
    )
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="address to serve on (default: %(default)s, this machine only; the token is asked either way)",
    )
    parser.add_argument("--port", type=int, default=0, help="port to serve on (default: 0, any free one)")
    parser.add_argument(
        "--refresh",
        type=float,
        default=None,
        metavar="SECONDS",
        help="read the API at most this often while a page is open (default: 1)",
    )
    add_connection_arguments(parser)
    parser.set_defaults(func=_dashboard)


def _dashboard(args: argparse.Namespace) -> int:
    from dashboard.app import REFRESH_S
    from dashboard.serve import is_loopback, listen

    refresh_s = REFRESH_S if args.refresh is None else args.refresh
    if not refresh_s > 0:
        raise ValueError("--refresh must be a positive number of seconds")
    options = credentials.connect_options(credentials.from_args(args))  # ValueError: a missing file
    sock = listen(args.host, args.port)
    try:
        if not is_loopback(sock):
            print(
                f"goodput dashboard: warning: serving beyond this machine ({args.host}), over plain HTTP: "
                "whoever reaches it with the URL sees what your login sees",
                file=sys.stderr,
            )
        return asyncio.run(_serve(args.server, options, sock, refresh_s))
    finally:
        sock.close()


async def _serve(server: str, options: dict, sock, refresh_s: float) -> int:
    url, running = await start(server, options, sock, refresh_s)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)
    async with running:
        print(f"dashboard: {url}", flush=True)
        print("open it in a browser on this machine (the token in it lets its holder in); Ctrl-C stops it", flush=True)
        await stopped.wait()
    print("dashboard stopped", flush=True)
    return 0


async def connect(server: str, options: dict):
    """A NATS connection for the dashboard (it reconnects by itself), once a first request to the
    user API showed that the server is there, takes the login and serves the API: ValueError
    saying which of them is wrong otherwise."""
    import nats.errors
    from nats.micro.request import ServiceError

    from cli.submit import ask
    from shared import subjects
    from shared.bus import Bus
    from shared.schema.api import JobsPage, JobsRequest

    try:  # ValueError: no API answers, or the login may not ask it
        await ask(server, subjects.API_JOBS, JobsRequest(limit=1), JobsPage, **options)
        return await Bus.connect(server, "goodput-dashboard", **options)
    except ServiceError as error:
        raise ValueError(f"the user API refused to list the jobs: {error.description}") from None
    except (OSError, asyncio.TimeoutError, nats.errors.Error) as error:
        raise ValueError(credentials.unreachable(server, error, options)) from None


async def start(server: str, options: dict, sock, refresh_s: float | None = None):
    """Log in (checked) and serve the dashboard on `sock`: its URL (with a new token) and an
    AsyncExitStack whose closing stops it and logs out."""
    from dashboard.app import REFRESH_S, create_app
    from dashboard.serve import page_hosts, page_url, serving
    from dashboard.source import ApiSource

    running = contextlib.AsyncExitStack()
    try:
        bus = await connect(server, options)
        running.push_async_callback(bus.close)
        token = secrets.token_urlsafe(32)
        app = create_app(ApiSource(bus), token, hosts=page_hosts(sock), refresh_s=refresh_s or REFRESH_S)
        await running.enter_async_context(serving(app, sock))
    except BaseException:
        await running.aclose()
        raise
    return page_url(sock, token), running
