"""`goodput explain`: the decisions the round loop records for each job (pure builders from what a
round decided), the sentences made of them, the round metrics from each round's summary, and the
round loop handing its decided rounds to a recorder. No server here: tests/test_explain_bus.py reads
and writes the decisions stream, and asks `goodput explain` of a live stack."""

from __future__ import annotations

import asyncio

import msgspec

from policies.base import Decision, Prediction
from services.api.explain import Namer, explanation, number, numbers_apart, sentences
from services.api.who import Who
from services.policy.decisions import (
    Measuring,
    job_decisions,
    job_outcome,
    measured_goodput,
    record_round_metrics,
    round_summary,
    span_attributes,
    team_waits,
    usable_and_absent,
)
from shared.cluster import build_cluster
from shared.lifecycle import JobState
from shared.schema.api import JobStatus
from shared.schema.base import Config
from shared.schema.decisions import Holder, JobDecision
from shared.schema.rounds import JobFacts, Reclaim
from shared.schema.teams import Team, Teams
from sim.rounds import job_models

A100_NODE = {"gpu_type": "dgx", "count": 1, "gpus_per_node": 8}
T4_NODE = {"gpu_type": "aws", "count": 1, "gpus_per_node": 4}
RUNNING = JobStatus("a", JobState.RUNNING)
WAITING = JobStatus("w", JobState.QUEUED)
ALICE = Who("alice")  # a login of the default team


def facts(job: str, placement=(), team: str = "default", **fields) -> JobFacts:
    return JobFacts(job, "cifar10", 0.0, 600.0, 1, 128, False, 128, 4096, placement=placement, team=team, **fields)


def decided(
    cluster, jobs, placements, predictions, held=None, failed=None, evicted=(), kept=None, policy="sia", waits=None
):
    """Each job's outcome of a round that gave `placements` (its facts say where each was before)."""
    by_id = {f.job_id: f for f in jobs}
    decision = Decision(
        {j: cluster.config_of(s) for j, s in placements.items()}, dict(placements), predictions=predictions
    )
    names = [*by_id, *(held or {}), *(failed or {})]
    return [
        job_outcome(
            j, by_id.get(j), held or {}, failed or {}, decision, placements, set(evicted), kept, cluster, policy, waits
        )
        for j in dict.fromkeys(names)
    ]


def models_of(cluster, *jobs, gpu_types=None):
    return {j: job_models(j, "cifar10", cluster, gpu_types=gpu_types) for j in jobs}


# ---- the decisions -------------------------------------------------------------------------------


def test_a_job_shrunk_for_another_names_the_taker_and_both_goodputs() -> None:
    cluster = build_cluster("one-a100", [A100_NODE])
    before = [facts("a", (("dgx-0", 8),)), facts("dana-7", team="vision")]
    after = {"a": (("dgx-0", 4),), "dana-7": (("dgx-0", 4),)}
    outcomes = decided(cluster, before, after, {"a": Prediction(goodput=800.0), "dana-7": Prediction(goodput=3100.0)})
    a, d = job_decisions(
        14, 840.0, outcomes, cluster, models_of(cluster, "a", "dana-7"), previous_goodput={"a": 2000.0}
    )
    assert (a.change, a.outcome, a.previous_gpus, a.gpus, a.gpu_type) == ("shrunk", "allocated", 8, 4, "dgx")
    assert (a.goodput, a.previous_goodput) == (800.0, 2000.0)
    assert a.holders == (Holder("dana-7", "vision", "dgx", 4, 3100.0),)
    assert (d.change, d.holders, d.previous_goodput) == ("started", (), None)
    [said] = sentences([a], RUNNING, Namer(ALICE, {"dana-7": "dana-7"}))[:1]
    assert said == (
        "In round 14 it was shrunk from 8 to 4 A100 GPUs: job dana-7's predicted goodput on them (3,100) "
        "exceeded what it lost (1,200)."
    )
    # Where the taker's samples/s are no more than what it lost, the sentence says what did decide.
    even = msgspec.structs.replace(a, previous_goodput=800.0 + 3100.0)
    [said] = sentences([even], RUNNING, Namer(ALICE, {"dana-7": "dana-7"}))[:1]
    assert said == (
        "In round 14 it was shrunk from 8 to 4 A100 GPUs: job dana-7 took them (predicted goodput 3,100 on them, "
        "against the 3,100 it lost): the policy weighs each job's speed-up over its own smallest allocation, "
        "the least sped-up first."
    )
    # A login of another team sees the taker by its team only, in the sentence and in the decision.
    other = explanation("a", RUNNING, [a], {}, Who("ann", "nlp"))
    assert "a job of team vision's predicted goodput" in other.sentences[0]
    assert other.decisions[0].holders[0].job == "" and "dana" not in str(msgspec.to_builtins(other.decisions))


