"""A login per team, its team the server's word: each team's logins in an account of their own
(shared/permissions.py), whose imports stamp every request with the account and map every
submission to the team's own intake subject; the operator's commands that make the teams' logins
(`goodput up --teams`, `goodput login add --team`, `goodput teams apply`), each refusing what is
wrong before it changes anything."""

from __future__ import annotations

import asyncio
import json
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import pytest

from cli.main import main as goodput
from launcher.nats import (
    SECRETS,
    TEAM_FILE,
    EmbeddedNats,
    embedded_nats,
    free_loopback_port,
    nats_from_binary,
    port_in_use,
    serving_pid,
)
from launcher.setup import provision_now
from shared import credentials, permissions, storage, subjects
from shared.bus import Bus
from shared.bus.requesters import requester_of
from shared.schema.records import JobRecord, JobsQuery, select
from shared.schema.teams import TeamFile
from shared.teams import load_team_file

PASSWORDS = {role: f"{role}Secret{index}x9" for index, role in enumerate(permissions.ROLES)}
LOGINS = {"user": "userSecret1x9", "alice": "aliceSecret1x9", "vision": "visionSecret1x9", "nlp": "nlpSecret1x9"}
TEAMS_OF = {"alice": "vision", "vision": "vision", "nlp": "nlp"}  # `user`: the default team's
GOOD = (
    "teams:\n  vision: {quota: {T4: 12, A100: 8}, weight: 1}\n  nlp: {quota: {T4: 12}, borrow: {A100: 8}, weight: 2}\n"
)
BAD = {  # a team file sia-hetero-64 refuses, and what the refusal says
    "unknown GPU type": ("teams:\n  vision: {quota: {H100: 4}}\n", "names GPU type 'H100'"),
    "quotas over the cluster": (
        "teams:\n  vision: {quota: {T4: 16}}\n  nlp: {quota: {T4: 12}}\n",
        "add up to 28 GPUs",
    ),
    "negative weight": ("teams:\n  vision: {quota: {T4: 4}, weight: -1}\n", "must be a positive number"),
}


SUBMISSION = b'{"id": "j", "application": "cifar10"}'


class NoTeamsPolicy:
    """A policy that does not honour teams (what `goodput up --teams` refuses)."""

    name = "no-teams"
    round_s = 60.0
    adaptive_batch = False
    honours_teams = False

    def allocate(self, state):  # never called: refused before any round
        raise AssertionError


@pytest.fixture
def no_teams_policy(monkeypatch: pytest.MonkeyPatch) -> str:
    from policies import base

    monkeypatch.setitem(base.POLICIES, "no-teams", f"{__name__}:NoTeamsPolicy")
    return "no-teams"


def accounts_of(config: str) -> dict[str, str]:
    """Each account's block of a rendered config, by name."""
    starts = [(m.group(1), m.start()) for m in re.finditer(r"^  (\S+) \{$", config, re.M)]
    return {
        name: config[start : (starts[i + 1][1] if i + 1 < len(starts) else len(config))]
        for i, (name, start) in enumerate(starts)
    }


def members(account: str) -> set[str]:
    """The users of an account's block."""
    return set(re.findall(r'\{user: "([^"]+)"', account))


