"""The dashboard's ASGI app: the page, its script and style (package data, no CDN), one server-sent
events stream of the cluster as JSON (`/events`), the same snapshot once (`/api/snapshot`) and a
job's explanation (`/api/jobs/ID`). The data is given only to a request with the token of the URL
printed at start in its `Authorization` header (`TokenGuard`: no cookie), and every text in it is
`shared.text.printable` (a job's stderr drives no terminal and disguises no row).

`create_app(source, token)` takes a source with four coroutines, `jobs()`, `rounds(limit)`,
`explain(id, rounds)` and `teams()`, answering as the user API does (`dashboard.source.ApiSource`
on NATS; a fake one in the tests). A snapshot is read at most once per `refresh_s` whatever the
number of pages open, and pushed to each page when it changed."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Iterable
from importlib import resources

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dashboard.source import Unavailable, UnknownJob
from shared.hardware import hardware_name
from shared.lifecycle import JobState
from shared.schema.api import JobStatus
from shared.schema.base import Node
from shared.schema.decisions import ExplainRequest, RoundsPage, RoundSummary
from shared.text import printable

REFRESH_S = 1.0  # the API is read at most this often
KEEPALIVE_S = 15.0  # a comment on an unchanged stream, so proxies and the page know it is alive
ROUNDS_SHOWN = 20
EXTRA_TIMEOUT_S = 5.0  # the rounds or the teams not answered by then: the snapshot goes without them
RETRY_EXTRA_S = 30.0  # ... and they are asked again after this long
EXPLAIN_ROUNDS = 200  # a job's last decisions drawn over time
# The page's own files: name -> media type. Nothing else is served from the package.
STATIC = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
# Only the page's own files run or style it; nothing may be framed, posted or fetched elsewhere.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}
UNAUTHORIZED = (
    "401 Unauthorized: the dashboard's data is for its page, which sends the token of the URL that "
    "`goodput dashboard` (or `goodput up`) printed: open http://HOST:PORT/#token=...\n"
)
MISDIRECTED = "403 Forbidden: this dashboard answers only at the address it printed\n"
# The page's own files: served to any request of the dashboard's address (they hold no data, and a
# browser's navigation carries no header), the data only with the token in `Authorization`.
PUBLIC = ("/", "/static/")


class TokenGuard:
    """ASGI middleware. A request must name the dashboard's own address in `Host` (when `hosts` is
    given: a loopback dashboard's) and, when it says where it comes from (`Origin`), come from its
    own page; else 403. The page's files are then served; every other request (the data) passes
    only with `Authorization: Bearer TOKEN`, compared in constant time, and else gets 401. No
    cookie is set or read: nothing a browser adds by itself lets a request in, so a page of another
    origin (another port of 127.0.0.1 included) can neither send the token nor read an answer."""

    def __init__(self, app, token: str, hosts: frozenset[str] | None = None) -> None:
        if len(token) < 16:
            raise ValueError("the dashboard's token must be at least 16 characters")
        self.app, self.token, self.hosts = app, token.encode(), hosts

    def _matches(self, authorization: str | None) -> bool:
        scheme, _, given = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token)

    def _refusal(self, request: Request) -> Response | None:
        host = request.headers.get("host", "")
        if self.hosts is not None and host not in self.hosts:
            return Response(MISDIRECTED, status_code=403, media_type="text/plain")
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{host}":
            return Response(MISDIRECTED, status_code=403, media_type="text/plain")
        public = request.url.path == PUBLIC[0] or request.url.path.startswith(PUBLIC[1])
        if not public and not self._matches(request.headers.get("authorization")):
            return Response(
                UNAUTHORIZED, status_code=401, media_type="text/plain", headers={"www-authenticate": "Bearer"}
            )
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a websocket: the dashboard serves none
            await send({"type": "websocket.close", "code": 1008})
            return

        async def send_guarded(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.decode().lower() not in SECURITY_HEADERS]
                headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        refusal = self._refusal(Request(scope))
        if refusal is not None:
            await refusal(scope, receive, send_guarded)
            return
        await self.app(scope, receive, send_guarded)


def job_row(job: JobStatus) -> dict:
    """A job as the page lists it."""
    return {
        "id": job.id,
        "state": job.state,
        "reason": job.reason,
        "application": job.application,
        "team": job.team,
        "gpus": job.gpus,
        "gpu_type": job.gpu_type,
        "gpu_alias": job.gpu_alias,
        "batch": job.batch if job.state == JobState.RUNNING else None,
        "placement": [list(spot) for spot in job.placement],
        "borrowed": job.borrowed,
        "restarts": job.restarts,
        "submit_s": job.submit_s,
        "finish_s": job.finish_s,
        "jct_s": job.jct_s,
    }


def gpu_layout(nodes: Iterable[Node], jobs: Iterable[JobStatus]) -> list[dict]:
    """Each node with its GPUs, each GPU the id of the job on it (None: idle), from the jobs'
    placements (node, GPUs): a job's GPUs on a node side by side, jobs in the order given. A node
    that holds jobs but is not among `nodes` is added, as large as what they hold."""
    jobs = list(jobs)
    held: dict[str, list[str]] = {}
    for job in jobs:
        if job.state != JobState.RUNNING or job.id is None:
            continue
        for node, gpus in job.placement:
            held.setdefault(node, []).extend([job.id] * gpus)
    layout = []
    for node in nodes:
        cells = held.pop(node.name, [])
        layout.append(_node(node.name, node.gpu_type, cells + [None] * max(0, node.gpus - len(cells))))
    types = {node: job.gpu_alias for job in jobs for node, _ in job.placement}
    for name, cells in sorted(held.items(), key=lambda item: _natural(item[0])):
        layout.append(_node(name, types.get(name), list(cells)))
    return layout


def _natural(name: str) -> list:
    """aws-2 before aws-10."""
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _node(name: str, gpu_type: str | None, cells: list) -> dict:
    return {
        "name": name,
        "gpu_type": gpu_type,
        "hardware": hardware_name(gpu_type) if gpu_type else None,
        "gpus": cells,
    }


def round_row(summary: RoundSummary) -> dict:
    """A decided round as the page lists it."""
    return {
        "round": summary.round,
        "at_s": summary.at_s,
        "policy": summary.policy,
        "jobs": summary.jobs,
        "allocated": summary.allocated,
        "waiting": summary.waiting,
        "restarts": summary.restarts,
        "gpus_total": summary.gpus_total,
        "gpus_allocated": sum(summary.gpus_allocated.values()),
        "goodput": summary.goodput,
        "objective": summary.objective,
        "solve_s": summary.solve_s,
        "duration_s": summary.duration_s,
        "events": list(summary.events),
    }


def snapshot_document(
    jobs: list[JobStatus],
    rounds: RoundsPage | None,
    rounds_note: str = "",
    teams=None,
    error: str = "",
) -> dict:
    """What `/events` pushes: the jobs, the nodes and their GPUs, the last rounds (newest first)
    or why they are not shown, and each team's GPUs when teams share the cluster."""
    nodes = rounds.nodes if rounds is not None and rounds.nodes else ()
    if rounds is not None and not nodes and rounds.rounds:
        nodes = rounds.rounds[-1].nodes
    counts = {str(state): 0 for state in JobState}
    for job in jobs:
        counts[job.state] = counts.get(job.state, 0) + 1
    return shown(
        {
            "jobs": [job_row(job) for job in jobs if job.id is not None],
            "counts": counts,
            "nodes": gpu_layout(nodes, jobs),
            "nodes_complete": bool(nodes),
            "rounds": None if rounds is None else [round_row(r) for r in reversed(rounds.rounds)],
            "rounds_note": rounds_note,
            "teams": _teams(teams),
            "error": error,
        }
    )


