"""The training library on GPUs, in one short run (a few minutes on one H200): what the CPU tests
cannot show.

    python benchmarks/gpu_check.py [--out out/gpu_check/gpu_check.json] [--gpus N]

1. jobs: each example job (examples/jobs: mlp_blobs, cnn_shapes, tiny_lm) trains to its target
   through `AdaptiveTraining`, one worker process a GPU as the executor starts them (torchrun's
   environment, CUDA_VISIBLE_DEVICES its one GPU; the library takes cuda:LOCAL_RANK % count), NCCL
   between the workers where there are two GPUs or more. Its metric against its target (the ones
   tests/test_trainer.py holds on CPU), its wall time (start-up included), the batches it ran at.
2. profile: the profiling run (GOODPUT_PROFILE=1 makes `AdaptiveTraining.run` sweep the per-GPU
   batch, `AdaptiveTraining.profile`) of an MLP whose hidden layer, 2**20 wide, holds about
   12 MiB an example in training (its output, the ReLU's and their gradients: 3 · 4 MiB), per-GPU
   batch 64 to 131072, on one GPU: the device's own memory ends the sweep (about 10,000 examples
   fit in 140 GiB). The batches measured, their step times, the first that ran out of memory.
3. overhead: the library's step against a plain DistributedDataParallel step over NCCL, the CNN
   and images of benchmarks/bench_trainer_overhead.py, the same local batch, alternating step by
   step; each step timed to the GPU's end of it (synchronized); the median of each and of the
   paired ratios. At world size 1 the library runs no DDP: then the plain DDP loop is over a
   one-rank NCCL group, and a plain loop without DDP is timed as well.

A table on stdout, the same figures as JSON at --out (written after each check), progress on
stderr, each worker's stderr in logs/ beside the JSON. Exit code 0 where every job reached its
target and re-tuned its batch, the sweep ran out of memory, and the overhead was measured.

Without CUDA it says so and what it would have checked, and exits 0 (it can be tried anywhere).
`--cpu N` rehearses the same checks on N CPU processes over gloo, the sweep under a slot's memory
limit (GOODPUT_SLOT_MEMORY_MB) with a narrower MLP: it tests this script, not a GPU.

Where goodput is not installed (a bare GPU machine) the library is taken from train/ beside this
folder; it needs torch, numpy, scipy, threadpoolctl and msgspec.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY_PATHS = [str(ROOT), str(ROOT / "train")]  # where goodput is not installed
sys.path.extend(path for path in LIBRARY_PATHS if path not in sys.path)  # before the imports below

import msgspec
import torch
import torch.distributed as dist
from bench_trainer_overhead import images, library_steps
from bench_trainer_overhead import model as overhead_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from goodput_train import AdaptiveTraining
from goodput_train.protocol import (
    GPU_TYPE_ENV,
    JOB_ENV,
    OUTCOME_PREFIX,
    PROFILE_ENV,
    PROFILE_PREFIX,
    SLOT_MEMORY_ENV,
    ProfileRun,
)
from launcher.nats import free_loopback_port

SCRIPT = str(Path(__file__).resolve())
JOBS = {"mlp_blobs": 0.95, "cnn_shapes": 0.95, "tiny_lm": 0.75}  # each example job's metric target (the tests')
CHECK_TIMEOUT_S = 90.0  # a check's workers are killed past this (a hang must not eat the run)

PROFILE_HIDDEN = 2**20  # the profiled MLP's hidden width on a GPU: 12 MiB an example
PROFILE_FEATURES, PROFILE_CLASSES = 64, 8
PROFILE_MIN_LOCAL, PROFILE_MAX_LOCAL = 64, 2**17
REHEARSAL_HIDDEN = 4096  # on CPU (--cpu): 48 KiB an example ...
REHEARSAL_SLOT_MEMORY_MB = 256  # ... in a slot of 256 MB
MEMORY_PREFIX = "gpu-check-memory "  # the profiling worker's peak device memory, JSON
OVERHEAD_PREFIX = "gpu-check-overhead "  # the overhead workers' timings (rank 0), JSON
OVERHEAD_BATCHES = (32, 512)  # local batches: bench_trainer_overhead's, and one that keeps a GPU busier
OVERHEAD_STEPS = 300  # timed steps of each loop per batch, alternating
OVERHEAD_TARGET = 0.05  # the library's target: at most 5% slower than plain DDP


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- workers: one process a device, as the executor starts a job's ---------------------------


@dataclass
class Workers:
    """What a check's worker processes left: each rank's stdout and exit code (None: killed at the
    timeout, or once another rank failed), the wall time, each rank's stderr log."""

    outputs: list[str]
    codes: list[int | None]
    wall_s: float
    logs: list[Path]
    timed_out: bool

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.codes)

    def error(self) -> str:
        """The last line the first failed rank wrote to stderr (a traceback's ends with the exception)."""
        failed = [(code, path) for code, path in zip(self.codes, self.logs) if code not in (0, None)] or [
            (code, path) for code, path in zip(self.codes, self.logs) if code is None
        ]
        if not failed:
            return ""
        code, path = failed[0]
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        why = (
            f"exit code {code}"
            if code is not None
            else "killed at the timeout"
            if self.timed_out
            else "killed once another rank failed"
        )
        return f"{path.name}: {why}: {lines[-1].strip() if lines else 'no error output'}"