def test_each_teams_logins_are_in_its_account_importing_its_own_intake_only():
    config = permissions.render_accounts(PASSWORDS, LOGINS, teams=TEAMS_OF)
    accounts = accounts_of(config)
    assert set(accounts) == {"GOODPUT", "LOGINS", "TEAM_vision", "TEAM_nlp"}
    assert [permissions.account_team(name) for name in ("LOGINS", "TEAM_vision", "TEAM_nlp", "GOODPUT")] == [
        "default",
        "vision",
        "nlp",
        None,
    ]
    assert {name: members(block) for name, block in accounts.items()} == {
        "GOODPUT": set(PASSWORDS),
        "LOGINS": {"user"},
        "TEAM_vision": {"vision", "alice"},
        "TEAM_nlp": {"nlp"},
    }
    for team in ("default", "vision", "nlp"):
        block = accounts[permissions.team_account(team)]
        intake = [line for line in block.splitlines() if f'to: "{subjects.submit("*")}"' in line]
        assert intake == [
            f'      {{service: {{account: GOODPUT, subject: "{subjects.intake(team, "*")}"}}, '
            f'to: "{subjects.submit("*")}", share: true}}'
        ]
        for subject in permissions.EXPORTS:  # what LOGINS imports, each team imports
            assert f'subject: "{subject}"}}, share: true}}' in block
        assert "$SRV" not in block  # the NATS service API: every instance answers, at no login's limit
    with pytest.raises(ValueError, match="logins there are not: bob"):
        permissions.render_accounts(PASSWORDS, LOGINS, teams={"bob": "vision"})
    with pytest.raises(ValueError, match="a team's name"):
        permissions.render_accounts(PASSWORDS, LOGINS, teams={"alice": "Vision.A"})


def test_the_manifests_renderer_reads_a_teams_logins_from_team_dot_login_files(tmp_path: Path):
    passwords, logins = tmp_path / "passwords", tmp_path / "logins"
    passwords.mkdir()
    logins.mkdir()
    for role, password in PASSWORDS.items():
        (passwords / role).write_text(password)
    (passwords / "user").write_text(LOGINS["user"])
    (passwords / "vision.vision").write_text(LOGINS["vision"])  # a key of the Secret the roles' are in
    (passwords / ".hidden").write_text("skipped")
    (logins / "vision.alice").write_text(LOGINS["alice"])
    (logins / "nlp.nlp").write_text(LOGINS["nlp"])
    out = tmp_path / "auth.conf"
    arguments = ["--passwords", str(passwords), "--logins", str(logins), "--out", str(out)]
    assert permissions.main(arguments) == 0
    rendered = accounts_of(out.read_text())
    assert {name: members(block) for name, block in rendered.items()} == {
        "GOODPUT": set(PASSWORDS),
        "LOGINS": {"user"},
        "TEAM_vision": {"vision", "alice"},
        "TEAM_nlp": {"nlp"},
    }
    assert all(f'password: "{password}"' in out.read_text() for password in LOGINS.values())
    (logins / "alice").write_text("aliceAgain1x9")  # one login in two teams
    with pytest.raises(SystemExit):
        permissions.main(arguments)


@pytest.fixture
def two_teams(tmp_path: Path) -> Iterator[str]:
    """A nats-server with the services' account and two teams' (and the default team's) logins, its storage set up."""
    config = permissions.render_server_config(PASSWORDS, LOGINS, teams=TEAMS_OF)
    with nats_from_binary(tmp_path, config=config) as url:
        provision_now(url, user="operator", password=PASSWORDS["operator"], inbox_prefix="_INBOX_operator")
        yield url


async def login(url: str, name: str, **options) -> nats.NATS:
    return await nats.connect(
        url, user=name, password=LOGINS[name], inbox_prefix=permissions.inbox_prefix(name), **options
    )


async def answering_who_asks(url: str, password: str) -> nats.NATS:
    """The API's role answering `goodput.api.job` with the requester the server named."""
    api = await nats.connect(url, user="api", password=password, inbox_prefix=permissions.inbox_prefix("api"))

    async def who(msg) -> None:
        found = requester_of(msg.headers)
        await msg.respond(json.dumps([found.account, found.user] if found else None).encode())

    await api.subscribe(subjects.API_JOB, cb=who)
    await api.flush()
    return api


async def answering_records(url: str, password: str, held: list[JobRecord]) -> nats.NATS:
    """The executors' role answering the records of `held` as the executors select them."""
    executor = await nats.connect(
        url, user="executor", password=password, inbox_prefix=permissions.inbox_prefix("executor")
    )

    async def records(msg) -> None:
        query = msgspec.msgpack.decode(msg.data, type=JobsQuery)
        await msg.respond(msgspec.msgpack.encode(select(held, query)))

    await executor.subscribe(subjects.RECORDS, cb=records)
    await executor.flush()
    return executor