def test_a_job_waiting_on_a_full_cluster_names_who_holds_each_of_its_types() -> None:
    cluster = build_cluster("mixed", [A100_NODE, T4_NODE])
    jobs = [facts("b", (("dgx-0", 8),)), facts("c", (("aws-0", 4),), team="vision"), facts("w")]
    held = {"b": (("dgx-0", 8),), "c": (("aws-0", 4),)}
    predictions = {"b": Prediction(goodput=5000.0), "c": Prediction(goodput=700.0)}
    outcomes = decided(cluster, jobs, held, predictions)
    decisions = job_decisions(12, 720.0, outcomes, cluster, models_of(cluster, "b", "c", "w"))
    w = decisions[-1]
    assert (w.change, w.outcome, w.gpus, w.idle_gpus) == ("waiting", "unallocated", 0, 0)
    assert w.usable_types == ("dgx", "aws") and w.absent_types == ()
    assert [(h.job, h.gpus, h.gpu_type) for h in w.holders] == [("b", 8, "dgx"), ("c", 4, "aws")]
    later = msgspec.structs.replace(w, round=13, at_s=780.0)
    said = sentences([w, later], WAITING, Namer(ALICE, {"b": "b"}))
    assert said == (
        "Waiting since round 12: the cluster's A100 and T4 GPUs are all held — job b holds 8 A100, "
        "a job of team vision holds 4 T4.",
    )
    # Read from its 13th round on, of more kept: it may have waited longer.
    assert sentences([later], WAITING, Namer(ALICE, {}), complete=False)[0].startswith(
        "Waiting since round 13 or earlier: the cluster's A100 and T4 GPUs are all held — another job holds 8 A100"
    )


def test_a_job_asking_for_a_type_the_cluster_lacks_is_told_so() -> None:
    with_v100 = build_cluster("v100", [{"gpu_type": "azure", "count": 1, "gpus_per_node": 4}, T4_NODE])
    cluster = build_cluster("t4", [T4_NODE])
    models = {"v": job_models("v", "cifar10", with_v100, gpu_types=("azure",))}
    assert usable_and_absent(models["v"], cluster.gpu_types) == ((), ("azure",))
    [v] = job_decisions(3, 180.0, decided(cluster, [facts("v")], {}, {}), cluster, models)
    assert (v.change, v.usable_types, v.absent_types, v.holders) == ("waiting", (), ("azure",), ())
    assert sentences([v], WAITING, Namer(ALICE, {})) == (
        "Waiting since round 3: it asks only for V100 GPUs, which the cluster does not have.",
    )


def test_a_job_moved_to_a_faster_type_says_the_gain_was_worth_the_restart() -> None:
    cluster = build_cluster("mixed", [A100_NODE, T4_NODE])
    outcomes = decided(
        cluster,
        [facts("m", (("aws-0", 4),))],
        {"m": (("dgx-0", 4),)},
        {"m": Prediction(goodput=1900.0, batch=512, restart_factor=0.93)},
    )
    [m] = job_decisions(20, 1200.0, outcomes, cluster, models_of(cluster, "m"), previous_goodput={"m": 410.0})
    assert (m.change, m.previous_type, m.gpu_type, m.restart_factor, m.batch) == ("moved", "aws", "dgx", 0.93, 512)
    assert outcomes[0].restart and span_attributes(outcomes[0])["restart"] is True
    assert sentences([m], RUNNING, Namer(ALICE, {}))[0] == (
        "In round 20 it moved from T4 to A100: its predicted goodput 410 → 1,900 was worth the restart "
        "(restart factor 0.93)."
    )


