"""One simulation from names and paths to the result document (DESIGN §6), and its plot.

Where the jobs' truth comes from: the reference profiles when the reference folder is there (as the
peers' simulators use them), otherwise the built-in model zoo (the embedded default).
"""

from __future__ import annotations

import asyncio
import sys
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence, TextIO

import numpy as np

from policies.base import Policy, check_honours_teams, make_policy
from services.simulated.truth import JobSources, ModelTruth, job_sources
from shared.cluster import Cluster, load_cluster
from shared.hardware import hardware_name
from shared.schema.records import JobRecord
from shared.schema.runs import RoundRecord
from shared.schema.teams import TeamFile, Teams
from shared.settings import FEEDBACK_ITERATIONS, SimSettings, simulation_settings
from shared.subjects import DEFAULT_TEAM
from shared.teams import load_team_file, resolve
from sim.bound import ModelTimes, model_times
from sim.decompose import job_parts, mean_parts
from sim.fairness import AloneRuns, finish_time_fairness
from sim.reference import WorkloadJob, load_workload
from sim.simulator import Simulator
from sim.workload import declare_targets


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "max": 0.0}
    p50, p95 = np.percentile(values, [50, 95])
    return {"p50": round(float(p50), 3), "p95": round(float(p95), 3), "max": round(float(max(values)), 3)}


@dataclass(frozen=True)
class Simulation:
    """One run of a workload on a simulated cluster: the jobs, the cluster, the policy and the world
    they run in. `teams`: a team file (its path, or the file) in force every round, checked first
    (`check_teams`); `restart_delay_s` replaces every model's checkpoint-restart delay; `round_s` the
    simulator's round; `horizon_s` stops the run early; `interference` slows distributed jobs that
    share a node by that fraction; `profile_request` measures each job at its request on every type
    before it starts (`services.simulated.world.request_observations`); `targets` and
    `target_noise` set the work each job declares (sim.workload.declare_targets)."""

    workload: str | Path | Sequence[WorkloadJob]
    cluster: str
    policy: str
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    reference: str | None = None
    use_zoo: bool = False
    calibration: str | None = None
    feedback_iterations: int = FEEDBACK_ITERATIONS
    restart_delay_s: float | None = None
    round_s: float | None = None
    horizon_s: float | None = None
    interference: float = 0.0
    profile_request: bool = False
    teams: str | Path | TeamFile | None = None
    targets: str = "given"
    target_noise: tuple[float, float] | None = None

    @property
    def settings(self) -> SimSettings:
        return simulation_settings(
            self.calibration,
            self.cluster,
            self.restart_delay_s,
            self.round_s,
            self.horizon_s,
            self.interference,
            self.profile_request,
        )

    @property
    def jobs(self) -> list[WorkloadJob]:
        return load_workload(self.workload) if isinstance(self.workload, (str, Path)) else list(self.workload)

    @property
    def name(self) -> str:
        """The workload's name in the result document: its file, or `<in memory>`."""
        return str(self.workload) if isinstance(self.workload, (str, Path)) else "<in memory>"

    @property
    def team_file(self) -> TeamFile | None:
        return load_team_file(self.teams) if isinstance(self.teams, (str, Path)) else self.teams


