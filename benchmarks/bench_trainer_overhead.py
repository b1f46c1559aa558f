"""Per-step overhead of the training library against plain DistributedDataParallel, side by side.

    .venv/bin/python benchmarks/bench_trainer_overhead.py [--world 2] [--steps 100] [--rounds 4]

Both loops train the same CNN on the same generated images at the same batch (the library's
re-tuning off, so both run the same (m, s)), on `--world` gloo processes of one thread each. They
alternate step by step (`--steps` pairs, `--rounds` times), so both see the same machine at each
moment; the median step time of each is compared, and the median of the pairs' ratios. The library's extra work a step: each bucket's local squared norm in the DDP hook, the
averaged gradient's norm, a finiteness check, one two-number all-reduce, the learning-rate factor
and the progress count. Target: at most 5% slower.
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


def worker(rank: int, world: int, port: int, steps: int, rounds: int, out) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data = images()
    plain_model = model()
    plain = DistributedDataParallel(plain_model)
    plain_optimizer = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9)
    adaptive_model = model()
    training = AdaptiveTraining(
        adaptive_model,
        torch.optim.SGD(adaptive_model.parameters(), lr=0.01, momentum=0.9),
        data,
        init_batch=LOCAL_BATCH * world,
        adaptive=False,
    )
    timings = {"ddp": [], "library": []}
    plain_steps(plain, plain_optimizer, data, rank, world, 5, 0)  # warm up both
    library_steps(training, 5)
    for step in range(rounds * steps):
        timings["ddp"] += plain_steps(plain, plain_optimizer, data, rank, world, 1, step)
        timings["library"] += library_steps(training, 1)
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
    ddp, library = (statistics.median(timings[k]) * 1e3 for k in ("ddp", "library"))
    paired = statistics.median(b / a for a, b in zip(timings["ddp"], timings["library"]))
    print(
        f"CNN, {args.world} gloo replicas x {LOCAL_BATCH} images, {args.rounds * args.steps} steps each, "
        f"alternating step by step: plain DDP {ddp:.1f} ms/step, library {library:.1f} ms/step, "
        f"overhead {100 * (library / ddp - 1):+.1f}% (median of paired ratios {100 * (paired - 1):+.1f}%; "
        f"target <= 5%)"
    )


if __name__ == "__main__":
    main()
