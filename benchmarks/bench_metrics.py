"""Benchmark of what a Prometheus scrape every second adds to a round.

    .venv/bin/python benchmarks/bench_metrics.py [--repetitions 10] [--workload CSV] [--policy goodput]

The round loop runs in this process (the simulator: `sim.run.simulate`, the model zoo's jobs on
sia-hetero-64) with the metrics installed as a service installs them (`setup_metrics`, an endpoint
on a free port), and each run is made twice, side by side: once alone and once with a thread that
GETs the endpoint every second, alternating which goes first. A round's time is the wall time
between the loop's progress calls (one per round). The runs are the same rounds, so each round of a
scraped run is compared with the same round unscraped.

Printed: the median and mean round time of each, and the difference (the mean's is the cost spread
over every round); for the rounds a scrape landed in, what it added (the same round's time minus its
median unscraped); and what one scrape takes, over HTTP and in-process, and how large it is. The
registry holds what a policy leader exports (every series of its catalog metrics, with the
cluster's GPU types, every stage and state) beside what the loop records itself. Target: a scrape
every second adds under 1 ms to a round.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from services.simulated.truth import job_sources
from shared import metrics
from shared.cluster import load_cluster
from shared.settings import DEFAULT_POLICY
from sim.run import Simulation, simulate
from sim.workload import BUILT_IN_WORKLOAD

CLUSTER = "sia-hetero-64"
SCRAPE_EVERY_S = 1.0
# Each label's values in a policy leader's series (the GPU types come from the cluster).
LABEL_VALUES = {
    "state": ("allocated", "idle", "borrowed"),
    "stage": ("facts", "models", "solve", "place", "apply", "advance"),
    "endpoint": ("status", "rounds", "explain"),
    "outcome": ("ok", "refused", "error"),
}


def fill_policy_series(policy: str, gpu_types: tuple[str, ...]) -> int:
    """Record one value in every series a policy leader exports (its catalog metrics, each label
    combination), so a scrape is as large as the leader's; how many series."""
    values = {**LABEL_VALUES, "gpu_type": gpu_types, "policy": (policy,)}
    count = 0
    for metric in metrics.CATALOG:
        if not {"policy", "every"} & set(metric.exporters):
            continue
        combinations: list[dict[str, str]] = [{}]
        for label in metric.labels:
            combinations = [{**c, label: v} for c in combinations for v in values[label]]
        instrument = metrics.instrument(metric)
        for labels in combinations:
            if metric.kind == "histogram":
                instrument.record(0.01, labels)
            elif metric.kind == "gauge":
                instrument.set(1.0, labels)
            else:
                instrument.add(1, labels)
            count += 1
    return count


# Prometheus's side, a process of its own as Prometheus is: a GET every `every` seconds, each
# printed as its start and end (time.monotonic: one clock for every process of the machine).
SCRAPER = """
import os, sys, time, urllib.request
url, every = sys.argv[1], float(sys.argv[2])
scrape = urllib.request.Request(url, headers={"Authorization": "Bearer " + os.environ["BENCH_METRICS_TOKEN"]})
while True:
    start = time.monotonic()
    with urllib.request.urlopen(scrape, timeout=10) as answer:
        answer.read()
    print(start, time.monotonic(), flush=True)
    time.sleep(max(0.0, start + every - time.monotonic()))
"""


class Scraper:
    """A process that scrapes `url` every SCRAPE_EVERY_S while in a `with`; then `spans`, when each
    scrape ran (time.monotonic)."""

    def __init__(self, url: str, token: str):
        self.url, self.token = url, token
        self.spans: list[tuple[float, float]] = []

    def __enter__(self) -> Scraper:
        command = [sys.executable, "-c", SCRAPER, self.url, str(SCRAPE_EVERY_S)]
        environment = {**os.environ, "BENCH_METRICS_TOKEN": self.token}  # the operator's, as Prometheus sends it
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment)
        self.first = self.process.stdout.readline()  # started and scraping: its start-up is no round's
        return self

    def __exit__(self, *_) -> None:
        self.process.terminate()
        out, _ = self.process.communicate()
        lines = [self.first, *out.splitlines()]
        self.spans = [(float(a), float(b)) for a, b in (line.split() for line in lines if line.strip())]


def run_rounds(workload: str, policy: str, sources, scraper: Scraper | None) -> list[tuple[float, float]]:
    """One run of the loop: each round's (start, end), time.monotonic, from the end of its first
    (whose start is the run's setup) on."""
    marks: list[float] = []
    progress = lambda *_: marks.append(time.monotonic())  # noqa: E731 - one round, one mark
    if scraper is None:
        simulate(Simulation(workload, CLUSTER, policy), sources=sources, fairness=False, progress=progress)
    else:
        with scraper:
            simulate(Simulation(workload, CLUSTER, policy), sources=sources, fairness=False, progress=progress)
    return list(zip(marks[:-1], marks[1:]))


