"""`goodput autoscale` — goodput-driven cloud auto-scaling of one long job (Pollux §5.4.1) against a
throughput-based auto-scaler (Or et al.): node count, statistical efficiency, cost and time of each."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from cli.output import add_out_argument, rounded, write_results
from services.simulated.truth import job_sources
from shared.settings import PRESETS, simulation_settings
from sim import autoscale as auto

_DIGITS = 6  # JSON floats: enough for hours and efficiencies, short enough to read


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "autoscale", help="goodput- vs throughput-driven cloud auto-scaling of one job (Pollux §5.4.1)"
    )
    parser.add_argument("--model", default="imagenet", help="the job's model (default: %(default)s)")
    parser.add_argument("--gpu-type", default="aws", help="the nodes' GPU type (default: %(default)s, 4x T4)")
    parser.add_argument("--gpus-per-node", type=int, default=4, help="GPUs a node (default: %(default)s)")
    parser.add_argument("--max-nodes", type=int, default=16, help="most nodes the cloud lends (default: %(default)s)")
    parser.add_argument(
        "--upper",
        type=float,
        default=auto.UPPER,
        metavar="U",
        help="scale up while goodput per node is above U of ideal (default: 2/3)",
    )
    parser.add_argument(
        "--lower",
        type=float,
        default=auto.LOWER,
        metavar="L",
        help="... to the size where it is about L of ideal; scale down below L (default: 1/2)",
    )
    parser.add_argument(
        "--period", type=float, default=60.0, metavar="S", help="seconds between decisions (default: %(default)s)"
    )
    parser.add_argument(
        "--baseline-local-batch",
        type=int,
        metavar="M",
        help="the throughput scaler's fixed per-GPU batch (default: the largest that fits a GPU)",
    )
    parser.add_argument(
        "--reference",
        help="reference folder for the job's true behaviour (default: "
        "$GOODPUT_REFERENCE, else ../shared/reference; the zoo if absent)",
    )
    parser.add_argument("--zoo", action="store_true", help="the built-in model zoo even when reference data is there")
    parser.add_argument(
        "--calibration",
        choices=sorted(PRESETS),
        default="pollux",
        help="simulator calibration: restart delays, per-GPU batch caps (default: %(default)s)",
    )
    parser.add_argument(
        "--restart-delay",
        type=float,
        metavar="S",
        help="a rescale's checkpoint-restart delay, instead of the calibration's",
    )
    add_out_argument(parser, "autoscale", "autoscale.json")
    parser.add_argument("--plot", help="also draw nodes and statistical efficiency over time into this PNG")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    options = auto.ScalingOptions(
        args.upper, args.lower, args.gpus_per_node, args.max_nodes, args.period, args.baseline_local_batch
    )
    sources = job_sources(args.reference, args.zoo)
    if args.model not in sources.truths:
        raise ValueError(f"unknown model {args.model!r} in {sources.origin}; choose one of {', '.join(sources.truths)}")
    settings = simulation_settings(args.calibration, "", args.restart_delay)
    runs = auto.compare(sources.truths[args.model], args.gpu_type, options, settings)
    results = build_results(runs, options, sources.origin, settings)
    write_results(results, args.out, format_report(results), plot_runs, args.plot)
    return 0


def _rounded(value):
    return rounded(value, _DIGITS)


def run_record(run: auto.AutoscaleRun) -> dict:
    return _rounded(
        {
            "finish_s": run.finish_s,
            "gpu_hours": run.gpu_hours,
            "restarts": run.restarts,
            "mean_nodes": run.mean_nodes(),
            "mean_efficiency": run.mean_efficiency(),
            "node_changes": [{"t_s": t, "nodes": n} for t, n in run.node_changes()],
            "timeline": [asdict(x) for x in run.samples],
        }
    )


def build_results(runs: dict[str, auto.AutoscaleRun], options: auto.ScalingOptions, origin: str, settings) -> dict:
    any_run = next(iter(runs.values()))
    return {
        "model": any_run.model,
        "gpu_type": any_run.gpu_type,
        "truth": origin,
        "calibration": settings.name,
        "restart_delay_s": settings.restart_delay(any_run.model),
        "options": _rounded(asdict(options)),
        "runs": {policy: run_record(run) for policy, run in runs.items()},
        "ratios": _rounded(auto.ratios(runs)),
        "pollux_reported": auto.POLLUX_REPORTED,
    }


def _hours(seconds: float | None) -> str:
    return "unfinished" if seconds is None else f"{seconds / 3600:.2f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _changes(record: dict) -> str:
    return ", ".join(f"{c['nodes']}@{c['t_s'] / 3600:.1f}h" for c in record["node_changes"])


def format_report(results: dict) -> str:
    o = results["options"]
    head = (
        f"{results['model']} on {o['gpus_per_node']}x {results['gpu_type']} nodes (at most {o['max_nodes']}), "
        f"truth {results['truth']}, U={o['upper']:.3g} L={o['lower']:.3g}, decisions every {o['period_s']:g} s, "
        f"restart {results['restart_delay_s']:g} s"
    )
    header = f"{'policy':<11} {'time (h)':>9} {'GPU-hours':>10} {'mean nodes':>10} {'mean eff':>9} {'restarts':>8}"
    rows = [
        f"{policy:<11} {_hours(r['finish_s']):>9} {r['gpu_hours']:>10.1f} {r['mean_nodes']:>10.1f} "
        f"{r['mean_efficiency']:>9.2f} {r['restarts']:>8}"
        for policy, r in results["runs"].items()
    ]
    nodes = [f"  {policy}: {_changes(r)}" for policy, r in results["runs"].items()]
    ratio, paper = results["ratios"], results["pollux_reported"]
    summary = (
        f"goodput / throughput: cost {_ratio(ratio['cost_ratio'])}, time {_ratio(ratio['time_ratio'])} "
        f"(Pollux §5.4.1 reports cost {paper['cost_ratio']:.2f}, time {paper['time_ratio']:.2f})"
    )
    return "\n".join([head, "", header, "-" * len(header), *rows, "", "nodes (count@time):", *nodes, "", summary])


def plot_runs(results: dict, path: str | Path) -> None:
    """Nodes and true statistical efficiency over time, both policies; from the results JSON alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (nodes_ax, eff_ax) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    styles = {"goodput": "-", "throughput": "--"}  # dashed: visible where both run the same size
    for policy, record in results["runs"].items():
        t = [x["t_s"] / 3600 for x in record["timeline"]]
        label = f"{policy} ({record['gpu_hours']:.0f} GPU-h, {_hours(record['finish_s'])} h)"
        nodes_ax.step(t, [x["nodes"] for x in record["timeline"]], where="post", ls=styles[policy], label=label)
        eff_ax.plot(t, [100 * x["efficiency"] for x in record["timeline"]], ls=styles[policy], label=policy)
    nodes_ax.set_ylabel("nodes")
    nodes_ax.set_ylim(bottom=0)
    nodes_ax.legend(loc="lower right", fontsize=8)
    eff_ax.set_ylabel("statistical efficiency (%)")
    eff_ax.set_ylim(0, 105)
    eff_ax.set_xlabel("time (h)")
    eff_ax.legend(loc="lower right", fontsize=8)
    for ax in (nodes_ax, eff_ax):
        ax.grid(alpha=0.3)
    o, ratio = results["options"], results["ratios"]
    fig.suptitle(
        f"Auto-scaling {results['model']} on {o['gpus_per_node']}-GPU {results['gpu_type']} nodes: "
        f"cost {_ratio(ratio['cost_ratio'])}x, time {_ratio(ratio['time_ratio'])}x (goodput / throughput)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
