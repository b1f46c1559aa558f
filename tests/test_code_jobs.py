"""A job that carries its code, on a real nats-server with the stack's permissions: a login uploads
the archive through the API (it never writes JetStream itself), a hostile one is refused with the
reason, the submission naming the stored archive is accepted, and a node agent (the executor's
role) fetches it, checks it, unpacks it into the job's folder and runs its entrypoint with its
arguments."""

from __future__ import annotations

import asyncio
import gzip
import io
import os
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.micro.request import ServiceError

from cli.submit import upload
from launcher.nats import nats_from_binary
from launcher.setup import provision_now
from services.api import service as api
from services.node.box import Box, Boxes, default_rules
from services.node.code import JobCode, store_fetcher
from services.node.job_main import parse
from services.node.processes import job_arguments, worker
from shared import permissions, storage, subjects
from shared.bus import Bus
from shared.code_archive import digest, pack, stored_name
from shared.schema.api import SubmitAnswer
from shared.schema.jobs import JobOwner, JobSpec
from shared.schema.records import JobRecords, JobsQuery

ROOT = Path(__file__).resolve().parent.parent
PASSWORDS = {role: f"{role}Secret{index}x9" for index, role in enumerate((*permissions.ROLES, "user"))}
SCRIPT = """import os, sys
from helper import GREETING
print(GREETING, sys.argv[1:], os.path.basename(os.getcwd()), flush=True)
"""


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A nats-server with the stack's roles and the login `user`, its storage provisioned."""
    config = permissions.render_server_config(
        {role: PASSWORDS[role] for role in permissions.ROLES}, {"user": PASSWORDS["user"]}
    )
    with nats_from_binary(tmp_path_factory.mktemp("code-nats"), config=config) as url:
        provision_now(url, user="operator", password=PASSWORDS["operator"], inbox_prefix="_INBOX_operator")
        yield url


def login(role: str) -> dict:
    return {"user": role, "password": PASSWORDS[role], "inbox_prefix": permissions.inbox_prefix(role)}


async def connect(url: str, role: str) -> Bus:
    return await Bus.connect(url, f"test-{role}", allow_reconnect=False, max_reconnect_attempts=1, **login(role))


def code_folder(root: Path) -> Path:
    root.mkdir()
    (root / "train.py").write_text(SCRIPT)
    (root / "helper.py").write_text("GREETING = 'hello from my own code'\n")
    return root


def escaping_archive() -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
        info = tarfile.TarInfo("../escape.py")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"boom\n"))
    return buffer.getvalue()


