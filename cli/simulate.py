"""`goodput simulate` — replay one workload; `goodput compare` — several policies on several workloads."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

from cli.output import add_out_argument, write_results
from policies.base import POLICIES, policy_spec
from policies.timeslice import DEFAULT_QUANTUM
from shared.cluster import PRESETS as CLUSTERS
from shared.settings import DEFAULT_POLICY, FEEDBACK_ITERATIONS, PRESETS
from sim.decompose import PARTS, mean_parts
from sim.sweep import LOCAL, default_workers, sweep
from sim.workload import BUILT_IN_WORKLOAD, TARGETS

# What `goodput compare` runs unless told: the default policy against the peers' (with --teams: the
# policies that hold teams' guarantees).
COMPARED = [DEFAULT_POLICY, *(p for p in ("sia", "pollux", "gavel") if p != DEFAULT_POLICY)]


def add_world_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulated world: its cluster, its jobs' truth, its calibration, restarts and round."""
    parser.add_argument(
        "--cluster",
        default="sia-hetero-64",
        help=f"preset ({', '.join(CLUSTERS)}) or a YAML/JSON cluster file (default: %(default)s)",
    )
    parser.add_argument(
        "--reference",
        help="reference folder for the jobs' true behaviour "
        "(default: $GOODPUT_REFERENCE, else ../shared/reference; the model zoo if absent)",
    )
    parser.add_argument(
        "--zoo", action="store_true", help="use the built-in model zoo even when reference data is there"
    )
    parser.add_argument(
        "--calibration",
        choices=sorted(PRESETS),
        help="peer simulator calibration (default: sia on sia-hetero-64, pollux on pollux-homo-64)",
    )
    parser.add_argument(
        "--restart-delay",
        type=float,
        metavar="S",
        help="every job's checkpoint-restart (switch) delay in seconds, instead of the calibration's",
    )
    parser.add_argument(
        "--round-s",
        type=float,
        help="the simulator's round in seconds (default 60); fifo, tiresias and timeslice decide every round",
    )


def add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    add_world_arguments(parser)
    parser.add_argument("--p", type=float, help="fairness exponent of sia (default -0.5) or pollux (default -1)")
    parser.add_argument(
        "--feedback-iterations",
        type=int,
        default=FEEDBACK_ITERATIONS,
        metavar="K",
        help="record each job's time to its first K iterations (default: %(default)s)",
    )
    parser.add_argument(
        "--quantum", type=int, help=f"timeslice: iterations a job runs before it yields (default {DEFAULT_QUANTUM})"
    )
    parser.add_argument(
        "--interference",
        type=float,
        default=0.0,
        metavar="F",
        help="distributed jobs sharing a node train F slower (0-0.5; default: %(default)s)",
    )
    parser.add_argument(
        "--profile-request",
        action="store_true",
        help="the profiler also measures each job at its requested GPUs and batch on every type "
        "before it starts, at no cost (the throughput matrix Gavel assumes)",
    )
    parser.add_argument(
        "--no-fairness",
        dest="fairness",
        action="store_false",
        help="skip finish-time fairness (it simulates each distinct job alone on its fair share)",
    )
    parser.add_argument(
        "--targets",
        choices=TARGETS,
        default="given",
        help="the work each job declares (target_epochs): given: the workload's column (default); "
        "from-truth: a missing one filled with its application's real target; none: no declarations",
    )
    parser.add_argument(
        "--target-noise",
        type=noise_range,
        metavar="LO,HI",
        help="scale each declaration by a factor drawn log-uniformly in [LO, HI] (seeded by the job's name)",
    )
    parser.add_argument(
        "--teams",
        metavar="FILE",
        help="team file (docs/teams.md): each team's guaranteed GPUs per type, held every round; the "
        "workload's `team` column names each job's team; the results have each team's",
    )


def noise_range(text: str) -> tuple[float, float]:
    """`--target-noise LO,HI`: two factors, 0 < LO <= HI."""
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two numbers, e.g. 0.5,2), got {text!r}") from None
    if not 0 < lo <= hi or not np.isfinite(hi):
        raise argparse.ArgumentTypeError(f"expected 0 < LO <= HI, got {text!r}")
    return lo, hi


