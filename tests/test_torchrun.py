"""docs/jobs.md's torchrun scripts, as the page shows them, through `goodput up --executors real
--nodes 2`: the plain DDP script (it knows nothing of goodput) is not profiled, runs rigidly on its 4
slots across both nodes with torchrun's environment in every rank and finishes when its ranks exit
0; the one that needs a package gets it from its requirements, and packages no index has fail
their jobs with the installer's lines; the elastic one starts on the slots a drain leaves, grows when the node comes back, resumes from
its checkpoint folder and reports its speed. And the pure parts: the job file, the declared profile,
the range the policy holds it to, the reports and what the estimator makes of them."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from goodput_train.goodput import Observation, iteration_time
from goodput_train.protocol import STATS_PREFIX, JobStats
from goodput_train.reporting import Reporter
from policies.base import RoundState, job_view, make_policy
from services.estimator.core import Estimator
from services.executor.progress import job_progress
from services.profiler.measure import declared_profile, declared_run, measured_profile
from shared.cluster import Cluster
from shared.schema.base import Node
from shared.schema.jobs import Elastic, JobSpec
from shared.schema.rounds import JobFacts
from tests.test_local_stack import Up, two_node_stack
from tests.test_own_code import script_folder, submit, until

CODE = "0" * 64  # an archive digest: the pure parts never read it
ROOT = Path(__file__).resolve().parents[1]


def page_script(first_line: str, language: str = "python") -> str:
    """The block of docs/jobs.md in `language` that begins with `first_line`, as the page shows it."""
    blocks = re.findall(rf"```{language}\n(.*?)```", (ROOT / "docs" / "jobs.md").read_text(), re.S)
    return next(block for block in blocks if block.startswith(first_line))


def test_a_torchrun_job_is_rigid_and_needs_its_code():
    job = msgspec.json.decode(
        f'{{"id": "d", "code": "{CODE}", "entrypoint": "train.py", "launcher": "torchrun", "requested_gpus": 4}}',
        type=JobSpec,
    )
    assert job.fixed_gpus and not job.rigid  # rigid by its launcher, without saying so
    assert not JobSpec("a", "cifar10").fixed_gpus
    with pytest.raises(msgspec.ValidationError, match="carries its code"):
        msgspec.json.decode(b'{"id": "d", "application": "cifar10", "launcher": "torchrun"}', type=JobSpec)
    with pytest.raises(msgspec.ValidationError, match="launcher"):
        msgspec.json.decode(b'{"id": "d", "application": "cifar10", "launcher": "mpirun"}', type=JobSpec)


def test_an_unprofiled_job_runs_as_declared_at_least_a_sample_a_gpu():
    run = declared_run(JobSpec("d", code=CODE, entrypoint="train.py", launcher="torchrun", requested_gpus=4))
    assert run.init_batch == run.max_batch == 4  # no batch asked: one sample a GPU
    assert [p.step_time / p.local_bsz for p in run.points] == [1.0, 1.0]  # flat: K GPUs are worth K times one
    asked = declared_run(JobSpec("d", code=CODE, entrypoint="train.py", launcher="torchrun", requested_batch=256))
    assert asked.init_batch == asked.max_batch == 256


def test_an_elastic_torchrun_job_keeps_its_batch_within_its_range():
    elastic = JobSpec("e", code=CODE, entrypoint="train.py", launcher="torchrun", elastic=Elastic(2, 4))
    assert not elastic.fixed_gpus and elastic.fixed_batch and elastic.gpu_range == (2, 4)
    assert JobSpec("r", code=CODE, entrypoint="t.py", launcher="torchrun", requested_gpus=3).gpu_range == (3, 3)
    assert JobSpec("a", "cifar10", min_gpus=2).gpu_range == (2, None)
    for body, reason in (
        (
            f'"code": "{CODE}", "entrypoint": "t.py", "launcher": "torchrun", "elastic": {{"min_gpus": 4, "max_gpus": 2}}',
            "more than",
        ),
        ('"application": "cifar10", "elastic": {"min_gpus": 1, "max_gpus": 2}', "torchrun job"),
        (
            f'"code": "{CODE}", "entrypoint": "t.py", "launcher": "torchrun", "rigid": true, "elastic": {{"min_gpus": 1, "max_gpus": 2}}',
            "not both",
        ),
    ):
        with pytest.raises(msgspec.ValidationError, match=reason):
            msgspec.json.decode(f'{{"id": "e", {body}}}'.encode(), type=JobSpec)


@pytest.mark.parametrize("policy", ["goodput", "sia"])
def test_the_policy_sizes_an_elastic_job_within_its_range_and_at_its_batch(policy):
    """On 16 free GPUs, an elastic job of 2 to 4 that once ran on 4 (Sia's rule alone would allow 8)
    and whose declared profile makes more GPUs always worth more is given at most 4, at its batch."""
    cluster = Cluster("t", (Node("a", "cpu", 8), Node("b", "cpu", 8)))
    spec = JobSpec("e", code=CODE, entrypoint="t.py", launcher="torchrun", elastic=Elastic(2, 4), requested_batch=64)
    run = declared_run(spec)
    estimator = Estimator()
    estimator.add("e", {"cpu": measured_profile("e", "t.py", "cpu", run)})
    facts = JobFacts(
        "e",
        "t.py",
        0.0,
        600.0,
        1,
        64,
        False,
        run.init_batch,
        run.max_batch,
        min_gpus=2,
        max_gpus=4,
        fixed_batch=True,
        max_gpus_seen=4,
    )
    models = estimator.models([facts])[0]
    assert models.fixed_batch == 64 and models.gpu_limit == 4
    decision = make_policy(policy).allocate(RoundState(600.0, cluster, (job_view(facts, models, cluster, 30.0),)))
    gpus = decision.allocations["e"].gpus
    assert 2 <= gpus <= 4, decision.allocations


def test_a_report_tells_the_median_step_at_its_size_from_rank_0_every_period():
    clock = iter([0.0, 0.5, 1.0, 1.2, 2.0, 2.5, 3.0]).__next__  # step times 0.5, 0.5, 0.2, 0.8, 0.5, 0.5
    environ = {
        "RANK": "0",
        "WORLD_SIZE": "4",
        "GROUP_WORLD_SIZE": "2",
        "GOODPUT_JOB_ID": "j",
        "GOODPUT_GPU_TYPE": "cpu",
    }
    reporter = Reporter(environ | {"GOODPUT_REPORT_S": "2"}, clock)
    printed = [reporter.step(64) for _ in range(7)]
    assert printed[0] is None  # the first step's time is the start's
    first, later = printed[1], [p for p in printed[2:] if p is not None]
    assert first.observations == (Observation(2, 4, 16, 0, 0.5),) and first.steps == 2 and first.m == 16
    assert [p.steps for p in later] == [6] and later[0].observations[0].t_iter == 0.5  # median, 2 s later
    shown = job_progress(first, None, (("n1", (0, 1)), ("n2", (2, 3))))  # as `goodput status` shows it
    assert shown.throughput == pytest.approx(64 / 0.5)
    other = Reporter({**environ, "RANK": "1"}, iter([0.0, 1.0]).__next__)
    assert [other.step(64), other.step(64)] == [None, None]  # rank 0's alone
    with pytest.raises(ValueError):
        reporter.step(0)


def test_what_a_job_reports_replaces_what_it_declared_on_every_type():
    run = declared_run(JobSpec("d", code=CODE, entrypoint="t.py", launcher="torchrun", requested_batch=64))
    profiles = {t: declared_profile("d", "t.py", t, run) for t in ("a", "b")}
    estimator = Estimator()
    estimator.add("d", profiles)
    facts = JobFacts("d", "t.py", 0.0, 60.0, 1, 64, True, 64, 64)
    declared = estimator.models([facts])[0].params["a"]
    assert float(iteration_time(declared, 1, 1, 64, 0)) == pytest.approx(64.0, rel=0.05)  # a sample a second
    estimator.observe("d", "a", Observation(1, 1, 64, 0, 0.25))  # it reports 256 samples a second on a
    reported = estimator.models([facts])[0].params
    assert float(iteration_time(reported["a"], 1, 1, 64, 0)) == pytest.approx(0.25, rel=0.05)
    assert reported["b"] == reported["a"]  # b, not reported from yet, is taken as fast as a


def test_report_prints_a_stats_line_the_executor_reads(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import goodput_train, time\nfor _ in range(4):\n    goodput_train.report(samples=8)\n    time.sleep(0.05)\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "RANK": "0",
        "WORLD_SIZE": "2",
        "GOODPUT_JOB_ID": "j",
        "GOODPUT_GPU_TYPE": "cpu",
        "GOODPUT_REPORT_S": "0",
    }
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith(STATS_PREFIX)]
    stats = msgspec.msgpack.decode(base64.b64decode(lines[-1][len(STATS_PREFIX) :]), type=JobStats)
    assert stats.job_id == "j" and stats.steps == 4 and stats.observations[0][:4] == (1, 2, 4, 0)
    assert 0.04 < stats.observations[0].t_iter < 1.0


def logged(up: Up, job: str, pattern: str, timeout_s: float = 300.0) -> str:
    """What `goodput logs` shows of the job once a line matches `pattern`."""
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, printed := up.command("logs", job, "--server", up.server).stdout):
        assert time.monotonic() < deadline, (
            f"{job}: no line like {pattern!r} after {timeout_s:.0f} s: {printed[-2000:]}"
        )
        time.sleep(1.0)
    return printed


@pytest.mark.e2e  # it starts `goodput up`: NATS, the services and two node agents
def test_the_pages_ddp_scripts_run_rigid_across_two_nodes_and_elastic_resized_from_their_checkpoints():
    with two_node_stack("goodput-torchrun-") as (base, up):
        # Rigid: on its 4 slots, both nodes', each rank given its place as torchrun gives it.
        folder = script_folder(base, "ddp", page_script("# train.py: a plain DDP script"))
        submit(up, base, "id: ddp-1\nentrypoint: train.py\nlauncher: torchrun\nrequested_gpus: 4\n", folder)
        ended = until(up, "ddp-1", lambda s: s["state"] in ("finished", "failed"), "ended", timeout_s=300)
        assert ended["state"] == "finished" and ended["restarts"] == 0, ended
        printed = logged(up, "ddp-1", r"(?s)(rank \d of 4.*){4}")  # its ranks' lines are stored as they come
        places = set(re.findall(r"rank (\d) of 4, local rank (\d) on node (\d) of 2: loss", printed))
        # Ranks 0-1 on the first node, 2-3 on the second: each its local rank and its node's group
        # (each run's: gloo on torch 2.13 may abort a rank as its group is destroyed, and it runs again).
        assert places == {("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")}, printed[-3000:]

        # Its packages: the page's script and job file, its requirements.txt as the page says; then
        # packages no index has, asked twice: the first build's lines end both, the second at once.
        folder = script_folder(base, "packages", page_script("# train.py: a DDP script that needs a package"))
        (folder / "requirements.txt").write_text("einops>=0.8\n")
        submit(up, base, page_script("# packages.yaml", "yaml"), folder)
        broken = "entrypoint: train.py\nlauncher: torchrun\nrequested_gpus: 1\nrequirements: [goodput-no-such-package==0.0.1]\n"
        submit(up, base, "id: broken-1\n" + broken, folder)
        ended = until(up, "ddp-3", lambda s: s["state"] in ("finished", "failed"), "ended", timeout_s=300)
        assert ended["state"] == "finished", ended
        assert len(re.findall(r"einops from its environment", logged(up, "ddp-3", r"(?s)(einops from.*){2}"))) == 2
        installed = up.command("logs", "ddp-3", "--rank", "env", "--server", up.server).stdout
        assert "+ einops==" in installed and "built in" in installed, installed
        failed = until(up, "broken-1", lambda s: s["state"] == "failed", "failed", timeout_s=300)
        assert "could not be installed" in failed["reason"] and "goodput-no-such-package" in failed["reason"], failed
        submit(up, base, "id: broken-2\n" + broken, folder)
        again = until(up, "broken-2", lambda s: s["state"] == "failed", "failed", timeout_s=300)
        assert again["reason"] == failed["reason"], again
        assert "failed in" not in up.command("logs", "broken-2", "--rank", "env", "--server", up.server).stdout

        # Elastic: with one node drained it starts on the other's 2 slots; once it has saved there, the
        # node is given back and it grows to 4, resuming from its checkpoint folder; it reports its speed.
        nodes = up.command("nodes", "--json", "--server", up.server, role="operator")
        node = json.loads(nodes.stdout)["nodes"][0]["name"]
        assert up.command("drain", node, "--server", up.server, role="operator").returncode == 0
        folder = script_folder(base, "elastic", page_script("# train.py: a DDP script that resumes"))
        job = "id: el-1\nentrypoint: train.py\nlauncher: torchrun\nrequested_batch: 32\nelastic: {min_gpus: 1, max_gpus: 4}\n"
        submit(up, base, job, folder)
        logged(up, "el-1", r"saved step \d+ on 2 ranks")
        assert up.command("drain", node, "--undo", "--server", up.server, role="operator").returncode == 0
        grown = until(up, "el-1", lambda s: s["state"] == "running" and len(s["nodes"]) == 2, "grown to both nodes")
        assert grown["restarts"] >= 1, grown
        until(up, "el-1", lambda s: (s.get("progress") or {}).get("throughput"), "its reported speed")
        ended = until(up, "el-1", lambda s: s["state"] in ("finished", "failed"), "ended", timeout_s=420)
        assert ended["state"] == "finished", ended
        printed = logged(up, "el-1", r"done at step")
        starts = [(int(step), int(world)) for step, world in re.findall(r"start at step (\d+) on (\d) ranks", printed)]
        steps = [step for step, _ in starts]
        # It starts at step 0 on the free node (its first round may give it one slot of two), grows when it can.
        assert starts[0][0] == 0 and starts[0][1] <= 2 and 4 in {world for _, world in starts}, starts
        assert steps == sorted(steps) and steps[-1] > 0, starts  # resumed each time, never back
        assert "done at step 12000" in printed, printed[-2000:]