async def asked_as(url: str, name: str, options: dict | None = None) -> list[str]:
    """The account and user the server named for `name`'s request (`options`: its connect options)."""
    client = await (nats.connect(url, **options) if options else login(url, name))
    try:
        return json.loads((await client.request(subjects.API_JOB, b"{}", timeout=5)).data)
    finally:
        await client.close()


async def intake_subjects(url: str, password: str) -> dict[str, int]:
    reader = await Bus.connect(url, "test-api", user="api", password=password, inbox_prefix="_INBOX_api")
    try:
        return (await reader.js.stream_info(subjects.INTAKE_STREAM, subjects_filter=">")).state.subjects or {}
    finally:
        await reader.close()


@pytest.mark.e2e
async def test_the_server_names_a_requests_team_account_and_maps_a_submission_to_its_team(two_teams: str):
    api = await answering_who_asks(two_teams, PASSWORDS["api"])
    try:
        for name, account in (
            ("vision", "TEAM_vision"),
            ("alice", "TEAM_vision"),
            ("nlp", "TEAM_nlp"),
            ("user", "LOGINS"),
        ):
            assert await asked_as(two_teams, name) == [account, name]
            assert permissions.account_team(account) == TEAMS_OF.get(name, subjects.DEFAULT_TEAM)
    finally:
        await api.close()
    for name in ("alice", "nlp"):
        client = await login(two_teams, name)
        try:
            ack = await client.jetstream().publish(subjects.submit(name), SUBMISSION)
            assert ack.stream == subjects.INTAKE_STREAM
        finally:
            await client.close()
    assert await intake_subjects(two_teams, PASSWORDS["api"]) == {
        subjects.intake("vision", "alice"): 1,
        subjects.intake("nlp", "nlp"): 1,
    }


