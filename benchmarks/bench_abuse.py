"""What one login can make another suffer, on the embedded stack (secured, as `goodput up` runs
it): the latency of another login's `goodput.api.submit` alone, while the first floods the API with
60 KiB submissions as fast as one connection publishes them, while it has 300 pages of
`goodput.api.jobs` (limit 500) in flight, and after it pointed every service's `$SRV` answer at the
jobs stream and the runs bucket. Both logins are clients with nats-py alone.

    .venv/bin/python benchmarks/bench_abuse.py
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from deploy.stack import another_login, users_view
from shared import subjects

ASKS = 20
numbers = itertools.count()


async def latencies(nc) -> list[float]:
    """Milliseconds of ASKS submissions (each a new job), one after another, each accepted."""
    times = []
    for _ in range(ASKS):
        job = {"id": f"bob-{next(numbers)}", "application": "cifar10"}
        started = time.perf_counter()
        answer = json.loads((await nc.request(subjects.API_SUBMIT, json.dumps(job).encode(), timeout=60)).data)
        times.append((time.perf_counter() - started) * 1000)
        assert answer["accepted"], answer
    return times


def shown(name: str, times: list[float]) -> str:
    p50, p95 = np.percentile(times, [50, 95])
    return f"{name:<52} p50 {p50:7.1f} ms  p95 {p95:7.1f} ms  max {max(times):7.1f} ms"


async def while_running(attack, nc) -> list[float]:
    """The other login's latencies while `attack()` runs (started a second before)."""
    task = asyncio.ensure_future(attack())
    await asyncio.sleep(1.0)
    try:
        return await latencies(nc)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def run(folder: Path) -> None:
    async with users_view(folder) as user:                  # the `user` login, nats-py alone
        bob = await another_login(folder, "bob", user.connected_url.geturl())
        try:
            print(shown("bob alone", await latencies(bob)), flush=True)
            body = json.dumps({"id": "flood", "application": "cifar10", "pad": " " * 60_000}).encode()
            inbox = user.new_inbox()
            await user.subscribe(inbox, cb=_ignore)

            async def flood() -> None:
                while True:
                    for _ in range(50):
                        await user.publish(subjects.API_SUBMIT, body, reply=inbox)
                    await asyncio.sleep(0)

            print(shown("bob while user floods 60 KiB submissions", await while_running(flood, bob)), flush=True)

            async def pages() -> None:
                await asyncio.gather(*(user.request(subjects.API_JOBS, b'{"limit": 500}', timeout=120)
                                       for _ in range(300)), return_exceptions=True)

            print(shown("bob while user has 300 pages of 500 in flight", await while_running(pages, bob)), flush=True)
            for verb in ("PING", "INFO", "STATS"):
                for target in ("$JS.API.STREAM.DELETE.GOODPUT_JOBS", "$KV.goodput_runs.live"):
                    for _ in range(100):
                        await user.publish(f"$SRV.{verb}", b"", reply=target)
            print(shown("bob after 600 $SRV requests answered onto storage", await latencies(bob)), flush=True)
        finally:
            await bob.close()


async def _ignore(_msg) -> None:
    return None


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(run(Path(folder)))


if __name__ == "__main__":
    main()