def time_one_scrape(times: int = 200) -> tuple[float, int]:
    """The median time (ms) of what a scrape costs this process (the text made from every series),
    and its size (bytes)."""
    took = []
    for _ in range(times):
        start = time.perf_counter()
        text = metrics.scrape()
        took.append(time.perf_counter() - start)
    return statistics.median(took) * 1e3, len(text.encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=10, help="runs of each, alternating (default: %(default)s)")
    parser.add_argument("--workload", default=str(BUILT_IN_WORKLOAD), help="workload CSV (default: the built-in one)")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="policy (default: %(default)s)")
    args = parser.parse_args()
    if args.repetitions < 1:
        parser.error("--repetitions must be at least 1")

    token = secrets.token_urlsafe(32)
    with tempfile.NamedTemporaryFile("w", suffix=".token") as token_file:  # 0600: the endpoint's, as a service's
        token_file.write(token)
        token_file.flush()
        metrics.setup_metrics("goodput-bench", port=0, token_file=token_file.name)
    host, port = metrics.metrics_address()
    url = f"http://{host}:{port}/metrics"
    gpu_types = tuple(dict.fromkeys(node.gpu_type for node in load_cluster(CLUSTER).nodes))
    series = fill_policy_series(args.policy, gpu_types)
    sources = job_sources(use_zoo=True)
    run_rounds(args.workload, args.policy, sources, None)  # warm-up: imports, caches, the policy's first solves

    plain: list[list[float]] = []  # each run's round times (ms)
    scraped: list[list[float]] = []
    landed: list[tuple[int, float]] = []  # (round, ms) of each round a scrape overlapped
    scrapes: list[float] = []  # each scrape's time (ms), as the scraper saw it
    cpu: dict[str, list[float]] = {"plain": [], "scraped": []}  # this process's CPU time a round (ms), each run
    for repetition in range(args.repetitions):
        order = ("plain", "scraped") if repetition % 2 == 0 else ("scraped", "plain")
        for kind in order:
            scraper = Scraper(url, token) if kind == "scraped" else None
            cpu_start = time.process_time()
            rounds = run_rounds(args.workload, args.policy, sources, scraper)
            cpu[kind].append((time.process_time() - cpu_start) * 1e3 / len(rounds))
            times = [(end - start) * 1e3 for start, end in rounds]
            (plain if kind == "plain" else scraped).append(times)
            if scraper is not None:
                scrapes += [(end - start) * 1e3 for start, end in scraper.spans]
                landed += [
                    (i, times[i])
                    for i, (start, end) in enumerate(rounds)
                    if any(s < end and e > start for s, e in scraper.spans)
                ]
        print(
            f"repetition {repetition + 1}: median round {np.median(plain[-1]):.3f} ms alone, "
            f"{np.median(scraped[-1]):.3f} ms scraped",
            flush=True,
        )
    lengths = {len(times) for times in plain + scraped}
    assert len(lengths) == 1, f"the runs differ in their rounds: {lengths}"
    unscraped = np.median(np.array(plain), axis=0)  # each round's median time alone
    alone, with_scrapes = np.concatenate(plain), np.concatenate(scraped)
    in_process_ms, size = time_one_scrape()
    samples = sum(line.startswith("goodput_") for line in metrics.scrape().splitlines())
    added = [ms - unscraped[i] for i, ms in landed]

    print(
        f"\n{args.repetitions} x 2 runs of {lengths.pop()} rounds ({Path(args.workload).name}, "
        f"{args.policy} on {CLUSTER}); "
        f"a scrape every {SCRAPE_EVERY_S:.0f} s of {series} goodput label sets, {samples} samples "
        "(+ the process's own)"
    )
    print(f"  {'':<22}{'median':>10}{'mean':>10}{'p95':>10}   (ms a round)")
    for label, times in (("alone", alone), ("scraped every second", with_scrapes)):
        print(f"  {label:<22}{np.median(times):>10.3f}{times.mean():>10.3f}{np.percentile(times, 95):>10.3f}")
    print(
        f"  {'difference':<22}{np.median(with_scrapes) - np.median(alone):>+10.3f}"
        f"{with_scrapes.mean() - alone.mean():>+10.3f}"
    )
    cpu_alone, cpu_scraped = np.median(cpu["plain"]), np.median(cpu["scraped"])
    print(
        f"  CPU time of this process a round (every thread, the endpoint's too): {cpu_alone:.3f} ms alone, "
        f"{cpu_scraped:.3f} ms scraped ({cpu_scraped - cpu_alone:+.3f})"
    )
    if added:
        print(
            f"  the {len(added)} rounds a scrape landed in: {np.median(added):+.3f} ms median, "
            f"{np.percentile(added, 95):+.3f} ms p95 (against the same round alone)"
        )
    print(
        f"  one scrape: {statistics.median(scrapes):.3f} ms over HTTP (median of {len(scrapes)}, from "
        f"another process), of which {in_process_ms:.3f} ms making its text in this one; {size} bytes"
    )


if __name__ == "__main__":
    main()
