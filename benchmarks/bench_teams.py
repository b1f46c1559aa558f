"""Sharing pays, for every team: two teams on sia-hetero-64 with the goodput policy (docs/teams.md).

    .venv/bin/python benchmarks/bench_teams.py [--team-file examples/teams/sia-hetero-64.yaml]
        [--out out/bench-teams] [--plot docs/figures/teams-sharing.png] [--policy goodput] [--flood 3]

The workload, made here from the reference traces (never stored in the repository): team `vision`
submits the 160 jobs of Sia's Philly workload-1, team `nlp` the 160 jobs of Sia's Helios (saturn)
workload-1, both on one timeline from t = 0. Two traces of two clusters are two teams' independent
arrival processes, of the same size and length, as two teams sharing a cluster have; splitting one
trace by model instead would leave one team with 85% of the jobs (cifar10 is 134 of each trace's
160). The team names are the issue's; what matters is two streams of jobs of comparable load.

Runs, each with the same policy, the whole workload simulated (finish-time fairness off):

- shared: both teams on sia-hetero-64 with the team file;
- alone: each team's jobs on a cluster of exactly its guaranteed nodes (the file's quotas, whole
  nodes of each type), which is also that team's static slice; the slices' cluster average is the
  average JCT of both alone runs' jobs together;
- shared, no team file: both teams on the whole cluster with no guarantees (what the team file
  adds over plain sharing);
- flood: vision submits every job `--flood` times (copies at the same time), nlp as before: shared
  with the team file, shared without it, and vision's flood alone on its slice.

It prints, per team, the shared and the alone average JCT and their ratio (the sharing incentive:
at most 1), the cluster's average JCT shared and on the slices, and what the flood does to nlp with
and without the team file. The derived workloads and the slices' cluster files are written under
`--out`, with each run's result JSON; `--plot` draws each team's GPUs over time against its quota in the shared and the flood
runs. Runs go in parallel, one process per CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from shared.cluster import Cluster, load_cluster
from shared.schema.teams import TeamFile
from shared.settings import DEFAULT_POLICY, settings_for
from shared.teams import load_team_file, resolve, scoped_id
from sim.reference import WorkloadJob, load_workload, reference_root
from sim.workload import write_workload

REPO = Path(__file__).resolve().parent.parent
CLUSTER = "sia-hetero-64"
# Every run, the slices' too, with sia-hetero-64's calibration: a cluster file implies none, and
# Sia's (cifar10 1.8 times slower, restarts of 15 to 250 s) would then favour the slices.
CALIBRATION = settings_for(None, CLUSTER).name
TRACES = {  # team -> its jobs: a Sia workload file under the reference folder
    "vision": "sia/sia-simulator/workloads/philly/workload-1.csv",
    "nlp": "sia/sia-simulator/workloads/saturn/workload-1.csv",
}


def team_jobs(team: str, trace: Path, copies: int = 1) -> list[WorkloadJob]:
    """A trace's jobs as `team`'s, named `team.name` (a copy beyond the first `team.name~k`)."""
    jobs = []
    for job in load_workload(trace):
        for k in range(copies):
            name = scoped_id(team, job.name if k == 0 else f"{job.name}~{k}")
            jobs.append(dataclasses.replace(job, name=name, team=team))
    return jobs


def slice_cluster(file: TeamFile, cluster: Cluster, team: str) -> dict:
    """The cluster file of exactly `team`'s guaranteed nodes: its quota of each type in whole nodes."""
    quota = resolve(file, cluster).teams[team].quota
    nodes = []
    for gpu_type, gpus in quota.items():
        per_node = cluster.gpus_per_node(gpu_type)
        if gpus % per_node:
            raise ValueError(f"team {team}: its {gpus} GPUs of {gpu_type} are not whole nodes of {per_node}")
        if gpus:
            nodes.append({"gpu_type": gpu_type, "count": gpus // per_node, "gpus_per_node": per_node})
    return {"name": f"{cluster.name}-{team}", "nodes": nodes}


def run_case(case: tuple) -> tuple[str, dict, float]:
    """One simulation in a worker process: (label, its result, wall seconds)."""
    from sim.run import Simulation, simulate

    label, workload, cluster, policy, team_file = case
    start = time.perf_counter()
    result = simulate(Simulation(workload, cluster, policy, calibration=CALIBRATION, teams=team_file), fairness=False)
    return label, result, time.perf_counter() - start


def mean_jct(results: list[dict], team: str | None = None) -> float:
    """The average JCT of the jobs of `results` together (only `team`'s, if named), finished ones."""
    jcts = [j["jct_s"] for r in results for j in r["jobs"] if team in (None, j["team"])]
    if any(jct is None for jct in jcts):
        raise RuntimeError("a job did not finish: the averages would not compare")
    return float(np.mean(jcts))


def plot(results: dict[str, dict], path: Path) -> None:
    """Each team's GPUs over time against its quota: the shared run above, the flood below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sim.run import draw_team_use

    runs = [(label, results[label]) for label in ("shared", "flood") if label in results]
    fig = plt.figure(figsize=(19, 4.2 * len(runs)), layout="constrained")
    for figure, (label, result) in zip(np.atleast_1d(fig.subfigures(len(runs), 1)), runs):
        draw_team_use(result, figure)
        figure.suptitle(f"{label}: {len(result['jobs'])} jobs, avg JCT {result['avg_jct_s'] / 3600:.2f} h")
    fig.suptitle(f"two teams on {CLUSTER}, {results['shared']['policy']} policy: GPUs held per team (dashed: quota)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--team-file", default=str(REPO / "examples/teams/sia-hetero-64.yaml"))
    parser.add_argument("--policy", default=DEFAULT_POLICY)
    parser.add_argument(
        "--flood", type=int, default=3, help="vision's jobs are submitted this many times (0: no flood)"
    )
    parser.add_argument("--out", default="out/bench-teams", help="folder for the derived workloads and clusters")
    parser.add_argument("--plot", help="PNG: each team's GPUs over time against its quota")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    file, cluster, root = load_team_file(args.team_file), load_cluster(CLUSTER), reference_root()
    if set(file.teams) != set(TRACES):
        parser.error(f"the team file must name the teams {', '.join(TRACES)}")
    jobs = {team: team_jobs(team, root / trace) for team, trace in TRACES.items()}
    workloads = {"both": out / "two-teams.csv"}
    write_workload(sorted(jobs["vision"] + jobs["nlp"], key=lambda j: j.time), workloads["both"])
    slices = {}
    for team in TRACES:
        workloads[team] = out / f"{team}.csv"
        write_workload(jobs[team], workloads[team])
        slices[team] = out / f"{CLUSTER}-{team}.yaml"
        slices[team].write_text(yaml.safe_dump(slice_cluster(file, cluster, team), sort_keys=False))
    cases = [
        ("shared", workloads["both"], CLUSTER, file),
        ("shared, no team file", workloads["both"], CLUSTER, None),
        *((f"{team} alone", workloads[team], slices[team], None) for team in TRACES),
    ]
    if args.flood > 1:
        flood = team_jobs("vision", root / TRACES["vision"], args.flood)
        workloads["flood"], workloads["vision flood"] = out / "two-teams-flood.csv", out / "vision-flood.csv"
        write_workload(sorted(flood + jobs["nlp"], key=lambda j: j.time), workloads["flood"])
        write_workload(flood, workloads["vision flood"])
        cases += [
            ("flood", workloads["flood"], CLUSTER, file),
            ("flood, no team file", workloads["flood"], CLUSTER, None),
            ("vision flood alone", workloads["vision flood"], slices["vision"], None),
        ]
    results, took = {}, {}
    with concurrent.futures.ProcessPoolExecutor(min(args.processes, len(cases))) as pool:
        runs = [(label, str(workload), str(on), args.policy, team_file) for label, workload, on, team_file in cases]
        for label, result, wall in pool.map(run_case, runs):
            results[label], took[label] = result, wall
            (out / f"{label.replace(' ', '-').replace(',', '')}.json").write_text(json.dumps(result))
            print(f"  {label}: {len(result['jobs'])} jobs in {wall:.0f} s", file=sys.stderr)

    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(
        f"{datetime.date.today()}, {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}), {time.perf_counter() - started:.0f} s"
    )
    print(
        f"team file {args.team_file}, policy {args.policy}, cluster {CLUSTER}, {CALIBRATION} calibration; "
        "times in hours"
    )
    for team in TRACES:
        quota = ", ".join(f"{t} {n}" for t, n in results["shared"]["teams"][team]["quota"].items())
        print(f"  {team}: {len(jobs[team])} jobs of {TRACES[team]}; quota {quota}")
    print()
    print("| team | jobs | shared avg JCT | alone avg JCT | shared / alone | shared p99 | alone p99 | borrowed GPU-h |")
    print("|---|---|---|---|---|---|---|---|")
    shared = results["shared"]
    for team in TRACES:
        mine, alone = shared["teams"][team], results[f"{team} alone"]
        ratio = mine["avg_jct_s"] / alone["avg_jct_s"]
        print(
            f"| {team} | {mine['jobs']} | {mine['avg_jct_s'] / 3600:.3f} | {alone['avg_jct_s'] / 3600:.3f} | "
            f"{ratio:.2f} | {mine['p99_jct_s'] / 3600:.3f} | {alone['p99_jct_s'] / 3600:.3f} | "
            f"{mine['borrowed_gpu_hours']:.1f} |"
        )
    slices_avg = mean_jct([results[f"{team} alone"] for team in TRACES])
    plain = results["shared, no team file"]
    print(
        f"| cluster | {len(shared['jobs'])} | {shared['avg_jct_s'] / 3600:.3f} | {slices_avg / 3600:.3f} (slices) | "
        f"{shared['avg_jct_s'] / slices_avg:.2f} | {shared['p99_jct_s'] / 3600:.3f} | | |"
    )
    print(
        f"shared with no team file: cluster {plain['avg_jct_s'] / 3600:.3f}, "
        + ", ".join(f"{team} {mean_jct([plain], team) / 3600:.3f}" for team in TRACES)
    )
    policy_ms = {label: results[label]["policy_runtime_ms"] for label in ("shared", "shared, no team file")}
    print(
        "policy ms p50/p95: " + "; ".join(f"{label} {ms['p50']:.1f}/{ms['p95']:.1f}" for label, ms in policy_ms.items())
    )
    if args.flood > 1:
        flood, unguarded, alone = results["flood"], results["flood, no team file"], results["nlp alone"]
        print()
        print(f"vision floods ({args.flood}x its jobs, {len(flood['jobs'])} jobs in all):")
        print("| run | vision avg JCT | nlp avg JCT | nlp / nlp alone | cluster avg JCT |")
        print("|---|---|---|---|---|")
        for label, result in (("with the team file", flood), ("no team file", unguarded)):
            nlp = mean_jct([result], "nlp")
            print(
                f"| {label} | {mean_jct([result], 'vision') / 3600:.3f} | {nlp / 3600:.3f} | "
                f"{nlp / alone['avg_jct_s']:.2f} | {result['avg_jct_s'] / 3600:.3f} |"
            )
        print(
            f"| alone on its slice | {results['vision flood alone']['avg_jct_s'] / 3600:.3f} | "
            f"{alone['avg_jct_s'] / 3600:.3f} | 1.00 | |"
        )
        reclaimed = {team: flood["teams"][team]["reclaimed"] for team in TRACES}
        print(
            "reclaims in the flood (jobs shrunk or stopped for the other team): "
            + ", ".join(f"{team}'s {n}" for team, n in reclaimed.items())
        )
    if args.plot:
        plot(results, Path(args.plot))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
