"""goodput.api.explain and goodput.api.rounds: why a job has what it has, in plain sentences, from the
decisions the policy leader recorded for it round by round (services/policy/recorder.py), and the last
rounds' summaries.

`explanation` is a pure function of a job's decisions (oldest first), its status and what the asker
may see of the other jobs the decisions name, as its `Who` says: a login sees its team's jobs
(DEFAULT_TEAM's logins: their own) by their ids, another team's only as "a job of team X"; the
operator sees every id.
`read_last` reads the last messages stored on one subject of the decisions stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.js import api

from services.api.who import Who
from shared import subjects
from shared.hardware import hardware_name
from shared.lifecycle import JobState
from shared.schema.api import JobStatus
from shared.schema.decisions import Explanation, Holder, JobDecision

T = TypeVar("T")
MAX_CHANGES = 10  # the sentences tell at most this many of its last changes
READ_TIMEOUT_S = 5.0  # a message of the stream not delivered by then ends the read with what came
ENDED_WORDS = {
    JobState.FINISHED: "It has finished.",
    JobState.CANCELLED: "It was cancelled.",
}


# ---- numbers and names ----------------------------------------------------------------------


def number(value: float) -> str:
    """A goodput as people read it: 1,900 or 12.5."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def numbers_apart(a: float, b: float) -> tuple[str, str]:
    """Two goodputs as `number` writes them, with more digits where that would write them alike
    (12,017.3 and 12,017.4, not 12,017 twice)."""
    x, y = number(a), number(b)
    for digits in (6, 7, 8):
        if x != y:
            break
        x, y = f"{a:,.{digits}g}", f"{b:,.{digits}g}"
    return x, y


def gpus_of(count: int, gpu_type: str | None) -> str:
    """`8 A100 GPUs`, `1 T4 GPU`; a node's CPU slots (real jobs on a machine without GPUs): `2 CPU slots`."""
    kind = hardware_name(gpu_type) if gpu_type else ""
    if kind.endswith("slot"):
        return f"{count} {kind}{'s' * (count != 1)}"
    return f"{count}{' ' * bool(kind)}{kind} GPU{'s' * (count != 1)}"


def listed(words: Sequence[str]) -> str:
    """`a`, `a and b`, `a, b and c` (nothing: "")."""
    return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else "".join(words)


class Namer:
    """How the sentences name the other jobs to `who`: by the id it knows (`known`: cluster id -> that
    id, as `Who.known_jobs` finds them), else as `Who.unknown_jobs` says."""

    def __init__(self, who: Who, known: Mapping[str, str]) -> None:
        self.who, self.known = who, known

    def one(self, holder: Holder) -> str:
        """`job b`, `a job of team vision`, `another job`."""
        if holder.job in self.known:
            return f"job {self.known[holder.job]}"
        return self.who.unknown_jobs(holder.team)

    def holdings(self, holders: Sequence[Holder]) -> str:
        """`job b holds 8 A100, 2 jobs of team vision hold 12 T4`: each job the asker knows by name,
        the others counted per team and type."""
        named: list[str] = []
        hidden: dict[tuple[str, str], list[int]] = {}
        for h in holders:
            if h.job in self.known:
                named.append(f"job {self.known[h.job]} holds {h.gpus} {hardware_name(h.gpu_type)}")
            else:
                hidden.setdefault((h.team, h.gpu_type), []).append(h.gpus)
        for (team, gpu_type), counts in hidden.items():
            verb = "hold" if len(counts) > 1 else "holds"
            named.append(f"{self.who.unknown_jobs(team, len(counts))} {verb} {sum(counts)} {hardware_name(gpu_type)}")
        return ", ".join(named)


# ---- the sentences ----------------------------------------------------------------------------


def _lost(d: JobDecision) -> float | None:
    """What a change cost the job in predicted goodput (its prediction before, less now)."""
    if d.previous_goodput is None:
        return None
    return d.previous_goodput - (d.goodput or 0.0)


