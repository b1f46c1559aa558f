"""The metrics as a platform team meets them: the Grafana dashboard names only series the services
export, docs/metrics.md's table is the catalog's, and `goodput up --metrics-port` serves, from each
of its processes, a scrape that Prometheus's own parser reads and whose values move as jobs run."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import random
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.nats import free_loopback_port, port_in_use
from launcher.stack import METRICS_FILE, SERVICES, metrics_ports
from shared.metrics import BUS_REQUESTS, CLUSTER_GOODPUT, GPUS, JOBS, ROUND_DURATION, markdown_table, prometheus_names

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "goodput.json"
DOC = ROOT / "docs" / "metrics.md"
SERIES = re.compile(r"\bgoodput_[a-z0-9_]+")
DATASOURCE = "${DS_PROMETHEUS}"


# ---- the Grafana dashboard ------------------------------------------------------------------------


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, those inside (collapsed) rows included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def expressions(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in panels(dashboard) for target in panel.get("targets", [])]


def unknown_series(dashboard: dict) -> set[str]:
    """The goodput_* series the dashboard's expressions name that no service exports."""
    return {name for expr in expressions(dashboard) for name in SERIES.findall(expr)} - prometheus_names()


def test_every_expression_of_the_dashboard_names_a_series_the_services_export():
    dashboard = json.loads(DASHBOARD.read_text())
    assert unknown_series(dashboard) == set()
    named = {name for expr in expressions(dashboard) for name in SERIES.findall(expr)}
    # what the issue asks the dashboard to show: GPUs by type and state, the queue, rounds, goodput
    assert {
        GPUS.prometheus,
        JOBS.prometheus,
        f"{ROUND_DURATION.prometheus}_bucket",
        CLUSTER_GOODPUT.prometheus,
    } <= named
    assert any("histogram_quantile" in expr and "by (le, stage)" in expr for expr in expressions(dashboard))


def test_the_dashboard_imports_on_any_prometheus_data_source():
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["uid"] and dashboard["title"]
    [variable] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert (variable["name"], variable["query"]) == ("DS_PROMETHEUS", "prometheus")
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), "two panels share an id"
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["targets"] and panel["datasource"]["uid"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target["expr"] and target["datasource"]["uid"] == DATASOURCE, panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]


def test_the_dashboard_check_notices_a_series_nobody_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    wrong = copy.deepcopy(dashboard)
    target = next(panel for panel in panels(wrong) if panel["type"] != "row")["targets"][0]
    target["expr"] = "sum(goodput_gpu_count) + sum(rate(goodput_rounds[5m]))"
    assert unknown_series(wrong) == {"goodput_gpu_count", "goodput_rounds"}


# ---- docs/metrics.md ------------------------------------------------------------------------------


def doc_table(text: str) -> str:
    """The table in docs/metrics.md whose header is the catalog's."""
    header = markdown_table().splitlines()[0]
    start = text.index(header)
    end = text.find("\n\n", start)
    return text[start : len(text) if end < 0 else end].rstrip("\n") + "\n"


def test_the_documented_table_is_the_catalog():
    assert doc_table(DOC.read_text()) == markdown_table(), "regenerate it: python -m shared.metrics"
    readme, commands = (ROOT / "README.md").read_text(), (ROOT / "docs" / "commands.md").read_text()
    assert "docs/metrics.md" in readme and "--metrics-port" in commands


# ---- `goodput up --metrics-port` ------------------------------------------------------------------


def test_a_taken_metrics_port_is_refused_before_anything_starts_saying_which():
    first = free_port_range(4)
    instances = ["api", "policy", "policy-2", "executor"]
    assert metrics_ports(instances, first) == {name: first + i for i, name in enumerate(instances)}
    with _listening(first + 2):
        with pytest.raises(ValueError, match=rf"{first + 2} \(for policy-2\) on 127.0.0.1 is taken"):
            metrics_ports(instances, first)
    with pytest.raises(ValueError, match="ports run from 1 to 65535"):
        metrics_ports(instances, 65534)
    with pytest.raises(ValueError, match="ports run from 1"):
        metrics_ports(instances, 0)