def launch(
    name: str, command: list[str], devices: list[str | None], env: dict[str, str], logs: Path, timeout_s: float
) -> Workers:
    """Run `command` once a device (a CUDA device id for CUDA_VISIBLE_DEVICES; None: a CPU slot,
    no GPU visible) with torchrun's environment, and wait for all (at most `timeout_s`; a rank
    that fails ends the others)."""
    world, port = len(devices), free_loopback_port()
    threads = "1" if devices[0] is None else str(max(1, (os.cpu_count() or 1) // world))  # a CPU slot is one core
    pythonpath = os.pathsep.join([*LIBRARY_PATHS, *filter(None, [os.environ.get("PYTHONPATH")])])
    inherited = {name: value for name, value in os.environ.items() if not name.startswith("GOODPUT_")}  # ours alone
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as folder:
        outputs = [Path(folder) / f"rank{rank}.out" for rank in range(world)]
        paths = [logs / f"{name}.rank{rank}.log" for rank in range(world)]
        processes, start = [], time.monotonic()
        for rank, device in enumerate(devices):
            worker_env = {
                **inherited,
                "OMP_NUM_THREADS": threads,
                **env,
                "PYTHONPATH": pythonpath,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GOODPUT_NODES": "1",
                "CUDA_VISIBLE_DEVICES": "" if device is None else device,
            }
            with open(outputs[rank], "w") as out, open(paths[rank], "w") as err:
                processes.append(subprocess.Popen(command, env=worker_env, cwd=ROOT, stdout=out, stderr=err))
        deadline = start + timeout_s
        while (
            time.monotonic() < deadline
            and any(p.poll() is None for p in processes)
            and not any(p.poll() not in (None, 0) for p in processes)
        ):
            time.sleep(0.2)
        wall = time.monotonic() - start
        codes = [process.poll() for process in processes]
        timed_out = None in codes and not any(code not in (None, 0) for code in codes)
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        return Workers([path.read_text(errors="replace") for path in outputs], codes, wall, paths, timed_out)


def line_after(output: str, prefix: str) -> str | None:
    """What follows `prefix` on the last line of `output` that starts with it."""
    found = [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]
    return found[-1] if found else None


# ---- 1. the example jobs ----------------------------------------------------------------------


def check_job(job: str, target: float, devices: list[str | None], gpu_type: str, logs: Path, timeout_s: float) -> dict:
    log(f"job {job}: {len(devices)} worker(s) ...")
    workers = launch(
        job,
        [sys.executable, "-m", f"examples.jobs.{job}"],
        devices,
        {JOB_ENV: job, GPU_TYPE_ENV: gpu_type},
        logs,
        timeout_s,
    )
    line = line_after(workers.outputs[0], OUTCOME_PREFIX)
    outcome = json.loads(line) if line else {}
    result = {
        "job": job,
        "world": len(devices),
        "target": target,
        "wall_s": round(workers.wall_s, 1),
        "metric": outcome.get("metric"),
        "batches": outcome.get("batches"),
        "steps": outcome.get("steps"),
        "epochs": outcome.get("epochs"),
        "skipped": outcome.get("skipped"),
        "exit_codes": workers.codes,
        "error": workers.error() or (None if line else "no outcome line from rank 0"),
    }
    if outcome and not result["error"]:
        misses = [
            why
            for missed, why in [
                (outcome.get("stopped"), "it stopped before its target"),
                ((outcome.get("metric") or 0.0) < target, "its metric is under the target"),
                (outcome.get("skipped"), f"it skipped {outcome.get('skipped')} steps"),
                (len(outcome.get("batches") or []) < 2, "it never re-tuned its batch"),
            ]
            if missed
        ]
        result["error"] = "; ".join(misses) or None
    result["ok"] = workers.ok and bool(outcome) and result["error"] is None
    log(
        f"job {job}: metric {result['metric']} (target {target}), {result['wall_s']} s, batches "
        f"{result['batches']}{'' if result['ok'] else ' - FAILED ' + str(result['error'] or '')}"
    )
    return result


# ---- 2. the profiling sweep on the device's memory -------------------------------------------


def profile_worker(hidden: int) -> None:
    """The profiling run of a job that no GPU fits at its largest batch: an MLP whose hidden layer
    holds 3 · hidden · 4 bytes an example in training. Its peak device memory after it."""
    if not os.environ.get(PROFILE_ENV):
        raise SystemExit(f"the profiling worker runs with {PROFILE_ENV}=1 (else it would train without end)")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(PROFILE_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, PROFILE_CLASSES))
    data = TensorDataset(torch.randn(4096, PROFILE_FEATURES), torch.randint(PROFILE_CLASSES, (4096,)))
    training = AdaptiveTraining(
        net,
        torch.optim.SGD(net.parameters(), lr=0.01),
        data,
        init_batch=PROFILE_MIN_LOCAL,
        max_batch=PROFILE_MAX_LOCAL,
        min_local=PROFILE_MIN_LOCAL,
        max_local=PROFILE_MAX_LOCAL,
    )
    training.run(lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))
    if training.device.type == "cuda":
        print(
            MEMORY_PREFIX
            + json.dumps(
                {
                    "peak_gib": torch.cuda.max_memory_allocated(training.device) / 2**30,
                    "total_gib": torch.cuda.get_device_properties(training.device).total_memory / 2**30,
                }
            ),
            flush=True,
        )


