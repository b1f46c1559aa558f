"""Every metric goodput exports, in one catalog, and the OpenTelemetry metrics setup of a process.

Each service records through the OpenTelemetry metrics API (`instrument(METRIC)`); `setup_metrics`
installs the process's meter provider once, with a Prometheus reader that an HTTP endpoint serves
(`--metrics-port`) to the operator's scraper only: a request without the operator's bearer token
(`Authorization: Bearer`, the token in the file `--metrics-token-file` or $GOODPUT_METRICS_TOKEN_FILE
names) gets 401, and a port without a readable token is not served at all (the process stops, saying
why). And, when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._METRICS_ENDPOINT`) is set and
`OTEL_METRICS_EXPORTER` is not `none`, an OTLP exporter beside it. Without a provider the instruments are the API's no-op ones, so a handler
called in a test records nothing and costs nothing.

Names follow Prometheus's conventions once exported: the catalog's `goodput.round.duration` in
seconds is `goodput_round_duration_seconds`, a counter gets `_total`, a unit in braces (`{job}`) adds
nothing. Labels are bounded sets (a state, a GPU type, a stage, an endpoint), never a job's id.
`python -m shared.metrics` prints the table docs/metrics.md holds.
"""

from __future__ import annotations

import functools
import hmac
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry import metrics as otel_metrics

METER_NAME = "goodput"
TOKEN_FILE_ENV = "GOODPUT_METRICS_TOKEN_FILE"  # the file of the operator's bearer token for the endpoint
MIN_TOKEN_CHARS = 16
UNAUTHORIZED = b"401 Unauthorized: goodput's metrics are the operator's: send Authorization: Bearer TOKEN\n"
OTLP_METRICS_VARIABLES = ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

# Histogram buckets, in the metric's unit: seconds from a millisecond to ten minutes, bytes from a KiB to 64 GiB.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
BYTES_BUCKETS = tuple(float(1024 * 4**k) for k in range(14))

# Prometheus's unit suffixes for the catalog's UCUM units (what the OpenTelemetry exporter appends).
_UNIT_SUFFIX = {"s": "seconds", "By": "bytes"}  # "1" and "{thing}" add none


@dataclass(frozen=True)
class Metric:
    """One metric: its OpenTelemetry name, instrument kind, unit (UCUM), labels and meaning, and the
    processes that export it."""

    name: str
    kind: str  # counter | histogram | gauge | updown
    unit: str
    labels: tuple[str, ...]
    meaning: str
    exporters: tuple[str, ...]  # the processes that export it (policy, api, executor, node, every)

    @property
    def prometheus(self) -> str:
        """The name a Prometheus scrape shows (without a histogram's `_bucket`/`_sum`/`_count`)."""
        base = self.name.replace(".", "_")
        suffix = _UNIT_SUFFIX.get(self.unit)
        if suffix and not base.endswith(f"_{suffix}"):
            base = f"{base}_{suffix}"
        return f"{base}_total" if self.kind == "counter" else base

    @property
    def series(self) -> tuple[str, ...]:
        """Every series name a scrape shows of it."""
        if self.kind == "histogram":
            return tuple(f"{self.prometheus}_{part}" for part in ("bucket", "sum", "count"))
        return (self.prometheus,)