def free_port_range(count: int, tries: int = 100) -> int:
    """The first of `count` consecutive free loopback ports, below the ephemeral range (where the
    services' own connections would take ports from under it)."""
    for _ in range(tries):
        first = random.randrange(20000, 32000 - count)
        if not any(port_in_use(port) for port in range(first, first + count)):
            return first
    raise AssertionError(f"no {count} consecutive free ports found in {tries} tries")


@contextlib.contextmanager
def _listening(port: int) -> Iterator[None]:
    """Something else listening on a loopback port meanwhile."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        yield


def scrape(url: str, token: str) -> dict[str, list]:
    """A scrape of `url` as Prometheus makes it (the operator's bearer token), parsed by
    prometheus_client's parser: each family's samples by family name."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def refused(url: str, headers: dict[str, str] | None = None) -> int:
    """The status of a request to `url` that must be refused (401), with `headers`."""
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10)
    assert error.value.headers["WWW-Authenticate"].startswith("Bearer")
    assert b"goodput_" not in error.value.read()
    return error.value.code


# ---- the operator's token ---------------------------------------------------------------------------

TOKEN = "operator-metrics-token-0123456789"


@pytest.mark.e2e
def test_the_endpoint_answers_only_the_bearer_of_the_operators_token(tmp_path):
    """Over HTTP, as Prometheus and any other local process reach it: no token, a wrong one, one
    in another scheme or in the URL get 401 and no figure; the operator's gets the scrape."""
    from shared.metrics import _serve

    server = _serve(0, "127.0.0.1", TOKEN)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert refused(url) == 401
        for wrong in (f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", "Bearer ", f"Basic {TOKEN}", TOKEN):
            assert refused(url, {"Authorization": wrong}) == 401, wrong
        assert refused(f"{url}?token={TOKEN}") == 401
        assert "process_cpu_seconds" in scrape(url, TOKEN)
        assert "process_cpu_seconds" in scrape(url.removesuffix("metrics"), TOKEN)  # any path, as before
    finally:
        server.shutdown()
        server.server_close()


def test_a_port_without_a_readable_token_is_not_served_and_says_why(tmp_path, monkeypatch):
    """Fail closed: no token file named, one missing, empty, or too short: MetricsUnavailable with
    the reason, before anything is installed or bound (the service exits 2 with it)."""
    from shared import metrics

    monkeypatch.setattr(metrics, "_provider", None)
    monkeypatch.setattr(metrics, "_server", None)
    with pytest.raises(metrics.MetricsUnavailable, match="GOODPUT_METRICS_TOKEN_FILE"):
        metrics.setup_metrics("goodput-test", port=0, environ={})
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "short").write_text("abc\n")
    for name, why in (("missing", "cannot be read: No such file"), ("empty", "holds no token"), ("short", "no token")):
        with pytest.raises(metrics.MetricsUnavailable, match=why):
            metrics.setup_metrics("goodput-test", port=0, environ={metrics.TOKEN_FILE_ENV: str(tmp_path / name)})
    assert metrics._provider is None and metrics._server is None  # nothing installed, nothing served
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert metrics.read_token(tmp_path / "token") == TOKEN


def test_goodput_up_makes_the_token_private_once_and_keeps_it(tmp_path):
    from launcher.stack import metrics_token

    secrets = tmp_path / "data" / "secrets"
    path = metrics_token(secrets)
    assert path == secrets / "metrics-token" and len(path.read_text().strip()) >= 32
    assert (path.stat().st_mode & 0o777, secrets.stat().st_mode & 0o777) == (0o600, 0o700)
    token = path.read_text()
    assert metrics_token(secrets).read_text() == token  # kept: Prometheus's copy stays good across restarts
    path.write_text("")
    with pytest.raises(ValueError, match="not served: .* holds no token"):
        metrics_token(secrets)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot be made"):
        metrics_token(tmp_path / "file" / "secrets")