def check_profile(device: str | None, logs: Path, timeout_s: float) -> dict:
    hidden = PROFILE_HIDDEN if device is not None else REHEARSAL_HIDDEN
    env = {PROFILE_ENV: "1", JOB_ENV: "profile"}
    if device is None:
        env[SLOT_MEMORY_ENV] = str(REHEARSAL_SLOT_MEMORY_MB)
    log(
        f"profile: the sweep of an MLP {hidden} wide ({3 * hidden * 4 / 2**20:.3g} MiB an example), per-GPU batch "
        f"{PROFILE_MIN_LOCAL}..{PROFILE_MAX_LOCAL} ..."
    )
    workers = launch(
        "profile",
        [sys.executable, SCRIPT, "--worker", "profile", "--hidden", str(hidden)],
        [device],
        env,
        logs,
        timeout_s,
    )
    result = {
        "hidden": hidden,
        "mib_per_example": 3 * hidden * 4 / 2**20,
        "wall_s": round(workers.wall_s, 1),
        "points": [],
        "out_of_memory": None,
        "gpu_seconds": None,
        "peak_gib": None,
        "total_gib": None,
        "slot_memory_mb": REHEARSAL_SLOT_MEMORY_MB if device is None else None,
        "error": workers.error() or None,
    }
    line = line_after(workers.outputs[0], PROFILE_PREFIX)
    if line is None:
        result["error"] = result["error"] or "no profile line"
    else:
        run = msgspec.msgpack.decode(base64.b64decode(line), type=ProfileRun)  # as services/profiler/measure.py
        result.update(
            points=[[p.local_bsz, p.step_time] for p in run.points],
            out_of_memory=run.out_of_memory,
            gpu_seconds=run.gpu_seconds,
        )
    memory = line_after(workers.outputs[0], MEMORY_PREFIX)
    if memory:
        result.update(json.loads(memory))
    result["ok"] = bool(workers.ok and result["points"] and result["out_of_memory"] is not None)
    log(
        f"profile: measured {[p[0] for p in result['points']]}, out of memory at {result['out_of_memory']}"
        f"{'' if result['ok'] else ' - FAILED ' + str(result['error'] or 'no batch ran out of memory')}"
    )
    return result


