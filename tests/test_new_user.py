"""What a new user meets first: --version, the built-in workload as simulate's default, errors that
name the valid policies and options, progress in a log, files under out/, plots that say what they
show and keep each application's colour."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cli.main import build_parser, main
from policies.base import POLICIES, make_policy, policy_options
from sim.workload import BUILT_IN_WORKLOAD

REPO = Path(__file__).resolve().parent.parent
TINY = "name,time,application,num_replicas,batch_size\ncifar10-0,0,cifar10,1,128\nncf-1,30,ncf,1,256\n"
FAST = ["--policy", "fifo", "--zoo", "--no-fairness"]  # a couple of seconds a run


def tiny_workload(folder: Path) -> Path:
    path = folder / "tiny.csv"
    path.write_text(TINY)
    return path


# 1. --version


@pytest.mark.e2e
def test_version_prints_the_package_version_and_exits_0():
    from shared.runner import VERSION

    run = subprocess.run(
        [sys.executable, "-m", "cli.main", "--version"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert run.stdout.strip() == f"goodput {version}"
    assert VERSION == version, "the services report the version pyproject.toml gives"


# 2. simulate without --workload


def test_simulate_defaults_to_the_built_in_workload_up_replays(tmp_path, monkeypatch, capsys):
    import cli.up

    assert BUILT_IN_WORKLOAD.is_file()
    assert Path(cli.up.BUILT_IN_WORKLOAD) == BUILT_IN_WORKLOAD
    assert build_parser().parse_args(["simulate"]).workload == str(BUILT_IN_WORKLOAD)
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", *FAST, "--out", "r.json"]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert Path(doc["workload"]) == BUILT_IN_WORKLOAD and len(doc["jobs"]) == 40
    assert "mixed-40.csv" in capsys.readouterr().out


@pytest.mark.e2e
def test_simulate_help_names_the_default_workload():
    run = subprocess.run(
        [sys.executable, "-m", "cli.main", "simulate", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0
    assert "built-in" in run.stdout and "mixed-40.csv" in run.stdout


# 3. errors that name what is valid


def test_an_unknown_option_names_the_policys_options_and_a_close_one(tmp_path, capsys):
    assert (
        main(
            [
                "simulate",
                "--workload",
                str(tiny_workload(tmp_path)),
                "--policy",
                "sia:pp=1",
                "--out",
                str(tmp_path / "o.json"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "'pp'" in err and "did you mean 'p'?" in err
    for option in policy_options("sia"):
        assert option in err
    assert "p=-0.5" in err and "round_s=60.0" in err  # with their defaults
    assert not (tmp_path / "o.json").exists()


def test_an_unknown_policy_lists_the_policies_with_a_suggestion(tmp_path, capsys):
    assert (
        main(
            [
                "simulate",
                "--workload",
                str(tiny_workload(tmp_path)),
                "--policy",
                "sai",
                "--out",
                str(tmp_path / "o.json"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "unknown policy 'sai'" in err and "did you mean 'sia'?" in err
    assert all(name in err for name in POLICIES)


def test_a_far_name_gets_no_suggestion_and_a_wrapper_passes_options_on():
    with pytest.raises(ValueError, match="unknown policy 'zzzz'; choose one of") as caught:
        make_policy("zzzz")
    assert "did you mean" not in str(caught.value)
    with pytest.raises(ValueError, match=r"no option 'objectiv' \(did you mean 'objective'\?\)"):
        make_policy("gavel", objectiv="max_sum_throughput")
    assert make_policy("chaos", policy="fifo", backfill=True).inner.backfill is True
    with pytest.raises(ValueError, match="did you mean 'backfill'"):
        make_policy("chaos", policy="fifo", backfil=True)  # the wrapped policy checks its own


def test_compare_refuses_a_misspelt_option_before_any_run(tmp_path, capsys):
    assert (
        main(
            [
                "compare",
                "--workloads",
                str(tiny_workload(tmp_path)),
                "--policies",
                "fifo",
                "fifo:backfil=true",
                "--zoo",
                "--out",
                str(tmp_path / "c.json"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "did you mean 'backfill'?" in err and "backfill=False" in err
    assert "avg JCT" not in err  # no run reported: refused first


def test_compare_without_fairness_writes_its_table_without_the_rho_columns(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert (
        main(
            [
                "compare",
                "--workloads",
                str(tiny_workload(tmp_path)),
                "--policies",
                "fifo",
                "--zoo",
                "--no-fairness",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = json.loads(out.read_text())["table"]
    assert [row["policy"] for row in table] == ["fifo"] and table[0]["avg_jct_s"] > 0
    assert table[0]["rho_max"] is None
    printed = capsys.readouterr().out
    assert "avg JCT h" in printed and "max rho" not in printed


# 4. progress when stderr is not a terminal


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_in_a_log_is_a_plain_line_every_few_seconds():
    from sim.run import progress_reporter

    out, clock = io.StringIO(), FakeClock()
    show = progress_reporter(10, out, tty=False, label="simulate", every_s=5.0, clock=clock)
    for done in range(10):  # one round a second of wall time
        clock.t += 1.0
        show(3600.0 * done, done, 10)
    lines = out.getvalue().splitlines()
    assert lines == [
        "  simulate: 4/10 jobs done, 4.0 h simulated, 5 s elapsed",
        "  simulate: 9/10 jobs done, 9.0 h simulated, 10 s elapsed",
    ]
    clock.t += 0.5
    show(36000.0, 10, 10)  # the end: said once, then nothing more
    show(36000.0, 10, 10)
    assert out.getvalue().splitlines()[2:] == ["  simulate: 10/10 jobs done, 10.0 h simulated, 10 s elapsed"]
    assert "\r" not in out.getvalue()


def test_a_short_run_in_a_log_says_nothing_and_the_terminal_keeps_its_bar():
    from sim.run import progress_reporter

    quiet, clock = io.StringIO(), FakeClock()
    show = progress_reporter(2, quiet, tty=False, clock=clock)
    show(60.0, 1, 2)
    show(120.0, 2, 2)
    assert quiet.getvalue() == ""
    bar = io.StringIO()
    show = progress_reporter(2, bar, tty=True)
    show(60.0, 1, 2)
    show(120.0, 2, 2)
    assert bar.getvalue().startswith("\r  [############") and "2/2 jobs done" in bar.getvalue()


def test_simulate_reports_progress_on_a_stderr_that_is_no_terminal(tmp_path, monkeypatch, capsys):
    import sim.run

    monkeypatch.setattr(sim.run, "PROGRESS_EVERY_S", 0.0)  # every round: the run is short
    assert (
        main(
            [
                "simulate",
                "--workload",
                str(tiny_workload(tmp_path)),
                "--policy",
                "fifo",
                "--zoo",
                "--out",
                str(tmp_path / "o.json"),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "  simulate: 2/2 jobs done" in err and "h simulated" in err
    assert "  finish-time fairness: 2/2 jobs" in err
    assert "\r" not in err


async def test_replay_follows_the_run_with_a_progress_callback():
    """`launcher.stack.replay(..., progress=...)` hands each step of the run's log to the callback
    (through follow_run); here the log is a stand-in bus's."""
    from launcher.stack import follow_run
    from shared.schema.runs import RunStep

    steps = [RunStep(r, 60.0 * r, None, (), (), done, 3, over=done == 3) for r, done in enumerate((0, 1, 1, 3))]

    class Log:
        async def follow(self, subject, kind, idle_timeout=None, new_only=False):
            for step in steps:
                yield step

    seen = []
    await follow_run(Log(), "run-1", progress=lambda now, done, total: seen.append((now, done, total)))
    assert seen == [(0.0, 0, 3), (60.0, 1, 3), (120.0, 1, 3), (180.0, 3, 3)]


