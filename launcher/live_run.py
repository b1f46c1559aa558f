"""Hand a deployed stack its live run: `python -m launcher.live_run --policy goodput --round 60`.

The policy leader schedules only the runs it finds in the KV bucket `goodput_runs`; `goodput up`
creates its live run itself (cli/up.py). A deployed stack (Kubernetes, compose) has no such driver,
so a one-shot job runs this as the operator: it sets up every stream, bucket and consumer (the
services only open them: launcher/setup.py), then creates the live run — jobs submitted with
`goodput submit` are scheduled a round every `--round` seconds with `--policy` — unless a run of that
id exists already, which it leaves as it is (the job may run again at every `kubectl apply`).
A live run never ends: its policy is the one it was created with.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import nats.errors

from deploy.probe import DEFAULT_SERVER, SERVER_ENV
from shared import storage
from shared.bus import Bus
from shared.credentials import connect_options, redact
from shared.schema.runs import RunRequest
from shared.settings import DEFAULT_POLICY
from shared.subjects import LIVE_RUN


def live_request(
    run_id: str, policy_spec: str, cluster: str, round_s: float, speed: float, option_defaults: dict | None = None
) -> RunRequest:
    """The live run's request, as `goodput up` makes it: a round every `round_s` seconds of the wall
    clock, each `round_s` x `speed` seconds of the cluster's clock (a simulated cluster may run
    faster than the wall clock). `option_defaults`: policy options unless the spec sets them.
    ValueError for an unknown policy or option."""
    from policies.base import make_policy
    from policies.base import policy_spec as parse_policy
    from shared.settings import settings_for

    if round_s <= 0 or speed <= 0:
        raise ValueError("--round and --speed must be positive")
    policy, options = parse_policy(policy_spec)
    options = {**(option_defaults or {}), **options}
    make_policy(policy, **options)  # refuse options the policy does not take, here
    return RunRequest(
        run_id, policy, options, settings_for(None, cluster).name, (), round_s * speed, live=True, speed=speed
    )


async def create_live_run(
    server: str, request: RunRequest, wait_s: float, lease_ttl_s: float = storage.LEASE_TTL_S
) -> RunRequest | None:
    """Set up the storage (the operator's part: launcher.setup), then create the run: None once
    created, or the stored request of the run of that id that exists already. Keeps trying to reach
    NATS for `wait_s` seconds."""
    from launcher.stack import ensure_run

    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        try:
            bus = await Bus.connect_once(
                server, "goodput-live-run", **connect_options()
            )  # the $GOODPUT_NATS_* credentials
            break
        except Exception as error:  # noqa: BLE001 - NATS may still be starting: try again until the deadline
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"cannot reach NATS at {redact(server)} within {wait_s:g} s: {error}") from None
            await asyncio.sleep(1.0)
    try:
        await storage.provision(bus, lease_ttl_s)
        return await ensure_run(bus, request)
    except nats.errors.Error as error:
        raise RuntimeError(f"cannot create the run on NATS at {redact(server)}: {error}") from None
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.live_run",
        description="create the live run a deployed goodput schedules submitted jobs in",
    )
    parser.add_argument(
        "--server",
        default=os.environ.get(SERVER_ENV, DEFAULT_SERVER),
        help=f"NATS URL (default: ${SERVER_ENV}, else {DEFAULT_SERVER})",
    )
    parser.add_argument("--run-id", default=LIVE_RUN, help="the run's id (default: %(default)s)")
    parser.add_argument(
        "--policy", default=DEFAULT_POLICY, help="policy, with options as NAME:KEY=VALUE (default: %(default)s)"
    )
    parser.add_argument(
        "--cluster",
        default="sia-hetero-64",
        help="the cluster the services run (preset or YAML file; picks the calibration)",
    )
    parser.add_argument("--round", type=float, default=60.0, help="seconds between rounds (default: %(default)s)")
    parser.add_argument(
        "--speed", type=float, default=1.0, help="simulated seconds per wall-clock second (default: %(default)s)"
    )
    parser.add_argument(
        "--wait", type=float, default=120.0, help="seconds to keep trying to reach NATS (default: %(default)s)"
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=storage.LEASE_TTL_S,
        help="seconds the policy leader's lease lasts unrenewed (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        if args.lease_ttl <= 0:
            raise ValueError("--lease-ttl must be positive")
        request = live_request(args.run_id, args.policy, args.cluster, args.round, args.speed)
        existing = asyncio.run(create_live_run(args.server, request, args.wait, args.lease_ttl))
    except (ValueError, RuntimeError) as error:
        print(f"live_run: {error}", file=sys.stderr)
        return 1
    if existing is None:
        print(f"live run {args.run_id!r} created: {describe(request)}")
    else:
        print(f"live run {args.run_id!r} exists already ({describe(existing)}); left as it is")
        if (existing.policy, existing.policy_options, existing.round_s) != (
            request.policy,
            request.policy_options,
            request.round_s,
        ):
            print(
                f"live_run: the settings asked for ({describe(request)}) differ; a live run keeps the ones it "
                "was created with",
                file=sys.stderr,
            )
    return 0


def describe(request: RunRequest) -> str:
    options = ",".join(f"{key}={value}" for key, value in request.policy_options.items())
    pace = f"{request.round_s / request.speed:g} s" + (
        f" ({request.round_s:g} s of the cluster's clock)" if request.speed != 1 else ""
    )
    return f"policy {request.policy}{':' + options if options else ''}, a round every {pace}"


if __name__ == "__main__":
    sys.exit(main())
