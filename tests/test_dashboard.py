"""The live web dashboard: the app with a fake source (the token, the snapshot, the event stream, a
job's explanation, what is shown when the rounds are not served), `goodput dashboard`'s errors, and
a real headless Chromium on `goodput dashboard`'s page while `goodput up` runs a job submitted
during the test, watched from queued to running to finished without a reload.

GOODPUT_DASHBOARD_SCREENSHOT=docs/figures/dashboard.png with the browser test also loads the cluster
with a few jobs and saves the page, with jobs running, to that file (docs/dashboard.md)."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import re
import signal
import subprocess
import threading
import time
from importlib import resources
from pathlib import Path

import httpx
import pytest

from dashboard.app import MISDIRECTED, UNAUTHORIZED, create_app, explanation_document, gpu_layout, snapshot_document
from dashboard.serve import listen, page_hosts, page_url, serving
from dashboard.source import Unavailable, UnknownJob
from shared.schema.api import JobStatus, TeamGpus, TeamsAnswer, TeamStatus
from shared.schema.base import Node
from shared.schema.decisions import Explanation, JobDecision, RoundsPage, RoundSummary

TOKEN = "t0ken-for-the-tests-only-0123456789"
BEARER = {"authorization": f"Bearer {TOKEN}"}
HOSTS = frozenset({"127.0.0.1:8765", "localhost:8765"})  # a loopback dashboard's (dashboard.serve.page_hosts)
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Headless, and nothing reaches beyond this machine: no update, sync, QUIC or first-run traffic.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
SCREENSHOT_ENV = "GOODPUT_DASHBOARD_SCREENSHOT"

NODES = (Node("aws-0", "aws", 4), Node("aws-1", "aws", 4), Node("dgx-ext-0", "dgx-ext", 8))


def status(job: str, state: str, **fields) -> JobStatus:
    return JobStatus(job, state, application=fields.pop("application", "cifar10"), **fields)


def running(job: str, placement: tuple[tuple[str, int], ...], alias: str = "aws", batch: int = 256) -> JobStatus:
    hardware = {"aws": "T4", "dgx-ext": "A100"}[alias]
    return status(
        job,
        "running",
        gpu_type=hardware,
        gpu_alias=alias,
        gpus=sum(g for _, g in placement),
        nodes=tuple(n for n, _ in placement),
        batch=batch,
        placement=placement,
    )


def summary(number: int, allocated: int = 2) -> RoundSummary:
    return RoundSummary(
        number,
        at_s=1200.0 * number,
        policy="goodput",
        jobs=3,
        allocated=allocated,
        waiting=3 - allocated,
        restarts=number % 2,
        gpus_total=16,
        gpus_allocated={"aws": 4, "dgx-ext": 4},
        goodput=1500.0 + number,
        duration_s=0.042,
        nodes=NODES,
    )


class FakeSource:
    """The user API as the app sees it: jobs, rounds (or not served), explanations and teams."""

    def __init__(self, rounds_served: bool = True) -> None:
        self.jobs_now = [
            running("big", (("dgx-ext-0", 4),), "dgx-ext", 1024),
            running("wide", (("aws-0", 2), ("aws-1", 2))),
            status("waits", "queued", reason="the cluster's GPUs of its types are all held"),
            status("done", "finished", finish_s=5000.0, jct_s=3000.0),
        ]
        self.rounds_served = rounds_served
        self.reads = 0

    async def jobs(self):
        self.reads += 1
        return list(self.jobs_now)

    async def rounds(self, limit: int):
        if not self.rounds_served:
            raise Unavailable("no service answers goodput.api.rounds")
        return RoundsPage(tuple(summary(n) for n in range(1, 4))[-limit:], NODES)

    async def explain(self, job_id: str, rounds: int):
        if job_id == "offline":
            raise Unavailable("no service answers goodput.api.explain")
        if job_id not in {job.id for job in self.jobs_now}:
            raise UnknownJob(f"no job {job_id}")
        decisions = (
            JobDecision(1, 1200.0, f"default.{job_id}", outcome="waits", change="waiting", reason="full"),
            JobDecision(2, 2400.0, f"default.{job_id}", outcome="allocated", change="started", gpus=2, gpu_type="aws"),
            JobDecision(
                3, 3600.0, f"default.{job_id}", outcome="allocated", change="moved", gpus=4, gpu_type="dgx-ext"
            ),
        )
        return Explanation(
            job_id, "running", ("It waited in round 1.", "It moved to 4 A100 GPUs in round 3."), decisions
        )

    async def teams(self):
        return TeamsAnswer((TeamStatus("default", (TeamGpus("T4", "aws", 0, 4, 4, 0),)),), note="no team file")


def asgi_client(app, headers: dict | None = None) -> httpx.AsyncClient:
    """A client of the app in this process, as if it served on 127.0.0.1:8765 (with the token's
    header by default, as the page's own requests)."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app),
        base_url="http://127.0.0.1:8765",
        headers=BEARER if headers is None else headers,
    )


