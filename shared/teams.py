"""Teams share the cluster: the operator's team file, checked against a cluster, and where a job's
id and team meet.

A team file (YAML or JSON; docs/teams.md) names each team with, per GPU type (by the names people
know: T4, A100, "RTX 2080 Ti", or the cluster's keys), its guaranteed GPUs (`quota`), how many more
it may borrow while others leave theirs idle (`borrow`; a type not named: any idle), and a `weight`
for sharing what lies beyond all guarantees:

    teams:
      vision: {quota: {T4: 12, A100: 8, RTX 2080 Ti: 8}, weight: 1}
      nlp:    {quota: {T4: 12, A100: 8, RTX 2080 Ti: 16}, borrow: {A100: 8}, weight: 2}

`TeamFile` is the file as the operator wrote it (what the teams' KV keeps and `goodput teams apply`
sends); `resolve(file, cluster)` checks it against a cluster and gives `Teams`, keyed by the
cluster's GPU types, which the policies read. A job belongs to the team of the login that submitted
it (the server's word: each team is a NATS account of its own, shared/permissions.py); the jobs of
the operator and of logins without a team are DEFAULT_TEAM's, which holds no guarantee and borrows
what is idle. Within the cluster a team's job is known by `team.id` (`scoped_id`), so ids are unique
per team and no team learns another's; DEFAULT_TEAM's jobs keep their ids as they are.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import msgspec
import yaml

from shared.cluster import Cluster
from shared.hardware import described, hardware_name, types_named
from shared.schema.base import TEAM_NAME as TEAM_NAME_PATTERN
from shared.schema.teams import Team, TeamFile, Teams
from shared.subjects import DEFAULT_TEAM

MAX_TEAMS = 64
# A team's name is a login's (`goodput up --teams` makes one login per team, named after it) and a
# subject token: lower-case letters, digits, '_' and '-'.
TEAM_NAME = re.compile(TEAM_NAME_PATTERN)


def team_problem(name: str) -> str | None:
    """Why `name` cannot name a team, or None."""
    if not isinstance(name, str) or not TEAM_NAME.match(name):
        return (
            f"a team's name is 1 to 32 lower-case letters, digits, '_' and '-', starting with a letter or digit "
            f"(it names the team's login and account); {name!r} is not"
        )
    if name == DEFAULT_TEAM:
        return f"{DEFAULT_TEAM!r} is the team of the jobs no other team holds; choose another name"
    return None


class _UniqueKeys(yaml.SafeLoader):
    """YAML as safe_load reads it, but a key given twice in one mapping is an error: in a team file
    the second `vision:` would silently replace the first team's guarantee."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_team_file(text: str | bytes, source: str = "the team file") -> TeamFile:
    """A team file's text (YAML or JSON) -> TeamFile; ValueError saying what is wrong and where."""
    try:
        document = yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as error:
        raise ValueError(f"{source} is not YAML: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("teams"), dict) or not document["teams"]:
        raise ValueError(f"{source}: a team file is a mapping `teams:` of team name -> {{quota, borrow, weight}}")
    try:
        return msgspec.convert(document, TeamFile)
    except msgspec.ValidationError as error:
        raise ValueError(f"{source}: {error}") from None


def load_team_file(path: str | Path) -> TeamFile:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no team file {path}")
    return parse_team_file(path.read_text(), str(path))


def _type_of(name: str, cluster: Cluster, team: str, field: str) -> str:
    found = types_named(name, cluster.gpu_types)
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(
            f"team {team}: {field} names GPU type {name!r}, which cluster {cluster.name} has not; "
            f"its types: {described(cluster.gpu_types)}"
        )
    raise ValueError(f"team {team}: {field} type {name!r} names {described(found)}: use the key")


def resolve(file: TeamFile, cluster: Cluster) -> Teams:
    """The team file checked against `cluster`: ValueError with the reason for a team's name that
    cannot be one, an unknown or ambiguous GPU type, a weight not a positive number, or guarantees
    of a type that add up to more than the cluster holds."""
    if len(file.teams) > MAX_TEAMS:
        raise ValueError(f"{len(file.teams)} teams: at most {MAX_TEAMS}")
    teams: dict[str, Team] = {}
    for name, spec in file.teams.items():
        problem = team_problem(name)
        if problem is not None:
            raise ValueError(problem)
        if not (isinstance(spec.weight, (int, float)) and math.isfinite(spec.weight) and spec.weight > 0):
            raise ValueError(f"team {name}: weight {spec.weight!r} must be a positive number")
        quota = {t: 0 for t in cluster.gpu_types}
        borrow: dict[str, int | None] = {t: None for t in cluster.gpu_types}
        for field, given, into in (("quota", spec.quota, quota), ("borrow", spec.borrow, borrow)):
            for type_name, gpus in given.items():
                gpu_type = _type_of(type_name, cluster, name, field)
                if field == "quota" and quota[gpu_type]:
                    raise ValueError(f"team {name}: quota names {hardware_name(gpu_type)} twice")
                into[gpu_type] = gpus
        teams[name] = Team(quota, borrow, float(spec.weight))
    for gpu_type in cluster.gpu_types:
        guaranteed = sum(team.quota[gpu_type] for team in teams.values())
        if guaranteed > cluster.capacity(gpu_type):
            held = ", ".join(f"{n} {t.quota[gpu_type]}" for n, t in teams.items() if t.quota[gpu_type])
            raise ValueError(
                f"the guarantees of {hardware_name(gpu_type)} add up to {guaranteed} GPUs ({held}); "
                f"cluster {cluster.name} has {cluster.capacity(gpu_type)}"
            )
    return Teams(teams)


def scoped_id(team: str, job_id: str) -> str:
    """A team's job `job_id` as the cluster knows it: `team.job_id` (DEFAULT_TEAM's: as it is)."""
    return job_id if team == DEFAULT_TEAM else f"{team}.{job_id}"


def user_id(team: str, scoped: str) -> str:
    """The id `team` knows its job `scoped` by (the inverse of `scoped_id`)."""
    return scoped if team == DEFAULT_TEAM else scoped.removeprefix(f"{team}.")