# 5. files under out/ by default


def test_default_outputs_land_under_out(tmp_path, monkeypatch, capsys):
    parser = build_parser()
    defaults = {
        cmd: parser.parse_args(cmd.split()).out
        for cmd in (
            "simulate",
            "compare --workloads x",
            "timeslice",
            "models report",
            "autoscale",
            "interference --workloads x",
            "workload",
        )
    }
    assert all(Path(out).parts[0] == "out" and len(Path(out).parts) == 3 for out in defaults.values()), defaults
    assert defaults["simulate"] == "out/simulate/simulation.json"
    assert defaults["timeslice"] == "out/timeslice/results.json"
    assert defaults["models report"] == "out/models/models-report.json"

    monkeypatch.chdir(tmp_path)
    workload = tiny_workload(tmp_path)
    assert main(["simulate", "--workload", str(workload), *FAST, "--plot", "out/simulate/run.png"]) == 0
    assert main(["timeslice"]) == 0
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "out/simulate/simulation.json").read_text())["jobs_finished"] == 2
    assert (tmp_path / "out/simulate/run.png").read_bytes()[:4] == b"\x89PNG"
    assert "schedules" in json.loads((tmp_path / "out/timeslice/results.json").read_text())
    assert "wrote out/simulate/simulation.json" in printed and "wrote out/timeslice/results.json" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.csv"]  # nothing else in the folder


