"""The training library on real PyTorch training: adapts its batch, trains data-parallel over gloo,
stops on SIGTERM with a checkpoint and resumes at another world size."""

import base64
import json
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from goodput_train.protocol import GPU_TYPE_ENV, OUTCOME_PREFIX, REPORT_ENV, STATS_PREFIX, JobStats
from goodput_train.trainer import AdaptiveTraining
from launcher.nats import free_loopback_port

JOB = [sys.executable, "-m", "examples.jobs.mlp_blobs"]
EXAMPLES = {"cnn_shapes": 0.95, "tiny_lm": 0.75}  # each example job's metric target
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # a CPU slot is one core


def outcome(stdout: str) -> dict:
    """A job's last line: its outcome, for the executor."""
    last = stdout.strip().splitlines()[-1]
    assert last.startswith(OUTCOME_PREFIX), last
    return json.loads(last[len(OUTCOME_PREFIX) :])


def report(line: str) -> JobStats:
    """A stats line (rank 0's, every GOODPUT_REPORT_S) as the executor reads it."""
    return msgspec.msgpack.decode(base64.b64decode(line.strip()[len(STATS_PREFIX) :]), type=JobStats)


def run_job(*args, env=None, timeout=300) -> dict:
    done = subprocess.run([*JOB, *args], env=env or ONE_THREAD, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return outcome(done.stdout)


def two_replicas(argv: list[str], **env: str) -> list[subprocess.Popen]:
    """Ranks 0 and 1 of `argv` on this machine, rendezvousing on a free loopback port."""
    port = free_loopback_port()
    return [
        subprocess.Popen(
            argv,
            env={
                **ONE_THREAD,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **env,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]


@pytest.mark.e2e
def test_a_job_alone_adapts_its_batch_and_reaches_its_accuracy():
    result = run_job("--epochs", "6")
    assert result["metric"] >= 0.95
    assert min(result["batches"]) == 32 and max(result["batches"]) > 32  # re-tuned beyond M0
    assert result["noise"] is not None and result["epochs"] >= 6


@pytest.mark.e2e
@pytest.mark.parametrize("job", sorted(EXAMPLES))
def test_the_other_example_jobs_reach_their_targets(job):
    done = subprocess.run(
        [sys.executable, "-m", f"examples.jobs.{job}"], env=ONE_THREAD, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = outcome(done.stdout)
    assert result["metric"] >= EXAMPLES[job] and result["skipped"] == 0
    assert max(result["batches"]) > min(result["batches"])  # it re-tuned its batch


@pytest.mark.e2e
def test_two_replicas_stop_on_sigterm_and_the_job_resumes_on_one(tmp_path):
    checkpoint = tmp_path / "job.pt"
    workers = two_replicas([*JOB, "--epochs", "1000", "--checkpoint", str(checkpoint)], **{REPORT_ENV: "0.1"})
    # Both training: rank 0 reports steps taken, which needs rank 1 in every all-reduce.
    first = []
    while not first:
        line = workers[0].stdout.readline()
        assert line, f"rank 0 ended before training: {workers[0].communicate()[1][-3000:]}"
        if line.startswith(STATS_PREFIX) and report(line).steps > 0:
            first.append(line)
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    outputs = [worker.communicate(timeout=120) for worker in workers]
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0, err[-3000:]
    stopped = [outcome(out) for out, _ in outputs]
    assert stopped[0]["steps"] >= report(first[0]).steps
    assert all(s["stopped"] for s in stopped) and stopped[0]["steps"] == stopped[1]["steps"] > 0
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["placement"] == [2, 1] and saved["steps"] == stopped[0]["steps"]
    resumed = run_job("--epochs", str(stopped[0]["epochs"] + 4), "--checkpoint", str(checkpoint))
    assert resumed["world"] == 1 and resumed["steps"] > stopped[0]["steps"]  # went on from the checkpoint
    assert resumed["metric"] >= 0.95


def tiny_training(optimizer_type=torch.optim.SGD, **options):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(256, 4), torch.randint(2, (256,)))
    return AdaptiveTraining(model, optimizer_type(model.parameters(), lr=0.1), data, init_batch=16, **options)


def one_step(training, loss_of=lambda out, y: nn.functional.cross_entropy(out, y)):
    for x, y in training.micro_batches():
        training.backward(loss_of(training.model(x), y))
    training.step()


def test_a_job_resumed_on_another_gpu_type_times_its_steps_afresh(tmp_path, monkeypatch):
    monkeypatch.setenv(GPU_TYPE_ENV, "slow")
    path = tmp_path / "job.pt"
    training = tiny_training(checkpoint_path=path)
    for _ in range(3):
        one_step(training)
    training.save()
    assert training.observations()
    again = tiny_training(checkpoint_path=path)
    assert again.steps == 3 and again.observations() == training.observations()  # the same type: kept
    monkeypatch.setenv(GPU_TYPE_ENV, "fast")
    moved = tiny_training(checkpoint_path=path)
    assert moved.steps == 3 and moved.observations() == []  # the other type's times are not this one's


def test_a_non_finite_step_is_skipped_and_never_learned_from():
    training = tiny_training()
    one_step(training)
    weights = training.model.weight.detach().clone()
    stats = training.noise.stats()
    one_step(training, lambda out, y: out.sum() * float("nan"))
    assert training.skipped == 1 and training.steps == 1
    assert torch.equal(training.model.weight, weights)
    assert training.noise.stats() == stats


@pytest.mark.parametrize("optimizer_type, rule", [(torch.optim.SGD, "adascale"), (torch.optim.Adam, "sqrt")])
def test_the_default_rule_follows_the_optimizer_and_noise_is_measured(optimizer_type, rule):
    training = tiny_training(optimizer_type, max_batch=64, max_local=8)  # m = 8, s = 1: accumulation
    assert training.lr.rule == rule and (training.m, training.s) == (8, 1)
    for _ in range(10):
        one_step(training)
    sqr, var = training.noise.stats()
    assert var > 0 and training.steps == 10


def test_stats_are_reported_as_the_bus_carries_them(monkeypatch):
    monkeypatch.setenv("GOODPUT_JOB_ID", "tiny-1")
    reports = []
    training = tiny_training(report=reports.append, report_every_s=0.0)
    for _ in range(6):
        one_step(training)
    assert len(reports) == 6 and [r.steps for r in reports] == list(range(1, 7))
    last = msgspec.msgpack.decode(msgspec.msgpack.encode(reports[-1]), type=JobStats)
    assert last.job_id == "tiny-1" and last.epochs == pytest.approx(training.epochs) and last.epochs > 0
    assert last.observations and last.observations[0].m == training.m and last.observations[0].t_iter > 0
    assert last.grad_sqr is not None and last.grad_var > 0
    quiet = []
    training = tiny_training(report=quiet.append)  # every 30 s by default: none in a few steps
    one_step(training)
    assert quiet == []


@pytest.mark.e2e
def test_two_replicas_checkpoint_together_every_so_often_and_a_kill_loses_only_the_rest(tmp_path):
    """Periodic checkpoints (here every 0.5 s), agreed by both replicas at the same step: kill -9 of
    both then loses only what came after the last one, and the job resumes from it."""
    checkpoint = tmp_path / "job.pt"
    workers = two_replicas([*JOB, "--epochs", "1000", "--checkpoint", str(checkpoint)], GOODPUT_CHECKPOINT_S="0.5")
    deadline = time.monotonic() + 120
    while not checkpoint.exists():  # the first periodic checkpoint, mid-training
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers), "no periodic checkpoint"
        time.sleep(0.1)
    first = torch.load(checkpoint, weights_only=True)["steps"]
    time.sleep(2)
    for worker in workers:
        worker.kill()
        worker.communicate()
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["placement"] == [2, 1] and saved["steps"] > first > 0  # saved again and again
    epochs = saved["progress"] / 8192  # progress in examples; mlp_blobs trains on 8192
    resumed = run_job("--epochs", str(epochs + 1), "--checkpoint", str(checkpoint))
    assert resumed["world"] == 1 and resumed["steps"] > saved["steps"]


ACCUMULATING_REPLICA = """
import json, torch
from torch import nn
from torch.utils.data import TensorDataset
import goodput_train.trainer as trainer

calls = []
hook = trainer._exchange_hook
trainer._exchange_hook = lambda state, bucket: calls.append(bucket.index()) or hook(state, bucket)
torch.manual_seed(0)
model = nn.Linear(4, 2)
data = TensorDataset(torch.randn(256, 4), torch.randint(2, (256,)))
training = trainer.AdaptiveTraining(
    model, torch.optim.SGD(model.parameters(), lr=0.1), data, init_batch=32, max_local=8, adaptive=False
)
whole = nn.Linear(4, 2)
whole.load_state_dict(model.state_dict())
start = training.order.position
for x, y in training.micro_batches():
    training.backward(nn.functional.cross_entropy(training.model(x), y))
grads = [p.grad.clone() for p in model.parameters()]
indices = training.order._take(start, 32)  # the step's 32 examples, all replicas' micro-batches
nn.functional.cross_entropy(whole(data.tensors[0][indices]), data.tensors[1][indices]).backward()
training.step()
print(json.dumps({
    "ms": [training.m, training.s],
    "hook_calls": len(calls),
    "max_error": max(float((g - p.grad).abs().max()) for g, p in zip(grads, whole.parameters())),
    "noise": training.noise.stats() is not None,
}))
torch.distributed.barrier()  # neither leaves while the other still talks to it
torch.distributed.destroy_process_group()
"""


@pytest.mark.e2e
def test_replicas_accumulating_micro_batches_all_reduce_once_a_step():
    """Two replicas of m = 8, s = 1: the first micro-batch's gradient stays local (DDP decides that
    in the forward pass), the step's one all-reduce averages the whole batch's gradient."""
    workers = two_replicas([sys.executable, "-c", ACCUMULATING_REPLICA])
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["ms"] == [8, 1] and result["hook_calls"] == 1  # one bucket, all-reduced once
        assert result["max_error"] < 1e-6 and result["noise"]


@pytest.mark.e2e
def test_the_library_stands_alone_and_its_protocol_needs_no_pytorch():
    """A job's image installs ./train only: the library imports nothing of the scheduler, and the
    services read its protocol and goodput model without importing PyTorch."""
    check = (
        "import sys, goodput_train.trainer, goodput_train.checkpoint; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'shared', 'services', 'sim', 'cli', 'deploy', 'examples', 'nats', 'cvxpy', 'yaml', 'opentelemetry'}))"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd="/", timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
    protocol = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, goodput_train.protocol, goodput_train.goodput; print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=120,
    )
    assert protocol.stdout.strip() == "False", protocol.stderr[-2000:]
