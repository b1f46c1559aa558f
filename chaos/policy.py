"""`chaos`: another policy whose solve fails in one round — for the fault-injection suite
(chaos/suite.py, docs/chaos.md) and its tests; not a scheduling choice.

`chaos` with options `policy="sia", fail_round=5, how="raise"` decides as sia except in the round at
now = 5 × round_s: `raise` makes the solve raise at once; `timeout` makes it hang for `stall_s`
(the wrapped policy's time limit by default) and then give up with TimeoutError, as a solver that
ran out of time with no usable answer. Either way the simulator keeps the previous allocation for
that round and says why in an event. The failing round is read off the clock, not counted, so a
standby leader that resumes the run fails the same round.
"""

from __future__ import annotations

import time

from policies.base import Decision, RoundState, make_policy, refuse_teams, restore_policy, snapshot_policy

HOW = ("raise", "timeout")
DEFAULT_STALL_S = 5.0


class ChaosPolicy:
    name = "chaos"
    honours_teams = False  # the class's word; an instance's is the wrapped policy's (__init__)

    def __init__(
        self, policy: str = "sia", fail_round: int = 1, how: str = "raise", stall_s: float | None = None, **options
    ):
        if how not in HOW:
            raise ValueError(f"chaos: how must be one of {HOW}, got {how!r}")
        self.inner = make_policy(policy, **options)
        self.round_s, self.adaptive_batch = self.inner.round_s, self.inner.adaptive_batch
        # It decides as the policy it wraps, teams included: that one honours them or refuses them.
        self.honours_teams = self.inner.honours_teams
        self.fail_round, self.how = int(fail_round), how
        self.stall_s = stall_s if stall_s is not None else getattr(self.inner, "time_limit_s", DEFAULT_STALL_S)

    def allocate(self, state: RoundState) -> Decision:
        if not self.honours_teams:
            refuse_teams(f"chaos over {self.inner.name}", state)
        if round(state.now_s / self.round_s) != self.fail_round:
            return self.inner.allocate(state)
        if self.how == "timeout":
            time.sleep(self.stall_s)  # in the leader's solver thread, as a real solve would be
            raise TimeoutError(f"chaos: the solve ran out of its {self.stall_s:g} s in round {self.fail_round}")
        raise RuntimeError(f"chaos: the solver failed in round {self.fail_round}")

    # The wrapped policy's state between rounds (pollux's population) travels with the checkpoint.
    def snapshot(self) -> bytes:
        return snapshot_policy(self.inner)

    def restore(self, state: bytes) -> None:
        restore_policy(self.inner, state)
