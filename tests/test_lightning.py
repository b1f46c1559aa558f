"""A PyTorch Lightning script with goodput's one callback, run as a worker is (the contract's
environment, in a subprocess): it reports throughput and gradient noise, stops on SIGTERM with a
checkpoint at GOODPUT_CHECKPOINT and the stopped mark, resumes from it (its steps go on) at another
world size with its batch re-split, and its profiling run prints a profile the profiler accepts."""

import base64
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from goodput_train.protocol import (
    CHECKPOINT_PATH_ENV,
    PROFILE_ENV,
    PROFILE_PREFIX,
    REPORT_ENV,
    STATS_PREFIX,
    STOPPED_MARK,
    JobStats,
    ProfileRun,
)
from launcher.nats import free_loopback_port
from services.node.processes import torchrun_env, worker_env
from services.profiler.measure import measured_profile

SCRIPT = """
import sys

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from goodput_train.lightning import GoodputCallback, placement


class Regression(L.LightningModule):
    def __init__(self, batch_size=16):
        super().__init__()
        self.batch_size = batch_size  # the callback sets it at each start
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 8, generator=generator)
        self.data = TensorDataset(x, x.sum(1, keepdim=True) + 0.3 * torch.randn(4096, 1, generator=generator))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if not hasattr(self, "first"):
            self.first = len(x)
            print(f"first batch {self.first}", flush=True)
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


torch.manual_seed(0)
trainer = L.Trainer(
    **placement(), max_steps=int(sys.argv[1]), accelerator="cpu", logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=[GoodputCallback()],
)
trainer.fit(Regression())
print(f"done at step {trainer.global_step}", flush=True)
"""


def decode(line: str, prefix: str, kind):
    return msgspec.msgpack.decode(base64.b64decode(line.strip()[len(prefix) :]), type=kind)


def stats_in(lines: list[str]) -> list[JobStats]:
    return [decode(line, STATS_PREFIX, JobStats) for line in lines if line.startswith(STATS_PREFIX)]


def worker_envs(folder: Path, world: int, job_id: str, **extra: str) -> list[dict[str, str]]:
    """Each rank's environment, as the node agent gives it: torchrun's, the checkpoint file, reports every 0.2 s."""
    port = free_loopback_port()
    checkpoint = {CHECKPOINT_PATH_ENV: str(folder / "checkpoints" / f"{job_id}.pt"), REPORT_ENV: "0.2", **extra}
    return [worker_env({**torchrun_env(rank, world, 1, port, job_id, "cpu"), **checkpoint}) for rank in range(world)]