def simulate(
    run: Simulation,
    *,
    sources: JobSources | None = None,
    progress: bool | Progress = False,
    over: Replayer | None = None,
    fairness: bool = True,
) -> dict:
    """Run one workload and return the result document, with each team's results (`team_results`)
    when it has teams. `sources`: the jobs' truth (default: `run`'s reference or zoo); `progress`
    True reports on stderr as the run goes (`progress_reporter`), or is a callback (simulated time,
    jobs done, jobs in all); `fairness` adds each job's finish-time fairness (a run of each job
    alone: sim.fairness); `over` replays the jobs through the services instead of the cores in this
    process (`launcher.replay.replay_over_nats`: `goodput simulate --bus nats`)."""
    jobs = run.jobs
    if not jobs:
        raise ValueError("the workload has no jobs")
    spec = load_cluster(run.cluster)
    settings = run.settings
    pol = make_policy(run.policy, **run.policy_options)
    team_file = run.team_file
    resolved = None
    if team_file is not None:
        source = f"team file {run.teams}" if team_file is not run.teams else ""
        resolved = check_teams(team_file, spec, pol, jobs, source)
    sources = sources or job_sources(run.reference, run.use_zoo)
    jobs = declare_targets(jobs, lambda model: sources.truths[model].epochs_total, run.targets, run.target_noise)
    show = progress_reporter(len(jobs), label="simulate") if progress is True else progress or None
    if over is not None:
        # The services are given the jobs as this run declares them, and the team file read.
        replayed = replace(run, workload=tuple(jobs), teams=team_file)
        report, records = asyncio.run(over(replayed, sources.origin, show))
        result = replay_results(run, jobs, report, records, sources.origin, resolved)
    else:
        sim = Simulator(
            jobs, spec, pol, settings, sources.truths, sources.profile, run.feedback_iterations, teams=team_file
        )
        sim.run(show)
        result = results(sim, run.name, sources.origin, teams=resolved)
    if fairness:
        add_fairness(result, run, jobs, sources, fairness_reporter(result) if progress is True else None)
    return result


def check_teams(
    file: TeamFile, cluster: Cluster, policy: Policy | None = None, jobs: Iterable[WorkloadJob] = (), source: str = ""
) -> Teams:
    """A run's team file, checked before anything runs: resolved against the cluster, a `policy`
    that holds teams' guarantees, and every job's team one the file names (or the default team).
    ValueError saying what is wrong; `source` names the file in it."""
    source = source or "the team file"
    try:
        teams = resolve(file, cluster)
    except ValueError as error:
        raise ValueError(f"{source} does not fit cluster {cluster.name}: {error}") from None
    if policy is not None:
        check_honours_teams(policy, teams)
    unknown = {}
    for job in jobs:
        if job.team != DEFAULT_TEAM and job.team not in teams.teams:
            unknown.setdefault(job.team, job.name)
    if unknown:
        named = ", ".join(f"{team!r} (job {job})" for team, job in sorted(unknown.items()))
        raise ValueError(
            f"the workload names teams that {source} does not: {named}; its teams: {', '.join(teams.teams)}"
        )
    return teams


def fairness_reporter(result: dict, stream: TextIO | None = None, **options) -> Progress:
    """`progress_reporter` for `add_fairness` on a result: its finished jobs, one alone run each."""
    return progress_reporter(
        sum(j["jct_s"] is not None for j in result["jobs"]),
        stream,
        label="finish-time fairness",
        what="jobs",
        **options,
    )


class _ReportedAloneRuns(AloneRuns):
    """AloneRuns that tell `progress` of each job looked up (simulated time None: each runs alone)."""

    def __init__(self, *args, progress: Progress, total: int):
        super().__init__(*args)
        self.progress, self.total, self.asked = progress, total, 0

    def jct(self, job, cluster):
        jct = super().jct(job, cluster)
        self.asked += 1
        self.progress(None, self.asked, self.total)
        return jct


def add_fairness(
    result: dict, run: Simulation, jobs: list[WorkloadJob], sources: JobSources, progress: Progress | None = None
) -> None:
    """Each job's finish-time fairness in `run`'s result document (sim.fairness): a run of each
    distinct job of `jobs` alone on its fair share, with the same policy and the same job model.
    `progress` is told of each finished job's alone run (None, done, finished jobs):
    `fairness_reporter(result)`."""
    policy = lambda: make_policy(run.policy, **run.policy_options)  # noqa: E731 - a fresh one each alone run
    args = (policy, run.settings, sources.truths, sources.profile, run.feedback_iterations)
    total = sum(j["jct_s"] is not None for j in result["jobs"])
    alone = _ReportedAloneRuns(*args, progress=progress, total=total) if progress else AloneRuns(*args)
    finish_time_fairness(result, jobs, load_cluster(run.cluster), alone)