@pytest.fixture
async def client():
    source = FakeSource()
    async with asgi_client(create_app(source, TOKEN, hosts=HOSTS, refresh_s=0.05)) as client:
        client.source = source
        yield client


# ---- the token ------------------------------------------------------------------------------

DATA = ("/events", "/api/snapshot", "/api/jobs/big", "/favicon.ico", "/api/nothing")


async def test_the_data_is_refused_without_the_token_in_the_header(client):
    """No cookie, no `?token=`, no wrong or empty bearer lets a request in: 401, and nothing is read."""
    for path in DATA:
        answer = await client.get(path, headers={"authorization": ""})
        assert answer.status_code == 401, path
        assert answer.text == UNAUTHORIZED and answer.headers["www-authenticate"] == "Bearer"
    refused = [
        {"authorization": f"Bearer {TOKEN[:-1]}x"},
        {"authorization": "Bearer "},
        {"authorization": f"Basic {TOKEN}"},
        {"authorization": "", "cookie": f"goodput-dashboard-8765={TOKEN}"},  # the cookie of before
    ]
    for headers in refused:
        assert (await client.get("/api/snapshot", headers=headers)).status_code == 401, headers
    assert (
        await client.get("/api/snapshot", params={"token": TOKEN}, headers={"authorization": ""})
    ).status_code == 401
    assert client.source.reads == 0  # nothing was read for them


async def test_the_page_opens_without_the_token_and_sets_no_cookie(client):
    """The page's files hold no data and a browser's navigation carries no header: they are served
    to the dashboard's address; the page then sends the token itself."""
    page = await client.get("/", headers={"authorization": ""})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "set-cookie" not in page.headers
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["referrer-policy"] == "no-referrer"
    assert (await client.get("/static/app.js", headers={"authorization": ""})).status_code == 200
    assert (await client.get("/static/nothing.js")).status_code == 404
    assert (await client.get("/static/..%2fapp.py")).status_code == 404
    answer = await client.get("/api/snapshot")  # the page's request: the token in its header
    assert answer.status_code == 200 and "set-cookie" not in answer.headers
    assert answer.headers["x-frame-options"] == "DENY"


async def test_another_host_or_another_origin_is_refused_even_with_the_token(client):
    """DNS rebinding (a name of the attacker's that resolves to 127.0.0.1) and a page of another
    port of 127.0.0.1 are not the dashboard's own: 403, the page itself included."""
    for headers in (
        {"host": "rebind.attacker.example:8765"},
        {"host": "127.0.0.1:9999"},
        {"origin": "http://127.0.0.1:9999"},  # a page that a job serves on another loopback port
        {"origin": "http://localhost:8765"},  # another origin, though the same port
        {"origin": "null"},  # a sandboxed frame, a file
    ):
        for path in ("/", "/api/snapshot"):
            answer = await client.get(path, headers=headers)
            assert answer.status_code == 403 and answer.text == MISDIRECTED, (headers, path)
    assert client.source.reads == 0  # nothing was read for them
    assert (await client.get("/api/snapshot", headers={"host": "localhost:8765"})).status_code == 200
    assert (await client.get("/api/snapshot", headers={"origin": "http://127.0.0.1:8765"})).status_code == 200