def start(folder: Path, script: str, args: list[str], envs: list[dict[str, str]]) -> list[subprocess.Popen]:
    (folder / "train.py").write_text(script)
    return [
        subprocess.Popen(
            [sys.executable, "train.py", *args],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]


def stop_after_steps(workers: list[subprocess.Popen], timeout_s: float = 120) -> list[list[str]]:
    """Read rank 0 until it reports steps taken, SIGTERM every rank (a rescale), and each rank's
    whole output once it has exited 0."""
    seen = []
    for line in workers[0].stdout:
        seen.append(line.strip())
        if line.startswith(STATS_PREFIX) and stats_in([line])[0].steps > 0:
            break
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    outputs = []
    for rank, worker in enumerate(workers):
        out, err = worker.communicate(timeout=timeout_s)
        assert worker.returncode == 0, err[-3000:]
        outputs.append((seen if rank == 0 else []) + out.splitlines())
    return outputs


def finish(workers: list[subprocess.Popen], timeout_s: float = 120) -> list[list[str]]:
    outputs = []
    for worker in workers:
        out, err = worker.communicate(timeout=timeout_s)
        assert worker.returncode == 0, err[-3000:]
        outputs.append(out.splitlines())
    return outputs


def saved_steps(folder: Path, job_id: str) -> int:
    import torch

    state = torch.load(folder / "checkpoints" / f"{job_id}.pt", weights_only=False)
    return state["global_step"]


def check_stopped_then_resumed(saved: int, stopped: list[list[str]], resumed: list[str], more: int) -> list[JobStats]:
    """The stop: the mark, rank 0's reports with step times and gradient noise, a checkpoint at
    least as far as they went. The resumed run: reports from there on, never back, to its end."""
    for lines in stopped:
        assert STOPPED_MARK in lines and not any(line.startswith("done at") for line in lines)
    reports = stats_in(stopped[0])
    assert reports and reports[-1].steps > 0
    last = reports[-1]
    assert last.observations and all(o.t_iter > 0 for o in last.observations)
    assert {(o.gpus, o.m) for o in last.observations} == {(len(stopped), 16)}
    assert last.grad_sqr is not None and last.grad_var is not None and last.grad_var > 0
    assert saved >= max(r.steps for r in reports) > 0
    steps = [r.steps for r in stats_in(resumed)]
    assert steps and min(steps) > saved and steps == sorted(steps) and steps[-1] == saved + more  # never back
    assert STOPPED_MARK not in resumed and resumed[-1] == f"done at step {saved + more}"
    return stats_in(resumed)


def stop_two_then_resume_one(folder: Path, script: str, job_id: str, more: int) -> None:
    """Two ranks over gloo stop on SIGTERM; one rank resumes from the checkpoint: its global step
    goes on, and the total batch the job was tuned for (2 × 16) is kept on one replica."""
    stopped = stop_after_steps(start(folder, script, ["100000"], worker_envs(folder, 2, job_id)))
    assert all("first batch 16" in lines for lines in stopped)
    saved = saved_steps(folder, job_id)
    (resumed,) = finish(start(folder, script, [str(saved + more)], worker_envs(folder, 1, job_id)))
    reports = check_stopped_then_resumed(saved, stopped, resumed, more)
    assert stats_in(stopped[0])[-1].m == 16
    m, s = reports[-1].m, reports[-1].s
    assert m * (s + 1) >= 32 and f"first batch {m}" in resumed  # one replica takes the whole batch, at least M0


def check_profiling_run(folder: Path, script: str, job_id: str) -> None:
    """The profile line, accepted by the profiler: per-GPU batches up to the script's 16, and
    nothing trained after it (no end line, no checkpoint)."""
    (worker,) = start(folder, script, ["100000"], worker_envs(folder, 1, job_id, **{PROFILE_ENV: "1"}))
    (lines,) = finish([worker])
    (profile,) = [decode(line, PROFILE_PREFIX, ProfileRun) for line in lines if line.startswith(PROFILE_PREFIX)]
    measured = measured_profile(job_id, "job", "cpu", profile)
    sizes = [p.local_bsz for p in profile.points]
    assert sizes == sorted(sizes) and len(sizes) > 2 and sizes[-1] == 16 and measured.max_local == 16
    assert profile.init_batch == 16 and not any(line.startswith("done at") for line in lines)
    assert not (folder / "checkpoints" / f"{job_id}.pt").exists()


@pytest.mark.e2e  # it starts workers, as a node agent does
def test_a_lightning_script_reports_stops_on_sigterm_and_resumes_at_another_size_with_its_batch_re_split(tmp_path):
    stop_two_then_resume_one(tmp_path, SCRIPT, "lit-1", 40)


@pytest.mark.e2e  # it starts workers, as a node agent does
def test_a_lightning_profiling_run_prints_a_profile_the_profiler_accepts_and_trains_no_further(tmp_path):
    check_profiling_run(tmp_path, SCRIPT, "lit-2")


def run_the_pages_script(folder: Path, first_line: str, job_id: str) -> None:
    """docs/jobs.md's script, as the page shows it, run as a worker: it reports, stops on SIGTERM with
    its checkpoint and the stopped mark, and resumed, goes on from the step it saved."""
    from tests.test_torchrun import page_script

    script = page_script(first_line)
    (stopped,) = stop_after_steps(start(folder, script, [], worker_envs(folder, 1, job_id)))
    assert STOPPED_MARK in stopped and stats_in(stopped), stopped[-20:]
    saved = saved_steps(folder, job_id)
    resumed = stop_after_steps(start(folder, script, [], worker_envs(folder, 1, job_id)))[0]
    assert STOPPED_MARK in resumed and saved_steps(folder, job_id) > saved and stats_in(resumed)[0].steps >= saved


@pytest.mark.e2e  # it starts workers, as a node agent does
def test_the_pages_lightning_script_reports_stops_and_resumes_as_written(tmp_path):
    run_the_pages_script(
        tmp_path, "# train.py: a regression on generated data, trained by PyTorch Lightning", "page-lit"
    )


def test_the_noise_samples_preconditioner_is_adams_for_every_group_and_none_before_its_state():
    """The fused square roots of Adam's preconditioner (the integrations' metric) equal the formula's,
    per group (each its own eps), and are None for SGD or before the first step."""
    import torch

    from goodput_train.integration import adam_scales

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(50, 200), torch.nn.ReLU(), torch.nn.Linear(200, 3))
    groups = [{"params": net[0].parameters()}, {"params": net[2].parameters(), "eps": 1e-3}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    net(torch.randn(8, 50)).sum().backward()
    assert adam_scales(optimizer) is None
    for _ in range(3):
        optimizer.step()
        net(torch.randn(8, 50)).sum().backward()
    want = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            v_hat = state["exp_avg_sq"] / (1 - group["betas"][1] ** float(state["step"]))
            want.append((1.0 / (v_hat.sqrt() + group["eps"])).sqrt())
    got = adam_scales(optimizer)
    assert len(got) == 4 and all(torch.allclose(a, b, rtol=1e-5) for a, b in zip(got, want))
    assert adam_scales(torch.optim.SGD(net.parameters(), lr=0.1)) is None


def test_the_callbacks_pair_sample_is_the_differenced_estimators_in_adams_metric_and_sgds():
    """The in-place sample of two consecutive steps equals `pgns.from_consecutive` of the same
    gradients, in Adam's preconditioned metric and in SGD's plain one."""
    import torch

    from goodput_train.integration import StepMeter, adam_scales
    from goodput_train.pgns import from_consecutive

    handler = signal.getsignal(signal.SIGTERM)  # a meter takes SIGTERM: pytest's back after
    for kind in (torch.optim.AdamW, torch.optim.SGD):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        optimizer = kind(net.parameters(), lr=1e-2)
        meter = StepMeter(optimizer, batch=(16, 0), init_batch=16, dataset_size=1024)
        previous = None
        for _ in range(4):
            optimizer.zero_grad()
            net(torch.randn(16, 20)).pow(2).mean().backward()
            grads = [p.grad.clone() for p in net.parameters()]
            if previous is not None:
                want = from_consecutive(previous, grads, 16, scales=adam_scales(optimizer))
                got = meter._pair_sample(grads)
                assert got.sqr == pytest.approx(want.sqr, rel=1e-6, abs=1e-9)
                assert got.trace == pytest.approx(want.trace, rel=1e-6)
            meter._previous, previous = [g.clone() for g in grads], grads
            optimizer.step()
    signal.signal(signal.SIGTERM, handler)