def shown(value):
    """`value` (a document for the page) with every text in it `printable` (several lines kept): a
    job's reason holds its own stderr, and the page renders no escape sequence, control or
    bidirectional override of it. Keys are the dashboard's own."""
    if isinstance(value, str):
        return printable(value, lines=True)
    if isinstance(value, dict):
        return {key: shown(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [shown(item) for item in value]
    return value


def _teams(answer) -> list[dict] | None:
    """The teams' GPUs when there is more than the default team or any guarantee; else None."""
    if answer is None or not answer.teams:
        return None
    if len(answer.teams) == 1 and not any(g.quota for g in answer.teams[0].gpus):
        return None
    return [msgspec.to_builtins(team) for team in answer.teams]


def explanation_document(explanation) -> dict:
    """A job's explanation as the page draws it: its sentences, and each decision's GPUs, type
    (hardware name) and batch over the run's clock."""
    return shown(
        {
            "id": explanation.id,
            "state": explanation.state,
            "sentences": list(explanation.sentences),
            "decisions": [
                {
                    "round": d.round,
                    "at_s": d.at_s,
                    "outcome": d.outcome,
                    "change": d.change,
                    "gpus": d.gpus,
                    "gpu_type": d.gpu_type and hardware_name(d.gpu_type),
                    "batch": d.batch,
                    "goodput": d.goodput,
                    "measured_goodput": d.measured_goodput,
                    "reason": d.reason,
                }
                for d in sorted(explanation.decisions, key=lambda d: (d.at_s, d.round))
            ],
        }
    )


class Snapshots:
    """The latest snapshot as JSON, read from the source at most once per `refresh_s`; when the
    jobs cannot be read, the last ones are kept and the error says why. The rounds and the teams
    are extras: one that is not available, or slow, is not asked again for `RETRY_EXTRA_S`, so the
    jobs keep their pace."""

    def __init__(self, source, refresh_s: float = REFRESH_S, rounds: int = ROUNDS_SHOWN) -> None:
        self.source, self.refresh_s, self.rounds = source, refresh_s, rounds
        self._lock = asyncio.Lock()
        self._body: str | None = None
        self._read_at = float("-inf")
        self._jobs: list[JobStatus] = []
        self._missing: dict[str, tuple[float, str]] = {}  # extra -> (asked again from, why not)

    async def latest(self) -> str:
        async with self._lock:
            if self._body is None or time.monotonic() - self._read_at >= self.refresh_s:
                self._body = json.dumps(await self._read(), separators=(",", ":"))
                self._read_at = time.monotonic()
            return self._body

    async def _read(self) -> dict:
        jobs, rounds, teams = await asyncio.gather(
            self.source.jobs(),
            self._extra("rounds", lambda: self.source.rounds(self.rounds)),
            self._extra("teams", self.source.teams),
            return_exceptions=True,
        )
        error = ""
        if isinstance(jobs, Unavailable):
            error, jobs = f"the jobs cannot be read now ({jobs}); shown as they were", self._jobs
        elif isinstance(jobs, BaseException):
            raise jobs
        self._jobs = jobs
        note = ""
        if isinstance(rounds, Unavailable):
            note, rounds = f"the rounds are not available ({rounds})", None
        elif isinstance(rounds, BaseException):
            raise rounds
        if isinstance(teams, Unavailable):
            teams = None
        elif isinstance(teams, BaseException):
            raise teams
        return snapshot_document(jobs, rounds, note, teams, error)

    async def _extra(self, name: str, read):
        """What `read()` answers; Unavailable, without asking, while it was lately."""
        retry_at, why = self._missing.get(name, (0.0, ""))
        if time.monotonic() < retry_at:
            raise Unavailable(why)
        try:
            answer = await asyncio.wait_for(read(), EXTRA_TIMEOUT_S)
        except (Unavailable, asyncio.TimeoutError) as error:
            why = str(error) or f"no answer within {EXTRA_TIMEOUT_S:.0f} s"
            self._missing[name] = (time.monotonic() + RETRY_EXTRA_S, why)
            raise Unavailable(why) from None
        self._missing.pop(name, None)
        return answer


def create_app(
    source,
    token: str,
    *,
    hosts: frozenset[str] | None = None,
    refresh_s: float = REFRESH_S,
    keepalive_s: float = KEEPALIVE_S,
    rounds: int = ROUNDS_SHOWN,
):
    """The dashboard for `source`, its data given for `token`, at `hosts` (None: any Host). Its `closing` (an asyncio.Event), once set,
    ends every event stream, so a server stops without waiting on the pages open."""
    if refresh_s <= 0:
        raise ValueError("the dashboard's refresh must be a positive number of seconds")
    snapshots = Snapshots(source, refresh_s, rounds)
    closing = asyncio.Event()
    files = {name: (resources.files("dashboard") / "static" / name).read_bytes() for name in STATIC}

    async def page(request: Request) -> Response:
        return Response(files["index.html"], media_type=STATIC["index.html"])

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC or name == "index.html":
            return Response("not found\n", status_code=404, media_type="text/plain")
        return Response(files[name], media_type=STATIC[name])

    async def snapshot(request: Request) -> Response:
        return Response(await snapshots.latest(), media_type="application/json")

    async def events(request: Request) -> Response:
        async def stream():
            yield f"retry: {int(max(1.0, refresh_s) * 2000)}\n\n"
            sent, quiet_since = None, time.monotonic()
            while not closing.is_set():
                body = await snapshots.latest()
                if body != sent:
                    yield f"event: snapshot\ndata: {body}\n\n"
                    sent, quiet_since = body, time.monotonic()
                elif time.monotonic() - quiet_since >= keepalive_s:
                    yield ": keepalive\n\n"
                    quiet_since = time.monotonic()
                try:
                    await asyncio.wait_for(closing.wait(), refresh_s)
                except asyncio.TimeoutError:
                    pass

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"x-accel-buffering": "no"})

    async def explain(request: Request) -> Response:
        try:
            ask = msgspec.convert({"id": request.path_params["job"], "rounds": EXPLAIN_ROUNDS}, ExplainRequest)
        except msgspec.ValidationError:
            return JSONResponse({"error": "not a job id"}, status_code=400)
        try:
            explanation = await source.explain(ask.id, ask.rounds)
        except UnknownJob as error:
            return JSONResponse(shown({"error": str(error) or f"no job {ask.id} of yours is known"}), status_code=404)
        except Unavailable as error:
            return JSONResponse(shown({"error": f"the explanation is not available ({error})"}), status_code=503)
        return JSONResponse(explanation_document(explanation))

    app = Starlette(
        routes=[
            Route("/", page),
            Route("/static/{name}", static),
            Route("/events", events),
            Route("/api/snapshot", snapshot),
            Route("/api/jobs/{job}", explain),
        ]
    )
    guarded = TokenGuard(app, token, hosts)
    guarded.closing = closing
    return guarded
