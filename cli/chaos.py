"""`goodput chaos` — the fault-injection suite (chaos/suite.py, docs/chaos.md): the undisturbed
replay over the embedded stack, then one replay per fault, and per fault whether any job was lost
or duplicated, any node over-filled, and the average JCT against the undisturbed run's."""

from __future__ import annotations

import argparse
import asyncio
import time


def register(sub: argparse._SubParsersAction) -> None:
    from chaos.suite import FAULTS

    chaos = sub.add_parser(
        "chaos",
        help="inject faults into replays over the embedded stack; report what was lost",
        description=__doc__,
        epilog="faults: " + "; ".join(f"{f.name}: {f.what}" for f in FAULTS),
    )
    chaos.add_argument("--out", default="out/chaos.json", help="the report, one record a fault (default: %(default)s)")
    chaos.add_argument("--quick", action="store_true", help="a smaller workload (the first 16 jobs): a few minutes")
    chaos.add_argument("--faults", nargs="+", metavar="NAME", help="only these faults (default: all)")
    chaos.add_argument("--workload", help="workload CSV (default: the built-in 40-job workload)")
    chaos.add_argument("--jobs", type=int, help="only the workload's first JOBS jobs")
    chaos.set_defaults(func=_chaos)


def _chaos(args: argparse.Namespace) -> int:
    from chaos.suite import run_suite, table, workload
    from cli.output import write_results

    jobs = workload(args.quick, args.workload, args.jobs)
    start = time.perf_counter()

    def progress(row: dict) -> None:
        ratio = f"{row['avg_jct_ratio']:.3f}" if row["avg_jct_ratio"] is not None else "—"
        print(
            f"[{time.perf_counter() - start:6.1f} s] {row['fault']}: {row['jobs_completed']}/{row['jobs_submitted']} "
            f"completed, {row['jobs_lost']} lost, {row['jobs_duplicated']} duplicated, "
            f"{row['capacity_violations']} over capacity, avg JCT ×{ratio}"
            + (f"; {'; '.join(row['notes'])}" if row["notes"] else "")
            + (f"; FAILED: {row['failure']}" if row["failure"] else ""),
            flush=True,
        )

    print(f"goodput chaos: {len(jobs)} jobs, each fault a replay of its own over the embedded stack")
    rows = asyncio.run(run_suite(jobs, args.faults, progress))
    write_results({"jobs": len(jobs), "faults": rows}, args.out, "\n" + table(rows))
    return 0 if all(row["ok"] for row in rows) else 1
