"""`goodput interference` — average JCT with interference avoidance on and off, at several slowdowns
of distributed jobs that share a node (Pollux §5.3, Fig. 8c)."""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np

from cli.output import add_out_argument, write_results


def register(sub: argparse._SubParsersAction) -> None:
    from cli.simulate import add_simulation_arguments

    parser = sub.add_parser("interference", help="avg JCT with interference avoidance on and off, per slowdown")
    parser.add_argument("--workloads", nargs="+", required=True, help="workload CSVs or folders of them")
    parser.add_argument(
        "--policy", default="pollux", help="a policy with an avoid_interference option (default: %(default)s)"
    )
    parser.add_argument(
        "--slowdowns",
        nargs="+",
        type=float,
        default=[0.0, 0.25, 0.5],
        help="slowdowns of distributed jobs sharing a node (default: %(default)s)",
    )
    add_out_argument(parser, "interference", "interference.json")
    parser.add_argument("--plot", help="PNG: avg JCT per slowdown, avoidance on and off")
    add_simulation_arguments(parser)
    parser.set_defaults(func=_interference, cluster="pollux-homo-64", fairness=False)


def _interference(args: argparse.Namespace) -> int:
    from cli.simulate import run_spec, workload_sets
    from policies.base import policy_spec
    from services.simulated.truth import job_sources

    name, options = policy_spec(args.policy)
    bad = [f for f in args.slowdowns if not 0.0 <= f < 1.0]
    if bad:  # refused before hours of runs, not after the first
        raise ValueError(f"slowdowns are fractions in [0, 1), got {bad}")
    if name != "pollux":
        raise ValueError(f"policy {name!r} has no interference avoidance to turn off (pollux has)")
    files = [f for group in workload_sets(args.workloads).values() for f in group]
    sources = job_sources(args.reference, args.zoo)
    avoid_off = f"{args.policy}{',' if options else ':'}avoid_interference=false"
    rows = []
    for slowdown in args.slowdowns:
        run_args = copy.copy(args)
        run_args.interference = slowdown
        row = {"slowdown": slowdown}
        for key, spec in (("avoid", args.policy), ("no_avoid", avoid_off)):
            start = time.perf_counter()
            jcts = [run_spec(run_args, f, spec, sources, progress=False)["avg_jct_s"] for f in files]
            row[key] = float(np.mean(jcts))
            print(
                f"  slowdown {slowdown:.0%}, {spec}: avg JCT {row[key]:.0f} s ({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
            )
        rows.append(row)
    table = [
        f"| slowdown | avg JCT, avoidance on (s) | avg JCT, avoidance off (s) | off / on |   ({len(files)} workloads)",
        "|---|---|---|---|",
    ]
    table += [
        f"| {row['slowdown']:.0%} | {row['avoid']:.0f} | {row['no_avoid']:.0f} | {row['no_avoid'] / row['avoid']:.2f} |"
        for row in rows
    ]
    write_results(
        {"policy": args.policy, "cluster": args.cluster, "workloads": files, "rows": rows},
        args.out,
        "\n".join(table),
        lambda results, path: _plot(results["rows"], path, _title(results)),
        args.plot,
    )
    return 0


def _title(results: dict) -> str:
    """The workload files (the first few, and how many), the policy and the cluster."""
    names = [Path(f).name for f in results["workloads"]]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{shown}: {results['policy']} on {results.get('cluster', '?')}, avg JCT over {len(names)} workload(s)"


def _plot(rows: list[dict], path: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(x - 0.2, [r["avoid"] / 3600 for r in rows], 0.4, label="avoidance on")
    ax.bar(x + 0.2, [r["no_avoid"] / 3600 for r in rows], 0.4, label="avoidance off")
    ax.set_xticks(x, [f"{r['slowdown']:.0%}" for r in rows])
    ax.set_xlabel("slowdown of distributed jobs sharing a node")
    ax.set_ylabel("average JCT (h)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
