"""A DDP script that knows nothing of goodput, written as for torchrun, runs unchanged: submitted with
`launcher: torchrun` through `goodput up --executors real --nodes 2`, it is not profiled, runs
rigidly on its 4 slots across both nodes with torchrun's environment in every rank, trains with
gloo and finishes when its ranks exit 0; the pure parts (the job file, the declared profile) too."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import msgspec
import pytest

from services.profiler.measure import declared_run
from shared.schema.jobs import JobSpec
from tests.test_local_stack import Up
from tests.test_own_code import script_folder, submit, until

CODE = "0" * 64  # an archive digest: the pure parts never read it

# A plain DDP script, as torchrun runs it: its place from the environment, gloo on CPU.
DDP_SCRIPT = """import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
env = {name: os.environ[name] for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")}
assert int(os.environ["RANK"]) == rank and int(os.environ["WORLD_SIZE"]) == world
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
generator = torch.Generator().manual_seed(rank)
for step in range(30):
    x = torch.randn(16, 8, generator=generator)
    loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
total = torch.tensor([float(rank)])
dist.all_reduce(total)
print(f"ddp rank {rank} of {world} local {env['LOCAL_RANK']} of {env['LOCAL_WORLD_SIZE']} "
      f"group {env['GROUP_RANK']} of {env['GROUP_WORLD_SIZE']} sum {total.item():.0f} loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
"""


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


@pytest.mark.e2e  # it starts `goodput up`: NATS, the services and two node agents
def test_a_plain_ddp_script_runs_unchanged_on_four_slots_across_two_nodes():
    base = Path(tempfile.mkdtemp(prefix="goodput-torchrun-"))
    base.chmod(0o711)  # a job's user must pass through to its folder
    up = Up(base / "data", "--nodes", "2", "--slots", "2", "--workload", "none")
    up.server = f"nats://127.0.0.1:{up.port}"
    try:
        up.line(r"serving:")
        folder = script_folder(base, "ddp", DDP_SCRIPT)
        submit(up, base, "id: ddp-1\nentrypoint: train.py\nlauncher: torchrun\nrequested_gpus: 4\n", folder)
        ended = until(up, "ddp-1", lambda s: s["state"] in ("finished", "failed"), "ended", timeout_s=300)
        assert ended["state"] == "finished", ended
        assert ended["restarts"] == 0, ended
        printed = up.command("logs", "ddp-1", "--server", up.server).stdout
        lines = sorted(re.findall(r"ddp rank (\d) of 4 local (\d) of 2 group (\d) of 2 sum 6 ", printed))
        # Ranks 0-1 on the first node, 2-3 on the second: each its local rank and its node's group.
        assert lines == [("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")], printed[-3000:]
    finally:
        up.stop()