# ---- 3. the library's overhead against plain DDP ---------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[], object], device: torch.device) -> float:
    """One step's time to the device's end of it (on a GPU the launch returns before the work ends)."""
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


def plain_step(
    net: nn.Module, optimizer: torch.optim.Optimizer, data: TensorDataset, at: int, batch: int, device: torch.device
) -> None:
    """bench_trainer_overhead's plain step, its batch moved to the device as the library moves its own."""
    x, y = (tensor[at : at + batch].to(device, non_blocking=True) for tensor in data.tensors)
    nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def overhead_worker(batches: list[int], steps: int) -> None:
    """Plain DDP and the library (and at world size 1 a plain loop) at each local batch; rank 0
    prints the timings' summary."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()) if cuda else torch.device("cpu")
    )  # the library's own choice
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")  # the library then trains in it
    data = images()
    summary = {batch: overhead_at(batch, data, rank, world, device, steps) for batch in batches}
    if rank == 0:
        print(OVERHEAD_PREFIX + json.dumps(summary), flush=True)
    dist.destroy_process_group()


def overhead_at(batch: int, data: TensorDataset, rank: int, world: int, device: torch.device, steps: int) -> dict:
    """The loops at one local batch, alternating step by step after 10 steps of warm-up each: the
    median step time of each (ms), and the median of the paired ratios library / DDP (/ plain)."""

    def sgd(net: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def at(step: int) -> int:  # where bench_trainer_overhead reads
        return (step * world + rank) * batch % (len(data) - batch)

    plain_net, library_net = overhead_model().to(device), overhead_model()
    ddp = DistributedDataParallel(plain_net, device_ids=[device.index] if device.type == "cuda" else None)
    ddp_optimizer = sgd(plain_net)
    training = AdaptiveTraining(library_net, sgd(library_net), data, init_batch=batch * world, adaptive=False)
    loops = {
        "ddp": lambda step: plain_step(ddp, ddp_optimizer, data, at(step), batch, device),
        "library": lambda step: library_steps(training, 1),
    }
    if world == 1:  # the library runs no DDP here: a plain loop is its other baseline
        single_net = overhead_model().to(device)
        single_optimizer = sgd(single_net)
        loops["plain"] = lambda step: plain_step(single_net, single_optimizer, data, at(step), batch, device)
    for step in range(10):
        for loop in loops.values():
            loop(step)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for step in range(steps):
        for name, loop in loops.items():
            times[name].append(timed(lambda: loop(step), device))
    summary = {f"{name}_ms": statistics.median(values) * 1e3 for name, values in times.items()}
    summary["paired"] = statistics.median(b / a for a, b in zip(times["ddp"], times["library"]))
    if world == 1:
        summary["paired_plain"] = statistics.median(b / a for a, b in zip(times["plain"], times["library"]))
    return summary


def check_overhead(devices: list[str | None], batches: list[int], steps: int, logs: Path, timeout_s: float) -> dict:
    log(f"overhead: library vs plain DDP, {len(devices)} worker(s), local batch {batches}, {steps} steps each ...")
    workers = launch(
        "overhead",
        [
            sys.executable,
            SCRIPT,
            "--worker",
            "overhead",
            "--overhead-batches",
            ",".join(map(str, batches)),
            "--overhead-steps",
            str(steps),
        ],
        devices,
        {},
        logs,
        timeout_s,
    )
    line = line_after(workers.outputs[0], OVERHEAD_PREFIX)
    rows = []
    for batch, row in (json.loads(line) if line else {}).items():
        rows.append(
            {
                "local_batch": int(batch),
                **row,
                "overhead": row["library_ms"] / row["ddp_ms"] - 1,
                "ddp_steps_s": 1e3 / row["ddp_ms"],
                "library_steps_s": 1e3 / row["library_ms"],
                "meets_target": row["library_ms"] / row["ddp_ms"] - 1 <= OVERHEAD_TARGET,
            }
        )
    result = {
        "world": len(devices),
        "steps": steps,
        "target": OVERHEAD_TARGET,
        "batches": rows,
        "wall_s": round(workers.wall_s, 1),
        "error": workers.error() or (None if line else "no timings line"),
    }
    result["ok"] = bool(workers.ok and rows)
    for row in rows:
        log(
            f"overhead: local batch {row['local_batch']}: DDP {row['ddp_ms']:.2f} ms, library {row['library_ms']:.2f} "
            f"ms, {100 * row['overhead']:+.1f}%"
        )
    if not result["ok"]:
        log(f"overhead: FAILED {result['error']}")
    return result


# ---- the report -------------------------------------------------------------------------------


def describe(cuda: bool, count: int) -> dict:
    device = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": count,
        "backend": "nccl" if cuda else "gloo",
    }
    if cuda:
        properties = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()  # (2, 21, 5); an int in old releases
        device.update(
            name=properties.name,
            memory_gib=round(properties.total_memory / 2**30, 1),
            nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        )
    return device


def nccl_note(cuda: bool, world: int) -> str:
    if not cuda:
        return "CPU rehearsal: gloo between CPU processes; no GPU, no NCCL exercised"
    if world >= 2:
        return f"NCCL between {world} ranks, one GPU each, exercised (jobs and overhead)"
    return (
        "world size 1 (one GPU): the jobs ran without a process group or any collective, so NCCL between ranks "
        "was NOT exercised (it needs >= 2 GPUs; NCCL refuses two ranks on one GPU, and gloo is not NCCL); "
        "the overhead's plain DDP ran on a one-rank NCCL group"
    )


def table(results: dict) -> str:
    device = results["device"]
    lines = [
        f"goodput GPU check: {device['gpus']} x {device.get('name', 'CPU slot')}"
        + (
            f" ({device['memory_gib']} GiB), torch {device['torch']}, CUDA {device['cuda']}, NCCL {device['nccl']}"
            if "name" in device
            else f", torch {device['torch']}"
        ),
        results["nccl"],
        "",
    ]
    if results.get("jobs"):
        batches = {job["job"]: ", ".join(map(str, job["batches"] or [])) or "-" for job in results["jobs"]}
        width = max(len("batches (re-tuned)"), *map(len, batches.values())) + 2
        lines.append(
            f"{'job':<12}{'world':>6}{'metric':>9}{'target':>8}{'wall s':>8}{'steps':>7}  "
            f"{'batches (re-tuned)':<{width}}ok"
        )
        for job in results["jobs"]:
            metric = "-" if job["metric"] is None else f"{job['metric']:.3f}"
            lines.append(
                f"{job['job']:<12}{job['world']:>6}{metric:>9}{job['target']:>8.2f}{job['wall_s']:>8.1f}"
                f"{job['steps'] or '-':>7}  {batches[job['job']]:<{width}}"
                f"{'yes' if job['ok'] else 'NO: ' + str(job['error'])}"
            )
        lines.append("")
    profile = results.get("profile")
    if profile:
        where = (
            f"a slot of {profile['slot_memory_mb']} MB"
            if profile["slot_memory_mb"]
            else f"one GPU of {profile['total_gib']:.1f} GiB"
            if profile["total_gib"]
            else "one GPU"
        )
        lines.append(
            f"profiling sweep: MLP {profile['hidden']} wide ({profile['mib_per_example']:.3g} MiB an example), "
            f"{where}, {profile['wall_s']} s"
        )
        lines.append(f"{'batch':>8}{'step ms':>10}")
        lines += [f"{batch:>8}{1e3 * seconds:>10.2f}" for batch, seconds in profile["points"]]
        peak = f" (peak allocated in the sweep {profile['peak_gib']:.1f} GiB)" if profile["peak_gib"] else ""
        lines.append(
            f"out of memory at batch {profile['out_of_memory']}{peak}"
            if profile["out_of_memory"]
            else "no batch ran out of memory"
        )
        lines.append(
            f"ok: {'yes' if profile['ok'] else 'NO: ' + str(profile['error'] or 'no batch ran out of memory')}"
        )
        lines.append("")
    overhead = results.get("overhead")
    if overhead:
        plain = overhead["world"] == 1
        lines.append(
            f"overhead against plain DDP, {overhead['world']} rank(s), {overhead['steps']} steps each, "
            f"alternating (target <= {100 * overhead['target']:.0f}%)"
        )
        lines.append(
            f"{'batch':>6}{'DDP ms':>9}{'lib ms':>9}{'DDP st/s':>10}{'lib st/s':>10}{'lib/DDP':>9}"
            f"{'paired':>9}" + (f"{'plain ms':>10}{'lib/plain':>11}" if plain else "")
        )
        for row in overhead["batches"]:
            lines.append(
                f"{row['local_batch']:>6}{row['ddp_ms']:>9.2f}{row['library_ms']:>9.2f}"
                f"{row['ddp_steps_s']:>10.0f}{row['library_steps_s']:>10.0f}{row['library_ms'] / row['ddp_ms']:>9.3f}"
                f"{row['paired']:>9.3f}"
                + (f"{row['plain_ms']:>10.2f}{row['library_ms'] / row['plain_ms']:>11.3f}" if plain else "")
            )
        if not overhead["ok"]:
            lines.append(f"NO: {overhead['error']}")
    lines.append("")
    lines.append(f"all checks {'passed' if results['ok'] else 'did NOT pass'}")
    return "\n".join(lines)


def no_cuda(args: argparse.Namespace) -> str:
    built = (
        f"built with CUDA {torch.version.cuda}, but no CUDA device is visible"
        if torch.version.cuda
        else "built without CUDA"
    )
    return "\n".join(
        [
            f"gpu_check: no CUDA device present (torch {torch.__version__}, {built}): nothing was run.",
            "Where CUDA is present it checks, on every visible GPU (or --gpus N):",
            (
                "  1. jobs: "
                + ", ".join(f"{job} (target {target})" for job, target in JOBS.items())
                + " trained to their targets through AdaptiveTraining, one worker a GPU (torchrun's environment,"
                " CUDA_VISIBLE_DEVICES its GPU), NCCL between workers at 2 GPUs or more: metric against target, wall time,"
                " the batches re-tuned to;"
            ),
            (
                f"  2. profile: the profiling sweep (GOODPUT_PROFILE=1) of an MLP {PROFILE_HIDDEN} wide"
                f" ({3 * PROFILE_HIDDEN * 4 / 2**20:.0f} MiB an example), per-GPU batch {PROFILE_MIN_LOCAL}..{PROFILE_MAX_LOCAL},"
                " on one GPU until its memory runs out: the batches measured, their step times, the batch that ran out of"
                " memory;"
            ),
            (
                f"  3. overhead: steps/s of AdaptiveTraining against a plain DDP loop over NCCL, bench_trainer_overhead's CNN"
                f" at local batch {args.overhead_batches}, alternating step by step, {args.overhead_steps} steps each, and"
                f" the ratio (target <= {100 * OVERHEAD_TARGET:.0f}%)."
            ),
            f"Figures to stdout and to {args.out}. `--cpu 2` rehearses the checks on CPU processes (gloo).",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/gpu_check/gpu_check.json"))
    parser.add_argument("--gpus", type=int, help="GPUs to use (default: every visible one)")
    parser.add_argument("--cpu", type=int, metavar="N", help="rehearse on N CPU processes (gloo), no GPU")
    parser.add_argument("--checks", default="jobs,profile,overhead", help="which checks (default: %(default)s)")
    parser.add_argument(
        "--timeout", type=float, default=CHECK_TIMEOUT_S, help="seconds a check may run (default: %(default)s)"
    )
    parser.add_argument("--overhead-batches", default=",".join(map(str, OVERHEAD_BATCHES)))
    parser.add_argument("--overhead-steps", type=int, default=OVERHEAD_STEPS)
    parser.add_argument("--worker", choices=["profile", "overhead"], help=argparse.SUPPRESS)  # a worker process
    parser.add_argument("--hidden", type=int, default=PROFILE_HIDDEN, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.overhead_batches.split(",")]
    if args.worker == "profile":
        return profile_worker(args.hidden)
    if args.worker == "overhead":
        return overhead_worker(batches, args.overhead_steps)
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print(no_cuda(args))
        return
    if cuda:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = (
            [d.strip() for d in visible.split(",") if d.strip()]
            if visible
            else [str(i) for i in range(torch.cuda.device_count())]
        )
        ids = ids[: torch.cuda.device_count()]
        if args.gpus is not None and not 1 <= args.gpus <= len(ids):
            parser.error(f"--gpus {args.gpus}: {len(ids)} visible")
        devices: list[str | None] = ids[: args.gpus or len(ids)]
    else:
        devices = [None] * args.cpu
    checks = set(args.checks.split(","))
    logs = args.out.parent / "logs"
    results = {
        "device": describe(cuda, len(devices)),
        "world": len(devices),
        "nccl_between_ranks": cuda and len(devices) > 1,
        "nccl": nccl_note(cuda, len(devices)),
        "ok": False,
    }
    gpu_type = results["device"].get("name", "cpu")
    log(f"{len(devices)} x {gpu_type}; {results['nccl']}; figures to {args.out}, worker logs in {logs}")

    def save() -> None:
        done = [results[name] for name in ("jobs", "profile", "overhead") if name in results]
        results["ok"] = all(all(j["ok"] for j in c) if isinstance(c, list) else c["ok"] for c in done)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    if "jobs" in checks:
        results["jobs"] = []
        for job, target in JOBS.items():
            results["jobs"].append(check_job(job, target, devices, gpu_type, logs, args.timeout))
            save()
    if "profile" in checks:
        results["profile"] = check_profile(devices[0], logs, args.timeout)
        save()
    if "overhead" in checks:
        results["overhead"] = check_overhead(devices, batches, args.overhead_steps, logs, args.timeout)
        save()
    print(table(results))
    sys.exit(0 if results["ok"] else 1)


if __name__ == "__main__":
    main()