def _takers(d: JobDecision, names: Namer, what: str) -> str:
    """Why the GPUs it lost went to others: the jobs of its team with a higher priority that took
    them (the policy weighs a job by its priority within its team), or the jobs that took them
    against what it lost."""
    first = d.holders[0]
    above = [h for h in d.holders if h.team == d.team and h.priority > d.priority]
    if above:
        takers = listed([names.one(h) for h in above])
        return (
            f"{takers} of team {d.team} took {what}, at a higher priority ({listed([str(h.priority) for h in above])} "
            f"against its {d.priority}): the policy weighs a job by its priority within its team"
        )
    lost = _lost(d)
    gained = sum(h.goodput for h in d.holders if h.goodput is not None)
    if lost is not None and gained <= lost:  # samples/s alone would not have moved them
        takers = listed([names.one(h) for h in d.holders])
        taken, kept = numbers_apart(gained, lost)
        return (
            f"{takers} took {what} (predicted goodput {taken} on them, against the {kept} it lost): the "
            f"policy weighs each job's speed-up over its own smallest allocation, the least sped-up first"
        )
    if len(d.holders) == 1 and first.goodput is not None and lost is not None:
        taken, kept = numbers_apart(first.goodput, lost)
        return f"{names.one(first)}'s predicted goodput on {what} ({taken}) exceeded what it lost ({kept})"
    takers = listed([names.one(h) for h in d.holders])
    worth = [number(h.goodput) for h in d.holders if h.goodput is not None]
    sentence = f"{takers} took {what}" + (f" (predicted goodput {', '.join(worth)})" if worth else "")
    return sentence + (f", more than it lost ({number(lost)})" if lost is not None else "")


def _goodputs(d: JobDecision) -> str:
    if d.previous_goodput is not None and d.goodput is not None:
        return f"its predicted goodput {number(d.previous_goodput)} → {number(d.goodput)}"
    if d.goodput is not None:
        return f"its predicted goodput {number(d.goodput)}"
    return ""


def change_sentence(d: JobDecision, names: Namer) -> str | None:
    """The sentence of a round that changed the job's GPUs (None for one that did not, or that failed
    it: its end says so)."""
    if d.outcome == "failed":
        return None
    at = f"In round {d.round}"
    taken_for_team = d.reason.startswith("team ")
    if d.change == "started":
        worth = f" (predicted goodput {number(d.goodput)})" if d.goodput is not None else ""
        return f"{at} it started on {gpus_of(d.gpus, d.gpu_type)}{worth}."
    if d.change == "grew":
        worth = f": {_goodputs(d)}" if d.goodput is not None else ""
        return f"{at} it grew from {d.previous_gpus} to {gpus_of(d.gpus, d.gpu_type)}{worth}."
    if d.change == "shrunk":
        head = f"{at} it was shrunk from {d.previous_gpus} to {gpus_of(d.gpus, d.gpu_type)}"
        if taken_for_team:
            return f"{head}: {d.reason}."
        if d.holders:
            return f"{head}: {_takers(d, names, 'them')}."
        return f"{head}" + (f" ({_goodputs(d)})" if d.goodput is not None else "") + "."
    if d.change == "moved":
        if d.gpu_type != d.previous_type:
            before, after = hardware_name(d.previous_type or "other"), hardware_name(d.gpu_type or "other")
            head = f"{at} it moved from {before} to {after}"
            if d.previous_gpus != d.gpus:
                head += f" ({d.previous_gpus} → {d.gpus} GPUs)"
        else:
            head = f"{at} it moved to other {gpus_of(d.gpus, d.gpu_type)} ({', '.join(n for n, _ in d.placement)})"
        factor = f" (restart factor {d.restart_factor:.2f})" if d.restart_factor is not None else ""
        gained = d.goodput is not None and d.previous_goodput is not None and d.goodput >= d.previous_goodput
        if taken_for_team:
            return f"{head}: {d.reason}."
        if gained or not d.holders:
            worth = _goodputs(d)
            return f"{head}: {worth} was worth the restart{factor}." if worth else f"{head}{factor}."
        what = f"the {hardware_name(d.previous_type)} GPUs" if d.previous_type else "its GPUs"
        return f"{head}: {_takers(d, names, what)}."
    if d.change == "stopped":
        head = f"{at} it was stopped (it held {gpus_of(d.previous_gpus, d.previous_type)})"
        if d.holders and not taken_for_team and d.outcome == "unallocated":
            return f"{head}: {_takers(d, names, 'them')}."
        return f"{head}: {d.reason}." if d.reason else f"{head}."
    return None


