"""The cost of a job's box (services/node/box.py): the same jobs on one in-process node agent, in a
runc box and with `--box off`, in turn.

    .venv/bin/python benchmarks/bench_box.py [--runs 5]

- **start**: from the agent's start order to the job's first line of output (tests/jobs/says.py
  prints it after importing PyTorch and the example model: the same imports either way), median;
- **training**: from that line to the job's end: the example MLP trained two epochs on one CPU
  slot (the same steps either way), median; box / off is the per-step cost of the box;
- **a neighbour**: a 1-slot job's loop rate (tests/jobs/greedy.py) alone, then beside another
  1-slot job whose four children each detach and spin, on a node of 2 slots (a core each here):
  the share of its rate it keeps, boxed and unboxed.

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
from shared.schema.nodes import NodeInfo, StartWorkers, StopWorkers

ROOT = Path(__file__).resolve().parent.parent
JOBS = "tests.jobs"
FIRST_LINE = "hello from says"


def node(workdir: Path, boxed: bool, slots: int = 1) -> NodeWorkers:
    shown = shown_folders(sys.executable, interpreter_paths(sys.executable, import_path(JOBS)))
    rules = default_rules(slots)
    boxes = Boxes(workdir, rules, sys.executable, "runc" if boxed else None, shown, "bench-box")
    boxes.prepare()
    return NodeWorkers(NodeInfo(workdir.name, "cpu", slots, "127.0.0.1"), workdir, JOBS, boxes=boxes, output=Output())


def run(workers: NodeWorkers, job: str, user: int) -> tuple[float, float]:
    """Seconds from the start order to the job's first line, and from it to the job's end (its
    training: the example MLP, two epochs on one CPU slot)."""
    workers.output.take()  # what earlier runs printed
    began, first = time.monotonic(), None
    order = StartWorkers(job, "says", 1, (0,), 1, 1, "cpu", str(workers.workdir / "ck" / job / "x.pt"), user=user)
    workers.start(order)
    try:
        while first is None:
            for _, _, batch in workers.output.take():
                if any(line.text == FIRST_LINE for line in batch.lines):
                    first = time.monotonic()
            if time.monotonic() - began > 120:
                raise TimeoutError(f"{job}: no first line in 120 s")
            time.sleep(0.005)
        while None in next(r.codes for r in workers.poll().jobs if r.job_id == job):
            time.sleep(0.01)
        return first - began, time.monotonic() - first
    finally:
        report = workers.stop(StopWorkers(job, grace_s=5, kill=True))
        if report.codes != (0,):
            raise RuntimeError(f"{job} ended {report.codes}: {report.error}")


def loop_rate(workers: NodeWorkers, job: str, user: int, neighbour: bool, seconds: float = 4.0) -> float:
    """The loops a second a 1-slot job counts for `seconds`, beside a greedy 1-slot job or alone."""
    workers.output.take()
    greedy = f"{job}-greedy"
    env = {"GREEDY_SECONDS": str(seconds + 2)}
    if neighbour:
        workers.start(
            StartWorkers(
                greedy,
                "greedy",
                1,
                (0,),
                1,
                1,
                "cpu",
                str(workers.workdir / "ck" / greedy / "x.pt"),
                {**env, "GREEDY_CHILDREN": "4"},
                user=user + 1000,
            )
        )
        time.sleep(1.0)  # its children spinning
    env["GREEDY_SECONDS"] = str(seconds)
    workers.start(
        StartWorkers(job, "greedy", 1, (0,), 1, 1, "cpu", str(workers.workdir / "ck" / job / "x.pt"), env, user=user)
    )
    try:
        deadline = time.monotonic() + seconds + 60
        while time.monotonic() < deadline:
            for _, _, batch in workers.output.take():
                for line in batch.lines:
                    if line.text.startswith("loops "):
                        return float(line.text.split()[1])
            time.sleep(0.05)
        raise TimeoutError(f"{job}: no loop rate")
    finally:
        for name in (job, greedy):
            workers.stop(StopWorkers(name, grace_s=1, kill=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # the job's package: tests.jobs
    problem = check("runc", sys.executable, [ROOT])
    if problem:
        raise SystemExit(f"bench_box: no box here: {problem}")
    starts: dict[str, list[float]] = {"box": [], "off": []}
    trains: dict[str, list[float]] = {"box": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="bench-box-") as folder:
        nodes = {mode: node(Path(folder) / f"node-{mode}", mode == "box") for mode in starts}
        for number in range(args.runs):
            for mode in starts:
                start, train = run(nodes[mode], f"{mode}-{number}", 2 * number + (mode == "box") + 1)
                starts[mode].append(start)
                trains[mode].append(train)
            print(
                f"run {number + 1}/{args.runs}: start box {starts['box'][-1]:.3f} s, off {starts['off'][-1]:.3f} s; "
                f"training box {trains['box'][-1]:.2f} s, off {trains['off'][-1]:.2f} s",
                flush=True,
            )
        pairs = {mode: node(Path(folder) / f"pair-{mode}", mode == "box", slots=2) for mode in starts}
        kept = {}
        for mode, workers in pairs.items():
            alone = loop_rate(workers, f"alone-{mode}", 500, neighbour=False)
            beside = loop_rate(workers, f"beside-{mode}", 600, neighbour=True)
            kept[mode] = beside / alone
            print(
                f"a 1-slot job's loops a second, {mode}: alone {alone:,.0f}, beside a greedy job {beside:,.0f}",
                flush=True,
            )
    box, off = (statistics.median(starts[mode]) for mode in ("box", "off"))
    print(
        f"start (order -> first line), median of {args.runs}: box {box:.3f} s, off {off:.3f} s, box adds {box - off:+.3f} s"
    )
    box, off = (statistics.median(trains[mode]) for mode in ("box", "off"))
    print(
        f"training (first line -> end), median of {args.runs}: box {box:.2f} s, off {off:.2f} s, box / off {box / off:.3f}"
    )
    print(
        f"a 1-slot job beside a greedy one keeps {kept['box']:.0%} of its rate alone in a box, {kept['off']:.0%} unboxed"
    )


if __name__ == "__main__":
    main()
