"""Running one service process: its arguments, tracing, the NATS connection, a clean stop on SIGTERM.

Every `python -m services.<name>` is `service_main(name, start)`, where `start(bus, args)` registers
the service's endpoints on a `new_service` and returns it; the service then starts answering the
NATS service API (ping, info, stats), so a service that answers ping answers its endpoints too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Awaitable, Callable

from nats import micro

from shared import credentials
from shared.bus import Bus
from shared.bus.connection import DEFAULT_SERVER, SERVER_ENV
from shared.files import private_umask
from shared.metrics import TOKEN_FILE_ENV, MetricsUnavailable, setup_metrics
from shared.tracing import setup_tracing

# The pid of the process that started this service and whose end stops it (`goodput up` sets it).
PARENT_ENV = "GOODPUT_PARENT_PID"
PARENT_POLL_S = 0.2
# An orphan's stop is bounded: its NATS server goes with the same parent, so requests it would make
# to stop cleanly (a node agent's workers checkpointing) can only wait out their timeouts.
ORPHAN_STOP_S = 3.0

VERSION = "0.1.0"
log = logging.getLogger(__name__)

Start = Callable[[Bus, argparse.Namespace], Awaitable[micro.Service]]


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """A `preexec_fn`: the child is sent `sig` when `parent` (the process starting it) ends, killed -9
    included (Linux's parent-death signal; elsewhere nothing). It is the starting thread's end that
    counts: start such a child from the main thread."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # gone before the signal was asked for
        os.kill(os.getpid(), sig)


def ended_with_this_process(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for a child that must not outlive this process (`die_with_parent`); None off
    the main thread, whose end, not the process's, would send the signal."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return functools.partial(die_with_parent, os.getpid(), sig)


def positive_float(text: str) -> float:
    """An option that must be a positive number (argparse type: a clear error before anything starts)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


EXECUTORS = ("simulated", "real")  # who plays the jobs: a simulated cluster, or node agents running real ones


def executors_kind(text: str) -> str:
    """`--executors`'s value (argparse type): `local` is read as `real`, with a word on stderr."""
    if text == "local":
        print("`--executors local` means `--executors real`; use `real`", file=sys.stderr)
        return "real"
    return text


def add_profile_arguments(parser: argparse.ArgumentParser, real_help: str) -> None:
    """The options of a service that judges submissions by their profiles: the cluster, where the
    profiles come from on a simulated one, and who plays the jobs (`real_help`: what real changes)."""
    parser.add_argument("--cluster", default="sia-hetero-64", help="cluster preset or YAML/JSON file")
    parser.add_argument("--reference", help="reference folder the profiles are read from (simulated executors)")
    parser.add_argument("--zoo", action="store_true", help="profiles from the built-in model zoo (simulated executors)")
    parser.add_argument(
        "--executors",
        type=executors_kind,
        choices=EXECUTORS,
        default="simulated",
        help=f"real: {real_help} (default: %(default)s)",
    )


METRICS_PORT_ENV = "GOODPUT_METRICS_PORT"


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a process serves its metrics for Prometheus (shared/metrics.py): none unless a port is given."""
    port = os.environ.get(METRICS_PORT_ENV, "")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(port) if port.isdigit() else None,
        help=f"serve Prometheus metrics on this port (default: ${METRICS_PORT_ENV}, else none)",
    )
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", help="the metrics endpoint's address (default: %(default)s)"
    )
    parser.add_argument(
        "--metrics-token-file",
        default=os.environ.get(TOKEN_FILE_ENV),
        help=f"the operator's bearer token that a scrape must send, in a file: a port is served only with "
        f"it (default: ${TOKEN_FILE_ENV})",
    )


async def new_service(bus: Bus, name: str, description: str, metadata: dict[str, str] | None = None) -> micro.Service:
    """A `nats.micro` service to add endpoints to, on the bus's listener; replicas of one service
    share its queue group."""
    config = micro.ServiceConfig(
        name=name, version=VERSION, description=description, metadata=metadata or {}, queue_group=name
    )
    return micro.Service(await bus.listener(), config)


def service_main(
    name: str,
    start: Start,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: list[str] | None = None,
) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}", description=f"the goodput {name} service")
    parser.add_argument(
        "--server",
        default=os.environ.get(SERVER_ENV, DEFAULT_SERVER),
        help=f"NATS URL (default: ${SERVER_ENV}, else {DEFAULT_SERVER})",
    )
    credentials.add_arguments(parser)
    add_metrics_arguments(parser)
    if add_arguments:
        add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        options = credentials.connect_options(credentials.from_args(args))
    except ValueError as error:
        parser.error(str(error))  # exits 2 with the reason, before anything starts
    private_umask()  # what the service writes, and the jobs a node agent starts, is its owner's only
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    try:
        setup_metrics(f"goodput-{name}", args.metrics_port, args.metrics_host, token_file=args.metrics_token_file)
    except MetricsUnavailable as error:  # no endpoint open to all instead: the reason, and exit 2
        parser.error(str(error))
    provider = setup_tracing(f"goodput-{name}")
    try:
        asyncio.run(serve(name, start, args, **options))
    finally:
        provider.shutdown()  # export the spans still buffered before the process ends


async def serve(name: str, start: Start, args: argparse.Namespace, **options: Any) -> None:
    """Serve until SIGTERM or SIGINT, then stop taking requests, finish the ones in hand and leave;
    a service started by `goodput up` (`PARENT_ENV`) also stops once that process is gone, even
    killed -9. `options` are nats-py connect options: the credentials and TLS of `shared.credentials`."""
    bus = await Bus.connect(args.server, f"goodput-{name}", **options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if os.environ.get(PARENT_ENV, "").isdigit():
        parent = int(os.environ[PARENT_ENV])
        threading.Thread(target=_stop_without_parent, args=(parent, loop, stop, name), daemon=True).start()
    service = await start(bus, args)
    await service.start()
    log.info("%s %s ready on %s", name, VERSION, args.server)
    await stop.wait()
    log.info("%s stopping", name)
    await service.stop()
    await bus.close()


def _stop_without_parent(parent: int, loop: asyncio.AbstractEventLoop, stop: asyncio.Event, name: str) -> None:
    """Set `stop` once the process that started this one is gone (this one is then another's
    child), and leave ORPHAN_STOP_S later if still here. A thread: neither the watch nor the bound
    waits for an event loop that a stop in hand may hold."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    log.warning("the process that started this service (pid %d) is gone: stopping", parent)
    with contextlib.suppress(RuntimeError):  # the loop closed: the process is leaving anyway
        loop.call_soon_threadsafe(stop.set)
    time.sleep(ORPHAN_STOP_S)
    log.warning("%s: not stopped within %.0f s of its parent's end: leaving now", name, ORPHAN_STOP_S)
    logging.shutdown()
    os._exit(1)