def waiting_sentence(d: JobDecision, since: int, earlier: bool, names: Namer) -> str:
    """Why a job with no GPUs after its latest round has none, since round `since` (`earlier`: or
    before: the decisions read begin there)."""
    head = f"Waiting since round {since}{' or earlier' if earlier else ''}"
    absent = listed([hardware_name(t) for t in d.absent_types]) if d.absent_types else ""
    if d.outcome == "unallocated" and not d.usable_types and d.absent_types:
        return f"{head}: it asks only for {absent} GPUs, which the cluster does not have."
    if d.outcome != "unallocated":
        return f"{head}: {d.reason or 'no GPUs this round'}."
    types = listed([hardware_name(t) for t in d.usable_types]) or "usable"
    if d.idle_gpus == 0 and d.holders:
        sentence = f"{head}: the cluster's {types} GPUs are all held — {names.holdings(d.holders)}."
    elif d.idle_gpus:
        held = f"; {names.holdings(d.holders)}" if d.holders else ""
        sentence = (
            f"{head}: {d.reason or 'the policy gave it none'}, though {d.idle_gpus} of the cluster's {types} "
            f"GPUs are idle (too few together for it, or kept for jobs it favours){held}."
        )
    else:
        sentence = f"{head}: {d.reason or 'the policy gave it none'}."
    if absent:
        sentence += f" It also asks for {absent} GPUs, which the cluster does not have."
    return sentence


def sentences(
    decisions: Sequence[JobDecision], status: JobStatus, names: Namer, complete: bool = True
) -> tuple[str, ...]:
    """Plain sentences, newest last: its changes (at most MAX_CHANGES), why it waits or what it runs
    on now, its predicted goodput against what it measured, and its end. `complete`: `decisions` are
    all that are kept of it (else the oldest read is not its first)."""
    ended = status.state in (JobState.FINISHED, JobState.CANCELLED, JobState.FAILED, JobState.REJECTED)
    if not decisions:
        if ended:
            return (_end(status),)
        why = f": {status.reason}" if status.reason else ""
        return (f"No round has decided for it yet ({status.state}){why}.",)
    said: list[str] = []
    changes = [s for s in (change_sentence(d, names) for d in decisions) if s is not None]
    if len(changes) > MAX_CHANGES:
        said.append(f"({len(changes) - MAX_CHANGES} earlier changes are not told here.)")
    said += changes[-MAX_CHANGES:]
    last = decisions[-1]
    if ended:
        said.append(_end(status))
        return tuple(said)
    if last.outcome == "failed":
        said.append(f"In round {last.round} it failed: {last.reason}.")
        return tuple(said)
    if last.gpus == 0:
        start = len(decisions) - 1
        while start > 0 and decisions[start - 1].gpus == 0:
            start -= 1
        said.append(waiting_sentence(last, decisions[start].round, start == 0 and not complete, names))
        if status.state == JobState.UNSCHEDULABLE and status.reason:
            said.append(f"The nodes as they are cannot take it, however the others move: {status.reason}.")
        return tuple(said)
    if not changes:  # running all along the decisions read
        said.append(f"It has run on {gpus_of(last.gpus, last.gpu_type)} since round {decisions[0].round} or earlier.")
    if last.outcome == "kept" and last.reason:
        said.append(f"In round {last.round} every job kept its place: {last.reason}.")
    if last.goodput is not None:
        predicted = f"Predicted goodput {number(last.goodput)} samples/s"
        before = last.previous_goodput
        if last.measured_goodput is not None and before:
            share = last.measured_goodput / before
            said.append(
                f"{predicted}; over the round before, measured {number(last.measured_goodput)} "
                f"({share:.0%} of the {number(before)} predicted for it)."
            )
        else:
            said.append(f"{predicted}; nothing measured on this placement yet (its first round, or a restart).")
    return tuple(said)