# The catalog: every metric a goodput process exports. A new one is added here first.
JOBS = Metric(
    "goodput.jobs", "gauge", "{job}", ("state",), "jobs by state (queued, running, finished, ...)", ("executor",)
)
SUBMISSIONS = Metric(
    "goodput.submissions",
    "counter",
    "{submission}",
    ("outcome",),
    "submissions answered: accepted, duplicate or refused",
    ("api",),
)
REFUSALS = Metric(
    "goodput.refusals",
    "counter",
    "{submission}",
    ("reason",),
    "submissions refused, by reason (malformed, too_large, unschedulable, team, code, over_limit, id_taken)",
    ("api",),
)
VERDICTS = Metric(
    "goodput.verdicts",
    "counter",
    "{submission}",
    ("verdict",),
    "the profiler's verdicts: accepted or rejected",
    ("profiler",),
)
GPUS = Metric(
    "goodput.gpus",
    "gauge",
    "{gpu}",
    ("gpu_type", "state"),
    "GPUs by type after the latest round: allocated, idle, borrowed (with teams; of the allocated)",
    ("policy",),
)
ROUNDS = Metric("goodput.rounds", "counter", "{round}", (), "rounds decided", ("policy",))
ROUND_DURATION = Metric(
    "goodput.round.duration", "histogram", "s", (), "a round's decision, from facts to placement", ("policy",)
)
STAGE_DURATION = Metric(
    "goodput.round.stage.duration",
    "histogram",
    "s",
    ("stage",),
    "each stage of a round: facts, models, solve, place, apply, advance, checkpoint, log",
    ("policy",),
)
SOLVER_DURATION = Metric(
    "goodput.solver.duration", "histogram", "s", ("policy",), "the policy's decision itself", ("policy",)
)
OBJECTIVE = Metric(
    "goodput.round.objective",
    "gauge",
    "1",
    ("policy",),
    "the policy's objective value in the latest round (when it reports one)",
    ("policy",),
)
RESTARTS_ORDERED = Metric(
    "goodput.restarts.ordered",
    "counter",
    "{restart}",
    (),
    "running jobs a round moved or resized (each a checkpoint-restart); a job stopped and started again in a later round is not one of them",
    ("policy",),
)
CLUSTER_GOODPUT = Metric(
    "goodput.cluster.goodput",
    "gauge",
    "1",
    (),
    "the running jobs' predicted goodput, summed (samples/s x statistical efficiency)",
    ("policy",),
)
UTILIZATION = Metric(
    "goodput.cluster.utilization", "gauge", "1", (), "the share of the cluster's GPUs allocated", ("policy",)
)
TEAM_GPUS = Metric(
    "goodput.team.gpus",
    "gauge",
    "{gpu}",
    ("team", "gpu_type"),
    "with teams: the GPUs each team's jobs hold after the latest round, by type",
    ("policy",),
)
TEAM_BORROWED = Metric(
    "goodput.team.borrowed",
    "gauge",
    "{gpu}",
    ("team",),
    "with teams: of a team's GPUs, those beyond its guarantee (lent by others)",
    ("policy",),
)
TEAM_RECLAIMED = Metric(
    "goodput.team.reclaimed",
    "counter",
    "{job}",
    ("team",),
    "with teams: a team's jobs a round shrank or stopped to give another team back its guarantee",
    ("policy",),
)
WORKERS = Metric("goodput.workers.running", "gauge", "{worker}", (), "the workers (ranks) running on a node", ("node",))
JOB_RESTARTS = Metric(
    "goodput.job.restarts",
    "counter",
    "{restart}",
    (),
    "every start of a job after its first, as the executors carried it out: the moves and resizes above, and each start after a stop",
    ("executor",),
)
CHECKPOINT_DURATION = Metric(
    "goodput.checkpoint.duration",
    "histogram",
    "s",
    (),
    "a job's checkpoint, from the stop order to its exit",
    ("node",),
)
CHECKPOINT_SIZE = Metric("goodput.checkpoint.size", "histogram", "By", (), "a job's checkpoint on disk", ("node",))
NODES = Metric("goodput.nodes", "gauge", "{node}", ("state",), "node agents: alive, lost, drained", ("executor",))
BUS_REQUESTS = Metric(
    "goodput.bus.requests",
    "counter",
    "{request}",
    ("endpoint", "outcome"),
    "requests served, by endpoint and outcome (ok, refused, not_found, throttled, error)",
    ("every",),
)
BUS_DURATION = Metric(
    "goodput.bus.request.duration", "histogram", "s", ("endpoint",), "a request's handling time", ("every",)
)

CATALOG: tuple[Metric, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Metric))


def prometheus_names() -> set[str]:
    """Every series name the catalog's metrics show in a scrape."""
    return {name for metric in CATALOG for name in metric.series}


@functools.cache
def instrument(metric: Metric) -> Any:
    """The process's instrument for `metric` (created once; a no-op until `setup_metrics` runs, then
    recording into the installed provider: the API's proxy meter hands over)."""
    meter = otel_metrics.get_meter(METER_NAME)
    if metric.kind == "counter":
        return meter.create_counter(metric.name, unit=metric.unit, description=metric.meaning)
    if metric.kind == "updown":
        return meter.create_up_down_counter(metric.name, unit=metric.unit, description=metric.meaning)
    if metric.kind == "gauge":
        return meter.create_gauge(metric.name, unit=metric.unit, description=metric.meaning)
    buckets = BYTES_BUCKETS if metric.unit == "By" else SECONDS_BUCKETS
    return meter.create_histogram(
        metric.name, unit=metric.unit, description=metric.meaning, explicit_bucket_boundaries_advisory=buckets
    )


