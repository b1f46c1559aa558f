"""The operator's one-shot setup: every stream, KV bucket and durable consumer of the storage plan
(shared/storage.py), created or brought to the plan. No service may create them.

`goodput up` and the embedded stacks run it before they start the services (`provision_now`); the
manifests' and compose's `live-run` one-shot runs it first (launcher/live_run.py); `python -m
launcher.setup` runs it alone, with the operator's credentials (shared/credentials.py).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
from typing import Any

from shared import credentials, storage
from shared.bus import DEFAULT_SERVER, SERVER_ENV, Bus


async def provision(server: str, lease_ttl_s: float = storage.LEASE_TTL_S, **options: Any) -> None:
    bus = await Bus.connect_once(server, "goodput-setup", **options)
    try:
        await storage.provision(bus, lease_ttl_s)
    finally:
        await bus.close()


def provision_now(server: str, lease_ttl_s: float = storage.LEASE_TTL_S, **options: Any) -> None:
    """`provision`, finished before this returns, from synchronous code (even inside an event loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, provision(server, lease_ttl_s, **options)).result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.setup", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server",
        default=os.environ.get(SERVER_ENV, DEFAULT_SERVER),
        help=f"NATS URL (default: ${SERVER_ENV}, else {DEFAULT_SERVER})",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=storage.LEASE_TTL_S,
        help="seconds the policy leader's lease lasts unrenewed: a standby takes over within it (default: %(default)s)",
    )
    credentials.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.lease_ttl <= 0:
        parser.error("--lease-ttl must be positive")
    try:
        options = credentials.connect_options(credentials.from_args(args))
    except ValueError as error:
        parser.error(str(error))
    asyncio.run(provision(args.server, args.lease_ttl, **options))
    print(
        f"storage ready on {credentials.redact(args.server)}: {len(storage.STREAMS)} streams, "
        f"{len(storage.BUCKETS)} KV buckets, {len(storage.CONSUMERS)} consumers, "
        f"at most {storage.total_bytes() / storage.GIB:.1f} GiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
