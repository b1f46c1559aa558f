"""The `goodput` policy's time per round against the cluster's size: a scaling curve.

    .venv/bin/python benchmarks/bench_scaling.py [--gpus 64 512 2048 8192 16384] [--rounds 5]
        [--out docs/figures/policy-scaling.png] [--reference DIR]

On each sia-hetero-N cluster (sia-hetero-64's node groups times N / 64), the workload of
`bench_policy.py --cluster` (Philly workload-1 with every job repeated max(1, N / 256) times, the
arrivals compressed 1,000x: every job active from the first round on), `--rounds` rounds of it.
Prints the table (GPUs, active jobs, policy ms p50 / p95 / max) and draws p50 and p95 against the
GPUs into the PNG, each point labelled with its active jobs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
from bench_policy import Timed, grown_workload  # this folder (the script's) is on the path

import sim.run
from services.simulated.truth import job_sources
from shared.cluster import load_cluster
from sim.reference import reference_root
from sim.run import Simulation, simulate


def measure(gpus: int, rounds: int, sources, base: Path) -> dict:
    cluster = f"sia-hetero-{gpus}"
    spec = load_cluster(cluster)
    jobs = grown_workload(base, max(1, spec.total_gpus // 256), 1000.0)
    timed = Timed("goodput", quality=False)
    start = time.perf_counter()
    with (
        mock.patch.object(sim.run, "make_policy", lambda *_, **__: timed),
        mock.patch.object(sim.run, "results", lambda *_, **__: {}),
    ):
        simulate(Simulation(jobs, cluster, "goodput", horizon_s=rounds * 60.0), sources=sources, fairness=False)
    ms = np.array([r[1] for r in timed.rounds])
    active = [r[0] for r in timed.rounds]
    p50, p95 = np.percentile(ms, [50, 95])
    return SimpleNamespace(
        gpus=spec.total_gpus,
        configs=len(spec.configurations()),
        jobs=len(jobs),
        active=int(np.median(active)),
        p50=float(p50),
        p95=float(p95),
        max=float(ms.max()),
        wall=time.perf_counter() - start,
    ).__dict__


def draw(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [r["gpus"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(gpus, [r["p50"] for r in rows], "o-", label="p50")
    ax.plot(gpus, [r["p95"] for r in rows], "s--", label="p95")
    ax.plot(gpus, [r["max"] for r in rows], "^:", label="max")
    for r in rows:
        ax.annotate(
            f"{r['active']:,} jobs", (r["gpus"], r["p95"]), textcoords="offset points", xytext=(0, 8), ha="center"
        )
    ax.axhline(1000, color="grey", lw=0.8)
    ax.text(gpus[0], 1080, "1 s: the p95 target at 16,384 GPUs", color="grey", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (sia-hetero-N)")
    ax.set_ylabel("policy time per round, ms")
    ax.set_title("goodput policy per round (goodput matrix + ILP), 2-core machine")
    ax.legend(loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 512, 2048, 8192, 16384])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="docs/figures/policy-scaling.png")
    parser.add_argument("--reference", help="reference folder (default: $GOODPUT_REFERENCE, else ../shared/reference)")
    args = parser.parse_args()
    base = Path(reference_root(args.reference)) / "sia" / "sia-simulator" / "workloads" / "philly" / "workload-1.csv"
    sources = job_sources(args.reference)
    rows = [measure(gpus, args.rounds, sources, base) for gpus in args.gpus]
    print("| GPUs | configurations | jobs | active jobs (median round) | policy ms p50 / p95 / max |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['gpus']:,} | {r['configs']:,} | {r['jobs']:,} | {r['active']:,} | "
            f"{r['p50']:.1f} / {r['p95']:.1f} / {r['max']:.1f} |"
        )
    draw(rows, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