def test_models_report_writes_under_out(tmp_path, monkeypatch, capsys):
    import cli.models
    import reports.models

    monkeypatch.setattr(cli.models, "reference_root", lambda path: tmp_path)
    monkeypatch.setattr(cli.models, "discover_models", lambda root: {})
    monkeypatch.setattr(reports.models, "report", lambda models: [])  # no fits: only where it writes
    monkeypatch.chdir(tmp_path)
    assert main(["models", "report"]) == 0
    assert json.loads((tmp_path / "out/models/models-report.json").read_text())["models"] == []
    assert "wrote out/models/models-report.json" in capsys.readouterr().out


# 6. plots: titles and colours


@pytest.fixture
def saved_figures(monkeypatch):
    """The figures the plotting code saves, kept open to be inspected."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    return figures


def _run_result(apps: list[str], workload: str) -> dict:
    jobs = [
        {
            "name": f"{a}-{i}",
            "application": a,
            "submit_s": 0.0,
            "finish_s": 600.0,
            "jct_s": 600.0,
            "restarts": 0,
            "gpu_seconds": 600.0,
        }
        for i, a in enumerate(apps)
    ]
    timeline = [{"t": 60.0 * k, "active": len(jobs), "gpus": {j["name"]: 1 for j in jobs}} for k in range(10)]
    return {
        "policy": "sia",
        "policy_spec": "sia:p=-1",
        "cluster": "sia-hetero-64",
        "workload": workload,
        "jobs": jobs,
        "timeline": timeline,
        "avg_jct_s": 600.0,
    }


def test_a_run_plot_names_workload_policy_cluster_and_keeps_colours(saved_figures):
    from matplotlib.colors import to_hex

    from sim.run import application_colour, plot

    plot(_run_result(["ncf", "yolov3"], "examples/workloads/a.csv"), "a.png")
    plot(_run_result(["bert", "cifar10", "imagenet", "ncf"], "examples/workloads/b.csv"), "b.png")
    first, second = saved_figures
    assert first.get_suptitle() == "workloads/a.csv: sia:p=-1 on sia-hetero-64"
    assert "b.csv" in second.get_suptitle()

    def colours(fig) -> dict[str, str]:
        ax = fig.axes[0]
        return {
            label: to_hex(c.get_facecolor()[0]) for label, c in zip(ax.get_legend_handles_labels()[1], ax.collections)
        }

    a, b = colours(first), colours(second)
    assert a["ncf"] == b["ncf"] == application_colour("ncf")  # in the 2nd plot ncf is 4th, not 1st
    assert len(set(b.values())) == 4


def test_application_colours_are_fixed_and_distinct():
    from sim.run import KNOWN_APPLICATIONS, application_colour

    colours = [application_colour(a) for a in KNOWN_APPLICATIONS]
    assert len(set(colours)) == len(colours)
    assert application_colour("bert") == "#1f77b4"  # fixed, whatever the workload holds
    assert application_colour("my-model") == application_colour("my-model") not in colours


def test_comparison_and_interference_plots_name_workloads_and_cluster(saved_figures):
    from cli.interference import _plot, _title
    from cli.simulate import _compare_title, plot_table

    table = [
        {"workloads": "out/sweep/philly", "files": 4, "policy": p, "avg_jct_s": 3600.0, "p99_jct_s": 7200.0}
        for p in ("sia", "fifo")
    ]
    runs = [{"cluster": "sia-hetero-64"}]
    plot_table(table, "c.png", _compare_title({"table": table, "runs": runs}))
    results = {
        "policy": "pollux",
        "cluster": "pollux-homo-64",
        "workloads": ["w/workload-1.csv", "w/workload-2.csv"],
        "rows": [{"slowdown": 0.0, "avoid": 3600.0, "no_avoid": 3700.0}],
    }
    _plot(results["rows"], "i.png", _title(results))
    compare, interference = saved_figures
    assert compare.get_suptitle() == "philly (4) on sia-hetero-64"
    title = interference.axes[0].get_title()
    assert "workload-1.csv" in title and "pollux on pollux-homo-64" in title