def run_goodput(arguments: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = goodput(arguments)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_login_of_a_team_not_in_the_team_file_is_refused(tmp_path: Path, capsys):
    from launcher.nats import Access

    data = tmp_path / "data"
    Access.kept_in(data / SECRETS)
    code, _, err = run_goodput(["login", "add", "carol", "--team", "vision", "--data", str(data)], capsys)
    assert code == 2 and "no team 'vision'" in err and "has no team file" in err
    (data / TEAM_FILE).write_text(GOOD)
    code, _, err = run_goodput(["login", "add", "carol", "--team", "robotics", "--data", str(data)], capsys)
    assert code == 2 and "no team 'robotics'" in err and "its teams: vision, nlp" in err
    assert not (data / "logins").exists()
    code, out, _ = run_goodput(["login", "add", "carol", "--team", "vision", "--data", str(data)], capsys)
    assert code == 0 and "login carol of team vision" in out
    _, out, _ = run_goodput(["login", "list", "--data", str(data)], capsys)
    assert {tuple(line.split()) for line in out.splitlines()} == {
        ("user", "team", "default"),
        ("carol", "team", "vision"),
    }


@pytest.mark.parametrize("case", [*BAD, "missing file", "a policy that cannot honour teams"])
def test_goodput_up_with_a_bad_team_file_starts_nothing(case: str, tmp_path: Path, capsys, no_teams_policy: str):
    data, port = tmp_path / "data", free_loopback_port()
    teams = tmp_path / "teams.yaml"
    policy = []
    if case in BAD:
        teams.write_text(BAD[case][0])
        expected = BAD[case][1]
    elif case == "missing file":
        expected = f"no team file {teams}"
    else:
        teams.write_text(GOOD)
        policy, expected = ["--policy", no_teams_policy], "policy 'no-teams' cannot honour"
    arguments = ["up", "--teams", str(teams), "--data", str(data), "--port", str(port), "--workload", "none"]
    code, _, err = run_goodput([*arguments, *policy], capsys)
    assert code == 2 and expected in err, err
    assert not port_in_use(port) and serving_pid(data) is None
    assert not [p for p in (data / "jetstream", data / SECRETS, data / TEAM_FILE, data / "teams") if p.exists()]


@pytest.fixture
def stack_data(tmp_path: Path) -> Iterator[tuple[Path, EmbeddedNats]]:
    """A data folder as `goodput up` leaves it while it serves (its server, storage, user.env and
    cluster), without the services."""
    from cli.teams import record_cluster

    data = tmp_path / "data"
    data.mkdir()
    with embedded_nats(data) as server:
        provision_now(server.url, **server.options("operator"))
        credentials.write_user_env(data, server.url, server.access.password_file("user"))
        record_cluster(data, "sia-hetero-64")
        yield data, server


async def stored_teams(server: EmbeddedNats) -> TeamFile | None:
    bus = await server.connect("test-teams")
    try:
        entry = await (await storage.open_kv(bus, subjects.TEAMS_BUCKET, TeamFile)).get(subjects.TEAMS_KEY)
        return None if entry is None else entry.value
    finally:
        await bus.close()


@pytest.mark.e2e
async def test_teams_apply_refuses_a_bad_file_changes_nothing_and_puts_a_good_one_in_force(
    stack_data, tmp_path: Path, capsys, no_teams_policy: str
):
    data, server = stack_data
    api_password = server.access.password_file("api").read_text().strip()
    api = await answering_who_asks(server.url, api_password)
    held: list[JobRecord] = []  # the executors' records
    executor = await answering_records(server.url, server.access.password_file("executor").read_text().strip(), held)
    apply = ["teams", "apply", str(tmp_path / "teams.yaml"), "--data", str(data)]
    nothing = {"stored": None, "in force": False, "team logins": False}

    async def state() -> dict:
        return {
            "stored": await stored_teams(server),
            "in force": (data / TEAM_FILE).exists(),
            "team logins": (data / "teams").exists(),
        }

    try:
        code, _, err = await asyncio.to_thread(run_goodput, apply, capsys)
        assert code == 2 and f"no team file {tmp_path / 'teams.yaml'}" in err
        for case, (text, expected) in BAD.items():
            (tmp_path / "teams.yaml").write_text(text)
            code, _, err = await asyncio.to_thread(run_goodput, apply, capsys)
            assert code == 2 and expected in err, (case, err)
            assert await state() == nothing, case
        server.access.add_login("nlp", server.url)  # a team's own login would take its name
        (tmp_path / "teams.yaml").write_text(GOOD)
        code, _, err = await asyncio.to_thread(run_goodput, apply, capsys)
        assert code == 2 and "team nlp's own login takes the team's name: login 'nlp' exists already" in err
        assert await state() == nothing
        server.access.remove_login("nlp")

        code, out, _ = await asyncio.to_thread(run_goodput, apply, capsys)
        assert code == 0 and "in force from the next round" in out, out
        assert await stored_teams(server) == load_team_file(tmp_path / "teams.yaml")
        assert (data / TEAM_FILE).read_text() == GOOD
        (tmp_path / "teams.yaml").unlink()  # the file in force is the copy: removing the given one changes nothing
        assert await stored_teams(server) == load_team_file(data / TEAM_FILE)
        for team in ("vision", "nlp"):
            file = data / "teams" / f"{team}.env"
            assert stat.S_IMODE(file.stat().st_mode) == 0o600 and f"GOODPUT_TEAM={team}" in file.read_text()
            # A new team's account reaches the services at once, as its login file says to connect.
            environ = credentials.user_environment({credentials.LOGIN_ENV: str(file)})
            options = credentials.connect_options(environ=environ)
            assert options["user"] == team and options["inbox_prefix"] == f"_INBOX_{team}"
            assert await asked_as(environ["GOODPUT_NATS_URL"], team, options=options) == [f"TEAM_{team}", team]
            client = await nats.connect(environ["GOODPUT_NATS_URL"], **options)
            try:
                await client.jetstream().publish(subjects.submit(team), SUBMISSION)
            finally:
                await client.close()
        assert await intake_subjects(server.url, api_password) == {
            subjects.intake("vision", "vision"): 1,
            subjects.intake("nlp", "nlp"): 1,
        }

        # A refused submission under `dora.x` holds nothing: a team dora may come.
        held.append(JobRecord("dora.x", "cifar10", 0.0, None, 0, 0.0, None, failure="refused", state="rejected"))
        (tmp_path / "teams.yaml").write_text(GOOD + "  dora: {quota: {RTX 2080 Ti: 8}}\n")
        code, out, err = await asyncio.to_thread(run_goodput, apply, capsys)
        assert code == 0 and "in force from the next round" in out, err
        (tmp_path / "teams.yaml").write_text(GOOD)
        code, out, err = await asyncio.to_thread(run_goodput, apply, capsys)
        assert code == 0 and "team dora is left out: its login and its jobs go on as the default team's" in out, err
        held.clear()
        # A default-team job holds `carol.x`: a team carol could neither use that id nor be told why.
        held.append(JobRecord("carol.x", "cifar10", 0.0, None, 0, 0.0, None, state="queued"))
        (tmp_path / "teams.yaml").write_text(GOOD + "  carol: {quota: {RTX 2080 Ti: 8}}\n")
        code, _, err = await asyncio.to_thread(run_goodput, apply, capsys)
        assert code == 2 and "jobs of the default team hold ids beginning with carol. (carol.x)" in err, err
        assert (data / TEAM_FILE).read_text() == GOOD and not (data / "teams" / "carol.env").exists()
        held.clear()

        # The live run's policy must honour teams: else the file is refused, and the one in force stays.
        from launcher.live_run import live_request
        from launcher.stack import create_run

        operator = await server.connect("test-live-run")
        try:
            await create_run(operator, live_request(subjects.LIVE_RUN, no_teams_policy, "sia-hetero-64", 60, 1))
        finally:
            await operator.close()
        (tmp_path / "teams.yaml").write_text(GOOD.replace("weight: 2", "weight: 3"))
        code, _, err = await asyncio.to_thread(run_goodput, apply, capsys)
        assert code == 2 and "policy 'no-teams' cannot honour" in err
        assert await stored_teams(server) == load_team_file(data / TEAM_FILE) and (data / TEAM_FILE).read_text() == GOOD

    finally:
        await api.close()
        await executor.close()


@pytest.mark.e2e
async def test_a_teams_logins_hold_at_most_their_accounts_connections_and_subscriptions(tmp_path: Path):
    """One team's logins together open at most its connections (the next is refused, another team's
    still connects); a connection that subscribes past its bound is closed, and only that one."""
    limits = permissions.LoginLimits(connections=3, subscriptions=10)
    config = permissions.render_server_config(PASSWORDS, LOGINS, teams=TEAMS_OF, limits=limits)
    once = {"allow_reconnect": False, "max_reconnect_attempts": 1}
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    with nats_from_binary(tmp_path, config=config) as url:
        greedy = await login(url, "alice", closed_cb=on_closed, **once)
        calm = await login(url, "vision")
        held = [greedy, calm, await login(url, "alice")]
        with pytest.raises(nats.errors.Error, match="maximum account active connections exceeded"):
            await login(url, "vision", **once)
        other = await login(url, "nlp")  # another team's account has its own
        for n in range(limits.subscriptions + 1):
            await greedy.subscribe(f"{permissions.inbox_prefix('alice')}.{n}")
        await asyncio.wait_for(closed.wait(), 10)
        assert "maximum subscriptions exceeded" in str(greedy.last_error)
        for client in (calm, other):
            await client.flush(timeout=5)
            assert client.is_connected
        for client in (*held, other):
            await client.close()