class MetricsUnavailable(OSError):
    """The metrics endpoint cannot be served as asked (its port, its token): the process says why
    and stops; it never serves an open endpoint instead."""


class MetricsPortTaken(MetricsUnavailable):
    """The metrics endpoint's port is in use (or cannot be bound)."""


_provider: Any = None
_server: Any = None


def read_token(path: str | os.PathLike) -> str:
    """The operator's metrics token in the file `path` (its text, without the line's end);
    MetricsUnavailable, saying why, when it cannot be read or is shorter than MIN_TOKEN_CHARS."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        why = getattr(error, "strerror", None) or error
        raise MetricsUnavailable(f"the metrics token file {path} cannot be read: {why}") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise MetricsUnavailable(
            f"the metrics token file {path} holds no token: one word of {MIN_TOKEN_CHARS} characters or more"
        )
    return token


def _guarded(app, token: str):
    """The WSGI app `app`, answering only a request that carries `token` as its bearer (compared in
    constant time); any other gets 401."""
    expected = token.encode()

    def guarded(environ, start_response):
        scheme, _, given = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", 'Bearer realm="goodput metrics"')],
        )
        return [UNAUTHORIZED]

    return guarded


def _serve(port: int, host: str, token: str):
    """Prometheus's text format on host:port for the bearer of `token`, from a daemon thread (as
    prometheus_client serves it, a thread per request); the server."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

    class Quiet(WSGIRequestHandler):
        def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
            pass

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    server = make_server(host, port, _guarded(make_wsgi_app(), token), server_class, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def setup_metrics(
    service_name: str,
    port: int | None = None,
    host: str = "127.0.0.1",
    environ: Mapping[str, str] | None = None,
    token_file: str | os.PathLike | None = None,
) -> Any:
    """Install this process's meter provider once (later calls return it), serving Prometheus's text
    format on `host:port` when a port is given (0: any free one; `metrics_address()` tells which) to
    the bearer of the token in `token_file` (else $GOODPUT_METRICS_TOKEN_FILE's). Raises
    MetricsUnavailable, saying why, before anything is installed, when there is no such token or the
    port cannot be bound (MetricsPortTaken)."""
    global _provider, _server
    if _provider is not None:
        return _provider
    environ = os.environ if environ is None else environ
    token = None
    if port is not None:
        token_file = token_file or environ.get(TOKEN_FILE_ENV)
        if not token_file:
            raise MetricsUnavailable(
                f"metrics port {port} is the operator's: name the file of its bearer token with "
                f"--metrics-token-file or ${TOKEN_FILE_ENV} (goodput up makes DATA/secrets/metrics-token)"
            )
        token = read_token(token_file)
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    # No `otel_scope_*` labels on every line: one meter, and a scrape half the size and time.
    readers: list = [PrometheusMetricReader(scope_info_enabled=False)]
    pushed = environ.get("OTEL_METRICS_EXPORTER", "otlp").lower() != "none"  # the SDK's switch: none is none
    if pushed and any(environ.get(name) for name in OTLP_METRICS_VARIABLES):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if port is not None:
        try:
            _server = _serve(port, host, token)
        except OSError as error:
            raise MetricsPortTaken(f"metrics port {host}:{port} cannot be served: {error.strerror or error}") from None
    _provider = MeterProvider(metric_readers=readers, resource=Resource.create({SERVICE_NAME: service_name}))
    otel_metrics.set_meter_provider(_provider)
    return _provider


def metrics_address() -> tuple[str, int] | None:
    """(host, port) the metrics endpoint serves on, or None when none does."""
    return None if _server is None else _server.server_address[:2]


def scrape() -> str:
    """What the metrics endpoint answers now (Prometheus's text format), read in-process."""
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY).decode()


def markdown_table() -> str:
    """The catalog as docs/metrics.md's table."""
    rows = ["| name | type | unit | labels | exported by | meaning |", "|---|---|---|---|---|---|"]
    for m in CATALOG:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
        kind = "gauge" if m.kind == "updown" else m.kind
        rows.append(f"| `{m.prometheus}` | {kind} | {m.unit} | {labels} | {', '.join(m.exporters)} | {m.meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
