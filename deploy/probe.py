"""Does a goodput service answer? `python -m deploy.probe SERVICE [--server URL] [--timeout S]`.

The readiness and liveness probes of the Kubernetes manifests, and the compose file's health checks,
run this inside the service's container. It sends the NATS service API's ping, `$SRV.PING.<SERVICE>`,
and exits 0 on the first answer from an instance of SERVICE. A service answers ping only once all its
endpoints are registered (shared/runner.py), so an answer means the service is serving.
Otherwise it says why on stderr and exits 1 (no instance answered) or 2 (NATS could not be reached).

With `--ready` (the readiness probe) it also asks the policy how the live run goes
(`goodput.policy.status`): while the live run is stalled (a round keeps failing, and is retried) it
says why and exits 1, so an orchestrator sees a scheduler that answers but does not schedule. The
liveness probe leaves it out: restarting the policy does not bring back what a round lacks.

What it cannot tell is *which* instance answered: replicas share the service's name, and the
service API names an instance only by a random id. With several replicas the probe says that the
service is served, not that this container serves it.

The NATS URL is `--server`, else $GOODPUT_NATS_URL, else nats://127.0.0.1:4222; credentials may
stand in it (nats://USER:PASSWORD@HOST:4222) and are never printed, or come as the services take
them, from $GOODPUT_NATS_USER, $GOODPUT_NATS_PASSWORD_FILE … (shared/credentials.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys

import nats
import nats.errors

from shared.credentials import connect_options, redact

DEFAULT_SERVER = "nats://127.0.0.1:4222"  # as shared.bus: this module stays light, for a fast probe
SERVER_ENV = "GOODPUT_NATS_URL"
PING_RESPONSE = "io.nats.micro.v1.ping_response"
EXIT_NO_ANSWER = 1
POLICY = "policy"
EXIT_NO_NATS = 2
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class ProbeFailed(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


async def ping(service: str, server: str, timeout_s: float, ready: bool = False, **options) -> dict:
    """The first ping answer of an instance of `service`; ProbeFailed with the reason otherwise
    (`ready`: also while the policy's live run is stalled). `options`: nats-py connect options
    (credentials, TLS, inbox prefix)."""
    errors: list[Exception] = []

    async def remember(error: Exception) -> None:
        errors.append(error)

    try:
        nc = await nats.connect(
            server,
            name=f"goodput-probe-{service}",
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.1,
            connect_timeout=timeout_s,
            error_cb=remember,
            **options,
        )
    except Exception as error:  # noqa: BLE001 - every way of not connecting is the same answer
        reason = errors[0] if errors else error
        raise ProbeFailed(
            f"cannot reach NATS at {redact(server)}: {reason or type(reason).__name__}", EXIT_NO_NATS
        ) from None
    try:
        answer = await _ping(nc, service, server, timeout_s)
        if ready and service == POLICY:
            await _check_live_run(nc, server, timeout_s)
        return answer
    finally:
        await nc.close()


async def _ping(nc, service: str, server: str, timeout_s: float) -> dict:
    try:
        message = await nc.request(f"$SRV.PING.{service}", b"", timeout=timeout_s)
    except nats.errors.NoRespondersError:
        raise ProbeFailed(
            f"no instance of service {service!r} is registered on NATS at {redact(server)}", EXIT_NO_ANSWER
        ) from None
    except nats.errors.TimeoutError:
        raise ProbeFailed(
            f"no instance of service {service!r} answered ping within {timeout_s:g} s on NATS at {redact(server)}",
            EXIT_NO_ANSWER,
        ) from None
    try:
        answer = json.loads(message.data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or answer.get("type") != PING_RESPONSE or answer.get("name") != service:
        raise ProbeFailed(
            f"$SRV.PING.{service} was answered, but not by a service named {service!r}: {message.data[:200]!r}",
            EXIT_NO_ANSWER,
        )
    return answer


async def _check_live_run(nc, server: str, timeout_s: float) -> None:
    """ProbeFailed while the live run is stalled, with its reason."""
    import msgspec

    from shared.schema.runs import PolicyStatus
    from shared.subjects import POLICY_STATUS

    try:
        reply = await nc.request(POLICY_STATUS, msgspec.msgpack.encode({}), timeout=timeout_s)
        status = msgspec.msgpack.decode(reply.data, type=PolicyStatus)
    except (nats.errors.Error, msgspec.DecodeError) as error:
        raise ProbeFailed(
            f"the policy answers ping but not {POLICY_STATUS} on NATS at {redact(server)}: "
            f"{error or type(error).__name__}",
            EXIT_NO_ANSWER,
        ) from None
    if status.run is not None and status.run.state == "stalled":
        raise ProbeFailed(f"the live run is stalled at round {status.run.round}: {status.run.reason}", EXIT_NO_ANSWER)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.probe", description="exit 0 when an instance of SERVICE answers the NATS service ping"
    )
    parser.add_argument("service", help="service name: api, profiler, estimator, policy, placer or executor")
    parser.add_argument(
        "--server",
        default=os.environ.get(SERVER_ENV, DEFAULT_SERVER),
        help=f"NATS URL (default: ${SERVER_ENV}, else {DEFAULT_SERVER})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=2.0,
        help="seconds to connect, and again to wait for an answer (default: %(default)s)",
    )
    parser.add_argument(
        "--ready", action="store_true", help="readiness: for the policy, also fail while its live run is stalled"
    )
    args = parser.parse_args(argv)
    if not _NAME.match(args.service):
        parser.error(f"service name {args.service!r} may hold only letters, digits, '_' and '-'")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    try:
        options = connect_options()  # the $GOODPUT_NATS_* credentials, as the service's own
        answer = asyncio.run(ping(args.service, args.server, args.timeout, args.ready, **options))
    except ValueError as error:
        print(f"probe: {error}", file=sys.stderr)
        return EXIT_NO_NATS
    except ProbeFailed as failure:
        print(f"probe: {failure}", file=sys.stderr)
        return failure.code
    print(f"probe: {args.service} answers (instance {answer.get('id')}, version {answer.get('version')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
