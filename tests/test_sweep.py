"""`goodput compare` spread over processes or a Dask cluster (sim.sweep): the results are the same
as one after another, in the cells' order, and an error or an unreachable engine says so."""

from __future__ import annotations

import json
import math

import pytest

from cli.main import main
from sim.sweep import LOCAL, sweep
from sim.workload import BUILT_IN_WORKLOAD

TIMINGS = {"policy_runtime_ms", "round_runtime_ms", "took_s"}  # what a run measures of the machine


def test_in_this_process_the_results_come_in_order_and_each_is_reported_once():
    reported = []
    assert sweep(math.sqrt, [16, 9, 4], done=lambda i, r: reported.append((i, r))) == [4.0, 3.0, 2.0]
    assert reported == [(0, 4.0), (1, 3.0), (2, 2.0)]
    with pytest.raises(ValueError, match="at least 1"):
        sweep(math.sqrt, [1], workers=0)


@pytest.mark.e2e
@pytest.mark.parametrize("engine", [None, LOCAL])
def test_in_processes_and_on_dask_the_results_are_in_the_items_order(engine):
    reported = []
    items = list(range(40, 0, -1))
    results = sweep(math.factorial, items, workers=2, engine=engine, done=lambda i, r: reported.append(i))
    assert results == [math.factorial(n) for n in items]
    assert sorted(reported) == list(range(len(items)))
    with pytest.raises(ValueError, match="math domain error"):
        sweep(math.sqrt, [4, -1, 9], workers=2, engine=engine)


@pytest.mark.e2e
def test_compare_gives_the_same_results_one_after_another_in_processes_and_on_dask(tmp_path, capsys):
    workload = tmp_path / "w.csv"
    workload.write_text("".join(BUILT_IN_WORKLOAD.read_text().splitlines(keepends=True)[:11]))
    outputs = {}
    runs = {
        "serial": ["--workers", "1"],
        "processes": ["--workers", "2"],
        "dask": ["--workers", "2", "--engine", LOCAL],
    }
    for label, options in runs.items():
        out = tmp_path / f"{label}.json"
        args = ["compare", "--workloads", str(workload), "--policies", "sia", "goodput", "--zoo", *options]
        assert main([*args, "--out", str(out)]) == 0
        outputs[label] = json.loads(out.read_text())
        assert "  [2/2] " in capsys.readouterr().err  # each cell reported as it ends
    serial = outputs.pop("serial")
    for label, other in outputs.items():
        assert [r["policy_spec"] for r in other["runs"]] == ["sia", "goodput"]
        for mine, theirs in zip(serial["runs"], other["runs"]):
            assert {k: v for k, v in mine.items() if k not in TIMINGS} == {
                k: v for k, v in theirs.items() if k not in TIMINGS
            }, label
        assert [r["avg_jct_s"] for r in other["table"]] == [r["avg_jct_s"] for r in serial["table"]]


def test_compare_says_when_the_dask_scheduler_cannot_be_reached(tmp_path, capsys):
    args = ["compare", "--workloads", str(BUILT_IN_WORKLOAD), "--policies", "fifo", "--zoo", "--no-fairness"]
    assert main([*args, "--engine", "tcp://127.0.0.1:9", "--out", str(tmp_path / "c.json")]) == 2
    assert "cannot reach the Dask scheduler at tcp://127.0.0.1:9" in capsys.readouterr().err