def test_a_job_stopped_for_a_teams_guarantee_and_one_held_by_the_executors_say_why() -> None:
    cluster = build_cluster("one-a100", [A100_NODE])
    jobs = [facts("s", (("dgx-0", 8),)), facts("g", team="nlp")]
    outcomes = decided(cluster, jobs, {"g": (("dgx-0", 8),)}, {"g": Prediction(goodput=900.0)}, held={"q": "queued"})
    reclaim = Reclaim(7, 420.0, "nlp", "dgx", 8, 0)
    s, g, q = job_decisions(7, 420.0, outcomes, cluster, models_of(cluster, "s", "g"), {"s": reclaim})
    assert (s.change, s.reason) == ("stopped", "team nlp took back GPUs of its guarantee")
    assert sentences([s], WAITING, Namer(ALICE, {}))[0] == (
        "In round 7 it was stopped (it held 8 A100 GPUs): team nlp took back GPUs of its guarantee."
    )
    assert (q.outcome, q.change, q.reason, q.holders) == ("waits", "waiting", "queued", ())
    assert sentences([q], WAITING, Namer(ALICE, {})) == ("Waiting since round 7: queued.",)


def test_a_job_stopped_for_a_job_of_its_team_at_a_higher_priority_says_so_not_goodput() -> None:
    cluster = build_cluster("one-a100", [A100_NODE])
    jobs = [facts("low", (("dgx-0", 8),), team="nlp", priority=0), facts("high", team="nlp", priority=5)]
    predicted = {"high": Prediction(goodput=300.0)}
    outcomes = decided(cluster, jobs, {"high": (("dgx-0", 8),)}, predicted)
    low, high = job_decisions(
        9, 540.0, outcomes, cluster, models_of(cluster, "low", "high"), previous_goodput={"low": 900.0}
    )
    assert (low.change, low.priority, [(h.job, h.priority) for h in low.holders]) == ("stopped", 0, [("high", 5)])
    assert sentences([low], WAITING, Namer(Who("ann", "nlp"), {"high": "high"}))[0] == (
        "In round 9 it was stopped (it held 8 A100 GPUs): job high of team nlp took them, at a higher priority "
        "(5 against its 0): the policy weighs a job by its priority within its team."
    )
    # The same round between jobs of one priority is told by their goodputs.
    equal = [msgspec.structs.replace(f, priority=0) for f in jobs]
    outcomes = decided(cluster, equal, {"high": (("dgx-0", 8),)}, predicted)
    [low, _] = job_decisions(
        9, 540.0, outcomes, cluster, models_of(cluster, "low", "high"), previous_goodput={"low": 900.0}
    )
    assert "priority" not in sentences([low], WAITING, Namer(Who("ann", "nlp"), {"high": "high"}))[0]


def nlp_and_cv(**jobs: tuple[str, dict]):
    """Two A100 nodes of 8; team nlp may hold 8 A100 (quota 4, borrow 4), team cv borrows without
    limit; each job (its id: its team, and the fields of its models that differ)."""
    cluster = build_cluster("two-a100", [{**A100_NODE, "count": 2}])
    teams = Teams({"nlp": Team({"dgx": 4}, {"dgx": 4}), "cv": Team({"dgx": 4}, {"dgx": None})})
    models = {job: msgspec.structs.replace(m, **jobs[job][1]) for job, m in models_of(cluster, *jobs).items()}
    return cluster, teams, {job: team for job, (team, _) in jobs.items()}, models