def _end(status: JobStatus) -> str:
    if status.state in ENDED_WORDS:
        return ENDED_WORDS[status.state]
    verb = "was rejected" if status.state == JobState.REJECTED else "failed"
    return f"It {verb}: {status.reason}." if status.reason else f"It {verb}."


def latest_per_round(decisions: Sequence[JobDecision]) -> list[JobDecision]:
    """One decision per round (a round recorded twice, by a new leader: its last), oldest first."""
    by_round = {d.round: d for d in decisions}
    return [by_round[r] for r in sorted(by_round)]


def shown_decision(d: JobDecision, job_id: str, shown: Mapping[str, str]) -> JobDecision:
    """A decision as the asker may see it: the job by the id it knows, the other jobs by theirs, or
    by their team only (an empty id)."""
    holders = tuple(msgspec.structs.replace(h, job=shown.get(h.job, "")) for h in d.holders)
    return msgspec.structs.replace(d, job=job_id, holders=holders)


def explanation(
    job_id: str,
    status: JobStatus,
    decisions: Sequence[JobDecision],
    known: Mapping[str, str],
    who: Who,
    complete: bool = True,
) -> Explanation:
    """goodput.api.explain's answer for the job `job_id` (as `who`, the asker, names it): its
    sentences and its decisions, oldest first. `known`: the other jobs `who` may know, cluster id ->
    its id for them; `complete`: `decisions` are all that are kept of the job."""
    ordered = latest_per_round(decisions)
    names = Namer(who, known)
    return Explanation(
        job_id,
        status.state,
        sentences(ordered, status, names, complete),
        tuple(shown_decision(d, job_id, known) for d in ordered),
    )


# ---- reading the decisions stream ------------------------------------------------------------------


async def read_last(bus: Any, subject: str, limit: int, msg_type: type[T]) -> tuple[list[T], int]:
    """The last `limit` messages stored on `subject` in the decisions stream, oldest first, and how
    many it holds there (none: no stream yet). A message that cannot be read is left out."""
    js = bus.js
    try:
        info = await js.stream_info(subjects.DECISIONS_STREAM, subjects_filter=subject)
    except nats.js.errors.NotFoundError:
        return [], 0
    total = (info.state.subjects or {}).get(subject, 0)
    if not total:
        return [], 0
    config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL)
    if total > limit:  # where the last `limit` begin: the sequences alone, no bodies
        sequences = [m.metadata.sequence.stream for m in await _scan(js, subject, config, headers_only=True)]
        if len(sequences) > limit:
            config = api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=sequences[-limit]
            )
    found = []
    for message in (await _scan(js, subject, config))[-limit:]:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            found.append(bus.decode(message.data, msg_type))
    return found, max(total, len(found))


async def _scan(js: Any, subject: str, config: api.ConsumerConfig, headers_only: bool = False) -> list:
    """The messages on `subject` from the consumer `config`'s start to the last stored (an ordered
    consumer: none missed or repeated), or as far as they come within READ_TIMEOUT_S each."""
    subscription = await js.subscribe(
        subject,
        stream=subjects.DECISIONS_STREAM,
        ordered_consumer=True,
        config=config,
        headers_only=headers_only or None,
    )
    messages = []
    try:
        while True:
            try:
                message = await subscription.next_msg(timeout=READ_TIMEOUT_S)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                return messages
            messages.append(message)
            if message.metadata.num_pending == 0:
                return messages
    finally:
        with contextlib.suppress(nats.errors.Error):
            await subscription.unsubscribe()
