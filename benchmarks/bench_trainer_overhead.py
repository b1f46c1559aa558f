"""Per-step overhead of the training library against plain DistributedDataParallel, side by side.

    .venv/bin/python benchmarks/bench_trainer_overhead.py [--world 2] [--steps 100] [--rounds 4]

The loops train the same CNN on the same generated images at the same batch (the library's
re-tuning off, so all run the same (m, s)), on `--world` gloo processes of one thread each: plain
DDP as one writes it (its defaults), plain DDP with `gradient_as_bucket_view=True` (as the library
wraps the model: the gradients are views of DDP's buckets, no copy in or out), and the library.
They alternate step by step (`--steps` steps each, `--rounds` times), in turn first, so all see the
same machine at each moment; the median step time of each is compared, and the median of the
paired ratios (each step of the library against the plain steps next to it). The library's extra
work a step: the averaged bucket's squared norm after its all-reduce, one read of it, the
finiteness check, the learning-rate factor and the progress count; every `noise_every` (4) steps
also each bucket's local squared norm before its all-reduce and three more numbers in the last
bucket's. Target: at most 2% slower
than plain DDP.

The last line is the headline, as key=value: overhead_pct and paired_median_pct against plain
DDP, own_work_pct and own_work_paired_pct against plain DDP with bucket views (the library's own
work, the copies it saves set aside), steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from goodput_train.trainer import AdaptiveTraining
from launcher.nats import free_loopback_port

LOCAL_BATCH = 32


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def images(n: int = 4096) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 3, 32, 32, generator=generator), torch.randint(10, (n,), generator=generator))


def plain_steps(ddp, optimizer, data, rank, world, steps, offset) -> list[float]:
    x, y = data.tensors
    times = []
    for step in range(steps):
        start = time.perf_counter()
        at = ((offset + step) * world + rank) * LOCAL_BATCH % (len(data) - LOCAL_BATCH)
        loss = nn.functional.cross_entropy(ddp(x[at : at + LOCAL_BATCH]), y[at : at + LOCAL_BATCH])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - start)
    return times


def library_steps(training, steps) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for x, y in training.micro_batches():
            training.backward(nn.functional.cross_entropy(training.model(x), y))
        training.step()
        times.append(time.perf_counter() - start)
    return times


def sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)


def worker(rank: int, world: int, port: int, steps: int, rounds: int, out) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data = images()
    loops = {}
    for name, view in (("ddp", False), ("ddp_view", True)):
        net = model()
        plain, optimizer = DistributedDataParallel(net, gradient_as_bucket_view=view), sgd(net)
        loops[name] = lambda step, plain=plain, optimizer=optimizer: plain_steps(
            plain, optimizer, data, rank, world, 1, step
        )
    net = model()
    training = AdaptiveTraining(net, sgd(net), data, init_batch=LOCAL_BATCH * world, adaptive=False)
    loops["library"] = lambda step: library_steps(training, 1)
    for step in range(5):  # warm up all
        for loop in loops.values():
            loop(step)
    timings = {name: [] for name in loops}
    names = list(loops)
    for step in range(rounds * steps):
        for name in names[step % 3 :] + names[: step % 3]:  # each first in turn
            timings[name] += loops[name](step)
    if rank == 0:
        out.put(timings)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_loopback_port()
    processes = [
        context.Process(target=worker, args=(rank, args.world, port, args.steps, args.rounds, queue))
        for rank in range(args.world)
    ]
    for process in processes:
        process.start()
    timings = queue.get()
    for process in processes:
        process.join()
    ms = {name: statistics.median(times) * 1e3 for name, times in timings.items()}

    def paired(baseline: str) -> float:
        return 100 * (statistics.median(b / a for a, b in zip(timings[baseline], timings["library"])) - 1)

    steps = args.rounds * args.steps
    print(
        f"CNN, {args.world} gloo replicas x {LOCAL_BATCH} images, {steps} steps each, alternating step by step: "
        f"plain DDP {ms['ddp']:.1f} ms/step, plain DDP with bucket views {ms['ddp_view']:.1f} ms/step, "
        f"library {ms['library']:.1f} ms/step"
    )
    print(
        f"overhead_pct={100 * (ms['library'] / ms['ddp'] - 1):+.1f} paired_median_pct={paired('ddp'):+.1f} "
        f"own_work_pct={100 * (ms['library'] / ms['ddp_view'] - 1):+.1f} own_work_paired_pct={paired('ddp_view'):+.1f} "
        f"steps={steps} target_pct=2"
    )


if __name__ == "__main__":
    main()
