"""Whose request the API is handling (`Who`), and every rule of what that requester may see.

Every request is a login's, of its team (`login()`: the server's word, `shared.bus.requester`, whose
account names the team; a request from within the services' own account is the operator's). A job
belongs to its team: the API stores it under `team.id` (`shared.teams.scoped_id`), so ids are unique
per team, and answers with the id as the team knows it. A team's logins look up, list, follow and
cancel the team's jobs; DEFAULT_TEAM's logins (a stack without teams) each their own; anyone else
looks one up, lists it or cancels it in vain ("not found", the very answer an unknown id gets); the
operator sees all, by their ids within the cluster. Of the jobs a login may not know it learns their
team only, and of the teams' GPUs and the rounds' use its own team's.

The endpoints' handlers take the `Who` of each request from the service (`services.api.service`),
never from the request, and ask it what to show.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from shared import subjects
from shared.bus.kv import TypedKV
from shared.bus.requesters import requester
from shared.permissions import account_team
from shared.schema.api import JobStatus, TeamStatus
from shared.schema.decisions import RoundSummary
from shared.schema.jobs import JobOwner
from shared.schema.records import JobsQuery
from shared.subjects import DEFAULT_TEAM
from shared.teams import scoped_id, user_id


class Who(NamedTuple):
    """Whose request is being handled: a login and its team, as the server says. The operator's
    (OPERATOR, of DEFAULT_TEAM) sees every team's jobs, by their ids within the cluster."""

    login: str
    team: str = DEFAULT_TEAM

    @property
    def everyone(self) -> bool:
        return self.login == subjects.OPERATOR

    # ---- ids ----

    def scoped(self, job_id: str) -> str:
        """The id within the cluster of the job this requester names `job_id`."""
        return job_id if self.everyone else scoped_id(self.team, job_id)

    def shown(self, scoped: str) -> str:
        """The id this requester knows the job `scoped` by."""
        return scoped if self.everyone else user_id(self.team, scoped)

    def not_found(self, job_id: str) -> str:
        """What a lookup of an id this requester has no job under is answered: the same for an
        unknown id and another's job."""
        whose = "by this login" if self.team == DEFAULT_TEAM else f"by team {self.team}"
        return f"no job {job_id!r} of yours: none was submitted under this id {whose}"

    # ---- jobs ----

    def query(self, prefix: str = "", **filters: Any) -> JobsQuery:
        """The executors' records this requester may see, of those whose id (as it names them) begins
        with `prefix`: its team's (DEFAULT_TEAM's logins: each its own), every one for the operator."""
        if self.everyone:
            return JobsQuery(prefix, None, team=None, **filters)
        own = self.login if self.team == DEFAULT_TEAM else None
        return JobsQuery(scoped_id(self.team, prefix), own, team=self.team, **filters)

    def sees(self, subject: str) -> bool:
        """Whether a submission stored on `subject` (a JobOwner's) is one this requester may see."""
        _, team, login = subjects.owner_of(subject)
        return self.everyone or (team == self.team and (team != DEFAULT_TEAM or login == self.login))

    def status(self, status: JobStatus) -> JobStatus:
        """A job's status with its id as this requester knows it."""
        return status if status.id is None else msgspec.structs.replace(status, id=self.shown(status.id))

    def logs_team(self, status: JobStatus) -> str:
        """The team whose logs stream holds what this requester's job `status` printed: its own (the
        operator's: the job's)."""
        return status.team if self.everyone else self.team

    async def known_jobs(self, jobs: Mapping[str, str], owners: TypedKV[JobOwner]) -> dict[str, str]:
        """Of `jobs` (cluster id -> its team), those this requester may know, by the id it knows each
        by: its team's (DEFAULT_TEAM's logins: their own, as the `owners` KV says), every one for the
        operator."""
        known = {}
        for job, team in jobs.items():
            if self.everyone or (team == self.team and team != DEFAULT_TEAM):
                known[job] = self.shown(job)
            elif team == self.team:
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    held = await owners.get(job)
                    if held is not None and self.sees(held.value.subject):
                        known[job] = job
        return known

    def unknown_jobs(self, team: str, count: int = 1) -> str:
        """How `count` jobs of `team` that this requester may not know are named to it: by their team
        only (`another job` of its own)."""
        if team == self.team:
            return f"{count} other jobs" if count > 1 else "another job"
        return f"{count} jobs of team {team}" if count > 1 else f"a job of team {team}"

    # ---- teams and rounds ----

    def counted_teams(self, named: Sequence[str]) -> list[str]:
        """The teams whose GPUs are counted for this requester's answer: the team file's `named` (what
        one team lends depends on the others' use), and its own even where the file does not name it."""
        return list(named) if self.everyone else [*named, self.team]

    def teams(self, rows: Iterable[TeamStatus]) -> tuple[TeamStatus, ...]:
        """Of the teams' GPUs, those this requester may see: its own team's, every team's for the operator."""
        return tuple(row for row in rows if self.everyone or row.team == self.team)

    def round(self, summary: RoundSummary) -> RoundSummary:
        """A round's summary as this requester may see it: its events name jobs, so only the operator
        has them, and a team sees its own use only, as `goodput.api.teams` shows it."""
        if self.everyone:
            return summary

        def own(by_team: dict) -> dict:
            return {team: value for team, value in by_team.items() if team == self.team}

        return msgspec.structs.replace(
            summary,
            events=(),
            team_gpus=own(summary.team_gpus),
            team_borrowed=own(summary.team_borrowed),
            team_reclaimed=own(summary.team_reclaimed),
        )


OPERATOR = Who(subjects.OPERATOR)


def login() -> Who:
    """Whose request is being handled: the login the server names, of the team its account holds;
    the operator for a request from within the services' own account."""
    who = requester()
    team = account_team(who.account) if who is not None else None
    return OPERATOR if team is None else Who(who.user, team)


def intake_owner(subject: str) -> Who:
    """Whose submission came on an intake subject (`goodput.jobs.submit.<team>.<login>`): the
    server's mapping names its team and login."""
    _, team, who = subjects.owner_of(subject)
    return Who(who, team or DEFAULT_TEAM)