def test_a_job_larger_than_its_team_may_hold_waits_on_the_team_file() -> None:
    # Two A100 nodes of 8; team nlp may hold 8 A100 (quota 4, borrow 4): a job that needs at least
    # 16 never runs while the file says so, however idle the cluster; 8 could, and 16 for a team
    # that borrows without limit.
    cluster, teams, team_of, models = nlp_and_cv(
        big=("nlp", {"min_gpus": 16}),
        fits=("nlp", {"min_gpus": 8}),
        free=("cv", {"min_gpus": 16}),
        rigid=("nlp", {"fixed_gpus": 16}),
    )
    waits = team_waits(models.values(), {}, cluster, teams, team_of, {})
    assert set(waits) == {"big", "rigid"}
    assert waits["big"].startswith(
        "needs at least 16 GPUs of one type (A100 gives that); team nlp may hold at most 8 A100 GPUs (its quota"
    )
    assert waits["rigid"].startswith("needs 16 GPUs of one type (A100 gives that); team nlp")
    # With "big" on 8 A100, team nlp holds all it may: "fits" waits on its team's jobs now.
    on_8 = team_waits(models.values(), {"big": (("dgx-0", 8),)}, cluster, teams, team_of, {"nlp": {"dgx": 8}})
    assert on_8.keys() == {"fits", "rigid"}

    outcomes = decided(cluster, [facts(job, team=team) for job, team in team_of.items()], {}, {}, waits=waits)
    assert [o.outcome for o in outcomes] == ["waits", "unallocated", "unallocated", "waits"]
    assert span_attributes(outcomes[0])["decision"] == "waits"  # the span says what the record says
    big, fits, free, rigid = job_decisions(4, 240.0, outcomes, cluster, models)
    assert (big.outcome, big.change, big.reason) == ("waits", "waiting", waits["big"])
    assert sentences([big], WAITING, Namer(Who("ann", "nlp"), {}))[0] == f"Waiting since round 4: {big.reason}."
    assert (fits.outcome, free.outcome, rigid.outcome) == ("unallocated", "unallocated", "waits")


def test_a_job_whose_team_holds_what_it_may_waits_on_its_teams_jobs() -> None:
    # Team nlp may hold 8 A100 (quota 4, borrow 4); its job "held" has 6 of them this round, so "next"
    # (at least 4) waits on the team, not on the cluster (10 A100 idle); "two" (2) would fit in what is
    # left, and team cv, which borrows without limit, waits on the cluster alone.
    cluster, teams, team_of, models = nlp_and_cv(
        held=("nlp", {}), next=("nlp", {"min_gpus": 4}), two=("nlp", {"min_gpus": 2}), cv=("cv", {"min_gpus": 4})
    )
    held = {"held": (("dgx-0", 4), ("dgx-1", 2))}
    waits = team_waits(models.values(), held, cluster, teams, team_of, {"nlp": {"dgx": 6}})
    assert waits == {
        "next": "needs at least 4 GPUs of one type; team nlp's jobs hold 6 of the 8 A100 GPUs it may hold (its "
        "quota and borrow limit in the team file): it waits until they free some, or the team file lets it hold more"
    }
    assert team_waits(models.values(), {}, cluster, teams, team_of, {}) == {}  # with nothing held, it fits


def test_predicted_against_measured_and_the_end() -> None:
    cluster = build_cluster("one-a100", [A100_NODE])
    models = models_of(cluster, "a")["a"]
    running = facts("a", (("dgx-0", 4),), slice_iterations=100.0)
    here = (("dgx-0", 4),)
    # 60 steps of the round's 512 in its 60 s, times the batch's statistical efficiency.
    assert 0 < measured_goodput(running, Measuring(here, 0.0, 40.0, 512, True), models, 60.0) < 60 * 512 / 60
    assert measured_goodput(running, Measuring((("dgx-0", 2),), 0.0, 40.0, 512, True), models, 60.0) is None
    assert measured_goodput(running, Measuring(here, 0.0, 0.0, 512, False), models, 60.0) is None  # (re)started
    assert measured_goodput(running, None, models, 60.0) is None  # its round's start is not known (a new leader)
    # A fixed batch is predicted by its samples/s (an efficiency of 1), and measured so.
    rigid = msgspec.structs.replace(models, fixed_batch=512)
    assert measured_goodput(running, Measuring(here, 0.0, 40.0, 512, True), rigid, 60.0) == 60 * 512 / 60
    d = JobDecision(
        5, 300.0, "a", gpus=4, gpu_type="dgx", change="same", goodput=1900.0, previous_goodput=1900.0,
        measured_goodput=1750.0,
    )  # fmt: skip
    said = sentences([d], RUNNING, Namer(ALICE, {}))
    assert said == (
        "It has run on 4 A100 GPUs since round 5 or earlier.",
        "Predicted goodput 1,900 samples/s; over the round before, measured 1,750 (92% of the 1,900 predicted for it).",
    )
    assert sentences([d], JobStatus("a", JobState.FINISHED), Namer(ALICE, {})) == ("It has finished.",)
    assert sentences([], JobStatus("a", JobState.PROFILING, "profiled on T4"), Namer(ALICE, {})) == (
        "No round has decided for it yet (profiling): profiled on T4.",
    )
    assert (number(3100.4), number(12.345), number(0.5)) == ("3,100", "12.3", "0.5")
    # Two goodputs that one rounding would write alike get the digits that tell them apart.
    assert numbers_apart(12017.3, 12017.4) == ("12,017.3", "12,017.4")
    assert numbers_apart(3100.4, 1200.0) == ("3,100", "1,200")