async def test_a_login_uploads_its_code_through_the_api_and_a_node_agent_runs_it(secured: str, tmp_path: Path) -> None:
    service = await connect(secured, "api")
    executor = await connect(secured, "executor")
    try:
        await executor.subscribe(subjects.RECORDS, JobsQuery, lambda query: JobRecords(()))  # no job read yet
        await api.serve(service, await storage.open_kv(service, subjects.JOB_OWNERS_BUCKET, JobOwner), lambda s: None)

        data = pack(code_folder(tmp_path / "code"))
        sent: list[int] = []
        assert await upload(data, secured, lambda done, size: sent.append(done), **login("user")) is True
        assert sent[-1] == len(data)
        assert await upload(data, secured, **login("user")) is False  # stored: not sent again

        with pytest.raises(ServiceError) as refused:  # `../` is refused at upload, with the reason
            await upload(escaping_archive(), secured, **login("user"))
        assert "'../escape.py'" in refused.value.description and "'..'" in refused.value.description
        assert refused.value.code == "400"

        user = await connect(secured, "user")
        try:
            absent = await user.request(
                subjects.API_SUBMIT, JobSpec("absent-1", code="f" * 64, entrypoint="train.py"), SubmitAnswer
            )
        except ServiceError as error:
            assert "no archive" in error.description and "in the code store" in error.description
        else:
            raise AssertionError(f"a job naming no stored archive was accepted: {absent}")
        spec = JobSpec("mine-1", code=digest(data), entrypoint="train.py", args=("--epochs", "2"))
        answer = await user.request(subjects.API_SUBMIT, spec, SubmitAnswer)
        assert answer.accepted, answer
        await user.close()

        # The node agent's side: fetched (as the executor's role), checked, unpacked, run.
        code = JobCode(tmp_path / "archives", store_fetcher(executor, asyncio.get_running_loop()))
        job_folder = tmp_path / "jobs" / "mine-1"
        archive = stored_name("user", spec.code)  # the login's own: as the executor names it from the job's owner
        folder = await asyncio.to_thread(code.prepare, job_folder, archive, spec.entrypoint, tmp_path / "mine-1.code")
        assert folder == job_folder / "code" and (folder / "helper.py").is_file()
        with open(tmp_path / "worker.log", "w") as log:
            box = Box(Boxes(tmp_path, default_rules(1), runtime=None), "mine-1", "mine-1.1", job_folder, None, None)
            process = worker(box, spec.entrypoint, list(spec.args), {}, log, code=folder)  # --box off: as us
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0, (tmp_path / "worker.log").read_text()
        assert out.strip() == "hello from my own code ['--epochs', '2'] code"
        with pytest.raises(ValueError, match="entrypoint 'nope.py' is not in the job's code"):
            await asyncio.to_thread(code.prepare, job_folder, archive, "nope.py", tmp_path / "mine-1.code")
        with pytest.raises(ValueError, match="no archive"):
            await asyncio.to_thread(
                code.prepare, tmp_path / "jobs" / "x", f"user.{'e' * 64}", "train.py", tmp_path / "x.code"
            )
        with pytest.raises(ValueError, match="no archive"):  # another login's is not fetched as this one's
            await asyncio.to_thread(
                code.prepare, tmp_path / "jobs" / "y", f"other.{spec.code}", "train.py", tmp_path / "y.code"
            )
    finally:
        await executor.close()
        await service.close()


def test_job_main_keeps_its_own_arguments_and_passes_on_the_jobs() -> None:
    arguments = job_arguments("train.py", ["--checkpoint", "mine"], Path("/ck/a.pt"), code=True)
    assert arguments == ["--checkpoint", "/ck/a.pt", "--code", "train.py", "--checkpoint", "mine"]
    assert parse(arguments) == ("/ck/a.pt", True, "train.py", ["--checkpoint", "mine"])
    assert parse(["examples.jobs.mlp_blobs"]) == (None, False, "examples.jobs.mlp_blobs", [])


def test_a_module_added_to_the_jobs_package_is_found_without_a_restart(tmp_path: Path, monkeypatch) -> None:
    from shared.runtime import declared_jobs, job_module

    package = tmp_path / "hotjobs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "first.py").write_text("GOODPUT_JOB = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert declared_jobs("hotjobs") == ["first"]
    with pytest.raises(ValueError, match="no job 'second'"):
        job_module("second", "hotjobs")
    (package / "second.py").write_text("GOODPUT_JOB = True\n")  # while serving
    assert declared_jobs("hotjobs") == ["first", "second"]
    assert job_module("second", "hotjobs") == "hotjobs.second"


def test_an_agent_stops_the_workers_a_killed_one_left_by_their_job_main_mark(tmp_path: Path) -> None:
    import subprocess
    import sys

    from services.node.processes import JOB_MAIN, stop_leftovers

    checkpoint = tmp_path / "a" / "a.pt"
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen([*sleep, "-m", JOB_MAIN, *job_arguments("train.py", ["x"], checkpoint, code=True)])
    other = subprocess.Popen([*sleep, "--checkpoint", str(checkpoint)])  # the mark, but no job_main's
    try:
        # Each is the process it will be read as (its command line its own) before the agent looks.
        for process in (ours, other):
            deadline = time.monotonic() + 60
            while str(checkpoint).encode() not in Path(f"/proc/{process.pid}/cmdline").read_bytes():
                assert time.monotonic() < deadline, process.args
                time.sleep(0.01)
        (tmp_path / "a.pids").write_text(f"{ours.pid} {other.pid}")
        (tmp_path / "a.checkpoint").write_text(str(checkpoint))
        stop_leftovers(tmp_path)
        assert ours.wait(timeout=10) != 0
        assert other.poll() is None
    finally:
        for process in (ours, other):
            process.kill()
            process.wait()