class _Replayed:
    """The wiring of a replay that ran in the services: nothing to call, no jobs here."""

    jobs: dict = {}


def replay_results(run: Simulation, jobs: list[WorkloadJob], report, records, origin: str, teams=None) -> dict:
    """The result document of `run`'s `jobs` replayed by the policy leader over NATS (its rounds and
    events, the executors' job records)."""
    policy = make_policy(run.policy, **run.policy_options)
    sim = Simulator(
        jobs,
        load_cluster(run.cluster),
        policy,
        run.settings,
        feedback_iterations=run.feedback_iterations,
        wiring=_Replayed(),
    )
    sim.loop.rounds, sim.loop.events = list(report.rounds), list(report.events)
    return results(sim, run.name, origin, list(records.jobs), teams)


Progress = Callable[[float | None, int, int], None]  # (simulated time s or None, jobs done, jobs in all)
# Replays a simulation's jobs through the services (launcher.replay.replay_over_nats), given the truth's
# origin and a progress callback: (report, the executors' records).
Replayer = Callable[["Simulation", str, "Progress | None"], Awaitable[tuple]]

PROGRESS_EVERY_S = 5.0  # wall-clock seconds between two progress lines when stderr is no terminal


def progress_reporter(
    total: int,
    stream: TextIO | None = None,
    *,
    tty: bool | None = None,
    label: str = "",
    what: str = "jobs done",
    every_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Progress:
    """A run's progress on `stream` (stderr): on a terminal a bar redrawn in place; otherwise (a log,
    a pipe, CI) a plain line every `every_s` seconds of wall time (default PROGRESS_EVERY_S), and a
    last one at the end when any was printed: `LABEL: 37/160 jobs done, 12.4 h simulated, 10 s
    elapsed`. For a run with an end: once done reaches the total it says no more."""
    stream = stream or sys.stderr
    every_s = PROGRESS_EVERY_S if every_s is None else every_s
    if tty is None:
        tty = stream.isatty()
    if tty:
        return _progress_bar(total, stream, what)
    start = clock()
    last, ended = [start], [False]
    prefix = f"{label}: " if label else ""

    def show(now: float | None, done: int, of: int) -> None:
        at = clock()
        if ended[0]:
            return
        ended[0] = done >= of
        if at - last[0] >= every_s or (ended[0] and last[0] > start):
            last[0] = at
            simulated = "" if now is None else f", {now / 3600:.1f} h simulated"
            print(f"  {prefix}{done}/{of} {what}{simulated}, {at - start:.0f} s elapsed", file=stream, flush=True)

    return show


def _progress_bar(total: int, stream: TextIO, what: str = "jobs done"):
    last = [-1]

    def show(now: float | None, done: int, _total: int) -> None:
        percent = 100 * done // max(total, 1)
        if percent != last[0]:
            last[0] = percent
            bar = "#" * (percent // 4)
            simulated = "" if now is None else f", {now / 3600:5.1f} h simulated"
            print(f"\r  [{bar:<25}] {done}/{total} {what}{simulated}", end="", file=stream)
            if done == total:
                print(file=stream)

    return show


def results(
    sim: Simulator, workload, origin: str, records: list[JobRecord] | None = None, teams: Teams | None = None
) -> dict:
    """The result document (DESIGN §6) of a finished run; `records` when the jobs ran elsewhere;
    with `teams` (or jobs of teams), each team's results (`team_results`)."""
    jobs = []
    for j in sorted(records if records is not None else sim.records(), key=lambda r: (r.submit_s, r.name)):
        jct = None if j.finish_s is None else j.finish_s - j.submit_s
        jobs.append(
            {
                "name": j.name,
                "application": j.application,
                "team": j.team,
                "submit_s": j.submit_s,
                "finish_s": j.finish_s,
                "jct_s": jct,
                "restarts": j.restarts,
                "gpu_seconds": round(j.gpu_seconds, 3),
                "feedback_s": None if j.feedback_s is None else round(j.feedback_s - j.submit_s, 3),
            }
        )
    done = [j for j in jobs if j["jct_s"] is not None]
    jcts = np.array([j["jct_s"] for j in done]) if done else np.zeros(0)
    finished = [j["finish_s"] for j in done]
    timeline = [{"t": r.now_s, "active": r.active, "gpus": r.gpus} for r in sim.rounds]
    for entry, r in zip(timeline, sim.rounds):
        if r.team_gpus:  # each team's GPUs by type (the names people know), and those borrowed
            entry["teams"] = {
                team: {hardware_name(t): n for t, n in held.items()} for team, held in r.team_gpus.items()
            }
            entry["borrowed"] = dict(r.team_borrowed)
    result = {
        "policy": sim.policy.name,
        "cluster": sim.cluster.name,
        "workload": str(workload),
        "calibration": sim.settings.name,
        "round_s": sim.settings.round_s,
        "truth": origin,
        "profiled_at_request": sim.settings.profile_request,
        "feedback_iterations": sim.feedback_iterations,
        "jobs": jobs,
        "jobs_finished": len(done),
        "jobs_unfinished": len(jobs) - len(done),
        "avg_jct_s": float(jcts.mean()) if done else None,
        "p99_jct_s": float(np.percentile(jcts, 99)) if done else None,
        "makespan_s": (max(finished) - min(j["submit_s"] for j in jobs)) if done else None,
        "gpu_hours_per_job": float(np.mean([j["gpu_seconds"] for j in jobs]) / 3600),
        "restarts_per_job": float(np.mean([j["restarts"] for j in jobs])),
        "policy_runtime_ms": _quantiles([r.policy_ms for r in sim.rounds]),
        "round_runtime_ms": _quantiles([r.round_ms for r in sim.rounds]),
        "rounds": len(sim.rounds),
        "contention": round(float(np.mean([r.active for r in sim.rounds])), 3) if sim.rounds else 0.0,
        "timeline": timeline,
        "events": sim.events,
    }
    if records is None:  # the jobs ran here: where their time went (sim.decompose), finished jobs'
        parts = jct_parts(sim)
        result["jct_parts_s"] = mean_parts(list(parts.values()))
        result["job_jct_parts_s"] = {
            name: {part: round(value, 3) for part, value in mine.items()} for name, mine in parts.items()
        }
    if teams is not None or any(j["team"] != DEFAULT_TEAM for j in jobs):
        result["teams"] = team_results(jobs, sim.rounds, teams, sim.policy.round_s)
    return result


# Each model's times alone, by (its truth, the cluster, the calibration): computed once a process.
_TIMES: dict[tuple[int, Cluster, str], tuple[ModelTruth, ModelTimes]] = {}


def jct_parts(sim: Simulator) -> dict[str, dict[str, float]]:
    """Each finished job's JCT in parts (sim.decompose), from the simulated executors of this process."""
    executors = sim.wiring.executors
    parts = {}
    for name, job in executors.jobs.items():
        truth = executors.truths[name]
        key = (id(truth), sim.cluster, sim.settings.name)
        if key not in _TIMES:  # the truth is kept with its times, so its id is not reused
            _TIMES[key] = (truth, model_times(sim.cluster, truth, sim.settings))
        if (mine := job_parts(job, truth, _TIMES[key][1])) is not None:
            parts[name] = mine
    return parts


def team_results(jobs: list[dict], rounds: list[RoundRecord], teams: Teams | None, decision_s: float) -> dict:
    """Each team's results: its jobs and how many finished, their average and p99 JCT, the
    GPU-hours they used, the GPU-hours of them beyond its guarantee (each decision's borrowed GPUs
    held until the next decision, at most `decision_s`), how often its jobs were shrunk or stopped
    for another team, and its quota per GPU type (the names people know)."""
    names = list(teams.teams) if teams is not None else []
    names += sorted({j["team"] for j in jobs} - set(names))
    borrowed_s = dict.fromkeys(names, 0.0)
    reclaimed = dict.fromkeys(names, 0)
    for r, after in zip(rounds, [*rounds[1:], None]):
        held_s = decision_s if after is None else min(after.now_s - r.now_s, decision_s)
        for team, gpus in r.team_borrowed.items():
            borrowed_s[team] = borrowed_s.get(team, 0.0) + gpus * held_s
        for team, count in r.team_reclaimed.items():
            reclaimed[team] = reclaimed.get(team, 0) + count
    out = {}
    for name in names:
        mine = [j for j in jobs if j["team"] == name]
        jcts = np.array([j["jct_s"] for j in mine if j["jct_s"] is not None])
        team = teams.teams.get(name) if teams is not None else None
        out[name] = {
            "jobs": len(mine),
            "jobs_finished": len(jcts),
            "avg_jct_s": float(jcts.mean()) if len(jcts) else None,
            "p99_jct_s": float(np.percentile(jcts, 99)) if len(jcts) else None,
            "gpu_hours": round(sum(j["gpu_seconds"] for j in mine) / 3600, 3),
            "borrowed_gpu_hours": round(borrowed_s.get(name, 0.0) / 3600, 3),
            "reclaimed": reclaimed.get(name, 0),
            "quota": {hardware_name(t): n for t, n in team.quota.items() if n} if team else {},
            "borrow": {hardware_name(t): n for t, n in team.borrow.items() if n is not None} if team else {},
            "weight": team.weight if team else None,
        }
    return out


# Every application known to the zoo and the reference data, in a fixed order: each keeps its colour
# in every plot, whichever applications a workload has. Append new names; never reorder.
KNOWN_APPLICATIONS = ("bert", "cifar10", "deepspeech2", "gpt_pmp", "imagenet", "ncf", "yolov3")
_KNOWN_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")  # tab10
_OTHER_COLOURS = (
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#c7c7c7",
    "#dbdb8d",
    "#9edae5",
)  # the rest of tab10, tab20's light


def application_colour(application: str) -> str:
    """The one colour of an application in every plot: a known application's own, any other's a
    stable hash of its name into the colours the known ones leave."""
    if application in KNOWN_APPLICATIONS:
        return _KNOWN_COLOURS[KNOWN_APPLICATIONS.index(application)]
    return _OTHER_COLOURS[zlib.crc32(application.encode()) % len(_OTHER_COLOURS)]


def run_title(result: dict) -> str:
    """What a plot of one run is about: the workload, the policy (with its options), the cluster."""
    workload = "/".join(Path(result["workload"]).parts[-2:]) if result.get("workload") else "workload"
    return f"{workload}: {result.get('policy_spec') or result['policy']} on {result['cluster']}"


def plot(result: dict, path: str | Path) -> None:
    """GPUs in use by each application over time (stacked), the JCT CDF, and the finish-time
    fairness CDF when the result has it; with teams, below them each team's GPUs over time against
    its quota (`draw_team_use`); titled with the workload, the policy and the cluster."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    app_of = {j["name"]: j["application"] for j in result["jobs"]}
    apps = sorted(set(app_of.values()))
    t = np.array([r["t"] for r in result["timeline"]]) / 3600
    stack = np.array(
        [[sum(g for name, g in r["gpus"].items() if app_of[name] == a) for r in result["timeline"]] for a in apps]
    )
    rhos = np.sort([j["rho"] for j in result["jobs"] if j.get("rho") is not None])
    width = 19 if len(rhos) else 13
    if has_team_use(result):
        fig = plt.figure(figsize=(width, 9), layout="constrained")
        top, bottom = fig.subfigures(2, 1)
        draw_team_use(result, bottom)
    else:
        fig = top = plt.figure(figsize=(width, 4.5))
    axes = top.subplots(1, 3 if len(rhos) else 2)
    ax1, ax2 = axes[:2]
    if len(t):
        ax1.stackplot(t, stack, labels=apps, colors=[application_colour(a) for a in apps], step="post")
    ax1.set_xlabel("time (h)")
    ax1.set_ylabel("GPUs allocated")
    ax1.set_title("GPUs per application")
    ax1.legend(loc="upper right", fontsize=8)
    jcts = np.sort([j["jct_s"] for j in result["jobs"] if j["jct_s"] is not None]) / 3600
    ax2.step(jcts, np.arange(1, len(jcts) + 1) / max(len(jcts), 1), where="post")
    ax2.set_xscale("log")
    ax2.set_xlabel("job completion time (h, log)")
    ax2.set_ylabel("fraction of jobs")
    ax2.set_title(f"JCT CDF (avg {result['avg_jct_s'] / 3600:.2f} h)" if result["avg_jct_s"] else "JCT CDF")
    ax2.grid(alpha=0.3)
    if len(rhos):
        ax3 = axes[2]
        ax3.step(rhos, np.arange(1, len(rhos) + 1) / len(rhos), where="post")
        ax3.axvline(1.0, color="grey", linestyle="--", linewidth=1)
        ax3.set_xlabel("finish-time fairness rho (JCT / JCT alone on a 1/N share)")
        ax3.set_ylabel("fraction of jobs")
        ax3.set_title(f"rho CDF (max {rhos[-1]:.2f}, {100 * np.mean(rhos > 1 + 1e-9):.0f}% above 1)")
        ax3.grid(alpha=0.3)
    fig.suptitle(run_title(result))
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def has_team_use(result: dict) -> bool:
    """Whether a result holds each team's GPUs over time (a run with teams)."""
    return bool(result.get("teams")) and any("teams" in r for r in result["timeline"])


def draw_team_use(result: dict, figure) -> None:
    """Each team's GPUs over time, stacked in the team file's order, against the quotas (dashed: where
    each team's guarantee ends, stacked the same way) in `figure` (a Figure or SubFigure): one panel
    per GPU type, then one for all types when there are several. A band above its dashed line is
    borrowed; one below it leaves part of the guarantee to others."""
    timeline, teams = result["timeline"], result["teams"]
    t = np.array([r["t"] for r in timeline]) / 3600
    types = sorted(
        {gpu_type for r in timeline for held in r.get("teams", {}).values() for gpu_type in held}
        | {gpu_type for team in teams.values() for gpu_type in team["quota"]}
    )
    panels = [*types, None] if len(types) > 1 else types  # None: all types
    axes = np.atleast_1d(figure.subplots(1, len(panels), sharex=True))
    colours = [f"C{k}" for k in range(len(teams))]
    for ax, gpu_type in zip(axes, panels):
        used, quotas = [], []
        for name, team in teams.items():
            held = [r.get("teams", {}).get(name, {}) for r in timeline]
            if gpu_type is None:
                used.append([sum(h.values()) for h in held])
                quotas.append(sum(team["quota"].values()))
            else:
                used.append([h.get(gpu_type, 0) for h in held])
                quotas.append(team["quota"].get(gpu_type, 0))
        labels = [f"{name} (quota {quota})" for name, quota in zip(teams, quotas)]
        if len(t):
            ax.stackplot(t, used, labels=labels, colors=colours, step="post", alpha=0.75)
        for boundary, quota, colour in zip(np.cumsum(quotas), quotas, colours):
            if quota:
                ax.axhline(boundary, color=colour, linestyle="--", linewidth=1.2)
        ax.set_title(f"{gpu_type or 'all'} GPUs held per team", fontsize=10)
        ax.set_xlabel("time (h)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("GPUs held (stacked; dashed: quotas)")
