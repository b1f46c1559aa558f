"""The user API: `goodput.api.*`, a NATS micro service (`api` in `$SRV.INFO`) that answers every
request, in the request's encoding (JSON or msgpack), so a client in any language needs only a NATS
client. It is a process of its own, `python -m services.api` (its replicas one queue group).

Its parts: whose request it is and what that requester may see (`services.api.who`), the endpoints
and their messages' JSON Schema (`services.api.endpoints`), the submissions, judged before anything
is stored (`services.api.submissions`), and the answers about jobs, teams and rounds
(`services.api.queries`); a job's code (`services.api.code`). Here they are wired: every handler
takes the request and its `Who`, and the service supplies the login of each request, once, for all
(`as_requested`): no handler asks, so none can forget.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats import micro

from services.api.code import CodeGate
from services.api.endpoints import ENDPOINTS, schemas
from services.api.queries import Queries
from services.api.submissions import Kept, Models, Problem, Submissions, live_problem
from services.api.who import login
from shared import storage, subjects
from shared.bus import Bus
from shared.bus.kv import TypedKV
from shared.cluster import Cluster, load_cluster
from shared.runner import add_profile_arguments, new_service
from shared.schema.base import Node
from shared.schema.jobs import JobOwner
from shared.schema.nodes import NodeInfo
from shared.schema.teams import TeamFile
from shared.submissions import agents_models
from sim.profiles import profile_source

CONCURRENCY = 64  # requests one replica serves at once: each mostly waits on JetStream and the executors
INTAKE_WINDOW = 64  # submissions from the intake stream one replica judges at once

Handler = Callable[..., Any]  # (request, or on_invalid's arguments, ..., Who) -> the answer


class Api:
    """The API's handlers over one bus: `submissions` judges and stores jobs, `queries` answers about
    jobs, teams and rounds. `problem`, `kept`, `code`: Submissions'; `teams`, `cluster`: Queries'."""

    def __init__(
        self,
        bus: Bus,
        owners: TypedKV[JobOwner],
        problem: Problem,
        kept: Kept | None = None,
        code: CodeGate | None = None,
        teams: TypedKV[TeamFile] | None = None,
        cluster: Callable[[], Awaitable[Cluster]] | None = None,
    ) -> None:
        self.queries = Queries(bus, owners, teams, cluster)
        self.submissions = Submissions(bus, owners, problem, self.queries, kept, code)

    def handlers(self) -> dict[str, Handler]:
        """Each endpoint's handler, by its name in ENDPOINTS: (request, Who) -> the answer."""
        submissions, queries = self.submissions, self.queries
        return {
            "submit": submissions.answered,
            "job": queries.job,
            "jobs": queries.jobs,
            "cancel": queries.cancel,
            "schemas": lambda _, __: schemas(),
            "logs": queries.logs,
            "code-put": lambda chunk, who: submissions.code.put(chunk, who.login, who.team),
            "code-has": lambda request, who: submissions.code.has(request, who.login),
            "teams": queries.teams,
            "explain": queries.explain,
            "rounds": queries.rounds,
        }


def as_requested(handler: Handler) -> Callable[..., Any]:
    """`handler` given the `Who` of the request being handled (`login()`, the server's word) after
    the endpoint's own arguments: the one place a handler learns who asks."""
    return lambda *arguments: handler(*arguments, login())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser, "an application is known when a live node agent says it runs it")


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    """The API service of `python -m services.api`: the applications it knows are the profiles'
    (simulated executors) or those the live node agents say they run (real ones), and the cluster
    the team file is read against is `--cluster` (simulated) or the live nodes (real ones)."""
    cluster = load_cluster(args.cluster)
    if args.executors == "real":
        nodes = await storage.open_kv(bus, subjects.NODES_BUCKET, NodeInfo)

        async def models() -> Models | None:
            return agents_models((await nodes.values()).values(), cluster.gpu_types)

        async def now() -> Cluster:
            live = tuple(Node(n.name, n.gpu_type, n.gpus) for n in (await nodes.values()).values() if n.gpus > 0)
            return Cluster("live", live) if live else cluster

    else:
        types = profile_source(args.reference, args.zoo).types

        async def models() -> Models | None:
            return types

        async def now() -> Cluster:
            return cluster

    await storage.open_stream(bus, subjects.DEAD_LETTER_STREAM)
    await storage.open_stream(bus, subjects.LOGS_STREAM)  # what jobs print, read to their submitters
    owners = await storage.open_kv(bus, subjects.JOB_OWNERS_BUCKET, JobOwner)
    teams = await storage.open_kv(bus, subjects.TEAMS_BUCKET, TeamFile)
    problem = live_problem(cluster, models, own_code=args.executors == "real")
    return (await open_api(bus, owners, problem, teams, now))[1]


async def open_api(
    bus: Bus,
    owners: TypedKV[JobOwner],
    problem: Problem,
    teams: TypedKV[TeamFile] | None = None,
    cluster: Callable[[], Awaitable[Cluster]] | None = None,
) -> tuple[Api, micro.Service]:
    """The API's endpoints on a service of their own (for the caller to start), and the logins' own
    submissions from the intake stream judged from now on. `problem(spec)`: why a well-formed live
    submission cannot be scheduled on this cluster, or None (a coroutine function when it asks,
    e.g. which applications the live node agents run); `teams`, `cluster`: Api's."""
    api = Api(bus, owners, problem, code=CodeGate(bus), teams=teams, cluster=cluster)
    handlers = api.handlers()
    request_types = {"submit": msgspec.Raw}  # decoded by `submit` itself, to answer a bad body
    service = await new_service(
        bus, subjects.API_SERVICE, "the user API: submit, look up, list and cancel jobs; each team's GPUs"
    )
    for endpoint in ENDPOINTS:
        await bus.add_endpoint(
            service,
            endpoint.name,
            endpoint.subject,
            request_types.get(endpoint.name, endpoint.request),
            as_requested(handlers[endpoint.name]),
            span_name=f"api.{endpoint.name}",
            metadata=endpoint.metadata,
            on_invalid=as_requested(api.submissions.unreadable) if endpoint.name == "submit" else None,
            concurrency=CONCURRENCY,
        )
    intake = await storage.open_consumer(
        bus,
        subjects.INTAKE_CONSUMER,
        msgspec.Raw,
        span_name="api.intake",
        on_invalid=api.submissions.unjudgeable,
        dead_letters=subjects.dead_letters(subjects.INTAKE_CONSUMER),
    )
    # Judged 64 at once (each mostly waits on JetStream); bodies under one id in the stream's order.
    asyncio.get_running_loop().create_task(
        intake.consume(api.submissions.judge, with_delivery=True, batch=INTAKE_WINDOW, concurrent=True)
    )
    return api, service


async def serve(
    bus: Bus,
    owners: TypedKV[JobOwner],
    problem: Problem,
    teams: TypedKV[TeamFile] | None = None,
    cluster: Callable[[], Awaitable[Cluster]] | None = None,
) -> Api:
    """`open_api`, its service started at once and stopped with the bus: the API within another
    process (a test's)."""
    api, service = await open_api(bus, owners, problem, teams, cluster)
    await service.start()
    bus.on_close(service.stop)
    return api