def test_a_round_recorded_twice_counts_once_newest_last() -> None:
    first = JobDecision(4, 240.0, "a", change="waiting", reason="first")
    again = msgspec.structs.replace(first, reason="again")
    answer = explanation("a", WAITING, [JobDecision(5, 300.0, "a", change="waiting"), first, again], {}, ALICE)
    assert [d.round for d in answer.decisions] == [4, 5] and answer.decisions[0].reason == "again"


# ---- the round's summary and metrics -------------------------------------------------------------


def test_the_round_summary_counts_gpus_per_type_and_state_and_the_metrics_show_every_one() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from shared.metrics import scrape, setup_metrics

    cluster = build_cluster("mixed", [A100_NODE, T4_NODE])
    outcomes = decided(
        cluster,
        [facts("b", (("dgx-0", 4),)), facts("c"), facts("w")],
        {"b": (("dgx-0", 8),), "c": (("aws-0", 2),)},
        {"b": Prediction(goodput=5000.0), "c": Prediction(goodput=700.0)},
    )
    stages = {"facts": 0.01, "models": 0.02, "solve": 0.3, "place": 0.04}
    summary = round_summary(9, 540.0, "goodput", outcomes, cluster, {"b": 2}, 12.5, stages, 0.4, ["e"] * 60)
    assert (summary.jobs, summary.allocated, summary.waiting, summary.restarts) == (3, 2, 1, 1)
    assert summary.gpus_allocated == {"dgx": 8, "aws": 2} and summary.gpus_idle == {"dgx": 0, "aws": 2}
    assert summary.gpus_borrowed == {"dgx": 2, "aws": 0} and summary.goodput == 5700.0
    assert (summary.solve_s, summary.objective, summary.gpus_total) == (0.3, 12.5, 12)
    assert len(summary.events) == 51 and summary.events[-1] == "... and 10 more events"

    setup_metrics("test-explain")
    seen: set[str] = {"rtx"}  # a type shown before that the cluster has no more
    record_round_metrics(summary, seen)
    samples = [sample for family in text_string_to_metric_families(scrape()) for sample in family.samples]
    gpus = {(s.labels["gpu_type"], s.labels["state"]): s.value for s in samples if s.name == "goodput_gpus"}
    assert gpus[("dgx", "allocated")] == 8 and gpus[("aws", "idle")] == 2 and gpus[("dgx", "borrowed")] == 2
    assert all(gpus[("rtx", state)] == 0 for state in ("allocated", "idle", "borrowed"))
    assert seen == {"rtx", "dgx", "aws"}
    names = {s.name for s in samples}
    for name in ("goodput_rounds_total", "goodput_round_objective", "goodput_cluster_utilization"):
        assert name in names, name
    stages = {s.labels["stage"] for s in samples if s.name == "goodput_round_stage_duration_seconds_count"}
    assert stages >= {"facts", "models", "solve", "place"}


