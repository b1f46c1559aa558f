"""`goodput bound` — lower bounds on a workload's average JCT on a cluster (sim.bound): how far
any policy's schedule can be from the best one."""

from __future__ import annotations

import argparse
import json
import sys

from cli.simulate import add_world_arguments


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bound",
        help="lower bounds on a workload's average JCT: each job alone on the cluster; with --lp, capacity priced",
    )
    parser.add_argument("workload", help="workload CSV (the columns of goodput simulate's --workload)")
    add_world_arguments(parser)
    parser.add_argument(
        "--lp",
        action="store_true",
        help="also solve the capacity LP (time-indexed, HiGHS): tighter, a minute or more on 160 jobs",
    )
    parser.add_argument(
        "--slot", type=float, default=120.0, metavar="S", help="the LP's slot in seconds (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print the result document as JSON, nothing else")
    parser.set_defaults(func=_bound)


def _bound(args: argparse.Namespace) -> int:
    from sim.bound import workload_bounds

    if args.slot <= 0:
        raise ValueError(f"--slot is a number of seconds above 0, got {args.slot:g}")
    result = workload_bounds(
        args.workload,
        args.cluster,
        reference=args.reference,
        use_zoo=args.zoo,
        calibration=args.calibration,
        restart_delay_s=args.restart_delay,
        round_s=args.round_s,
        lp=args.lp,
        slot_s=args.slot,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(
        f"Lower bounds on the average JCT of {result['workload']} ({result['jobs']} jobs) on {result['cluster']} "
        f"({result['calibration']} calibration, truth: {result['truth']})"
    )
    print("  each model alone on the cluster, from its first step:")
    for model, m in sorted(result["models"].items(), key=lambda kv: -kv[1]["jobs"]):
        best = m["best_fixed"]
        print(
            f"    {model:<12} {m['jobs']:>4} jobs  {best['seconds']:>10.1f} s on {best['gpus']} {best['gpu_type']}"
            f" ({m['switching_s']:.1f} s, each epoch on its best placement)"
        )
    if "capacity_lp" in result:
        lp = result["capacity_lp"]
        print(
            f"  capacity LP ({lp['slots']} slots of {lp['slot_s']:g} s, {lp['variables']:,} variables, "
            f"solved in {lp['solve_s']:.0f} s): {lp['average_jct_s']:.1f} s"
        )
    print(f"  infinite cluster (each job alone, from its first round): {result['infinite_cluster_s']:.1f} s")
    return 0
