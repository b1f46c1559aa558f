"""A job's life (shared/lifecycle.py): its states are the strings on the wire, the moves between
them, and the one rule both executors use to tell a job's state."""

import pytest

from shared.lifecycle import TRANSITIONS, IllegalTransition, JobState, check_transition, job_state

S = JobState


def test_the_states_are_the_strings_records_carry_in_the_order_status_counts_them():
    assert [str(state) for state in JobState] == [
        "queued",
        "unschedulable",
        "profiling",
        "running",
        "finished",
        "failed",
        "rejected",
        "cancelled",
    ]
    assert JobState("running") is S.RUNNING and S.RUNNING == "running" and f"{S.QUEUED}" == "queued"
    assert set(TRANSITIONS) == set(JobState)


def test_a_job_moves_from_profiling_through_the_queue_to_an_end():
    path = [S.PROFILING, S.QUEUED, S.RUNNING, S.QUEUED, S.RUNNING, S.FINISHED]
    for before, after in zip(path, path[1:]):
        assert check_transition(before, after, "j") is after
    for state in JobState:  # staying is no move
        assert check_transition(state, state) is state


@pytest.mark.parametrize(
    "before, after",
    [
        (S.PROFILING, S.REJECTED),
        (S.PROFILING, S.CANCELLED),
        (S.QUEUED, S.CANCELLED),
        (S.RUNNING, S.CANCELLED),
        (S.RUNNING, S.FAILED),
        (S.QUEUED, S.FINISHED),  # its workers finished as they were being stopped
        (S.CANCELLED, S.FINISHED),  # ... as its cancel stopped them
        (S.FAILED, S.FINISHED),
        (S.REJECTED, S.FAILED),  # refused by the executors on submission, accepted by the profiler after all
        (S.QUEUED, S.UNSCHEDULABLE),  # its nodes were drained or lost
        (S.RUNNING, S.UNSCHEDULABLE),  # ... while it ran on them
        (S.PROFILING, S.UNSCHEDULABLE),  # accepted, and the live nodes cannot take it
        (S.UNSCHEDULABLE, S.QUEUED),  # a node joined, a drain was lifted
        (S.UNSCHEDULABLE, S.RUNNING),  # ... and the same round placed it
        (S.UNSCHEDULABLE, S.CANCELLED),
    ],
)
def test_the_moves_a_job_makes(before, after):
    assert check_transition(before, after) is after


@pytest.mark.parametrize(
    "before, after",
    [
        (S.FINISHED, S.CANCELLED),  # a cancel of an ended job does nothing
        (S.FINISHED, S.RUNNING),
        (S.CANCELLED, S.QUEUED),  # cancelled while profiled: its verdict after does not start it
        (S.REJECTED, S.QUEUED),
        (S.FAILED, S.RUNNING),
        (S.PROFILING, S.RUNNING),  # it waits in the queue first
        (S.QUEUED, S.PROFILING),
        (S.UNSCHEDULABLE, S.PROFILING),
        (S.FINISHED, S.UNSCHEDULABLE),
        (S.REJECTED, S.UNSCHEDULABLE),
    ],
)
def test_an_illegal_move_raises_a_value_error_naming_the_job(before, after):
    with pytest.raises(IllegalTransition, match=f"job cifar-1: {before} -> {after}"):
        check_transition(before, after, "cifar-1")
    assert issubclass(IllegalTransition, ValueError)


def known(finished=False, cancelled=False, failed=False, profiled=True, placed=False, fits=True) -> JobState:
    return job_state(finished=finished, cancelled=cancelled, failed=failed, profiled=profiled, placed=placed, fits=fits)


def test_a_jobs_state_from_what_is_known_of_it():
    assert known(profiled=False) == S.PROFILING
    assert known() == S.QUEUED
    assert known(placed=True) == S.RUNNING
    assert known(fits=False) == S.UNSCHEDULABLE
    assert known(fits=False, placed=True) == S.RUNNING  # placed all the same: it runs
    assert known(fits=False, profiled=False) == S.PROFILING
    assert known(fits=False, failed=True) == S.FAILED
    assert known(finished=True, placed=True) == S.FINISHED
    assert known(failed=True) == S.FAILED
    assert known(failed=True, profiled=False) == S.REJECTED
    assert known(cancelled=True, failed=True) == S.CANCELLED
    assert known(cancelled=True, failed=True, profiled=False) == S.CANCELLED  # before its verdict


def test_a_finish_stands_over_a_cancel_or_failure_that_came_after_it():
    assert known(finished=True, cancelled=True, failed=True) == S.FINISHED
    assert known(finished=True, failed=True, placed=True) == S.FINISHED