def register(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("simulate", help="replay a workload on a simulated cluster")
    sim.add_argument(
        "--workload",
        default=str(BUILT_IN_WORKLOAD),
        help="workload CSV (name,time,application,num_replicas,batch_size, optionally team,priority,target_epochs; "
        f"default: the built-in 40-job workload, {BUILT_IN_WORKLOAD.relative_to(BUILT_IN_WORKLOAD.parents[2])})",
    )
    sim.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        metavar="NAME[:KEY=VALUE,...]",
        help=f"one of {', '.join(POLICIES)}, with options, e.g. gavel:objective=max_sum_throughput "
        "(default: %(default)s)",
    )
    sim.add_argument(
        "--bus",
        choices=["direct", "nats"],
        default="direct",
        help="direct: the cores in this process (default); nats: the six services over a NATS "
        "server of their own, on a virtual clock",
    )
    add_out_argument(sim, "simulate", "simulation.json", "result JSON")
    sim.add_argument(
        "--plot",
        help="PNG: GPUs per application over time, the JCT CDF and the finish-time fairness CDF; "
        "with --teams, each team's GPUs over time against its quota",
    )
    add_simulation_arguments(sim)
    sim.set_defaults(func=_simulate)

    cmp = sub.add_parser("compare", help="several policies on several workload files; prints the table")
    cmp.add_argument(
        "--workloads",
        nargs="+",
        required=True,
        help="workload CSVs or folders of them (each folder is one set; cells are means over its files)",
    )
    cmp.add_argument(
        "--policies",
        nargs="+",
        metavar="NAME[:KEY=VALUE,...]",
        help=f"default: {' '.join(COMPARED)}; with --teams, the policies that hold teams' guarantees",
    )
    add_out_argument(cmp, "compare", "compare.json", "all results as JSON")
    cmp.add_argument("--plot", help="PNG: average and p99 JCT per policy and workload set")
    cmp.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        metavar="N",
        help="simulations at once, each in a process of its own (default: this machine's cores, %(default)s); "
        "1 runs them one after another in this process; the results are the same",
    )
    cmp.add_argument(
        "--engine",
        metavar="ADDRESS",
        help=f"run the simulations on the Dask cluster whose scheduler is at ADDRESS (tcp://host:8786), "
        f"or '{LOCAL}' for a Dask cluster of --workers processes started here; its workers need goodput "
        "installed and the reference data at the same path",
    )
    add_simulation_arguments(cmp)
    cmp.set_defaults(func=_compare)


def _options(args: argparse.Namespace, policy: str) -> dict:
    options = {}
    if args.p is not None and policy in ("sia", "pollux"):
        options["p"] = args.p
    if policy == "timeslice" and args.quantum is not None:
        options["quantum"] = args.quantum
    if policy in ("fifo", "tiresias", "timeslice") and args.round_s is not None:
        options["round_s"] = args.round_s  # sia and pollux keep 60 s, gavel its 360 s
    return options


def run_spec(args: argparse.Namespace, workload: str, spec: str, sources, progress: bool) -> dict:
    from sim.run import Simulation, simulate

    over = None
    if getattr(args, "bus", "direct") == "nats":
        from launcher.replay import replay_over_nats as over
    policy, options = policy_spec(spec)
    result = simulate(
        Simulation(
            workload,
            args.cluster,
            policy,
            calibration=args.calibration,
            policy_options=_options(args, policy) | options,
            feedback_iterations=args.feedback_iterations,
            restart_delay_s=args.restart_delay,
            round_s=args.round_s,
            interference=args.interference,
            profile_request=args.profile_request,
            teams=getattr(args, "team_file", None) or getattr(args, "teams", None),
            targets=args.targets,
            target_noise=args.target_noise,
        ),
        sources=sources,
        progress=progress,
        over=over,
        fairness=args.fairness,
    )
    result["policy_spec"] = spec
    return result


def compare_cell(args: argparse.Namespace, cell: tuple[str, str]) -> dict:
    """One cell of `goodput compare`: a workload file under a policy, timed (sim.sweep runs it in
    this process or another, on this machine or a Dask worker)."""
    workload, spec = cell
    start = time.perf_counter()
    result = run_spec(args, workload, spec, sources_of(args.reference, args.zoo), progress=False)
    result["took_s"] = round(time.perf_counter() - start, 2)
    return result


@functools.cache
def sources_of(reference: str | None, use_zoo: bool):
    """The jobs' truth, read once a process."""
    from services.simulated.truth import job_sources

    return job_sources(reference, use_zoo)


