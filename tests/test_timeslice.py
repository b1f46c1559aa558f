"""The time-slicing event simulator against hand-derived closed forms, plus the CLI and notebook.

Closed forms, for N identical jobs of I iterations of d seconds, switch cost c, quantum q
(run-to-completion is q = I), feedback threshold k <= I:

* there are R = ceil(I / q) rounds; every round visits all N jobs in order, so there are N R visits
  and a switch between each consecutive pair: switches = N R - 1, makespan = N I d + (N R - 1) c;
* job i's k-th iteration falls in round r = ceil(k / q); every earlier round was full (q iterations
  per job), and in round r each job runs m = min(q, I - (r - 1) q) iterations. Before job i's visit
  in round r the machine ran (r - 1) q N + i m iterations and made (r - 1) N + i switches, so
  feedback_i = ((r - 1) q N + i m + k - (r - 1) q) d + ((r - 1) N + i) c;
* completion is the same with k = I.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cli.main import main
from cli.timeslice import build_results, plot_feedback
from sim import timeslice as ts

N, I, D = 8, 4, 1.0
ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def hand_feedback(i: int, k: int, q: int, c: float, n: int = N, iters: int = I, d: float = D) -> float:
    r = math.ceil(k / q)
    m = min(q, iters - (r - 1) * q)
    done_before = (r - 1) * q * n + i * m
    return (done_before + k - (r - 1) * q) * d + ((r - 1) * n + i) * c


def hand_switches(q: int, n: int = N, iters: int = I) -> int:
    return n * math.ceil(iters / q) - 1


# --- the worked case: 8 x 4 x 1 s, c = 0.1 s, feedback at iteration 1 --------------------------


def test_worked_case_run_to_completion_by_hand():
    rtc = ts.worked_case()[0]
    assert (rtc.schedule, rtc.quantum, rtc.threshold, rtc.switch_cost_s) == ("run_to_completion", None, 1, 0.1)
    # Job i starts after i whole jobs (I d each) and i switches; its first iteration takes d more.
    for i, job in enumerate(rtc.jobs):
        assert job.feedback_s == pytest.approx(i * (I * D + 0.1) + D)
        assert job.completion_s == pytest.approx((i + 1) * I * D + i * 0.1)
    assert rtc.first_feedback_s == pytest.approx(1.0)
    assert rtc.last_feedback_s == pytest.approx(7 * 4.1 + 1)  # 29.7
    assert rtc.last_feedback_s == pytest.approx(29.7)
    assert rtc.makespan_s == pytest.approx(N * I * D + (N - 1) * 0.1)  # 32.7
    assert rtc.makespan_s == pytest.approx(32.7)
    assert rtc.switches == N - 1
    assert rtc.mean_feedback_s == pytest.approx(sum(i * 4.1 + 1 for i in range(N)) / N)  # 15.35


def test_worked_case_quantum_1_by_hand():
    q1 = ts.worked_case()[1]
    assert (q1.schedule, q1.quantum) == ("round_robin", 1)
    # First round: job i's first iteration ends after i one-iteration visits and i switches.
    for i, job in enumerate(q1.jobs):
        assert job.feedback_s == pytest.approx(i * (D + 0.1) + D)
        # Last round: 3 full rounds (24 iterations, 24 switches) before it, then i more visits.
        assert job.completion_s == pytest.approx((3 * N + i + 1) * D + (3 * N + i) * 0.1)
    assert q1.last_feedback_s == pytest.approx(7 * 1.1 + 1)  # 8.7
    assert q1.last_feedback_s == pytest.approx(8.7)
    assert q1.switches == N * I - 1  # 31: every one-iteration visit but the first follows a switch
    assert q1.makespan_s == pytest.approx(32 + 31 * 0.1)  # 35.1
    assert q1.makespan_s == pytest.approx(35.1)


def test_worked_case_quantum_2_by_hand():
    q2 = ts.worked_case()[2]
    assert (q2.schedule, q2.quantum) == ("round_robin", 2)
    for i, job in enumerate(q2.jobs):
        assert job.feedback_s == pytest.approx(i * (2 * D + 0.1) + D)
        assert job.completion_s == pytest.approx((2 * N + 2 * i + 2) * D + (N + i) * 0.1)
    assert q2.last_feedback_s == pytest.approx(7 * 2.1 + 1)  # 15.7
    assert q2.last_feedback_s == pytest.approx(15.7)
    assert q2.switches == 2 * N - 1  # 15: two rounds of 8 visits
    assert q2.makespan_s == pytest.approx(32 + 15 * 0.1)  # 33.5
    assert q2.makespan_s == pytest.approx(33.5)


# --- the sweep ---------------------------------------------------------------------------------


def test_sweep_is_48_fully_specified_schedules():
    results = ts.sweep()
    assert len(results) == 48
    keys = {(r.threshold, r.quantum, r.switch_cost_s) for r in results}
    assert keys == {(k, q, c) for k in (1, 3, 4) for q in (1, 2, 3, 4) for c in (0, 0.1, 0.5, 1)}
    assert all(r.schedule == "round_robin" and len(r.jobs) == N for r in results)


def test_useful_work_identical_across_all_48():
    results = ts.sweep()
    assert {r.useful_work_s for r in results} == {N * I * D}  # 32 s
    # Makespan is useful work plus switch time and nothing else (no idle time on one accelerator).
    for r in results:
        assert r.makespan_s == pytest.approx(r.useful_work_s + r.switches * r.switch_cost_s)


def test_every_sweep_schedule_matches_closed_form():
    for r in ts.sweep():
        k, q, c = r.threshold, r.quantum, r.switch_cost_s
        feedback = [hand_feedback(i, k, q, c) for i in range(N)]
        completion = [hand_feedback(i, I, q, c) for i in range(N)]
        for job, f, t in zip(r.jobs, feedback, completion):
            assert job.feedback_s == pytest.approx(f), (k, q, c)
            assert job.completion_s == pytest.approx(t), (k, q, c)
        assert r.switches == hand_switches(q)
        assert r.makespan_s == pytest.approx(N * I * D + hand_switches(q) * c)
        assert r.first_feedback_s == pytest.approx(min(feedback))
        assert r.last_feedback_s == pytest.approx(max(feedback))
        assert r.mean_feedback_s == pytest.approx(sum(feedback) / N)


def test_threshold_at_full_length_makes_last_feedback_the_makespan():
    for r in ts.sweep():
        if r.threshold == I:
            assert r.last_feedback_s == pytest.approx(r.makespan_s)


def test_quantum_at_job_length_is_run_to_completion():
    w = ts.Workload.uniform(N, I, D, 0.5)
    for k in (1, 3, 4):
        rtc = ts.simulate(w, None, k)
        for q in (I, I + 3):
            rr = ts.simulate(w, q, k)
            assert (rr.jobs, rr.switches, rr.makespan_s) == (rtc.jobs, rtc.switches, rtc.makespan_s)


# --- optimal quanta ----------------------------------------------------------------------------


def _optimal() -> dict[tuple[int, float], tuple]:
    return {(o.threshold, o.switch_cost_s): o.quanta for o in ts.optimal_quanta(ts.sweep())}


def test_optimal_quanta_at_switch_cost_0_1():
    # k = 1: last feedback (N-1)(q d + c) + d grows with q, so q = 1 (8.7 s).
    # k = 3: q=1 -> 24 + 2.3 = 26.3, q=2 -> 31 + 1.5 = 32.5, q=3 -> 24 + 0.7 = 24.7, q=4 -> 31 + 0.7 = 31.7.
    # k = 4: last feedback is the makespan, fewest switches wins: q = 4 (32.7 s).
    best = _optimal()
    assert best[(1, 0.1)] == (1,)
    assert best[(3, 0.1)] == (3,)
    assert best[(4, 0.1)] == (4,)
    lows = {(o.threshold, o.switch_cost_s): o.last_feedback_s for o in ts.optimal_quanta(ts.sweep())}
    assert lows[(1, 0.1)] == pytest.approx(8.7)
    assert lows[(3, 0.1)] == pytest.approx(24.7)
    assert lows[(4, 0.1)] == pytest.approx(32.7)


def test_ties_at_zero_switch_cost_report_every_tied_quantum():
    # c = 0: k=1 -> 7q + 1 (unique q=1); k=3 -> q=1: 24, q=2: 31, q=3: 24, q=4: 31; k=4 -> 32 for all.
    best = _optimal()
    assert best[(1, 0.0)] == (1,)
    assert best[(3, 0.0)] == (1, 3)
    assert best[(4, 0.0)] == (1, 2, 3, 4)


def test_ties_use_a_tolerance_not_exact_equality():
    def result(q: int, last: float) -> ts.ScheduleResult:
        return ts.ScheduleResult("round_robin", q, 1, 0.0, 1.0, last, 1.0, last, 0, 1.0, ())

    best = ts.optimal_quanta([result(1, 0.1 + 0.2), result(2, 0.3), result(3, 0.3 + 1e-6)])
    assert best[0].quanta == (1, 2)


# --- the round-robin rule and clamping ----------------------------------------------------------


def test_next_job_wraps_skips_finished_and_keeps_the_last_one_running():
    assert ts.next_job([2, 0, 1], None) == 0
    assert ts.next_job([2, 0, 1], 0) == 2
    assert ts.next_job([2, 0, 1], 2) == 0
    assert ts.next_job([0, 0, 3], 2) == 2  # only one left: it continues, no switch
    assert ts.next_job([0, 0, 0], 1) is None
    assert ts.visit_iterations(5, 2) == 2
    assert ts.visit_iterations(1, 2) == 1
    assert ts.visit_iterations(5, None) == 5


def test_mixed_lengths_clamp_threshold_and_charge_no_switch_for_the_last_job():
    # Jobs of 1 and 3 iterations, q = 1, d = 1, c = 0.5, k = 2. Job 0 runs [0,1] and is done (k
    # clamped to 1). Switch to job 1 (1.5), which runs [1.5,2.5], then alone: [2.5,3.5] (its 2nd
    # iteration: feedback) and [3.5,4.5], with no further switch.
    r = ts.simulate(ts.Workload((1, 3), 1.0, 0.5), 1, 2)
    assert [(j.feedback_s, j.completion_s) for j in r.jobs] == [(1.0, 1.0), (3.5, 4.5)]
    assert r.switches == 1
    assert r.makespan_s == 4.5
    assert r.useful_work_s == 4.0


def test_single_job_never_switches():
    r = ts.simulate(ts.Workload.uniform(1, 5, 2.0, 1.0), 1, 1)
    assert r.switches == 0 and r.makespan_s == 10.0 and r.last_feedback_s == 2.0


# --- bad input ---------------------------------------------------------------------------------


def test_zero_jobs_rejected():
    with pytest.raises(ValueError, match="zero jobs"):
        ts.Workload((), 1.0, 0.1)
    with pytest.raises(ValueError, match="at least one job"):
        ts.Workload.uniform(0, 4, 1.0, 0.1)


def test_negative_switch_cost_rejected():
    with pytest.raises(ValueError, match="switch cost must be non-negative"):
        ts.Workload.uniform(8, 4, 1.0, -0.1)


@pytest.mark.parametrize("quantum", [0, -1, 1.5, True])
def test_bad_quantum_rejected(quantum):
    with pytest.raises(ValueError, match="quantum must be a positive whole number"):
        ts.simulate(ts.Workload.uniform(8, 4, 1.0, 0.1), quantum, 1)


@pytest.mark.parametrize("threshold", [0, -2])
def test_bad_threshold_rejected(threshold):
    with pytest.raises(ValueError, match="feedback threshold must be a positive whole number"):
        ts.simulate(ts.Workload.uniform(8, 4, 1.0, 0.1), 1, threshold)


def test_bad_iterations_and_iteration_time_rejected():
    with pytest.raises(ValueError, match="job 1 must need a positive whole number of iterations"):
        ts.Workload((4, 0), 1.0, 0.1)
    with pytest.raises(ValueError, match="iteration time must be positive"):
        ts.Workload((4,), 0.0, 0.1)


# --- CLI, figure and notebook ------------------------------------------------------------------

SCHEDULE_FIELDS = {
    "schedule",
    "quantum",
    "threshold",
    "switch_cost_s",
    "first_feedback_s",
    "last_feedback_s",
    "mean_feedback_s",
    "makespan_s",
    "switches",
    "useful_work_s",
    "jobs",
}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("timeslice")
    out, png = out_dir / "results.json", out_dir / "feedback.png"
    assert main(["timeslice", "--out", str(out), "--plot", str(png)]) == 0
    return out, png


def test_cli_writes_results_with_required_fields(cli_run):
    out, _ = cli_run
    data = json.loads(out.read_text())
    assert {"schedules", "worked_case", "optimal_quanta"} <= data.keys()
    for record in data["schedules"]:
        assert SCHEDULE_FIELDS <= record.keys()
        assert record["schedule"] in ("run_to_completion", "round_robin")
        assert (record["quantum"] is None) == (record["schedule"] == "run_to_completion")
        assert all(set(job) == {"feedback_s", "completion_s"} for job in record["jobs"])
    sweep = [r for r in data["schedules"] if "sweep" in r["cases"]]
    assert len(sweep) == 48
    # Every schedule listed once; the worked case's run-to-completion is among them.
    keys = [(r["schedule"], r["quantum"], r["threshold"], r["switch_cost_s"]) for r in data["schedules"]]
    assert len(keys) == len(set(keys)) == 49
    assert ("run_to_completion", None, 1, 0.1) in keys
    worked = {r["quantum"]: r for r in data["worked_case"]["schedules"]}
    assert set(worked) == {None, 1, 2}
    assert (worked[None]["last_feedback_s"], worked[None]["makespan_s"]) == (29.7, 32.7)
    assert (worked[1]["last_feedback_s"], worked[1]["makespan_s"]) == (8.7, 35.1)
    assert (worked[2]["last_feedback_s"], worked[2]["makespan_s"]) == (15.7, 33.5)
    best = {(o["threshold"], o["switch_cost_s"]): o["quanta"] for o in data["optimal_quanta"]}
    assert best[(3, 0.0)] == [1, 3] and best[(4, 0.0)] == [1, 2, 3, 4]


def test_cli_plot_is_a_png(cli_run):
    _, png = cli_run
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_plot_needs_only_the_results_json(cli_run, tmp_path):
    out, _ = cli_run
    png = tmp_path / "again.png"
    plot_feedback(json.loads(out.read_text()), png)
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_cli_prints_the_tables(cli_run, capsys, tmp_path):
    assert main(["timeslice", "--out", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "Worked case" in text and "Sweep: 48" in text and "1,2,3,4" in text


def test_notebook_runs_against_generated_results(tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps(build_results()))
    nb = json.loads((ROOT / "notebooks" / "timeslice.ipynb").read_text())
    assert nb["nbformat"] == 4
    code = [cell for cell in nb["cells"] if cell["cell_type"] == "code"]
    assert code
    namespace = {"RESULTS": str(results)}
    for cell in code:
        exec("".join(cell["source"]), namespace)
    assert namespace["RESULTS"] == str(results)
    assert len(namespace["sweep"]) == 48