def test_the_printed_url_carries_the_token_in_its_fragment_and_names_its_hosts():
    sock = listen("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert page_url(sock, TOKEN) == f"http://127.0.0.1:{port}/#token={TOKEN}"
        assert page_hosts(sock) == {f"127.0.0.1:{port}", f"localhost:{port}"}
    finally:
        sock.close()
    anywhere = listen("0.0.0.0", 0)
    try:
        assert page_hosts(anywhere) is None  # beyond loopback: any name of the machine, the token asked
    finally:
        anywhere.close()


async def test_a_jobs_hostile_text_reaches_the_page_printable():
    """A job's reason (its stderr) and an explanation's sentences lose their escape sequences,
    controls and bidirectional overrides; their lines stay."""
    source = FakeSource()
    source.jobs_now[2] = status(
        "waits", "failed", reason="crashed\x1b]0;title\x07\n\x1b[2J\x1b]52;c;ZXZpbA==\x07Error: \u202eboom\x9b1A"
    )
    async with asgi_client(create_app(source, TOKEN)) as client:
        document = (await client.get("/api/snapshot")).json()
    assert document["jobs"][2]["reason"] == "crashed\nError: boom"
    explanation = Explanation("big", "failed", ("It failed: \x1b[1A\x1b[2K  big  running",), ())
    assert explanation_document(explanation)["sentences"] == ["It failed:   big  running"]


def test_the_page_needs_nothing_from_outside():
    """No CDN, no external font or script: every URL in the page's files is its own (relative)."""
    folder = resources.files("dashboard") / "static"
    for name in ("index.html", "app.js", "style.css", "icon.svg"):
        text = (folder / name).read_text()
        outside = [url for url in re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"')]*", text) if "www.w3.org" not in url]
        assert not outside, (name, outside)
        assert "@import" not in text and "innerHTML" not in text, name


# ---- what the page is sent ---------------------------------------------------------------------


async def test_the_snapshot_lays_each_running_job_on_its_gpus(client):
    document = (await client.get("/api/snapshot")).json()
    assert [job["id"] for job in document["jobs"]] == ["big", "wide", "waits", "done"]
    assert document["counts"]["running"] == 2 and document["counts"]["queued"] == 1
    nodes = {node["name"]: node for node in document["nodes"]}
    assert list(nodes) == ["aws-0", "aws-1", "dgx-ext-0"] and document["nodes_complete"]
    assert nodes["aws-0"]["gpus"] == ["wide", "wide", None, None]
    assert nodes["aws-1"]["hardware"] == "T4"
    assert nodes["dgx-ext-0"]["gpus"] == ["big"] * 4 + [None] * 4
    rounds = document["rounds"]
    assert [r["round"] for r in rounds] == [3, 2, 1]  # newest first
    assert rounds[0]["gpus_allocated"] == 8 and rounds[0]["goodput"] == 1503.0
    assert document["teams"] is None  # one team without guarantees: nothing to show
    waits = next(job for job in document["jobs"] if job["id"] == "waits")
    assert waits["state"] == "queued" and "all held" in waits["reason"]


async def test_without_the_rounds_the_jobs_are_still_shown_and_the_page_says_why():
    document = snapshot_document(FakeSource().jobs_now, None, "the rounds are not available (no service answers)")
    assert document["rounds"] is None and "not available" in document["rounds_note"]
    assert not document["nodes_complete"]
    # The nodes the jobs hold, in their names' order, as large as what they hold.
    assert [(n["name"], n["gpus"]) for n in document["nodes"]] == [
        ("aws-0", ["wide", "wide"]),
        ("aws-1", ["wide", "wide"]),
        ("dgx-ext-0", ["big"] * 4),
    ]
    async with asgi_client(create_app(FakeSource(rounds_served=False), TOKEN)) as client:
        served = (await client.get("/api/snapshot")).json()
    assert served["rounds"] is None and "goodput.api.rounds" in served["rounds_note"]
    assert len(served["jobs"]) == 4


async def test_rounds_and_teams_that_do_not_answer_are_not_asked_each_time(monkeypatch):
    """The jobs keep their pace: an extra that failed, or was slow, waits RETRY_EXTRA_S."""
    import dashboard.app
    from dashboard.app import Snapshots

    monkeypatch.setattr(dashboard.app, "EXTRA_TIMEOUT_S", 0.05)
    source = FakeSource(rounds_served=False)
    asked = {"rounds": 0, "teams": 0}
    rounds = source.rounds

    async def counted_rounds(limit):
        asked["rounds"] += 1
        return await rounds(limit)

    async def slow_teams():
        asked["teams"] += 1
        await asyncio.sleep(3600)

    source.rounds, source.teams = counted_rounds, slow_teams
    snapshots = Snapshots(source, refresh_s=1e-6)
    for _ in range(3):
        document = json.loads(await snapshots.latest())
        assert len(document["jobs"]) == 4 and "goodput.api.rounds" in document["rounds_note"]
    assert asked == {"rounds": 1, "teams": 1} and source.reads == 3
    source.jobs_now.pop()
    assert len(json.loads(await snapshots.latest())["jobs"]) == 3