def test_each_teams_gpus_borrowed_gpus_and_reclaimed_jobs_are_metrics_a_team_left_out_at_zero() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from shared.metrics import scrape, setup_metrics
    from shared.schema.runs import RoundRecord

    cluster = build_cluster("mixed", [A100_NODE, T4_NODE])
    outcomes = decided(cluster, [facts("b", team="nlp"), facts("c", team="cv")], {"b": (("dgx-0", 8),)}, {})
    record = RoundRecord(
        540.0, 2, 1, 1.0, 2.0, {"b": 8}, {"b": "dgx"}, {}, {},
        team_gpus={"nlp": {"dgx": 8}, "cv": {}}, team_borrowed={"nlp": 4, "cv": 0}, team_reclaimed={"cv": 1},
    )  # fmt: skip
    summary = round_summary(9, 540.0, "goodput", outcomes, cluster, {"b": 4}, None, {}, 0.1, (), record)
    assert (summary.team_gpus, summary.team_borrowed, summary.team_reclaimed) == (
        record.team_gpus, record.team_borrowed, record.team_reclaimed
    )  # fmt: skip

    def scraped() -> dict:
        samples = [sample for family in text_string_to_metric_families(scrape()) for sample in family.samples]
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in samples if s.name.startswith("goodput_team_")
        }

    setup_metrics("test-team-metrics")
    seen: set[tuple[str, str]] = {("ml", "dgx")}  # a team shown before that the file no longer names
    record_round_metrics(summary, set(), seen)
    shown = scraped()
    assert shown[("goodput_team_gpus", (("gpu_type", "dgx"), ("team", "nlp")))] == 8
    assert shown[("goodput_team_gpus", (("gpu_type", "aws"), ("team", "cv")))] == 0
    assert shown[("goodput_team_gpus", (("gpu_type", "dgx"), ("team", "ml")))] == 0
    assert shown[("goodput_team_borrowed", (("team", "nlp"),))] == 4
    assert shown[("goodput_team_borrowed", (("team", "ml"),))] == 0
    assert shown[("goodput_team_reclaimed_total", (("team", "cv"),))] == 1
    assert ("nlp", "aws") in seen and ("ml", "dgx") in seen


# ---- the round loop hands each decided round to its recorder -------------------------------------


class Recorded:
    def __init__(self) -> None:
        self.rounds: list = []
        self.stages: list[str] = []

    async def decided(self, summary, decisions) -> None:
        self.rounds.append((summary, list(decisions)))

    def stage(self, stage: str, seconds: float) -> None:
        self.stages.append(stage)


class KeepRunning:
    """Three rounds of a fixed cluster: the executors' facts say where the last apply put each job and
    that it trained 50 steps in each round there; every job ends at the third round."""

    def __init__(self, cluster, jobs) -> None:
        self.cluster, self.placements, self.jobs, self.advanced = cluster, {}, jobs, 0
        self.rounds_placed: dict[str, int] = {}

    async def facts(self, now, jobs):
        from shared.schema.rounds import FactsReply

        return FactsReply(
            tuple(
                facts(j, self.placements.get(j, ()), slice_iterations=50.0 * self.rounds_placed.get(j, 0)) for j in jobs
            )
        )

    async def models(self, known):
        from shared.schema.rounds import ModelsReply

        return ModelsReply(tuple(job_models(f.job_id, "cifar10", self.cluster) for f in known))

    async def place(self, round, allocations, previous, groups, nodes=None):
        from services.placer.core import place
        from shared.schema.rounds import PlacementResult

        placed = place(self.cluster, allocations, previous, groups)
        return PlacementResult(placed.placements, placed.restarts, ())

    async def apply(self, request):
        self.placements = {j: tuple(s) for j, s in request.placements.items() if s}

    async def advance(self, now, step, jobs):
        from shared.schema.rounds import AdvanceReply

        self.advanced += 1
        for j in self.placements:
            self.rounds_placed[j] = self.rounds_placed.get(j, 0) + 1
        return AdvanceReply(tuple(jobs) if self.advanced >= 3 else ())


class Predicting:
    """Gives each job one A100 and predicts 100 samples/s of it, with its batch."""

    name, round_s, adaptive_batch, honours_teams = "predicting", 60.0, True, False

    def allocate(self, state):
        return Decision(
            {v.job_id: Config("dgx", 1, 1) for v in state.jobs},
            predictions={v.job_id: Prediction(goodput=100.0, batch=256) for v in state.jobs},
            objective=2.0,
        )