def check_team_run(args: argparse.Namespace, specs: list[str], workloads: list[str]) -> None:
    """With --teams: the team file read and resolved against the cluster, every policy one that
    holds teams' guarantees and every workload's teams named in it, before any truth is loaded
    (ValueError saying what is wrong); the file kept on `args.team_file` for the runs."""
    args.team_file = None
    if not getattr(args, "teams", None):
        return
    from policies.base import make_policy
    from shared.cluster import load_cluster
    from shared.teams import load_team_file
    from sim.reference import load_workload
    from sim.run import check_teams

    args.team_file = load_team_file(args.teams)
    cluster = load_cluster(args.cluster)
    source = f"team file {args.teams}"
    for spec in specs:
        policy, options = policy_spec(spec)
        check_teams(args.team_file, cluster, make_policy(policy, **options), source=source)
    for workload in workloads:
        try:
            check_teams(args.team_file, cluster, jobs=load_workload(workload), source=source)
        except ValueError as error:
            raise ValueError(f"{workload}: {error}") from None


def _hours(seconds) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.3f}"


def _simulate(args: argparse.Namespace) -> int:
    policy_spec(args.policy)  # a bad name or option refused before the truth is loaded
    check_team_run(args, [args.policy], [args.workload])
    sources = sources_of(args.reference, args.zoo)
    start = time.perf_counter()
    # On a terminal a bar; in a log or a pipe a plain line every few seconds (sim.run.progress_reporter).
    result = run_spec(args, args.workload, args.policy, sources, progress=True)
    took = time.perf_counter() - start
    report(result, took, args.out, args.plot)
    return 0


def report(result: dict, took: float, out: str, plot_path: str | None = None) -> None:
    """Print a run's summary, write its JSON (and plot)."""
    from sim.run import plot

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    title = result.get("policy_spec", result["policy"])
    profiled = ", profiled at the request" if result.get("profiled_at_request") else ""
    print(
        f"{title} on {result['cluster']}, workload {result['workload']} "
        f"({result['calibration']} calibration, truth: {result['truth']}{profiled})"
    )
    print(
        f"  jobs {len(result['jobs'])} (unfinished {result['jobs_unfinished']}), rounds {result['rounds']}, "
        f"took {took:.1f} s"
    )
    print(
        f"  avg JCT {_hours(result['avg_jct_s'])} h   p99 JCT {_hours(result['p99_jct_s'])} h   "
        f"makespan {_hours(result['makespan_s'])} h"
    )
    print(
        f"  GPU-hours/job {result['gpu_hours_per_job']:.2f}   restarts/job {result['restarts_per_job']:.2f}   "
        f"policy ms p50/p95/max {result['policy_runtime_ms']['p50']:.1f}/{result['policy_runtime_ms']['p95']:.1f}/"
        f"{result['policy_runtime_ms']['max']:.1f}"
    )
    if result.get("jct_parts_s"):
        print(f"  where the avg JCT goes (s): {parts_line(result['jct_parts_s'])}")
    if result.get("rho_max") is not None:
        print(
            f"  finish-time fairness: max rho {result['rho_max']:.2f}, p99 {result['rho_p99']:.2f}, "
            f"rho > 1 for {100 * result['rho_over_1']:.1f}% of jobs"
        )
    for name, team in (result.get("teams") or {}).items():
        quota = ", ".join(f"{t} {n}" for t, n in team["quota"].items()) or "none"
        print(
            f"  team {name}: {team['jobs']} jobs, avg JCT {_hours(team['avg_jct_s'])} h, p99 JCT "
            f"{_hours(team['p99_jct_s'])} h, {team['gpu_hours']:.1f} GPU-hours ({team['borrowed_gpu_hours']:.1f} "
            f"borrowed), reclaimed {team['reclaimed']} times; quota {quota}"
        )
    for event in result["events"][:10]:
        print(f"  event: {event}")
    print(f"wrote {path}")
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(result, plot_path)
        print(f"wrote {plot_path}")


def workload_sets(paths: list[str]) -> dict[str, list[str]]:
    sets: dict[str, list[str]] = {}
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(p.glob("*.csv"), key=lambda f: (len(f.name), f.name))
            if not files:
                raise ValueError(f"{p} holds no workload CSV files")
            sets[str(p)] = [str(f) for f in files]
        elif p.is_file():
            sets[str(p)] = [str(p)]
        else:
            raise ValueError(f"no such workload file or folder: {p}")
    return sets