def test_a_node_holding_more_than_the_round_said_shows_what_it_holds():
    layout = gpu_layout((Node("aws-0", "aws", 2),), [running("a", (("aws-0", 2),)), running("b", (("aws-0", 1),))])
    assert layout[0]["gpus"] == ["a", "a", "b"]
    assert gpu_layout(NODES, [status("q", "queued")])[0]["gpus"] == [None] * 4


async def test_a_jobs_explanation_and_its_errors(client):
    document = (await client.get("/api/jobs/big")).json()
    assert document["sentences"][-1] == "It moved to 4 A100 GPUs in round 3."
    assert [(d["gpus"], d["gpu_type"]) for d in document["decisions"]] == [(0, None), (2, "T4"), (4, "A100")]
    assert (await client.get("/api/jobs/nobody")).status_code == 404
    assert (await client.get("/api/jobs/not%20an%20id")).status_code == 400
    unavailable = await client.get("/api/jobs/offline")
    assert unavailable.status_code == 503 and "not available" in unavailable.json()["error"]


async def test_the_event_stream_pushes_a_snapshot_and_each_change():
    """Through uvicorn on a loopback port, as a browser reads it."""
    source = FakeSource()
    app = create_app(source, TOKEN, refresh_s=0.05)
    sock = listen("127.0.0.1", 0)
    events = page_url(sock, TOKEN).partition("#")[0] + "events"
    async with serving(app, sock), httpx.AsyncClient(timeout=30) as http:
        assert (await http.get(events, headers={"authorization": "Bearer no"})).status_code == 401
        async with http.stream("GET", events, headers=BEARER) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = _events(stream)
            first = await anext(events)
            assert [job["state"] for job in first["jobs"]] == ["running", "running", "queued", "finished"]
            source.jobs_now[2] = running("waits", (("aws-0", 2),))
            second = await anext(events)
            assert second["jobs"][2]["state"] == "running"
            assert second["nodes"][0]["gpus"] == ["wide", "wide", "waits", "waits"]
    # Stopped with a page still open: the socket is closed.
    assert sock.fileno() == -1


async def _events(stream):
    """The JSON of each `snapshot` event of a server-sent events stream."""
    kind = None
    async for line in stream.aiter_lines():
        if line.startswith("event:"):
            kind = line.partition(":")[2].strip()
        elif line.startswith("data:") and kind == "snapshot":
            yield json.loads(line.partition(":")[2])


# ---- the command's errors ----------------------------------------------------------------------


