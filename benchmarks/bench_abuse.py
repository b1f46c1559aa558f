"""What one login can make another suffer, on the embedded stack (secured, as `goodput up` runs
it): the latency of another login's `goodput.api.submit` alone, while the first floods the API with
60 KiB submissions as fast as one connection publishes them, while it has 300 pages of
`goodput.api.jobs` (limit 500) in flight, and after it pointed every service's `$SRV` answer at the
jobs stream and the runs bucket. Both logins are clients with nats-py alone.

    .venv/bin/python benchmarks/bench_abuse.py
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

import nats
import numpy as np

from launcher.nats import SECRETS
from launcher.stack import another_login, users_view
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


async def while_running(attack: str, url: str, folder: Path, nc) -> list[float]:
    """The other login's latencies while `attack` runs as `user`, in a process of its own (started a
    second before, stopped after)."""
    process = multiprocessing.Process(
        target=attacker, args=(attack, url, (folder / SECRETS / "user").read_text().strip())
    )
    process.start()
    await asyncio.sleep(1.0)
    try:
        return await latencies(nc)
    finally:
        process.terminate()
        process.join()


def attacker(attack: str, url: str, password: str) -> None:
    """As the login `user`, with nats-py alone: `flood` publishes 60 KiB submissions as fast as one
    connection does; `pages` keeps 300 pages of 500 jobs in flight."""

    async def run() -> None:
        nc = await nats.connect(url, user="user", password=password, inbox_prefix="_INBOX_user")
        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=_ignore)
        body = json.dumps({"id": "flood", "application": "cifar10", "pad": " " * 60_000}).encode()
        while True:
            if attack == "flood":
                for _ in range(50):
                    await nc.publish(subjects.API_SUBMIT, body, reply=inbox)
                await asyncio.sleep(0)
            else:
                await asyncio.gather(
                    *(nc.request(subjects.API_JOBS, b'{"limit": 500}', timeout=120) for _ in range(300)),
                    return_exceptions=True,
                )

    asyncio.run(run())


async def run(folder: Path) -> None:
    async with users_view(folder) as user:  # the `user` login, nats-py alone
        url = user.connected_url.geturl()
        bob = await another_login(folder, "bob", url)
        try:
            print(shown("bob alone", await latencies(bob)), flush=True)
            print(
                shown("bob while user floods 60 KiB submissions", await while_running("flood", url, folder, bob)),
                flush=True,
            )
            print(
                shown("bob while user has 300 pages of 500 in flight", await while_running("pages", url, folder, bob)),
                flush=True,
            )
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