METRICS = [
    ("avg_jct_s", "avg JCT h", 3600),
    ("p99_jct_s", "p99 JCT h", 3600),
    ("makespan_s", "makespan h", 3600),
    ("gpu_hours_per_job", "GPU-h/job", 1),
    ("restarts_per_job", "restarts/job", 1),
    ("rho_max", "max rho", 1),
    ("rho_over_1", "rho>1", 1),
]


# The bound on each set (its files' mean), and each policy's way from sia's average JCT to it.
BOUND_METRICS = [("bound_s", "bound h", 3600), ("to_bound", "sia→bound", 1)]


def compare_bounds(args: argparse.Namespace, sets: dict[str, list[str]], sources) -> dict[str, float]:
    """Each file's infinite-cluster bound (sim.bound), in the runs' world."""
    from sim.bound import workload_bounds

    times: dict = {}  # each model's times, once for the whole comparison: one cluster, one world
    return {
        f: workload_bounds(
            f,
            args.cluster,
            sources=sources,
            calibration=args.calibration,
            restart_delay_s=args.restart_delay,
            round_s=args.round_s,
            times=times,
        )["infinite_cluster_s"]
        for files in sets.values()
        for f in files
    }


def add_way_to_bound(rows: list[dict], runs: list[dict], bound: dict[str, float], sets: dict[str, list[str]]) -> None:
    """Each row's `to_bound`: the mean over its set's files of how far its average JCT went from
    sia's (0) to the infinite-cluster bound (1); none where sia was not run."""
    sia = {r["workload"]: r["avg_jct_s"] for r in runs if r["policy_spec"] == "sia"}
    for row in rows:
        ways = [
            (sia[r["workload"]] - r["avg_jct_s"]) / (sia[r["workload"]] - bound[r["workload"]])
            for r in runs
            if r["policy_spec"] == row["policy"]
            and r["workload"] in sets[row["workloads"]]
            and r["workload"] in sia
            and None not in (sia[r["workload"]], r["avg_jct_s"])
            and sia[r["workload"]] > bound[r["workload"]]
        ]
        row["to_bound"] = float(np.mean(ways)) if ways else None


