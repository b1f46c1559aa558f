"""Benchmark of job-submission ingest: JobSpecs stored in the JetStream submissions stream.

    .venv/bin/python benchmarks/bench_ingest.py [--jobs 20000] [--in-flight 256]

Starts a nats-server (JetStream on, file storage in a temporary folder), then publishes `--jobs`
distinct submissions, each acknowledged only once stored (PubAck), with up to `--in-flight`
unacknowledged at a time, and a second pass of the same ids, which the stream must refuse as
duplicates. Target: >= 5,000 submissions/s.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from launcher.nats import EmbeddedNats, embedded_nats
from shared import storage, subjects
from shared.bus import Bus
from shared.schema.jobs import JobSpec


async def publish_all(bus: Bus, specs: list[JobSpec], in_flight: int) -> tuple[float, int]:
    """(seconds, duplicates reported) to publish every spec with at most `in_flight` awaiting their ack."""
    gate = asyncio.Semaphore(in_flight)
    duplicates = 0

    async def one(spec: JobSpec) -> None:
        nonlocal duplicates
        async with gate:
            ack = await bus.js_publish(subjects.stored(subjects.DEFAULT_TEAM, subjects.OPERATOR), spec, msg_id=spec.id)
            duplicates += bool(ack.duplicate)

    start = time.perf_counter()
    await asyncio.gather(*(one(s) for s in specs))
    return time.perf_counter() - start, duplicates


async def run(nats: EmbeddedNats, jobs: int, in_flight: int) -> None:
    bus = await nats.connect("bench-ingest")  # as the operator: it reads the stream's state after
    try:
        await storage.provision(bus)
        specs = [JobSpec(f"job-{i}", "cifar10", requested_gpus=1 + i % 8) for i in range(jobs)]
        took, duplicates = await publish_all(bus, specs, in_flight)
        print(
            f"stored {jobs} submissions in {took:.2f} s: {jobs / took:,.0f} submissions/s "
            f"(target >= 5,000), {duplicates} reported as duplicates"
        )
        took, duplicates = await publish_all(bus, specs, in_flight)
        stored = (await bus.js.stream_info(subjects.JOBS_STREAM)).state.messages
        print(
            f"the same {jobs} again: {jobs / took:,.0f} submissions/s, {duplicates} refused as duplicates, "
            f"{stored} stored in all"
        )
    finally:
        await bus.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--in-flight", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, embedded_nats(Path(folder)) as nats:
        asyncio.run(run(nats, args.jobs, args.in_flight))


if __name__ == "__main__":
    main()
