"""Each job's Python packages (shared/requirements.py, services/node/environments.py): the lines a
submission may name, and environments built by uv from the package index in real boxes, shared by
the jobs that ask the same, sealed against every job, and a build that fails ending its jobs with
the installer's lines."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import msgspec
import pytest

from services.node.box import Boxes, Rules
from services.node.environments import FOLDER, KEPT, Environments, _copy
from shared.bus.encoding import Refused
from shared.requirements import environment_key, lines, requirement_problem
from shared.schema.jobs import JobSpec
from shared.schema.nodes import CANNOT_RUN, StartWorkers, StopWorkers
from tests.test_box import BOXED, boxed_node, wait_until_ended

CODE = "0" * 64
MISSING = "goodput-no-such-package-anywhere==0.0.1"


def test_a_job_names_packages_as_pip_reads_them_and_no_option():
    assert requirement_problem("six==1.17.0") is None
    assert requirement_problem('lightning>=2.4; python_version >= "3.11"') is None
    assert requirement_problem("transformers[torch]") is None
    assert requirement_problem("pkg @ https://example.com/pkg-1.0-py3-none-any.whl") is None
    for line, said in [
        ("--index-url https://evil.example/simple", "pip options are not taken"),
        ("-r other.txt", "pip options are not taken"),
        ("six ==", "is not one pip reads"),
        ("pkg @ file:///etc/passwd", "http(s) address"),
        ("pkg @ File:///etc/passwd", "http(s) address"),
        ("pkg @ /opt/wheels/pkg-1.0-py3-none-any.whl", "http(s) address"),
        ("pkg @ git+file:///srv/repo", "http(s) address"),
        ("pkg @ https://host/pkg.whl?x=${UV_INDEX_URL}", "no $"),
        (" six", "no spaces around it"),
    ]:
        assert said in requirement_problem(line), line
    text = "# the model's\nsix==1.17.0  # pinned\n\n  tomli-w\n"
    assert lines(text) == ["six==1.17.0", "tomli-w"]


def test_a_submission_with_requirements_is_checked_as_it_comes():
    spec = msgspec.convert({"id": "a", "code": CODE, "entrypoint": "t.py", "requirements": ["six"]}, JobSpec)
    assert spec.own_code == (CODE, "t.py", (), ("six",))
    with pytest.raises(msgspec.ValidationError, match="pip options"):
        msgspec.convert({"id": "a", "code": CODE, "entrypoint": "t.py", "requirements": ["-e ."]}, JobSpec)
    with pytest.raises(msgspec.ValidationError, match="carries its code"):
        msgspec.convert({"id": "a", "application": "cifar10", "requirements": ["six"]}, JobSpec)


def test_an_environments_name_is_what_was_asked_over_what_the_node_has():
    key = environment_key(("six",), "node-1")
    assert key == environment_key(["six"], "node-1")
    assert len({key, environment_key(("six==1.17.0",), "node-1"), environment_key(("six",), "node-2")}) == 3


def start(node, job_id: str, requirements: tuple[str, ...], user: int, checkpoints: Path):
    order = StartWorkers(
        job_id,
        "packages",
        1,
        (0,),
        1,
        1,
        "cpu",
        str(checkpoints / job_id / f"{job_id}.pt"),
        requirements=requirements,
        user=user,
    )
    return node.start(order)


@pytest.mark.e2e
@BOXED
def test_jobs_asking_the_same_packages_share_one_sealed_environment_built_once(tmp_path):
    """Two jobs of two users ask for `six` (the node has it not): the first's start builds the
    environment in a box of its own, the second's finds it; each imports six from it and the node's
    torch; neither can change it."""
    node = boxed_node("env-0", tmp_path / "node", rules=Rules(cpus=1.0, memory_mb=2048, processes=512))
    kept: list[str] = []
    node.output = None
    node._keeper = lambda job, rank, stream, team: kept.append  # what the installer said, per job
    logs = {}
    for job_id, user in (("first", 1), ("second", 2)):
        start(node, job_id, ("six",), user, tmp_path / "checkpoints")
        try:
            wait_until_ended(node, job_id)
        finally:
            report = node.stop(StopWorkers(job_id))
        logs[job_id] = node.log_path(job_id, 0).read_text()
        assert report.codes == (0,), logs[job_id]
    assert sum("built in" in line for line in kept) == 1, kept  # built for the first only
    assert any("+ six==" in line for line in kept), kept
    for log in logs.values():
        told = json.loads(next(line for line in log.splitlines() if line.startswith("{")))
        assert told["prefix"] == "/env" and told["virtual_env"] == "/env"
        assert told["six"].startswith("/env/lib/")
        assert not told["torch"].startswith("/env/")  # the node's, not fetched again
        assert told["plant a module"].startswith("denied") and told["change a module"].startswith("denied"), told
    built = [path for path in (node.workdir / "environments").iterdir() if not path.name.startswith(".")]
    assert len(built) == 1 and built[0].stat().st_uid == 0
    assert node.environments.preparing() == {}


@pytest.mark.e2e
@BOXED
def test_requirements_that_cannot_be_installed_refuse_the_job_with_the_installers_lines_and_at_once_after(tmp_path):
    node = boxed_node("env-1", tmp_path / "node", rules=Rules(cpus=1.0, memory_mb=2048, processes=512))
    kept: list[str] = []
    node._keeper = lambda job, rank, stream, team: kept.append
    with pytest.raises(Refused) as first:
        start(node, "broken-1", (MISSING,), 1, tmp_path / "checkpoints")
    assert first.value.code == CANNOT_RUN
    reason = str(first.value)
    assert "could not be installed on node env-1" in reason and "goodput-no-such-package-anywhere" in reason, reason
    with pytest.raises(Refused) as second:  # the same asked again: the same lines, without a build
        start(node, "broken-2", (MISSING,), 2, tmp_path / "checkpoints")
    assert str(second.value) == reason
    assert sum("failed in" in line for line in kept) == 1, kept  # one build, for the first
    assert node.poll().jobs == ()  # nothing of either runs


def test_a_node_keeps_the_environments_used_last_and_every_one_a_job_runs_in(tmp_path):
    boxes = Boxes(tmp_path, Rules(cpus=1.0, memory_mb=512), runtime=None)
    running = tmp_path / FOLDER / "env-00"  # the oldest, but a job runs in it
    environments = Environments(boxes, "n", uv="uv", in_use=lambda: {running})
    for number in range(KEPT + 4):
        built = tmp_path / FOLDER / f"env-{number:02d}"
        built.mkdir(parents=True)
        os.utime(built, (1000 + number, 1000 + number))
    (tmp_path / FOLDER / ".env-99.building").mkdir()  # one being built
    environments._evict(keep=tmp_path / FOLDER / "env-01")  # the one just asked for
    left = sorted(path.name for path in (tmp_path / FOLDER).iterdir())
    newest = [f"env-{number:02d}" for number in range(KEPT + 4 - (KEPT - 1), KEPT + 4)]
    assert left == sorted([".env-99.building", "env-00", "env-01", *newest]), left


def test_what_a_builder_made_is_copied_not_taken_so_nothing_it_holds_or_links_reaches_the_environment(tmp_path):
    """The environment is a copy of ours: a handle the builder kept writes to its own file, not the
    copy; a link is a link (its target untouched); no FIFO, no setuid bit."""
    made, secret = tmp_path / "made", tmp_path / "secret"
    (made / "lib").mkdir(parents=True)
    secret.write_text("the host's")
    secret.chmod(0o600)
    (made / "lib" / "module.py").write_text("print('built')")
    (made / "lib" / "tool").write_text("#!/bin/sh")
    (made / "lib" / "tool").chmod(0o4755)  # setuid
    (made / "lib" / "shadow").symlink_to(secret)
    os.mkfifo(made / "lib" / "pipe")
    held = open(made / "lib" / "module.py", "a")  # noqa: SIM115 - the builder's, kept past the build
    try:
        assert _copy(made, tmp_path / "env", 1 << 30) is None
        held.write("print('planted after')")
        held.flush()
    finally:
        held.close()
    env = tmp_path / "env"
    assert (env / "lib" / "module.py").read_text() == "print('built')"
    assert stat.S_IMODE((env / "lib" / "tool").stat().st_mode) == 0o755
    assert (env / "lib" / "shadow").is_symlink() and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not (env / "lib" / "pipe").exists()
    assert stat.S_IMODE(env.stat().st_mode) == 0o755 and stat.S_IMODE((env / "lib").stat().st_mode) == 0o755
    assert _copy(made, tmp_path / "small", 4) is not None  # past its size: refused