def test_the_round_loop_records_each_decided_round_with_the_last_rounds_prediction() -> None:
    from services.policy.rounds import Arrival, RoundLoop
    from shared.settings import SimSettings

    cluster = build_cluster("one-a100", [A100_NODE])
    recorder = Recorded()
    loop = RoundLoop(
        [Arrival("a", 0.0), Arrival("b", 0.0)],
        cluster,
        Predicting(),
        SimSettings("test", round_s=60.0),
        KeepRunning(cluster, ["a", "b"]),
        recorder=recorder,
    )
    asyncio.run(loop.run())
    [(first, one), (second, two), (_, three)] = recorder.rounds
    assert (first.round, second.round, first.objective, first.allocated) == (0, 1, 2.0, 2)
    assert set(first.stages_s) == {"facts", "models", "solve", "place"}
    assert first.gpus_allocated == {"dgx": 2} and first.gpus_idle == {"dgx": 6}
    assert [(d.job, d.change, d.previous_goodput) for d in one] == [("a", "started", None), ("b", "started", None)]
    assert [(d.change, d.previous_goodput) for d in two] == [("same", 100.0), ("same", 100.0)]
    # The round it started in measures nothing (its start's seconds are not slowness); the next, its
    # 50 steps of batch 256 in the round's 60 s, times the batch's statistical efficiency.
    assert [d.measured_goodput for d in two] == [None, None]
    assert all(0 < d.measured_goodput <= 50 * 256 / 60 for d in three)
    assert recorder.stages == ["apply", "advance"] * 3
    # and each round's record says where its time went
    assert all(set(r.stages_ms) == {"facts", "models", "solve", "place", "apply", "advance"} for r in loop.rounds)
    assert all(ms >= 0 for r in loop.rounds for ms in r.stages_ms.values())


# ---- the policy's objective, and the command ------------------------------------------------------


def test_the_ilp_policies_report_the_objective_of_their_decision() -> None:
    from policies import sia_ilp
    from policies.base import make_policy
    from policies.sia_ilp.problem import objective
    from sim.rounds import job_view, round_state

    cluster = build_cluster("small", [A100_NODE, T4_NODE])
    state = round_state([job_view(f"j{i}", app, cluster) for i, app in enumerate(("cifar10", "bert", "ncf"))], cluster)
    for name in ("sia", "goodput"):
        policy = make_policy(name)
        problem = policy.problem(state)
        solution = sia_ilp.solve(problem, policy.p, policy.lam)
        assert solution.objective == objective(problem, solution.choice, policy.p, policy.lam)
        assert policy.allocate(state).objective is not None


def test_goodput_explain_refuses_a_bad_request_before_asking(capsys) -> None:
    from cli.main import main

    assert main(["explain", "a b"]) == 2 and "'a b' is not a job id" in capsys.readouterr().err
    assert main(["explain", "lm-1", "--rounds", "0"]) == 2 and "--rounds 0: from 1 to 500" in capsys.readouterr().err


class TeamOfNlp(KeepRunning):
    """KeepRunning, every job of team nlp."""

    async def facts(self, now, jobs):
        reply = await super().facts(now, jobs)
        return msgspec.structs.replace(reply, facts=tuple(msgspec.structs.replace(f, team="nlp") for f in reply.facts))


class FourToA(Predicting):
    """Holds teams' limits (as it says), and gives job a 4 A100, job b none."""

    name, honours_teams = "four-to-a", True

    def allocate(self, state):
        return Decision({"a": Config("dgx", 1, 4)}, predictions={"a": Prediction(goodput=100.0, batch=256)})


def test_the_round_tells_the_executors_and_the_record_of_a_job_waiting_on_its_teams_jobs() -> None:
    from services.policy.rounds import Arrival, FixedTeams, RoundLoop
    from shared.schema.teams import TeamFile, TeamSpec
    from shared.settings import SimSettings

    cluster = build_cluster("one-a100", [A100_NODE])
    recorder, wiring = Recorded(), TeamOfNlp(cluster, ["a", "b"])
    applied = []
    apply = wiring.apply

    async def keep(request):
        applied.append(request)
        await apply(request)

    wiring.apply = keep
    loop = RoundLoop(
        [Arrival("a", 0.0), Arrival("b", 0.0)],
        cluster,
        FourToA(),
        SimSettings("test", round_s=60.0),
        wiring,
        recorder=recorder,
        teams=FixedTeams(TeamFile({"nlp": TeamSpec({"A100": 4}, {"A100": 0})})),
    )
    asyncio.run(loop.run())
    said = "team nlp's jobs hold 4 of the 4 A100 GPUs it may hold"
    assert said in applied[0].waits["b"] and "a" not in applied[0].waits
    [b] = [d for d in recorder.rounds[0][1] if d.job == "b"]
    assert b.outcome == "waits" and said in b.reason
