"""No job's stop holds up a round: the real executor service's round handlers over in-process node
agents (real worker processes on one node of 6 CPU slots), two jobs whose workers ignore SIGTERM
(tests/jobs/deaf.py: every stop of theirs takes the whole grace, then SIGKILL).

    .venv/bin/python benchmarks/bench_stops.py [--period 15] [--rounds 7] [--grace 60]

A round loop as the policy's: every `--period` s (from when the deaf jobs' workers run) it asks
the executor service for the live nodes, applies the round's placements and advances, each call in
turn, as the policy leader does; a round starts late when the last one's calls had not answered.

- round 0: a (team x) on 2 slots, b (team x) on 2 slots;
- round 1: a shrunk to 1 slot, c (team y) on the 2 free slots; b is cancelled by its user a moment
  after the round's apply (the jobs stream's cancel, beside the loop);
- round 2 on: a on 1, c on 2, d (team y) on b's 2 slots.

It prints how late each round started, how long each call took to answer, and when each job's
workers were started after the round that placed them: c on free slots, d on the slots of b's
stopping workers (it waits for them: about the grace), a's restart on 1 slot (after its own stop).
`--grace` needs the executors' grace setting; without it (an older executor) the grace is
shared/runtime.py's STOP_TIMEOUT_S.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec

from services.executor.local import InProcessNodes, LocalExecutors
from services.executor.real import RealExecutors, RealExecutorService
from services.node.agent import NodeWorkers
from shared import subjects
from shared.cluster import Cluster
from shared.runtime import STOP_TIMEOUT_S
from shared.schema.jobs import Cancel, JobSpec, Profiled
from shared.schema.nodes import NodeInfo
from shared.schema.rounds import AdvanceRequest, ApplyRequest, LiveJobsRequest

NODE = NodeInfo("local-0", "cpu", 6, "127.0.0.1")


class MemoryKV:
    """A KV bucket in memory (what the handlers keep, and the live nodes)."""

    def __init__(self, held=None):
        self.held = dict(held or {})

    async def put(self, key, value):
        self.held[key] = value
        return len(self.held)

    async def get(self, key):
        return None

    async def keys(self):
        return list(self.held)

    async def values(self):
        return dict(self.held)

    async def delete(self, key, revision=None):
        self.held.pop(key, None)


class EventsBus:
    """The bus as `on_event` uses it (decoding an event); nothing else is sent on it here."""

    def decode(self, data, kind):
        return msgspec.msgpack.decode(data, type=kind)


class TimedNodes(InProcessNodes):
    """The node agents in this process, and when each job's workers were started (monotonic)."""

    def __init__(self, workers):
        super().__init__(workers)
        self.started: dict[str, list[float]] = {}

    def start(self, node, order):
        self.started.setdefault(order.job_id, []).append(time.monotonic())
        return super().start(node, order)


def asleep(folder: Path, job_id: str) -> bool:
    return all(
        (folder / f"{job_id}.rank{r}.log").exists() and "asleep" in (folder / f"{job_id}.rank{r}.log").read_text()
        for r in (0, 1)
    )


