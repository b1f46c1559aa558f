"""How a command leaves its results: a JSON file (floats rounded to be read), a printed report,
and optionally a figure drawn from the file just written, so it depends on the JSON alone.
By default the commands write under `out/<command>/` (`default_out`), never into the current folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


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
