"""`goodput timeslice` — the time-slicing trade-off: the worked case, the 48-schedule sweep, the
optimal quanta, a results.json and (optionally) a figure drawn from that JSON alone."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from cli.output import add_out_argument, rounded, write_results
from sim import timeslice as ts

# JSON floats are rounded so 0.1-multiples read as written (8.7, not 8.700000000000001).
_DIGITS = 9


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "timeslice",
        help="simulate time-slicing for early feedback: worked case, sweep, optimal quanta",
    )
    add_out_argument(parser, "timeslice", "results.json", "results file")
    parser.add_argument("--plot", help="also draw last feedback vs makespan into this PNG")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    results = build_results()
    write_results(results, args.out, format_report(results), plot_feedback, args.plot)
    return 0


def _rounded(value):
    return rounded(value, _DIGITS)


def schedule_record(result: ts.ScheduleResult, cases: list[str]) -> dict:
    record = _rounded(asdict(result))
    record["cases"] = cases  # which study the schedule belongs to: "worked", "sweep" or both
    return record


def _key(r: ts.ScheduleResult) -> tuple:
    return (r.schedule, r.quantum, r.threshold, r.switch_cost_s)


def build_results() -> dict:
    """The worked case and the sweep, each schedule listed once in `schedules`."""
    worked = ts.worked_case()
    swept = ts.sweep()
    worked_keys = {_key(r) for r in worked}
    swept_keys = {_key(r) for r in swept}

    def record(r: ts.ScheduleResult) -> dict:
        return schedule_record(
            r, [name for name, keys in (("worked", worked_keys), ("sweep", swept_keys)) if _key(r) in keys]
        )

    # Worked-case schedules outside the sweep first, then the sweep in its own order.
    schedules = [record(r) for r in worked if _key(r) not in swept_keys] + [record(r) for r in swept]
    return {
        "workload": {
            "jobs": ts.SWEEP_JOBS,
            "iterations": ts.SWEEP_ITERATIONS,
            "iteration_s": ts.SWEEP_ITERATION_S,
        },
        "schedules": schedules,
        "worked_case": {
            "switch_cost_s": ts.WORKED_SWITCH_COST,
            "threshold": ts.WORKED_THRESHOLD,
            "schedules": [record(r) for r in worked],
        },
        "sweep": {
            "thresholds": list(ts.SWEEP_THRESHOLDS),
            "quanta": list(ts.SWEEP_QUANTA),
            "switch_costs_s": list(ts.SWEEP_SWITCH_COSTS),
        },
        "optimal_quanta": [_rounded(asdict(o)) for o in ts.optimal_quanta(swept)],
    }


def _label(record: dict) -> str:
    return "run-to-completion" if record["quantum"] is None else f"round-robin q={record['quantum']}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _s(x: float) -> str:
    return f"{x:.1f}"  # every time but a mean is a multiple of 0.1 s here


def _mean(x: float) -> str:
    return f"{x:.2f}"


def format_report(results: dict) -> str:
    w, wc = results["workload"], results["worked_case"]
    head = f"{w['jobs']} jobs x {w['iterations']} iterations x {w['iteration_s']:g} s on one accelerator"
    worked = _table(
        ["schedule", "first fb", "last fb", "mean fb", "makespan", "switches", "useful"],
        [
            [
                _label(r),
                _s(r["first_feedback_s"]),
                _s(r["last_feedback_s"]),
                _mean(r["mean_feedback_s"]),
                _s(r["makespan_s"]),
                str(r["switches"]),
                _s(r["useful_work_s"]),
            ]
            for r in wc["schedules"]
        ],
    )
    swept = [r for r in results["schedules"] if "sweep" in r["cases"]]
    sweep = _table(
        ["k", "switch s", "q", "first fb", "last fb", "mean fb", "makespan", "switches", "useful"],
        [
            [
                str(r["threshold"]),
                f"{r['switch_cost_s']:g}",
                str(r["quantum"]),
                _s(r["first_feedback_s"]),
                _s(r["last_feedback_s"]),
                _mean(r["mean_feedback_s"]),
                _s(r["makespan_s"]),
                str(r["switches"]),
                _s(r["useful_work_s"]),
            ]
            for r in swept
        ],
    )
    best = _table(
        ["k", "switch s", "best q", "last fb"],
        [
            [str(o["threshold"]), f"{o['switch_cost_s']:g}", ",".join(map(str, o["quanta"])), _s(o["last_feedback_s"])]
            for o in results["optimal_quanta"]
        ],
    )
    return "\n\n".join(
        [
            head,
            f"Worked case (switch cost {wc['switch_cost_s']:g} s, feedback at iteration {wc['threshold']}; times in s)\n"
            + worked,
            f"Sweep: {len(swept)} round-robin schedules (k = feedback threshold in iterations; times in s)\n" + sweep,
            "Quanta minimising last-feedback time (all ties listed)\n" + best,
        ]
    )


def plot_feedback(results: dict, path: str | Path) -> None:
    """Last feedback versus makespan for each quantum (one line across switch costs), one panel per
    threshold; uses nothing but the loaded results.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swept = [r for r in results["schedules"] if "sweep" in r["cases"]]
    thresholds = results["sweep"]["thresholds"]
    quanta = results["sweep"]["quanta"]
    markers = "osD^v<>p"
    fig, axes = plt.subplots(1, len(thresholds), figsize=(5 * len(thresholds), 4.8), squeeze=False)
    for ax, k in zip(axes[0], thresholds):
        rows = [r for r in swept if r["threshold"] == k]
        lo = min(min(r["makespan_s"], r["last_feedback_s"]) for r in rows)
        hi = max(r["makespan_s"] for r in rows)
        ax.plot([lo, hi], [lo, hi], color="0.6", lw=1, ls="--", zorder=0, label="last feedback = makespan")
        for i, q in enumerate(quanta):
            pts = sorted((r for r in rows if r["quantum"] == q), key=lambda r: r["switch_cost_s"])
            # Hollow markers shrinking with q, so coinciding schedules stay visible on top of each other.
            ax.plot(
                [r["makespan_s"] for r in pts],
                [r["last_feedback_s"] for r in pts],
                marker=markers[i % len(markers)],
                ms=12 - 2.5 * i,
                mfc="none",
                mew=1.6,
                lw=1.2,
                label=f"q = {q}",
            )
        ax.set_title(f"feedback at iteration {k}")
        ax.set_xlabel("makespan (s)")
        ax.set_ylabel("last feedback (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    w = results["workload"]
    costs = ", ".join(f"{c:g}" for c in results["sweep"]["switch_costs_s"])
    fig.suptitle(
        f"Time-slicing {w['jobs']} jobs x {w['iterations']} iterations x {w['iteration_s']:g} s on one "
        f"accelerator; each line runs left to right over switch costs {costs} s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
