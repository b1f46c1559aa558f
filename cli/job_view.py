"""How `goodput status` shows a job's progress and metrics (a JobStatus as JSON builtins): a short
note on its row, and the lines of `goodput status JOB`. Pure functions over the status."""

from __future__ import annotations

import math

from shared.lifecycle import JobState


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


def job_lines(job: dict) -> list[str]:
    """The lines under its row in `goodput status JOB`: progress, speed, expected end, metrics, and
    its reason's further lines (a crash's stderr)."""
    lines = []
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
    if job.get("metrics"):
        lines.append("metrics: " + ", ".join(f"{name} {number(value)}" for name, value in job["metrics"].items()))
    if job.get("restarts"):
        lines.append(f"restarts: {job['restarts']}")
    lines += (job.get("reason") or "").splitlines()[1:]
    return lines


def job_row(j: dict) -> str:
    """A job's row in `goodput status`: where it runs (or why it waits, or how it ended: the first
    line of a crash's stderr; `goodput status JOB` shows the rest), then its progress."""
    where = (
        f"{j['gpus']} {j['gpu_type']}{'s' * (j['gpus'] != 1 and j['gpu_type'].endswith('slot'))} on "
        f"{', '.join(j['nodes'])}" + (f", batch {j['batch']}" if j["batch"] else "")
        if j["state"] == JobState.RUNNING
        else (j["reason"] or "").split("\n", 1)[0]
    )
    shown = "; ".join(filter(None, (where, progress_note(j))))
    return f"  {j['id'] or '(unreadable)':<28} {j['application'] or '-':<12} {j['state']:<10} {shown}"
