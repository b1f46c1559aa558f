"""The executor library's state: atomic checkpoints and an elastic data order."""

import signal
import subprocess
import sys
import time

import pytest
import torch

from goodput_train import checkpoint
from goodput_train.data import ElasticOrder


def run_steps(order: ElasticOrder, world: int, m: int, s: int, steps: int) -> list[list[int]]:
    """`steps` optimizer steps on `world` ranks (each rank's own copy of the order): every rank's
    examples, step by step."""
    taken = []
    for _ in range(steps):
        state = order.state_dict()
        ranks = [ElasticOrder.from_state(order.size, state).step(rank, world, m, s) for rank in range(world)]
        assert all(len(batch) == m for micro in ranks for batch in micro)  # always full: ranks in step
        taken.append([int(i) for micro in ranks for batch in micro for i in batch])
        order.step(0, world, m, s)
    return taken


def test_resizing_mid_epoch_neither_repeats_nor_skips_an_example():
    size = 1000
    order = ElasticOrder(size, seed=3)
    seen = [i for step in run_steps(order, 2, 16, 1, 7) for i in step]  # 2 ranks, 64 examples a step
    resumed = ElasticOrder.from_state(size, order.state_dict())  # checkpoint, resume on 3 ranks
    seen += [i for step in run_steps(resumed, 3, 10, 0, 20) for i in step]  # 448 + 600 examples
    assert sorted(seen[:size]) == list(range(size))  # the epoch: each example once
    assert len(set(seen[size:])) == len(seen) - size  # the next one has begun afresh
    assert resumed.epoch == 1


def test_the_next_epoch_is_a_new_permutation():
    order = ElasticOrder(10, seed=1)
    first = [int(i) for b in order.step(0, 1, 10, 0) for i in b]
    second = [int(i) for b in order.step(0, 1, 10, 0) for i in b]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert order.epoch == 2
    with pytest.raises(ValueError):
        order.step(2, 2, 4, 0)


def test_a_checkpoint_round_trips_and_a_missing_one_is_none(tmp_path):
    assert checkpoint.load(tmp_path / "none.pt") is None
    state = {"model": {"w": torch.arange(6.0)}, "order": {"position": 40, "seed": 0}}
    checkpoint.save(state, tmp_path / "job.pt")
    loaded = checkpoint.load(tmp_path / "job.pt")
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["order"] == state["order"]


WRITER = """
import sys, time
from pathlib import Path
import torch
from goodput_train import checkpoint

class MidWrite:
    # Pickled in the middle of torch.save: says so, then dawdles (it loads back as a plain int).
    def __reduce__(self):
        Path(sys.argv[2]).touch()
        time.sleep(0.5)
        return (int, (0,))

checkpoint.save({"version": 0, "payload": torch.full((1000,), 0.0)}, sys.argv[1])
for version in range(1, 10**9):
    checkpoint.save({"version": version, "payload": torch.full((1000,), float(version)), "slow": MidWrite()},
                    sys.argv[1])
"""


@pytest.mark.e2e
def test_kill_9_while_writing_never_corrupts_the_last_checkpoint(tmp_path):
    path, mid_write = tmp_path / "job.pt", tmp_path / "writing"
    for _ in range(3):
        mid_write.unlink(missing_ok=True)
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(mid_write)])
        deadline = time.monotonic() + 60
        while not mid_write.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        writer.send_signal(signal.SIGKILL)  # certainly in the middle of writing one
        writer.wait()
        assert list(tmp_path.glob(".job.pt.*.partial")), "the kill did not land mid-write"
        state = checkpoint.load(path)  # the last complete one, whole
        assert torch.all(state["payload"] == float(state["version"]))