async def run(period_s: float, rounds: int, grace_s: float | None) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="bench-stops-"))
    nodes = TimedNodes({NODE.name: NodeWorkers(NODE, folder, "tests.jobs")})
    options = {}
    if "blocking" in inspect.signature(LocalExecutors).parameters:
        options = {"blocking": False, **({"grace_s": grace_s} if grace_s is not None else {})}
    elif grace_s is not None and grace_s != STOP_TIMEOUT_S:
        raise SystemExit("--grace: these executors have no grace setting (theirs is STOP_TIMEOUT_S)")
    executors = LocalExecutors(nodes, folder, Cluster("none", ()), jobs_package="tests.jobs", **options)
    agent = RealExecutors(executors)
    service = RealExecutorService(EventsBus(), agent, MemoryKV(), MemoryKV({NODE.name: NODE}), MemoryKV())
    loop = asyncio.get_running_loop()
    if hasattr(service, "wake"):
        executors.wake = lambda: service.wake(loop)
    for sequence, (name, team, hears) in enumerate(
        (("a", "x", False), ("b", "x", False), ("c", "y", True), ("d", "y", True)), start=1
    ):
        agent.submitted(JobSpec(name, "deaf", team=team), sequence)
        agent.executors.jobs[name].args = () if not hears else ("--hears",)
        agent.profiled(Profiled(name, 16, 256, submission=sequence))
    service.watching = loop.create_task(service.watch())
    plans = [
        {"a": (("local-0", 2),), "b": (("local-0", 2),)},
        {"a": (("local-0", 1),), "b": (("local-0", 2),), "c": (("local-0", 2),)},
    ] + [{"a": (("local-0", 1),), "c": (("local-0", 2),), "d": (("local-0", 2),)}] * (rounds - 2)
    late, calls, began = [], {"live": [], "apply": [], "advance": []}, []
    cancelled: dict[str, float] = {}

    async def cancel() -> None:
        start = time.monotonic()
        delivery = SimpleNamespace(raw=SimpleNamespace(subject=subjects.CANCEL), stream_sequence=9, traceparent="")
        await service.on_event(msgspec.msgpack.encode(Cancel("b")), delivery)
        cancelled["answered_s"] = time.monotonic() - start

    async def timed(kind: str, call):
        start = time.monotonic()
        answer = await call
        calls[kind].append(time.monotonic() - start)
        return answer

    try:
        t0 = None
        cancelling = None
        for k, plan in enumerate(plans):
            if k == 1:  # the deaf jobs ignore SIGTERM by now; the rounds' clock starts here
                while not (asleep(folder, "a") and asleep(folder, "b")):
                    await asyncio.sleep(0.05)
                t0 = time.monotonic() - period_s
            if t0 is not None:
                scheduled = t0 + k * period_s
                await asyncio.sleep(max(0.0, scheduled - time.monotonic()))
                late.append(time.monotonic() - scheduled)
            began.append(time.monotonic())
            now = float(k * period_s)
            live = await timed("live", service.on_live(LiveJobsRequest(now)))
            await timed("apply", service.on_apply(ApplyRequest(now, plan, {}, True, jobs=tuple(live.jobs))))
            if k == 1:
                cancelling = loop.create_task(cancel())
                await asyncio.sleep(0.1)  # the stream's cancel is read beside the round
            await timed("advance", service.on_advance(AdvanceRequest(now, period_s, tuple(live.jobs))))
        if cancelling is not None:
            await cancelling
        deadline = time.monotonic() + 3 * (grace_s or STOP_TIMEOUT_S)
        while not ("d" in nodes.started and len(nodes.started.get("a", ())) >= 2) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        service.watching.cancel()
        executors.grace_s = 1.0
        await asyncio.to_thread(executors.stop_all)

    def after(job: str, round_: int, nth: int = 0) -> float | None:
        times = nodes.started.get(job, [])
        return times[nth] - began[round_] if len(times) > nth else None

    return {
        "rounds_late_s": late,
        "calls_s": calls,
        "cancel_answered_s": cancelled.get("answered_s"),
        "c_started_after_round_1_s": after("c", 1),
        "d_started_after_round_2_s": after("d", 2),
        "a_restarted_after_round_1_s": after("a", 1, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--period", type=float, default=15.0, help="seconds between rounds (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds, at least 3 (default: %(default)s)")
    parser.add_argument("--grace", type=float, help=f"a stop's grace, s (default: {STOP_TIMEOUT_S:.0f})")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the deaf job's package: tests.jobs
    figures = asyncio.run(run(args.period, max(3, args.rounds), args.grace))

    def s(value) -> str:
        return "-" if value is None else f"{value:.2f} s"

    late = figures["rounds_late_s"]
    print(f"grace {args.grace or STOP_TIMEOUT_S:.0f} s, a round every {args.period:.0f} s")
    print(
        f"rounds 1-{len(late)} started late by: " + ", ".join(f"{v:.2f}" for v in late) + f" s (max {max(late):.2f} s)"
    )
    for kind, took in figures["calls_s"].items():
        print(f"{kind:<8} answered in at most {max(took):.2f} s")
    print(f"cancel   answered in {s(figures['cancel_answered_s'])}")
    print(f"c (another team's, on free slots) started {s(figures['c_started_after_round_1_s'])} after its round began")
    print(f"d (on the cancelled job's slots) started {s(figures['d_started_after_round_2_s'])} after its round began")
    print(f"a (shrunk) restarted on 1 slot {s(figures['a_restarted_after_round_1_s'])} after its round began")


if __name__ == "__main__":
    main()