def test_a_taken_port_and_a_bad_refresh_are_clear_errors(capsys, no_login, tmp_path, monkeypatch):
    from cli.main import main

    monkeypatch.chdir(tmp_path)  # no out/stack/user.env here
    taken = listen("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        assert main(["dashboard", "--port", str(port)]) == 2
        assert f"port {port} on 127.0.0.1 is taken" in capsys.readouterr().err
    finally:
        taken.close()
    assert main(["dashboard", "--refresh", "0"]) == 2
    assert "--refresh must be a positive" in capsys.readouterr().err
    assert main(["dashboard", "--host", "no-such-host.invalid"]) == 2
    assert "--host no-such-host.invalid" in capsys.readouterr().err


def test_goodput_up_refuses_a_taken_dashboard_port_before_anything_starts(capsys, tmp_path):
    from cli.main import main

    taken = listen("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        assert main(["up", "--workload", "none", "--dashboard-port", str(port), "--data", str(tmp_path / "d")]) == 2
    finally:
        taken.close()
    assert f"--dashboard-port {port}: port {port} on 127.0.0.1 is taken" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_no_nats_is_a_clear_error_before_serving(capsys, no_login, tmp_path, monkeypatch):
    from cli.main import main
    from launcher.nats import free_loopback_port

    monkeypatch.chdir(tmp_path)
    assert main(["dashboard", "--server", f"nats://127.0.0.1:{free_loopback_port()}"]) == 2
    error = capsys.readouterr()
    assert "cannot reach NATS" in error.err and "dashboard:" not in error.out


# ---- a real browser on the live stack ------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.skipif(
    not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()),
    reason=f"no Chromium ({CHROMIUM}, {CHROMEDRIVER}): `make install` as root installs Debian's chromium "
    "and chromium-driver",
)
def test_a_job_submitted_while_the_page_is_open_goes_from_queued_to_running_to_finished(tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    from launcher.nats import free_loopback_port
    from tests.test_live_service import GOODPUT, ROOT, Up, command_env

    data = tmp_path / "data"
    up = Up(free_loopback_port(), data)
    dashboard = browser = None
    try:
        up.wait_serving()
        _check_up_serves_its_dashboard(up.log.read_text())
        _check_logins_are_checked_before_serving(data, tmp_path)
        dashboard, url = _start_dashboard(data, tmp_path)
        browser = _chromium(tmp_path)
        browser.get(url)
        browser.execute_script("window.openedOnce = true")  # gone if the page were reloaded
        wait = WebDriverWait(browser, 600, poll_frequency=0.1)
        wait.until(lambda b: b.find_element("id", "live").get_attribute("data-live") == "live")
        wait.until(lambda b: b.execute_script("return document.querySelector('#queue tbody tr') !== null"))

        job = _job_file(tmp_path, "watched-1", "deepspeech2")
        submitted = subprocess.run(
            [*GOODPUT, "submit", str(job)], cwd=ROOT, env=command_env(data), capture_output=True, text=True, timeout=120
        )
        assert submitted.returncode == 0, submitted.stderr

        def state():
            return browser.execute_script(
                "const row = document.querySelector('#queue tr[data-job=\"watched-1\"]');"
                "return row && [row.dataset.state, row.dataset.seen]"
            )

        wait.until(lambda b: state() is not None)
        wait.until(lambda b: state()[0] == "finished")
        seen = state()[1].split()
        assert seen[0] in ("profiling", "queued"), seen
        assert "running" in seen and seen.index("running") > 0 and seen[-1] == "finished", seen
        assert browser.execute_script("return window.openedOnce === true"), "the page was reloaded"

        _click(browser, '#queue tr[data-job="watched-1"]')
        shown = "const title = document.querySelector('#job .title b'); return title && title.textContent"
        wait.until(lambda b: b.execute_script(shown) == "watched-1")
        if os.environ.get(SCREENSHOT_ENV):
            _screenshot(browser, wait, data, tmp_path, Path(os.environ[SCREENSHOT_ENV]))
        _check_no_other_page_gets_the_data(browser, wait, url)
    finally:
        if browser is not None:
            browser.quit()
        if dashboard is not None:
            _stop(dashboard)
        up.kill()


def _check_up_serves_its_dashboard(log: str) -> None:
    """`goodput up` printed its dashboard's URL: its page opens, its data only with the token."""
    match = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/)#token=(\S+)", log)
    assert match, log
    page, token = match.groups()
    assert httpx.get(page, timeout=30).status_code == 200
    assert httpx.get(f"{page}api/snapshot", timeout=30).status_code == 401
    answer = httpx.get(f"{page}api/snapshot", headers={"authorization": f"Bearer {token}"}, timeout=30)
    assert answer.status_code == 200 and "jobs" in answer.json()


FETCH = """
const [url, init, done] = arguments;
fetch(url, init).then((answer) => done(answer.type === "opaque" ? "opaque" : answer.status), (error) => done("blocked"));
"""


def _check_no_other_page_gets_the_data(browser, wait, url: str) -> None:
    """The token stays in the dashboard's own page: out of its address bar and of any cookie, sent
    only in its own requests' header (one without it is refused). A page that a job serves on
    another loopback port can read nothing of it, and its links open the page without the data."""
    root = url.partition("#")[0]
    assert browser.execute_script("return [location.hash, document.cookie]") == ["#job=watched-1", ""]
    assert browser.execute_async_script(FETCH, "api/snapshot", {}) == 401
    with_token = {"headers": {"Authorization": f"Bearer {url.partition('#token=')[2]}"}}
    assert browser.execute_async_script(FETCH, "api/snapshot", with_token) == 200

    page = f'<a id="page" href="{root}">dashboard</a> <a id="data" href="{root}api/snapshot">data</a>'.encode()

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *_):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        browser.switch_to.new_window("tab")
        browser.get(f"http://127.0.0.1:{other.server_address[1]}/")
        for init in ({"credentials": "include"}, with_token):  # it cannot read the answer, token or not
            assert browser.execute_async_script(FETCH, f"{root}api/snapshot", init) == "blocked", init
        assert browser.execute_async_script(FETCH, f"{root}api/snapshot", {"mode": "no-cors"}) == "opaque"
        _click(browser, "#data")  # a link to the data: nothing the browser adds lets it in
        wait.until(lambda b: b.current_url == f"{root}api/snapshot")
        assert browser.find_element("tag name", "body").text.startswith("401 Unauthorized")
        browser.back()
        wait.until(lambda b: b.execute_script("return document.getElementById('page') !== null"))
        _click(browser, "#page")  # a link to the page: it opens, without the token, so without the data
        wait.until(lambda b: b.execute_script("return document.getElementById('live')?.dataset.live") == "closed")
        assert "no token" in browser.find_element("id", "live").text
        assert browser.execute_script("return document.querySelector('#queue tbody tr')") is None
    finally:
        other.shutdown()
        other.server_close()


