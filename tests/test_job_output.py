"""A job's output end to end: NATS, the six services and a node agent on this machine; a user's job
prints a line on its stdout and one on its stderr, and the user reads both (goodput.api.logs from
a plain nats-py client, then `goodput logs`), while another login is told there is no such job."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from launcher.nats import reload, taken
from launcher.stack import records_once_ended
from shared import credentials, subjects
from tests.test_local_stack import _live_stack
from tests.test_multinode import until

pytestmark = pytest.mark.e2e  # it starts NATS, the services and a node agent as processes
ROOT = Path(__file__).resolve().parents[1]


async def _logs(nc, body: dict) -> tuple[dict, dict]:
    reply = await nc.request(subjects.API_LOGS, json.dumps(body).encode(), timeout=30)
    return json.loads(reply.data), dict(reply.headers or {})


async def _read_by_its_submitter_only(folder):
    async with _live_stack(folder, jobs_package="tests.jobs") as (bus, _, server):
        bob_file = server.access.add_login("bob", server.url)
        reload(folder, server.access)
        bob_env = credentials.user_environment({credentials.LOGIN_ENV: str(bob_file)})
        bob = await taken(server.url, credentials.connect_options(environ=bob_env))
        user = await nats.connect(server.url, **server.options("user"))
        try:
            reply = await user.request(
                subjects.API_SUBMIT, json.dumps({"id": "says-1", "application": "says"}).encode(), timeout=30
            )
            assert json.loads(reply.data)["accepted"] is True, reply.data

            async def printed():
                page, _ = await _logs(user, {"id": "says-1"})
                texts = {(line["rank"], line["stream"], line["text"]) for line in page["lines"]}
                wanted = {(0, "stdout", "hello from says"), (0, "stderr", "a warning from says")}
                return page if wanted <= texts else None

            page = await until(printed, "the job's lines to be readable by its submitter", timeout_s=240)
            profiled = await _logs(user, {"id": "says-1", "rank": "profile"})
            denied = [await _logs(bob, {"id": job_id}) for job_id in ("says-1", "nosuch")]
            await records_once_ended(bus, ["says-1"], timeout_s=300)
            # The whole of it through the command, as the user runs it once the job has ended.
            env = {k: v for k, v in os.environ.items() if not k.startswith(credentials.ENV_PREFIX)}
            env["PYTHONPATH"] = str(ROOT)  # run from the test's folder: no data folder of another stack there
            command = [sys.executable, "-m", "cli.main", "logs", "says-1", "--server", server.url]
            user_options = ["--nats-user", "user", "--nats-password-file", str(server.access.password_file("user"))]
            run = {"capture_output": True, "text": True, "timeout": 60, "cwd": folder}
            shown = subprocess.run([*command, *user_options], env=env, **run)
            refused = subprocess.run(command, env={**env, credentials.LOGIN_ENV: str(bob_file)}, **run)
            silent = subprocess.run([*command, "--rank", "999", *user_options], env=env, **run)  # no such rank
            final, _ = await _logs(user, {"id": "says-1", "after": page["next"]})
            return page, profiled, denied, shown, refused, silent, final
        finally:
            await user.close()
            await bob.close()


def test_a_jobs_output_is_read_by_its_submitter_only(tmp_path):
    page, (profiled, _), denied, shown, refused, silent, final = asyncio.run(_read_by_its_submitter_only(tmp_path))
    assert page["next"] > 0 and isinstance(page["lines"][0]["time"], float), page
    # Its profiling run printed the same lines first, kept apart.
    assert {line["text"] for line in profiled["lines"]} >= {"hello from says", "a warning from says"}, profiled
    assert {line["rank"] for line in profiled["lines"]} == {"profile"}
    for answer, headers in denied:  # another login learns nothing of the job, not even that it exists
        assert headers.get("Nats-Service-Error-Code") == "404" and "of yours" in answer["error"], (answer, headers)
    assert final["end"] is True and final["more"] is False, final
    assert shown.returncode == 0, shown.stderr
    assert "[0] hello from says" in shown.stdout and "[0] a warning from says" in shown.stdout, shown.stdout
    assert "[profile] hello from says" in shown.stdout
    assert refused.returncode == 2 and "no job 'says-1' of yours" in refused.stderr, refused.stderr
    # Nothing to show is said, not left to look like a hang.
    assert silent.returncode == 0 and silent.stdout == "", silent
    assert "no output of job says-1 (rank 999) is stored, and it has ended" in silent.stderr, silent.stderr
