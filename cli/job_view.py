"""How `goodput status` shows a job's progress and metrics (a JobStatus as JSON builtins): a short
note on its row, and the lines of `goodput status JOB` (its team, what it holds of its team's
guarantee, its reclaims); the job table, with a team column when more than one team shows; and
the teams table of `goodput status --teams` (a TeamsAnswer as JSON builtins). Pure functions."""

from __future__ import annotations

import math

from shared.hardware import hardware_name
from shared.lifecycle import JobState
from shared.subjects import DEFAULT_TEAM


def duration(seconds: float) -> str:
    """`45 s`, `12 min`, `1 h 20 min`: as precise as an estimate deserves."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def number(value: float | str | None) -> str:
    if isinstance(value, str):
        return value
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def epochs(progress: dict) -> str:
    target = progress.get("target_epochs")
    done = f"epoch {progress['epochs']:.1f}"
    if not target:
        return done
    return f"{done} of {number(target)} ({min(progress['epochs'] / target, 1.0):.0%})"


def progress_note(job: dict) -> str:
    """Its row's note: where it is against its target, and when it should end."""
    progress = job.get("progress")
    if not progress:
        return ""
    note = epochs(progress)
    if progress.get("remaining_s") is not None and job["state"] == "running":
        note += f", ends in ~{duration(progress['remaining_s'])}"
    return note


def team_line(job: dict) -> str | None:
    """Its team, and while it runs what it holds of its team's guarantee and what it borrows:
    `team nlp: holds 8 A100, 4 of its team's guarantee and 4 borrowed`. None for a job of
    DEFAULT_TEAM that borrows nothing and was never reclaimed (a cluster without teams)."""
    team = job.get("team") or DEFAULT_TEAM
    borrowed, gpus = min(job.get("borrowed") or 0, job.get("gpus") or 0), job.get("gpus") or 0
    if team == DEFAULT_TEAM and not borrowed and not job.get("reclaims"):
        return None
    if job["state"] != JobState.RUNNING or not gpus:
        return f"team {team}"
    held = f"team {team}: holds {gpus} {job['gpu_type']}"
    if not borrowed:
        return f"{held}, all of its team's guarantee"
    if borrowed == gpus:
        return f"{held}, all borrowed (beyond its team's guarantee: others' idle GPUs, taken back when they want them)"
    return f"{held}, {gpus - borrowed} of its team's guarantee and {borrowed} borrowed"


def reclaim_sentence(reclaim: dict) -> str:
    """`round 12: shrunk from 8 to 4 A100 so that team nlp got its guaranteed GPUs back`."""
    before, after, kind = reclaim["gpus_before"], reclaim["gpus_after"], hardware_name(reclaim["gpu_type"])
    what = f"shrunk from {before} to {after} {kind}" if after else f"gave up its {before} {kind} (stopped, or moved)"
    return f"round {reclaim['round']}: {what} so that team {reclaim['by_team']} got its guaranteed GPUs back"


def job_lines(job: dict) -> list[str]:
    """The lines under its row in `goodput status JOB`: its team and what it holds of its team's
    guarantee, each reclaim it went through, progress, speed, expected end, once ended its time and
    GPU-hours, metrics, and its reason's further lines (a crash's stderr)."""
    lines = [line for line in (team_line(job),) if line is not None]
    lines += [reclaim_sentence(r) for r in job.get("reclaims") or ()]
    progress = job.get("progress")
    if progress:
        lines.append(f"progress: step {progress['steps']:,}, {epochs(progress)}")
        if progress.get("throughput") is not None:
            speed = f"speed: {number(progress['throughput'])} examples/s"
            if progress.get("goodput") is not None:
                speed += f", goodput {number(progress['goodput'])} (at its statistical efficiency)"
            lines.append(speed + (f", batch {job['batch']}" if job.get("batch") else ""))
        if progress.get("remaining_s") is not None and job["state"] == "running":
            lines.append(f"expected end: in ~{duration(progress['remaining_s'])}, at its rate since it last started")
    if job.get("jct_s") is not None:  # ended: how long from its submission, on how much
        lines.append(
            f"{job['state']} {duration(job['jct_s'])} after its submission, "
            f"{number(job.get('gpu_seconds', 0.0) / 3600)} GPU-hours"
        )
    if job.get("metrics"):
        lines.append("metrics: " + ", ".join(f"{name} {number(value)}" for name, value in job["metrics"].items()))
    if job.get("restarts"):
        lines.append(f"restarts: {job['restarts']}")
    lines += (job.get("reason") or "").splitlines()[1:]
    lines += [f"another body sent under its id was refused: {_summary(r)}" for r in job.get("refusals") or ()]
    return lines


def _summary(reason: str) -> str:
    """A reason on one line: its first, and of the lines after (a crash's stderr) the last, its error."""
    first, *rest = reason.splitlines() or [""]
    error = next((line.strip() for line in reversed(rest) if line.strip()), "")
    return f"{first} {error}" if error else first


def job_table(jobs: list[dict]) -> list[str]:
    """The jobs' rows, with a team column when they are of more than one team."""
    teams = {j.get("team") or DEFAULT_TEAM for j in jobs}
    return [job_row(j, with_team=len(teams) > 1) for j in jobs]


def job_row(j: dict, with_team: bool = False) -> str:
    """A job's row in `goodput status`: its team (`with_team`), where it runs (or why it waits, or
    how it ended: with a crash, the last line of its stderr, the error; `goodput status JOB` shows
    the lines before), then its progress."""
    where = (
        f"{j['gpus']} {j['gpu_type']}{'s' * (j['gpus'] != 1 and j['gpu_type'].endswith('slot'))} on "
        f"{', '.join(j['nodes'])}" + (f", batch {j['batch']}" if j["batch"] else "")
        if j["state"] == JobState.RUNNING
        else _summary(j["reason"] or "")
    )
    shown = "; ".join(filter(None, (where, progress_note(j))))
    team = f"{j.get('team') or DEFAULT_TEAM:<12} " if with_team else ""
    return f"  {j['id'] or '(unreadable)':<28} {team}{j['application'] or '-':<12} {j['state']:<10} {shown}"


def teams_lines(answer: dict) -> list[str]:
    """`goodput status --teams`: per team and GPU type, its guarantee, what its jobs use, how many
    of those are borrowed, how many of its guarantee are lent now, and how many more it may borrow."""
    lines = [answer["note"]] if answer.get("note") else []
    lines.append(f"  {'team':<14} {'GPU type':<24} {'quota':>5} {'used':>5} {'borrowed':>8} {'lent':>5}  may borrow")
    for team in answer["teams"]:
        shown = team["team"] + (f" (weight {team['weight']:g})" if team.get("weight", 1.0) != 1.0 else "")
        for gpus in team["gpus"]:
            kind = gpus["gpu_type"] + (f" ({gpus['gpu_alias']})" if gpus["gpu_alias"] != gpus["gpu_type"] else "")
            limit = "any idle" if gpus.get("borrow_limit") is None else str(gpus["borrow_limit"])
            lines.append(
                f"  {shown:<14} {kind:<24} {gpus['quota']:>5} {gpus['used']:>5} {gpus['borrowed']:>8} "
                f"{gpus['lent']:>5}  {limit}"
            )
            shown = ""
        if not team["gpus"]:
            lines.append(f"  {shown:<14} (no GPUs)")
    return lines