def _mean(values: list) -> float | None:
    """Mean over the files of a set, None when no file has a value (every job unfinished)."""
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def _compare(args: argparse.Namespace) -> int:
    sets = workload_sets(args.workloads)
    if args.policies is None:
        from policies.base import team_policies

        args.policies = COMPARED if not args.teams else [p for p in COMPARED if p in team_policies()]
    for spec in args.policies:
        policy_spec(spec)  # refuse a bad name before hours of runs
    check_team_run(args, args.policies, [f for files in sets.values() for f in files])
    if args.reference:  # as the workers will read it, wherever they run
        args.reference = str(Path(args.reference).absolute())
    sources = sources_of(args.reference, args.zoo)
    rows, everything = [], []
    bounds = compare_bounds(args, sets, sources)
    # With teams, each team's average JCT too (a column per team).
    team_metrics = [
        (f"{name}_avg_jct_s", f"{name} avg JCT h", 3600) for name in (args.team_file.teams if args.team_file else ())
    ]
    cells = [(f, policy) for files in sets.values() for policy in args.policies for f in files]

    finished = itertools.count(1)

    def done(i: int, r: dict) -> None:
        f, policy = cells[i]
        line = f"{policy:<9} {f}: avg JCT {_hours(r['avg_jct_s'])} h ({r['took_s']:.0f} s)"
        print(f"  [{next(finished)}/{len(cells)}] {line}", file=sys.stderr, flush=True)

    # Each cell runs on absolute paths (a worker's folder is its own); its result names the file as given.
    tasks = [(str(Path(f).absolute()), policy) for f, policy in cells]
    task = functools.partial(compare_cell, args)
    runs_of = dict(zip(cells, sweep(task, tasks, workers=args.workers, engine=args.engine, done=done)))
    for (f, _), r in runs_of.items():
        r["workload"] = f
    for name, files in sets.items():
        for policy in args.policies:
            runs = [runs_of[f, policy] for f in files]
            everything.extend(runs)
            cells = {key: _mean([r.get(key) for r in runs]) for key, _, _ in METRICS}  # no rho: --no-fairness
            for key, _, _ in team_metrics:
                team = key.removesuffix("_avg_jct_s")
                cells[key] = _mean([r["teams"][team]["avg_jct_s"] for r in runs if team in r.get("teams", {})])
            policy_ms = [r["policy_runtime_ms"] for r in runs]
            rows.append(
                {
                    "workloads": name,
                    "files": len(files),
                    "policy": policy,
                    **cells,
                    "bound_s": _mean([bounds[f] for f in files]),
                    "to_bound": None,
                    "policy_ms_p50": float(np.mean([q["p50"] for q in policy_ms])),
                    "policy_ms_p95": float(np.mean([q["p95"] for q in policy_ms])),
                    "unfinished": sum(r["jobs_unfinished"] for r in runs),
                    "took_s": float(np.mean([r["took_s"] for r in runs])),
                    "jct_parts_s": mean_parts([r["jct_parts_s"] for r in runs])
                    if all(r.get("jct_parts_s") for r in runs)
                    else None,
                }
            )
    add_way_to_bound(rows, everything, bounds, sets)
    metrics = [
        m for m in METRICS + team_metrics + BOUND_METRICS if any(row[m[0]] is not None for row in rows)
    ]  # columns some run measured
    header = (
        "| workloads | policy | " + " | ".join(label for _, label, _ in metrics) + " | policy ms p50/p95 | run took |"
    )
    table = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        cells = " | ".join(
            "-" if row[key] is None else f"{row[key] / scale:.3f}" if key.endswith("_s") else f"{row[key]:.2f}"
            for key, _, scale in metrics
        )
        table.append(
            f"| {Path(row['workloads']).name} ({row['files']}) | {row['policy']} | {cells} | "
            f"{row['policy_ms_p50']:.1f} / {row['policy_ms_p95']:.1f} | {row['took_s']:.0f} s |"
        )
    parted = [row for row in rows if row["jct_parts_s"]]
    if parted:  # where each average JCT goes (sim.decompose)
        table += ["", "| workloads | policy | " + " | ".join(p.replace("_", " ") + " s" for p in PARTS) + " |"]
        table.append("|" + "---|" * (len(PARTS) + 2))
        table += [
            f"| {Path(row['workloads']).name} ({row['files']}) | {row['policy']} | "
            + " | ".join(f"{row['jct_parts_s'][p]:.0f}" for p in PARTS)
            + " |"
            for row in parted
        ]
    write_results(
        {"table": rows, "runs": everything},
        args.out,
        "\n".join(table),
        lambda results, path: plot_table(results["table"], path, _compare_title(results)),
        args.plot,
    )
    return 0


def parts_line(parts: dict[str, float]) -> str:
    """`compute 682, slower type 144, ...`: the parts of an average JCT (sim.decompose), in seconds."""
    return ", ".join(f"{name.replace('_', ' ')} {parts[name]:.0f}" for name in PARTS)


def _compare_title(results: dict) -> str:
    """A comparison plot's title: the workload sets (files in each) and the cluster(s) they ran on."""
    sets = ", ".join(
        f"{Path(r['workloads']).name} ({r['files']})" for r in {r["workloads"]: r for r in results["table"]}.values()
    )
    clusters = ", ".join(sorted({r["cluster"] for r in results["runs"]}))
    profiled = ", profiled at the request" if any(r.get("profiled_at_request") for r in results["runs"]) else ""
    return f"{sets} on {clusters}{profiled}"


def plot_table(rows: list[dict], path: str, title: str | None = None) -> None:
    """Grouped bars: one group per workload set, one bar per policy run on it; average and p99 JCT.
    `title` names the workloads and the cluster (default: the workload sets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["workloads"] for r in rows))
    colours = {p: f"C{i}" for i, p in enumerate(dict.fromkeys(r["policy"] for r in rows))}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, label in zip(axes, ("avg_jct_s", "p99_jct_s"), ("average JCT (h)", "p99 JCT (h)")):
        labelled: set[str] = set()
        for i, name in enumerate(sets):
            group = [r for r in rows if r["workloads"] == name and r[key] is not None]
            width = 0.8 / max(len(group), 1)
            for k, row in enumerate(group):
                x = i + (k - (len(group) - 1) / 2) * width
                first = row["policy"] not in labelled
                labelled.add(row["policy"])
                bar = ax.bar(
                    x, row[key] / 3600, width, color=colours[row["policy"]], label=row["policy"] if first else None
                )
                ax.bar_label(bar, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(sets)), [Path(s).name for s in sets])
        ax.set_ylabel(label)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)  # room for the labels and the legend
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title or ", ".join(Path(s).name for s in sets))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