def _check_logins_are_checked_before_serving(data: Path, tmp_path: Path) -> None:
    """A wrong password, and no login at all, are each a clear error; nothing is served."""
    from tests.test_live_service import GOODPUT, command_env, user_env

    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    env = {**command_env(data), "GOODPUT_NATS_PASSWORD_FILE": str(wrong)}
    refused = subprocess.run([*GOODPUT, "dashboard"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "refused the login" in refused.stderr, refused.stderr
    assert "dashboard:" not in refused.stdout
    anonymous = subprocess.run(
        [*GOODPUT, "dashboard", "--server", user_env(data)["GOODPUT_NATS_URL"]],
        env=command_env(None),
        cwd=tmp_path,  # no out/stack/user.env here
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert anonymous.returncode == 2 and "without a login" in anonymous.stderr, anonymous.stderr


def _start_dashboard(data: Path, tmp_path: Path):
    """`goodput dashboard` with the user's login, reading the API often; it and the URL it printed."""
    from tests.test_live_service import GOODPUT, ROOT, command_env

    log = tmp_path / "dashboard.log"
    output = log.open("w")
    process = subprocess.Popen(
        [*GOODPUT, "dashboard", "--refresh", "0.2"],
        cwd=ROOT,
        env=command_env(data),
        stdout=output,
        stderr=subprocess.STDOUT,
    )
    process.output = output
    deadline = time.monotonic() + 120
    while not (match := re.search(r"dashboard: (\S+)", log.read_text())):
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return process, match.group(1)


def _stop(process) -> None:
    process.send_signal(signal.SIGINT)
    try:
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.output.close()


def _chromium(tmp_path: Path):
    """Debian's Chromium through its chromedriver (nothing downloaded), headless, a fresh profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        *CHROMIUM_FLAGS,
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--window-size=1440,1000",
        "--hide-scrollbars",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(
        service=Service(CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log")), options=options
    )


def _click(browser, selector: str) -> None:
    """Click what `selector` finds, in one step of the page's own thread: the page redraws its rows
    as updates come, so an element found before a click may be gone by then."""
    assert browser.execute_script(
        "const found = document.querySelector(arguments[0]); if (found) found.click(); return found !== null", selector
    ), selector


def _job_file(folder: Path, job: str, application: str, more: str = "") -> Path:
    path = folder / f"{job}.yaml"
    path.write_text(f"id: {job}\napplication: {application}\n{more}")
    return path


# Long jobs of several kinds, so the figure shows a busy cluster.
FIGURE_JOBS = [("imagenet", 3), ("gpt_pmp", 3), ("yolov3", 3), ("bert", 2), ("deepspeech2", 2)]
# ... and one that waits, with why: no node type gives a job exactly 3 GPUs.
FIGURE_WAITING = ("rigid-3", "cifar10", "rigid: true\nrequested_gpus: 3\n")


def _screenshot(browser, wait, data: Path, tmp_path: Path, path: Path) -> None:
    """Load the cluster, choose a job that has run a few rounds, and save the whole page."""
    from tests.test_live_service import GOODPUT, ROOT, command_env

    files = [_job_file(tmp_path, f"{app}-{i}", app) for app, n in FIGURE_JOBS for i in range(1, n + 1)]
    files.append(_job_file(tmp_path, *FIGURE_WAITING))
    subprocess.run([*GOODPUT, "submit", *map(str, files)], cwd=ROOT, env=command_env(data), check=True, timeout=300)
    wait.until(lambda b: len(b.find_elements("css selector", "#queue tr[data-state=running]")) >= 8)
    wait.until(lambda b: b.find_elements("css selector", '#queue tr[data-job="rigid-3"][data-state=unschedulable]'))
    _click(browser, '#queue tr[data-job="imagenet-1"]')
    # Its history drawn, or the page saying why it cannot be.
    wait.until(
        lambda b: b.execute_script(
            "const note = document.querySelector('#job .note');"
            "return document.querySelectorAll('#job .chart rect').length >= 3"
            " || (note !== null && !note.textContent.startsWith('reading'))"
        )
    )
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 1440, "height": height, "deviceScaleFactor": 1, "mobile": False}
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(path)), path
