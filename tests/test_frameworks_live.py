"""docs/jobs.md's Lightning and Hugging Face scripts, as the page shows them, with the one added
callback and their requirements, through `goodput up --executors real --nodes 2`: each is profiled,
runs, is moved to the other node agent by a drain (checkpoint, stop, start there from its
checkpoint, its step count never going back) and finishes."""

from __future__ import annotations

import re
import time

import pytest

from tests.test_local_stack import two_node_stack
from tests.test_own_code import script_folder, status, submit, until
from tests.test_torchrun import logged, page_script

JOBS = {
    "lit-1": ("# train.py: a regression on generated data, trained by PyTorch Lightning", "lightning"),
    "hf-1": ("# train.py: a tiny BERT classifier on generated tokens", "transformers"),
}


def steps(shown: dict) -> int:
    return int((shown.get("progress") or {}).get("steps") or 0)


@pytest.mark.e2e  # it starts `goodput up`: NATS, the services and two node agents
def test_the_pages_lightning_and_trainer_scripts_are_profiled_moved_between_agents_and_finish():
    with two_node_stack("goodput-frameworks-") as (base, up):
        for job, (first_line, package) in JOBS.items():  # the next one once the first has moved
            folder = script_folder(base, job, page_script(first_line))
            job_file = (
                page_script("# lightning.yaml", "yaml").replace("lit-1", job).replace("[lightning]", f"[{package}]")
            )
            submit(up, base, job_file, folder)
            running = until(up, job, lambda s: s["state"] == "running" and steps(s) > 0, "reported its steps")
            node = running["nodes"][0]
            drained = up.command("drain", node, "--server", up.server, role="operator")
            assert drained.returncode == 0, drained.stderr
            moved = until(up, job, lambda s: s["state"] == "running" and node not in s["nodes"], "moved off " + node)
            assert moved["restarts"] >= 1 and steps(moved) >= steps(running), (running, moved)
            assert up.command("drain", node, "--undo", "--server", up.server, role="operator").returncode == 0
        for job in JOBS:
            seen, deadline = 0, time.monotonic() + 420
            while (shown := status(up, job))["state"] != "finished":
                assert shown["state"] in ("queued", "running"), shown
                assert steps(shown) >= seen, (seen, shown)  # resumed from its checkpoint, never back
                seen = steps(shown)
                assert time.monotonic() < deadline, shown
                time.sleep(1.0)
            done = int(re.search(r"done at step (\d+)", logged(up, job, r"done at step \d+")).group(1))
            assert done >= seen, (done, seen)
            environment = up.command("logs", job, "--rank", "env", "--server", up.server).stdout
            assert "built in" in environment, environment  # its requirements, the node's own packages
