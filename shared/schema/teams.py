"""The teams' messages: the operator's team file (stored in the teams' KV, carried by a replay's
request) and the teams it makes against a cluster (shared/teams.py checks and resolves them)."""

from __future__ import annotations

from typing import Annotated

import msgspec

Gpus = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
TypeName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class TeamSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One team as the file names it: GPU types by any name the cluster knows them by."""

    quota: dict[TypeName, Gpus] = {}
    borrow: dict[TypeName, Gpus] = {}  # a type not named: it may borrow any idle GPU of it
    weight: float = 1.0


class TeamFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The operator's team file."""

    teams: dict[str, TeamSpec]


class Team(msgspec.Struct, frozen=True):
    """One team against a cluster: every GPU type by the cluster's key."""

    quota: dict[str, int]  # guaranteed GPUs of each type (0 for a type it holds none of)
    borrow: dict[str, int | None]  # at most this many more of each type (None: any idle)
    weight: float = 1.0


class Teams(msgspec.Struct, frozen=True):
    """The teams of a cluster, checked: what the policies read each round."""

    teams: dict[str, Team]

    def quota(self, team: str, gpu_type: str) -> int:
        found = self.teams.get(team)
        return found.quota.get(gpu_type, 0) if found is not None else 0

    def borrow_limit(self, team: str, gpu_type: str) -> int | None:
        """How many GPUs of `gpu_type` beyond its quota `team` may hold (None: any idle); a team the
        file does not name (DEFAULT_TEAM's jobs) borrows like one without limits."""
        found = self.teams.get(team)
        return found.borrow.get(gpu_type) if found is not None else None

    def most(self, team: str, gpu_type: str, capacity: int) -> int:
        """The most GPUs of `gpu_type` (of which the cluster has `capacity`) that `team`'s jobs may
        hold together: its quota and its borrow limit, or all of them where it borrows without one."""
        limit = self.borrow_limit(team, gpu_type)
        return capacity if limit is None else min(capacity, self.quota(team, gpu_type) + limit)

    def weight(self, team: str) -> float:
        found = self.teams.get(team)
        return found.weight if found is not None else 1.0
