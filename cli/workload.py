"""`goodput workload` — write a synthetic workload CSV (the reference format)."""

from __future__ import annotations

import argparse

from cli.output import add_out_argument


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("workload", help="generate a synthetic workload CSV from the model zoo")
    parser.add_argument("--jobs", type=int, default=40, help="number of jobs (default: %(default)s)")
    parser.add_argument("--hours", type=float, default=2.0, help="arrival window in hours (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--teams",
        metavar="NAME,NAME",
        help="each job belongs to one of these teams, drawn uniformly (a `team` column; docs/teams.md)",
    )
    add_out_argument(parser, "workload", "workload.csv", "CSV to write")
    parser.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from sim.workload import generate_workload, write_workload

    teams = tuple(name.strip() for name in args.teams.split(",")) if args.teams else ()
    jobs = generate_workload(args.jobs, args.hours, args.seed, teams=teams)
    write_workload(jobs, args.out)
    among = f" among teams {', '.join(teams)}" if teams else ""
    print(f"wrote {args.out}: {len(jobs)} jobs over {args.hours:g} h (seed {args.seed}){among}")
    return 0
