"""What recording the decisions costs a round: a decided round of 2,000 jobs on sia-hetero-2048
(the goodput policy), without a recorder and with the live run's (build each job's JobDecision and
the RoundSummary, publish them to a real NATS server), in turn, twice.

    .venv/bin/python benchmarks/bench_decisions.py
"""

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from launcher.nats import nats_from_binary
from policies.base import make_policy
from services.placer.core import place
from services.policy.recorder import DecisionRecorder
from services.policy.rounds import Arrival, RoundLoop
from shared import storage, subjects
from shared.bus import Bus
from shared.cluster import load_cluster
from shared.schema.rounds import AdvanceReply, FactsReply, JobFacts, ModelsReply, PlacementResult
from shared.settings import SimSettings
from sim.rounds import job_models

N = 2000
APPS = ["cifar10", "bert", "ncf", "imagenet", "deepspeech2", "yolov3"]
cluster = load_cluster("sia-hetero-2048")
models = {}
for i in range(N):
    j = f"job-{i}"
    app = APPS[i % len(APPS)]
    try:
        models[j] = (app, job_models(j, app, cluster))
    except KeyError:
        models[j] = ("cifar10", job_models(j, "cifar10", cluster))


class Wiring:
    def __init__(self):
        self.placements = {}

    async def facts(self, now, jobs):
        out = []
        for j in jobs:
            app, m = models[j]
            out.append(
                JobFacts(
                    j,
                    app,
                    0.0,
                    600.0,
                    1,
                    m.init_batch,
                    False,
                    m.init_batch,
                    m.max_batch,
                    placement=self.placements.get(j, ()),
                    slice_iterations=10.0,
                )
            )
        return FactsReply(tuple(out))

    async def models(self, facts):
        return ModelsReply(tuple(models[f.job_id][1] for f in facts))

    async def place(self, round, allocations, previous, groups, nodes=None):
        p = place(cluster, allocations, previous, groups)
        return PlacementResult(p.placements, p.restarts, ())

    async def apply(self, request):
        self.placements = {j: tuple(s) for j, s in request.placements.items() if s}

    async def advance(self, now, step, jobs):
        return AdvanceReply(())


async def rounds(recorder, count=12):
    wiring = Wiring()
    loop = RoundLoop(
        [Arrival(f"job-{i}", 0.0) for i in range(N)],
        cluster,
        make_policy("goodput"),
        SimSettings("bench", round_s=60.0),
        wiring,
        recorder=recorder,
    )
    times, record_times = [], []
    active = [f"job-{i}" for i in range(N)]
    for r in range(count):
        t = time.perf_counter()
        decided = await loop._decide(60.0 * r, active, r, r)
        t1 = time.perf_counter()
        await loop.observer.record_decision()
        t2 = time.perf_counter()
        await wiring.apply(decided.apply)
        times.append(t1 - t)
        record_times.append(t2 - t1)
        if recorder is not None:
            t3 = time.perf_counter()
            await asyncio.gather(*recorder.in_flight)
            record_times[-1] = (record_times[-1], time.perf_counter() - t3)
    return times[1:], record_times[1:]


async def main():
    with tempfile.TemporaryDirectory() as d, nats_from_binary(Path(d)) as url:
        bus = await Bus.connect(url, "bench")
        s = storage.STREAMS[subjects.DECISIONS_STREAM]
        await bus.ensure_stream(s.name, s.subjects, **s.limits)
        for label, rec in (
            ("without a recorder", None),
            ("with the recorder", DecisionRecorder(bus)),
            ("without a recorder", None),
            ("with the recorder", DecisionRecorder(bus)),
        ):
            decide, record = await rounds(rec)
            line = (
                f"{label:20s}: decision p50 {statistics.median(decide) * 1e3:7.1f} ms  max {max(decide) * 1e3:7.1f} ms"
            )
            if rec is not None:
                line += (
                    f"; recorder.decided p50 {statistics.median(r[0] for r in record) * 1e3:5.1f} ms,"
                    f" its background publish and acks p50 {statistics.median(r[1] for r in record) * 1e3:5.1f} ms"
                )
            print(line)
        info = await bus.js.stream_info(subjects.DECISIONS_STREAM)
        print("stored", info.state.messages, "messages,", info.state.bytes // 1024, "KiB")
        await bus.close()


if __name__ == "__main__":
    asyncio.run(main())
