"""The user API under a burst, on the embedded stack (secured, as `goodput up` runs it), asked by
`--logins` logins at once, each with nats-py alone and JSON bodies: `--jobs` submissions in all to
`goodput.api.submit`, `--in-flight` at a time (shared out: a login may have 16 in hand), each answered
once it is stored (or refused); then the same bodies submitted again (each a repeat, nothing
stored), then one `goodput.api.job` after another.

    .venv/bin/python benchmarks/bench_api.py [--jobs 1000] [--in-flight 64] [--logins 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from launcher.stack import another_login, users_view

SUBMIT, JOB = "goodput.api.submit", "goodput.api.job"  # as a client in another language writes them


async def burst(logins: list, bodies: list[bytes], in_flight: int) -> tuple[float, list[float], list[dict]]:
    """(seconds, each answer's milliseconds, the answers) for every body, `in_flight` at a time,
    shared out over the logins' connections (body i from login i mod their number)."""
    gates = [asyncio.Semaphore(max(1, in_flight // len(logins))) for _ in logins]
    times: list[float] = []

    async def one(i: int, body: bytes) -> dict:
        nc = logins[i % len(logins)]
        async with gates[i % len(logins)]:
            started = time.perf_counter()
            answer = json.loads((await nc.request(SUBMIT, body, timeout=120)).data)
            times.append((time.perf_counter() - started) * 1000)
            return answer

    start = time.perf_counter()
    answers = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    return time.perf_counter() - start, times, answers


def shown(name: str, took: float, times: list[float], count: int) -> str:
    p50, p95 = np.percentile(times, [50, 95])
    return (
        f"{name:<36} {count / took:7.0f} a second ({count} in {took:.2f} s); answer p50 {p50:6.1f} ms, "
        f"p95 {p95:6.1f} ms, max {max(times):6.1f} ms"
    )


async def run(folder: Path, jobs: int, in_flight: int, logins: int) -> None:
    async with users_view(folder) as nc:  # the user's login, nats-py alone; and more logins
        url = nc.connected_url.geturl()
        connections = [nc, *[await another_login(folder, f"team-{n}", url) for n in range(1, logins)]]
        bodies = [
            json.dumps({"id": f"api-{i}", "application": "cifar10", "requested_gpus": 1 + i % 4}).encode()
            for i in range(jobs)
        ]
        took, times, answers = await burst(connections, bodies, in_flight)
        accepted = sum(a["accepted"] for a in answers)
        print(shown(f"submitted ({accepted} accepted)", took, times, jobs), flush=True)
        took, times, answers = await burst(connections, bodies, in_flight)
        repeats = sum("not stored again" in a.get("reason", "") for a in answers)
        print(shown(f"the same again ({repeats} repeats)", took, times, jobs), flush=True)
        looked = []
        start = time.perf_counter()
        for i in range(0, jobs, max(jobs // 50, 1)):
            asked = time.perf_counter()
            await nc.request(JOB, json.dumps({"id": f"api-{i}"}).encode(), timeout=60)
            looked.append((time.perf_counter() - asked) * 1000)
        print(shown("looked up one after another", time.perf_counter() - start, looked, len(looked)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument(
        "--logins", type=int, default=4, help="logins submitting at once (each holds at most 16 in hand)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(run(Path(folder), args.jobs, args.in_flight, args.logins))


if __name__ == "__main__":
    main()
