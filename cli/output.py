"""How a command leaves its results: a JSON file (floats rounded to be read), a printed report,
and optionally a figure drawn from the file just written, so it depends on the JSON alone.
By default the commands write under `out/<command>/` (`default_out`), never into the current folder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence


def rounded(value: Any, digits: int) -> Any:
    """`value` with every float rounded to `digits`, through dicts, lists and tuples."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


OUT = Path("out")


def default_out(command: str, name: str) -> str:
    """Where `command` writes `name` unless told otherwise: out/<command>/<name>."""
    return str(OUT / command / name)


def tally(noun: str, states: Iterable[str], found: Sequence[str]) -> str:
    """`3 jobs: 2 running, 1 queued` (each of `states` that `found` holds, in that order), or `no jobs`."""
    if not found:
        return f"no {noun}s"
    return f"{len(found)} {noun}{'s' * (len(found) != 1)}: " + ", ".join(
        f"{n} {state}" for state in states if (n := found.count(state))
    )


def add_out_argument(parser: argparse.ArgumentParser, command: str, name: str, what: str = "results JSON") -> None:
    """`--out`: where `command` writes its `what` (default: out/<command>/<name>)."""
    parser.add_argument(
        "--out", default=default_out(command, name), help=f"{what}, its folder created (default: %(default)s)"
    )


def write_results(
    results: dict, out: str, report: str, plot: Callable[[dict, str], None] | None = None, plot_path: str | None = None
) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(report)
    print(f"\nwrote {path}")
    if plot and plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(json.loads(path.read_text()), plot_path)
        print(f"wrote {plot_path}")
