"""The cost of a job's box (services/node/box.py): the same jobs on one in-process node agent, in a
runc box and with `--box off`, in turn.

    .venv/bin/python benchmarks/bench_box.py [--runs 5]

- **start**: from the agent's start order to the job's first line of output (tests/jobs/says.py
  prints it after importing PyTorch and the example model: the same imports either way), median;
- **step**: the library's own profiling run of the same job (the example MLP on one CPU slot),
  its median step time at each batch size it measured, median over the runs; the ratio of the
  medians (box / off) over all batch sizes.

It needs root and runc (what the box needs); both modes run one after the other in each round, so
the machine's drift falls on both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from services.node.agent import NodeWorkers
from services.node.box import Boxes, check, default_rules, interpreter_paths, shown_folders
from services.node.output import Output
from services.node.processes import import_path
from shared.schema import NodeInfo, ProfileRequest, StartWorkers, StopWorkers

ROOT = Path(__file__).resolve().parent.parent
JOBS = "tests.jobs"
FIRST_LINE = "hello from says"


def node(workdir: Path, boxed: bool) -> NodeWorkers:
    shown = shown_folders(sys.executable, interpreter_paths(sys.executable, import_path(JOBS)))
    rules = default_rules(1)
    boxes = Boxes(workdir, rules, sys.executable, "runc" if boxed else None, shown, "bench-box")
    boxes.prepare()
    return NodeWorkers(NodeInfo(workdir.name, "cpu", 1, "127.0.0.1"), workdir, JOBS, boxes=boxes, output=Output())


def start_latency(workers: NodeWorkers, job: str, user: int) -> float:
    """Seconds from the start order to the job's first line."""
    began = time.monotonic()
    workers.start(
        StartWorkers(job, "says", 1, (0,), 1, 1, "cpu", str(workers.workdir / "ck" / job / "x.pt"), user=user)
    )
    try:
        while True:
            for _, _, batch in workers.output.take():
                if any(line.text == FIRST_LINE for line in batch.lines):
                    return time.monotonic() - began
            if time.monotonic() - began > 120:
                raise TimeoutError(f"{job}: no first line in 120 s")
            time.sleep(0.005)
    finally:
        workers.stop(StopWorkers(job, grace_s=5, kill=True))


def step_times(workers: NodeWorkers, job: str, user: int) -> dict[int, float]:
    """The profiling run's step time at each per-slot batch size."""
    answer = workers.profile(ProfileRequest(job, "says", user=user))
    if answer.run is None:
        raise RuntimeError(f"{job}: its profiling run failed: {answer.failure}")
    return {point.local_bsz: point.step_time for point in answer.run.points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    problem = check("runc", sys.executable, [ROOT])
    if problem:
        raise SystemExit(f"bench_box: no box here: {problem}")
    starts: dict[str, list[float]] = {"box": [], "off": []}
    steps: dict[str, dict[int, list[float]]] = {"box": {}, "off": {}}
    with tempfile.TemporaryDirectory(prefix="bench-box-") as folder:
        nodes = {mode: node(Path(folder) / f"node-{mode}", mode == "box") for mode in starts}
        for run in range(args.runs):
            for number, mode in enumerate(starts):
                user = 10 * run + number + 1
                starts[mode].append(start_latency(nodes[mode], f"start-{mode}-{run}", user))
                for batch, step in step_times(nodes[mode], f"step-{mode}-{run}", user).items():
                    steps[mode].setdefault(batch, []).append(step)
            print(
                f"run {run + 1}/{args.runs}: start box {starts['box'][-1]:.3f} s, off {starts['off'][-1]:.3f} s",
                flush=True,
            )
    box, off = (statistics.median(starts[mode]) for mode in ("box", "off"))
    print(
        f"start (order -> first line), median of {args.runs}: box {box:.3f} s, off {off:.3f} s, box adds {box - off:+.3f} s"
    )
    ratios = []
    for batch in sorted(set(steps["box"]) & set(steps["off"])):
        in_box, unboxed = (statistics.median(steps[mode][batch]) for mode in ("box", "off"))
        ratios.append(in_box / unboxed)
        print(
            f"step at batch {batch:>4}: box {in_box * 1000:.2f} ms, off {unboxed * 1000:.2f} ms, ratio {in_box / unboxed:.3f}"
        )
    print(f"step time, box / off, median over batch sizes: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
