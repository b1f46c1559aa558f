"""A user's own training script through `goodput up --executors real --nodes 2 --workload none`, as
docs/jobs.md tells it: the page's script (exit 0 at its target, no outcome line, no checkpoint
argument) in a folder of the test's, submitted with `goodput submit job.yaml --code DIR`, is
profiled, runs, is moved off a drained node and resumes from its checkpoint (its step count never
goes back), finishes, and shows its metric and what it printed; a second one, a variant written
while the stack serves, too. A rigid job that no longer fits after the drain reads `unschedulable`,
an archive with a `../` path is refused with the reason, and a job that reads the stack's secrets
cannot."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path

import pytest
from nats.micro.request import ServiceError

from cli.submit import upload
from services.node.agent import box_problem
from shared import credentials
from tests.test_code_jobs import escaping_archive
from tests.test_job_contract import page_script
from tests.test_local_stack import Up, two_node_stack

pytestmark = pytest.mark.e2e  # it starts `goodput up`: NATS, the services and two node agents

ROOT = Path(__file__).resolve().parents[1]
# Prepended to the page's script (the profiler runs a job only when it trains through the library).
SECRETS_PROBE = """import os, sys  # what a job must not read: the stack's secrets and logins, the agent's environment
data = sys.argv[1]
targets = [os.path.join(data, name) for name in ("user.env", "nats.conf")]
targets += [os.path.join(data, "secrets", name) for name in sorted(os.listdir(data + "/secrets"))] if os.access(data + "/secrets", os.R_OK) else [data + "/secrets/"]
targets.append(f"/proc/{os.getppid()}/environ")
for target in targets:
    try:
        with open(target, "rb") as file:
            print(f"probe READ {target} {len(file.read())} bytes", flush=True)
    except OSError as error:
        print(f"probe DENIED {target}: {type(error).__name__}", flush=True)
"""


def status(up: Up, job: str) -> dict:
    shown = up.command("status", job, "--json", "--server", up.server)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def until(up: Up, job: str, done, what: str, timeout_s: float = 420.0) -> dict:
    """The job's status once `done(status)`; fails with the last one after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        shown = status(up, job)
        if done(shown):
            return shown
        assert shown["state"] not in ("failed", "rejected", "cancelled") or done(shown), shown
        assert time.monotonic() < deadline, f"{job}: {what}: not after {timeout_s:.0f} s: {shown}"
        time.sleep(1.0)


def submit(up: Up, folder: Path, job_file: str, code: Path | None = None) -> None:
    path = folder / f"{time.monotonic_ns()}.yaml"
    path.write_text(job_file)
    submitted = up.command("submit", str(path), *(("--code", str(code)) if code else ()), "--server", up.server)
    assert submitted.returncode == 0, submitted.stderr


def script_folder(root: Path, name: str, text: str) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "train.py").write_text(text)
    return folder


def test_a_script_written_from_the_docs_is_submitted_with_its_code_moved_resumed_and_finished():
    with two_node_stack("goodput-own-code-") as (base, up):
        script = page_script()
        first = script_folder(base, "regression", script)
        # Written while the stack serves: a variant of the page's, with a target of its own.
        second = script_folder(base, "shorter", script.replace("target_epochs=60", "target_epochs=20"))
        submit(up, base, "id: own-1\nentrypoint: train.py\n", first)
        submit(up, base, "id: own-2\nentrypoint: train.py\n", second)

        running = until(up, "own-1", lambda s: s["state"] == "running" and s["nodes"], "running")
        node = running["nodes"][0]
        drained = up.command("drain", node, "--server", up.server, role="operator")
        assert drained.returncode == 0, drained.stderr
        until(
            up,
            "own-1",
            lambda s: s["restarts"] >= 1 and (s["state"] != "running" or node not in s["nodes"]),
            f"moved off {node}",
        )

        # With a node drained, a rigid job of every slot of both nodes cannot run: it says so.
        submit(up, base, "id: wide-1\napplication: mlp_blobs\nrigid: true\nrequested_gpus: 4\n")
        wide = until(up, "wide-1", lambda s: s["state"] == "unschedulable", "unschedulable")
        assert "drain" in wide["reason"], wide
        assert up.command("cancel", "wide-1", "--server", up.server).returncode == 0
        undone = up.command("drain", node, "--undo", "--server", up.server, role="operator")
        assert undone.returncode == 0, undone.stderr

        for job in ("own-1", "own-2"):
            ended = until(up, job, lambda s: s["state"] in ("finished", "failed"), "ended", timeout_s=600)
            assert ended["state"] == "finished", ended
            assert isinstance(ended["metrics"].get("test_mse"), float), ended
        shown = up.command("status", "own-1", "--server", up.server)
        assert "test_mse" in shown.stdout, shown.stdout

        logs = up.command("logs", "own-1", "--server", up.server)
        assert logs.returncode == 0, logs.stderr
        assert re.search(r"done: \d+ steps, test MSE", logs.stdout), logs.stdout[-3000:]
        starts = [int(step) for step in re.findall(r"starting at step (\d+) with batch", logs.stdout)]
        assert len(starts) >= 2 and starts == sorted(starts) and starts[-1] > 0, starts  # resumed, never back

        # An archive that reaches out of its folder is refused at upload, with the reason.
        options = credentials.connect_options(environ=credentials.user_environment({}, data=up.folder))
        with pytest.raises(ServiceError, match=r"\.\."):
            asyncio.run(upload(escaping_archive(), up.server, **options))

        # A job's own code cannot read the stack's secrets: it runs in a box of its own (the agents
        # refuse to start where there can be none, unless told --box off).
        if not box_problem("runc", sys.executable, "tests.jobs")[0]:
            probe = base / "probe"
            probe.mkdir()
            (probe / "probe.py").write_text(SECRETS_PROBE + script.replace("target_epochs=60", "target_epochs=5"))
            submit(up, base, f"id: probe-1\nentrypoint: probe.py\nargs: [{json.dumps(str(up.folder))}]\n", probe)
            until(up, "probe-1", lambda s: s["state"] == "finished", "finished")
            printed = up.command("logs", "probe-1", "--server", up.server).stdout
            assert "probe DENIED" in printed and "probe READ" not in printed, printed
