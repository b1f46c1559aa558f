"""What a user's login can make the status endpoints suffer, on the embedded stack (secured, as
`goodput up` runs it): the latency of `goodput.executor.status` alone, then right after six
requests that claim to come in 256 parts (which once held the endpoint 5 s each), then after
requests whose replies name the JetStream API (dropped unhandled).

    .venv/bin/python benchmarks/bench_abuse.py
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from deploy.stack import users_view
from shared import subjects

ASKS = 20


async def latencies(nc) -> list[float]:
    """Milliseconds of ASKS status requests, one after another."""
    times = []
    for _ in range(ASKS):
        started = time.perf_counter()
        await nc.request(subjects.EXECUTOR_STATUS, msgspec.msgpack.encode({}), timeout=60)
        times.append((time.perf_counter() - started) * 1000)
    return times


def shown(name: str, times: list[float]) -> str:
    p50, p95 = np.percentile(times, [50, 95])
    return f"{name:<44} p50 {p50:6.1f} ms  p95 {p95:6.1f} ms  max {max(times):6.1f} ms"


async def run(folder: Path) -> None:
    async with users_view(folder) as nc:          # the user's login, nats-py alone
        print(shown("alone", await latencies(nc)), flush=True)
        for _ in range(6):
            await nc.publish(subjects.EXECUTOR_STATUS, b"\x80", reply=nc.new_inbox(),
                             headers={"Goodput-Chunk": "0/256"})
        print(shown("after 6 requests 'in 256 parts'", await latencies(nc)), flush=True)
        for _ in range(600):
            await nc.publish(subjects.EXECUTOR_STATUS, b"\x80", reply=f"$JS.API.STREAM.DELETE.{subjects.JOBS_STREAM}")
        print(shown("after 600 requests answered onto $JS.API", await latencies(nc)), flush=True)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(run(Path(folder)))


if __name__ == "__main__":
    main()