def test_a_job_file_of_an_id_and_an_entrypoint_with_its_code_folder_is_a_whole_job(tmp_path: Path) -> None:
    from cli.submit import PLACEHOLDER, code_folder, load_job

    (tmp_path / "jobs").mkdir()
    job = tmp_path / "jobs" / "job.yaml"
    job.write_text("id: mine-2\nentrypoint: train.py\nargs: ['--epochs', '2']\ncode: ../src\n")
    assert code_folder(job) == tmp_path / "jobs" / ".." / "src"  # relative to the job file
    assert code_folder(job, "elsewhere") == Path("elsewhere")  # --code wins
    spec = load_job(job, "a" * 64)
    assert (spec.id, spec.code, spec.entrypoint, spec.args, spec.application) == (
        "mine-2",
        "a" * 64,
        "train.py",
        ("--epochs", "2"),
        None,
    )
    job.write_text("id: mine-3\nentrypoint: ../train.py\n")  # refused before anything is packed or sent
    with pytest.raises(ValueError, match="'..'"):
        load_job(job, PLACEHOLDER)
    job.write_text(f"id: mine-4\nentrypoint: train.py\ncode: {'b' * 64}\n")  # an archive stored before
    assert code_folder(job) is None and load_job(job).code == "b" * 64


@pytest.mark.skipif(os.geteuid() != 0, reason="a job's own user needs an agent that runs as root")
@pytest.mark.e2e
def test_a_jobs_code_is_unpacked_in_its_box_by_its_user_never_by_root(tmp_path: Path) -> None:
    from services.node.agent import box_problem
    from tests.test_box import boxed_node

    if box_problem("runc", sys.executable, "tests.jobs")[0]:
        pytest.skip(box_problem("runc", sys.executable, "tests.jobs")[0])
    data = pack(code_folder(tmp_path / "src"))
    archive = stored_name("user", digest(data))
    code = JobCode(tmp_path / "archives", {archive: data}.get)
    node = boxed_node("code-0", tmp_path / "node")
    box = node.boxes.open("own-1", "own-1.1", node.job_folder("own-1"), 777, (0,), True)
    try:
        folder = code.prepare(box.folder, archive, "train.py", tmp_path / "job.code", box)
        assert (folder / "helper.py").read_text() == "GREETING = 'hello from my own code'\n"
        assert {p.stat().st_uid for p in (folder, folder / "train.py", folder / "helper.py")} == {box.uid}
        assert code.prepare(box.folder, archive, "train.py", tmp_path / "job.code", box) == folder
        with pytest.raises(ValueError, match="entrypoint 'nope.py' is not in the job's code"):
            code.prepare(box.folder, archive, "nope.py", tmp_path / "job.code", box)
    finally:
        box.close()


def test_the_kept_archives_are_evicted_past_one_that_vanished_meanwhile(tmp_path: Path, monkeypatch) -> None:
    from services.node import code as job_code

    monkeypatch.setattr(job_code, "CACHED", 1)
    stored = {stored_name("user", digest(bytes([n]))): bytes([n]) for n in range(3)}
    code = JobCode(tmp_path / "archives", stored.get)
    first, second, third = stored
    code.archive(first)
    (tmp_path / "archives" / f"user.{'f' * 64}").symlink_to(tmp_path / "gone")  # as if renamed away while listed
    assert code.archive(second) == stored[second]
    assert code.archive(third) == stored[third]
    assert not (tmp_path / "archives" / first).exists()
    with pytest.raises(ValueError, match="names no archive in the code store"):
        code.archive("../../etc/passwd")
