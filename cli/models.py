"""`goodput models ...` — validate the throughput model on reference data; build the model zoo."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.output import add_out_argument
from sim.reference import discover_models, reference_root


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("models", help="validate the throughput models; build the model zoo")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    report = actions.add_parser(
        "report", help="fit every (model, GPU type) of a reference folder and report prediction errors"
    )
    report.add_argument("--reference", help="reference folder (default: $GOODPUT_REFERENCE, else ../shared/reference)")
    add_out_argument(report, "models", "models-report.json", "JSON report")
    report.set_defaults(func=_report)

    zoo = actions.add_parser("zoo", help="fit the built-in model zoo from a reference folder")
    zoo.add_argument("--reference", help="reference folder (default: $GOODPUT_REFERENCE, else ../shared/reference)")
    zoo.add_argument("--out", default="sim/zoo.json", help="zoo file to write (default: %(default)s)")
    zoo.set_defaults(func=_zoo)


def _pct(stats: dict | None, key: str) -> str:
    return "-" if stats is None else f"{100 * stats[key]:.1f}%"


def _report(args: argparse.Namespace) -> int:
    from reports.models import BOOTSTRAP_TARGET, FITTED_TARGET, report

    root = reference_root(args.reference)
    reports = report(discover_models(root))
    header = (
        f"{'model':<12} {'type':<8} {'rows':>5} {'multi':>5}  {'fit med':>7} {'fit p90':>7}  "
        f"{'boot/fit med':>12}  {'best source':<18}"
    )
    print(header)
    print("-" * len(header))
    for r in reports:
        best = r.bootstrap_best
        best_text = f"{best} {_pct(r.bootstrap[best]['vs_fitted'], 'median')}" if best else "-"
        boot = "-" if r.bootstrap_median is None else f"{100 * r.bootstrap_median:.1f}%"
        print(
            f"{r.model:<12} {r.gpu_type:<8} {r.placements:>5} {'yes' if r.multi_gpu else 'no':>5}  "
            f"{_pct(r.error, 'median'):>7} {_pct(r.error, 'p90'):>7}  {boot:>12}  {best_text:<18}"
            f"{'  (' + r.note + ')' if r.note else ''}"
        )
    multi = [r for r in reports if r.multi_gpu]
    booted = [r for r in reports if r.bootstrap_ok is not None]
    pairs = [b["vs_fitted"]["median"] for r in reports for b in r.bootstrap.values()]
    print(
        f"\nfitted model, median error <= {FITTED_TARGET:.0%} (pairs with multi-GPU data): "
        f"{sum(r.fitted_ok for r in multi)} of {len(multi)}"
    )
    print(
        f"bootstrapped model within {BOOTSTRAP_TARGET:.0%} median of the fitted one "
        f"(median over source types): {sum(bool(r.bootstrap_ok) for r in booted)} of {len(booted)}; "
        f"per (type, source) pair: {sum(p <= BOOTSTRAP_TARGET for p in pairs)} of {len(pairs)}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "reference": str(root),
                "fitted_target": FITTED_TARGET,
                "bootstrap_target": BOOTSTRAP_TARGET,
                "models": [r.to_dict() for r in reports],
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


def _zoo(args: argparse.Namespace) -> int:
    from sim.zoo import build_zoo

    zoo = build_zoo(discover_models(reference_root(args.reference)))
    out = Path(args.out)
    out.write_text(json.dumps(zoo, indent=1) + "\n")
    summary = ", ".join(f"{name} ({len(model['types'])} GPU types)" for name, model in zoo["models"].items())
    print(f"wrote {out}: {summary}")
    return 0