def value(families: dict[str, list], sample: str, **labels: str) -> float | None:
    """The value of the sample named `sample` with `labels` (among others), or None when absent."""
    family = sample.removesuffix("_count").removesuffix("_sum").removesuffix("_bucket").removesuffix("_total")
    for candidate in families.get(family, []):
        if candidate.name == sample and labels.items() <= candidate.labels.items():
            return candidate.value
    return None


def until(condition: Callable[[], object], what: str, log: Path, timeout_s: float = 300.0) -> object:
    """Poll `condition` until it holds (truthy); fail with `what` and `goodput up`'s output past the bound."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s\n{log.read_text()[-3000:]}"
        time.sleep(0.25)
    return result


# Zoo jobs that run for a round (cifar10) to several (yolov3, deepspeech2) of `Up`'s 1200 s.
JOBS_SUBMITTED = [
    {"id": "metrics-cifar10", "application": "cifar10"},
    {"id": "metrics-yolov3", "application": "yolov3"},
    {"id": "metrics-deepspeech2", "application": "deepspeech2"},
]


@pytest.mark.e2e
def test_every_process_of_goodput_up_serves_a_scrape_whose_values_move_as_jobs_run(tmp_path):
    from test_live_service import Up, publish

    first, data = free_port_range(len(SERVICES)), tmp_path / "data"
    up = Up(free_loopback_port(), data, "--metrics-port", str(first))
    try:
        up.wait_serving()
        endpoints = json.loads((data / METRICS_FILE).read_text())
        assert endpoints == {name: f"http://127.0.0.1:{first + i}/metrics" for i, name in enumerate(SERVICES)}
        token_file = data / "secrets" / "metrics-token"
        assert f"a scrape sends the bearer token in {token_file.resolve()}" in up.log.read_text()
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        for name, url in endpoints.items():  # each answers the operator's scrape, that Prometheus's parser reads
            assert refused(url) == 401, name
            assert "process_cpu_seconds" in scrape(url, token), name
        policy, executor = endpoints["policy"], endpoints["executor"]

        def read(url: str) -> dict[str, list]:
            return scrape(url, token)

        # Every poll scrapes both, so the executor's job counts are seen from the submission on.
        seen: list[dict[str, float]] = []  # the executor's goodput_jobs by state, scrape after scrape

        def observe() -> tuple[dict, dict]:
            at_policy, at_executor = read(policy), read(executor)
            seen.append({s.labels["state"]: s.value for s in at_executor.get(JOBS.prometheus, [])})
            return at_policy, at_executor

        asyncio.run(publish(data, JOBS_SUBMITTED))
        # The policy: GPUs by type after a round, and a round-latency histogram that grows.
        until(lambda: value(observe()[0], GPUS.prometheus, state="allocated"), "GPUs allocated", up.log)
        gpus = observe()[0][GPUS.prometheus]
        assert {s.labels["gpu_type"] for s in gpus} - {""}, gpus
        assert {s.labels["state"] for s in gpus} >= {"allocated", "idle"}, gpus
        count = f"{ROUND_DURATION.prometheus}_count"
        before = until(lambda: value(observe()[0], count), "a round's duration recorded", up.log)
        until(lambda: (value(observe()[0], count) or 0) > before, "more rounds' durations recorded", up.log)
        assert value(observe()[0], f"{ROUND_DURATION.prometheus}_bucket", le="+Inf") > before

        # The executor: goodput_jobs by state, the jobs running, then every one finished.
        until(lambda: observe() and seen[-1].get("finished", 0) >= len(JOBS_SUBMITTED), "every job finished", up.log)
        assert any(snapshot.get("running", 0) > 0 for snapshot in seen), seen
        assert seen[-1].get("running", 0) == 0 and seen[0] != seen[-1], seen
        # ... and the bus requests the rounds made of it, by endpoint
        requests = read(executor)[BUS_REQUESTS.prometheus.removesuffix("_total")]
        assert {"facts", "apply", "advance"} <= {s.labels["endpoint"] for s in requests}, requests
    finally:
        up.kill()
