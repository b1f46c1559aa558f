"""Teams inside the policy: the ledger of borrowed GPUs and reclaims, and the guarantees, lending,
borrowing limits and priorities that the sia/goodput ILP holds."""

import itertools
from dataclasses import replace

import numpy as np
import pytest

from policies import sia, sia_ilp
from policies.base import RoundState, make_policy, policy_spec
from policies.sia_ilp import solve, team_guarantees
from policies.sia_ilp.problem import IlpProblem, objective, value_matrix, weighted_costs
from policies.sia_ilp.reduced import candidates
from policies.teams import borrowed_gpus, ledger
from shared.cluster import load_cluster
from shared.schema.base import Config
from shared.schema.rounds import Reclaim
from shared.teams import parse_team_file, resolve
from sim.rounds import job_view

CLUSTER = load_cluster("sia-hetero-64")  # aws (T4) 24 in nodes of 4, dgx-ext (A100) 16 in 8, rtx 24 in 8
TEAMS = resolve(
    parse_team_file(
        """
teams:
  a: {quota: {T4: 12, A100: 8, RTX 2080 Ti: 8}}
  b: {quota: {T4: 12, A100: 8, RTX 2080 Ti: 16}, weight: 2}
"""
    ),
    CLUSTER,
)


def view(job_id, team, *, current=None, priority=0, submit_s=0.0, model="cifar10", **kw):
    return replace(
        job_view(job_id, model, CLUSTER, current=current, submit_s=submit_s, **kw), team=team, priority=priority
    )


def state(jobs, teams=TEAMS, now_s=3600.0):
    return RoundState(now_s, CLUSTER, tuple(jobs), teams)


# --- the ledger -------------------------------------------------------------------------------------


def test_a_team_given_twice_in_one_file_is_refused_not_replaced_by_the_second():
    with pytest.raises(ValueError, match="'a' is given twice in one mapping"):
        parse_team_file("teams:\n  a: {quota: {T4: 12}}\n  b: {quota: {T4: 4}}\n  a: {quota: {T4: 2}}\n")
    with pytest.raises(ValueError, match="'T4' is given twice"):
        parse_team_file("teams:\n  a: {quota: {T4: 12, T4: 2}}\n")


def test_without_teams_the_ledger_is_empty():
    jobs = [view("x", "a", current=Config("rtx", 2, 16))]
    assert ledger(state(jobs, teams=None), {"x": Config("rtx", 2, 16)}, 3) == ({}, {})


def test_a_teams_gpus_beyond_its_quota_are_borrowed_by_its_lowest_priority_then_newest_jobs():
    """Team a holds 8 rtx GPUs: 16 more are borrowed, by its low-priority job first, then of equal
    priorities the most recently submitted."""
    jobs = [
        view("old", "a", submit_s=0.0),
        view("new", "a", submit_s=50.0),
        view("low", "a", submit_s=10.0, priority=-1),
        view("vip", "a", submit_s=90.0, priority=5),
    ]
    allocations = {
        "old": Config("rtx", 1, 8),
        "new": Config("rtx", 1, 4),
        "low": Config("rtx", 1, 8),
        "vip": Config("rtx", 1, 4),
    }
    assert borrowed_gpus(TEAMS, jobs, allocations) == {"low": 8, "new": 4, "old": 4}
    borrowed, reclaims = ledger(state(jobs), allocations, 1)
    assert borrowed == {"low": 8, "new": 4, "old": 4} and reclaims == {}


def test_within_quota_nothing_is_borrowed_and_the_default_teams_jobs_borrow_all_they_hold():
    jobs = [view("mine", "a"), view("anon", "default")]
    allocations = {"mine": Config("dgx-ext", 1, 8), "anon": Config("aws", 1, 2)}
    assert ledger(state(jobs), allocations, 1)[0] == {"anon": 2}


def test_a_borrower_shrunk_while_the_owner_grows_back_to_its_quota_is_a_reclaim_by_the_owner():
    """Team a borrowed b's whole rtx quota; b's job arrives and gets 8: a's jobs that hold fewer rtx
    GPUs after (one shrunk from 16 to 8, one moved to T4) are b's reclaims; a's job kept whole is none."""
    jobs = [
        view("a-big", "a", current=Config("rtx", 2, 16), submit_s=5.0),
        view("a-own", "a", current=Config("rtx", 1, 4), submit_s=1.0),
        view("a-kept", "a", current=Config("rtx", 1, 4), submit_s=2.0),
        view("b-new", "b"),
    ]
    after = {
        "a-big": Config("rtx", 1, 4),
        "a-own": Config("aws", 1, 4),
        "a-kept": Config("rtx", 1, 4),
        "b-new": Config("rtx", 2, 16),
    }
    borrowed, reclaims = ledger(state(jobs, now_s=600.0), after, 7)
    assert reclaims == {
        "a-big": Reclaim(7, 600.0, "b", "rtx", 16, 4),
        "a-own": Reclaim(7, 600.0, "b", "rtx", 4, 0),
    }
    assert borrowed == {}  # a now holds 8 rtx (its quota) and 4 T4


def test_of_two_alike_borrowers_the_one_the_policy_stopped_is_the_reclaimed_one():
    """a holds 16 A100 (8 borrowed, attributed to its newer job); the policy stops the older one to
    give b its 8: that job is the reclaim, the newer one now holds a's quota."""
    jobs = [
        view("a-old", "a", current=Config("dgx-ext", 1, 8), submit_s=1.0),
        view("a-new", "a", current=Config("dgx-ext", 1, 8), submit_s=2.0),
        view("b-1", "b", submit_s=3.0),
    ]
    after = {"a-new": Config("dgx-ext", 1, 8), "b-1": Config("dgx-ext", 1, 8)}
    assert borrowed_gpus(TEAMS, jobs, {j.job_id: j.current for j in jobs if j.current}) == {"a-new": 8}
    assert ledger(state(jobs), after, 2) == ({}, {"a-old": Reclaim(2, 3600.0, "b", "dgx-ext", 8, 0)})


def test_a_borrower_stopped_or_moved_to_another_type_is_reclaimed_to_none_of_the_type():
    jobs = [
        view("a-1", "a", current=Config("dgx-ext", 1, 8), submit_s=1.0),
        view("a-2", "a", current=Config("dgx-ext", 1, 8), submit_s=2.0),
        view("b-1", "b", submit_s=3.0),
    ]
    stopped = ledger(state(jobs), {"a-1": Config("dgx-ext", 1, 8), "b-1": Config("dgx-ext", 1, 8)}, 2)[1]
    assert stopped == {"a-2": Reclaim(2, 3600.0, "b", "dgx-ext", 8, 0)}
    moved = ledger(
        state(jobs),
        {"a-1": Config("dgx-ext", 1, 8), "a-2": Config("aws", 1, 4), "b-1": Config("dgx-ext", 1, 4)},
        2,
    )[1]
    assert moved == {"a-2": Reclaim(2, 3600.0, "b", "dgx-ext", 8, 0)}


def test_a_borrower_stopped_when_no_team_below_its_quota_gains_is_no_reclaim():
    """a's borrower stops, b (below its rtx quota) keeps what it had, and the default team (which
    holds no guarantee) takes the GPUs: nobody took back a guarantee."""
    jobs = [
        view("a-big", "a", current=Config("rtx", 1, 8), submit_s=5.0),
        view("a-own", "a", current=Config("rtx", 1, 8), submit_s=1.0),
        view("b-1", "b", current=Config("rtx", 1, 8)),
        view("anon", "default"),
    ]
    after = {"a-own": Config("rtx", 1, 8), "b-1": Config("rtx", 1, 8), "anon": Config("rtx", 1, 8)}
    assert ledger(state(jobs), after, 4) == ({"anon": 8}, {})


def test_the_reclaim_names_the_team_that_gained_most():
    """a and b both below their A100 quota before; b gains 8, a 4: b reclaims."""
    jobs = [
        view("anon", "default", current=Config("dgx-ext", 2, 16)),
        view("a-1", "a"),
        view("b-1", "b"),
    ]
    after = {"a-1": Config("dgx-ext", 1, 4), "b-1": Config("dgx-ext", 1, 8)}
    borrowed, reclaims = ledger(state(jobs), after, 9)
    assert reclaims == {"anon": Reclaim(9, 3600.0, "b", "dgx-ext", 16, 0)} and borrowed == {}


# --- the guarantees inside the sia/goodput ILP --------------------------------------------------------

NODES = {t: [n.name for n in CLUSTER.nodes if n.gpu_type == t] for t in CLUSTER.gpu_types}


def use_of(team, allocations):
    """GPU type -> GPUs that `team`'s jobs (ids starting "team-") hold."""
    held = {}
    for job_id, config in allocations.items():
        if job_id.startswith(f"{team}-"):
            held[config.gpu_type] = held.get(config.gpu_type, 0) + config.gpus
    return held


def filling(team, **kw):
    """`team`'s jobs holding every GPU of the cluster, one whole node each."""
    return [
        view(
            f"{team}-{t}-{i}",
            team,
            model="imagenet",
            current=Config(t, 1, CLUSTER.gpus_per_node(t)),
            placement=((node, CLUSTER.gpus_per_node(t)),),
            max_gpus_seen=CLUSTER.gpus_per_node(t),
            requested_gpus=CLUSTER.gpus_per_node(t),
            progress=1e5,
            age_s=3000.0,
            submit_s=float(i),
            **kw,
        )
        for t in CLUSTER.gpu_types
        for i, node in enumerate(NODES[t])
    ]


def flooding(team, count=12, **kw):
    """`team`'s new jobs, each asking for 8 GPUs: together more than the cluster."""
    return [
        view(
            f"{team}-{i}", team, model="imagenet", requested_gpus=8, progress=1e5, age_s=100.0, submit_s=float(i), **kw
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("policy", ["sia", "goodput"])
def test_a_team_whose_job_arrives_while_another_borrows_its_quota_gets_it_in_that_decision(policy):
    """Team a holds the whole cluster with jobs that restarted so often that moving them costs more
    than stopping them. b's job arrives: with teams (of equal weights) it gets what it takes alone
    (within b's quota) at once and a's jobs give way, the round's reclaims by b; without teams it
    waits (sia) or gets half of it (goodput)."""
    equal = resolve(
        parse_team_file("teams: {a: {quota: {T4: 12, A100: 8, RTX 2080 Ti: 8}}, b: {quota: {T4: 12, A100: 8}}}"),
        CLUSTER,
    )
    arriving = view("b-new", "b", model="imagenet", requested_gpus=8, progress=1e5, age_s=0.0, submit_s=100.0)
    jobs = filling("a", restarts=12, restart_cost_s=250.0) + [arriving]
    alone = make_policy(policy).allocate(state([arriving])).allocations["b-new"]
    decided = make_policy(policy).allocate(state(jobs, teams=equal)).allocations
    assert decided.get("b-new") == alone
    assert use_of("a", decided)[alone.gpu_type] <= CLUSTER.capacity(alone.gpu_type) - alone.gpus
    borrowed, reclaims = ledger(state(jobs, teams=equal), decided, 5)
    assert reclaims and {r.by_team for r in reclaims.values()} == {"b"}
    assert all(r.gpu_type == alone.gpu_type and r.gpus_after < r.gpus_before for r in reclaims.values())
    without = make_policy(policy).allocate(state(jobs, teams=None)).allocations.get("b-new")
    assert without is None or without.gpus < alone.gpus


@pytest.mark.parametrize("policy", ["sia", "goodput"])
def test_a_borrower_still_starting_gives_the_guarantee_back_in_that_decision(policy):
    """a's jobs hold the whole cluster and are all mid-restart (just started): pinned, as any job
    mid-restart is, except those that borrow a type b's arriving job wants, so that b's guarantee
    comes back in the round it is wanted; a's jobs within a's own quota stay pinned."""
    arriving = view("b-new", "b", model="imagenet", requested_gpus=8, progress=1e5, age_s=0.0, submit_s=100.0)
    jobs = filling("a", mid_restart=True) + [arriving]
    before = {v.job_id: v.current for v in jobs if v.current is not None}
    alone = make_policy(policy).allocate(state([arriving])).allocations["b-new"]
    decided = make_policy(policy).allocate(state(jobs)).allocations
    assert decided.get("b-new") == alone
    lent = ledger(state(jobs), before, 0)[0]
    kept_own = [j for j in before if j not in lent]
    assert kept_own and all(decided.get(j) == before[j] for j in kept_own)


@pytest.mark.parametrize("policy", ["sia", "goodput"])
def test_a_teams_idle_quota_is_lent(policy):
    """b has no job: a's flood takes the whole cluster, as without teams, 36 GPUs borrowed."""
    jobs = flooding("a")
    with_teams = make_policy(policy).allocate(state(jobs)).allocations
    assert with_teams == make_policy(policy).allocate(state(jobs, teams=None)).allocations
    if policy == "goodput":
        assert sum(use_of("a", with_teams).values()) == CLUSTER.total_gpus
        assert sum(ledger(state(jobs), with_teams, 1)[0].values()) == CLUSTER.total_gpus - 28


@pytest.mark.parametrize("policy", ["sia", "goodput"])
def test_borrowing_limits_hold(policy):
    limited = resolve(
        parse_team_file(
            """
teams:
  a: {quota: {T4: 12, A100: 8, RTX 2080 Ti: 8}, borrow: {T4: 4, A100: 0, RTX 2080 Ti: 2}}
  b: {quota: {T4: 12, A100: 8, RTX 2080 Ti: 16}}
"""
        ),
        CLUSTER,
    )
    decided = make_policy(policy).allocate(state(flooding("a"), teams=limited)).allocations
    held = use_of("a", decided)
    assert held.get("aws", 0) <= 16 and held.get("dgx-ext", 0) <= 8 and held.get("rtx", 0) <= 10
    if policy == "goodput":  # it takes what it may: the limits bind
        assert held == {"aws": 16, "dgx-ext": 8, "rtx": 10}


def test_a_teams_job_spills_to_another_type_the_team_holds_quota_on():
    """a's running job holds a's 8 A100; its new job, best on A100 too, runs on a type where a holds
    quota (RTX: 8) at once, while b's flood takes all the rest; without teams it gets 2 GPUs."""
    running = view(
        "a-1",
        "a",
        model="imagenet",
        current=Config("dgx-ext", 1, 8),
        placement=((NODES["dgx-ext"][0], 8),),
        max_gpus_seen=8,
        requested_gpus=8,
        progress=1e5,
        age_s=3000.0,
    )
    new = view("a-2", "a", model="imagenet", requested_gpus=8, progress=1e5, age_s=10.0, submit_s=50.0)
    jobs = [running, new] + flooding("b")
    assert make_policy("goodput").allocate(state([new])).allocations["a-2"].gpu_type == "dgx-ext"
    decided = make_policy("goodput").allocate(state(jobs)).allocations
    assert decided["a-1"] == running.current
    assert decided["a-2"].gpu_type != "dgx-ext" and decided["a-2"].gpus == 8
    assert make_policy("goodput").allocate(state(jobs, teams=None)).allocations["a-2"].gpus < 8


@pytest.mark.parametrize("policy", ["sia", "goodput"])
def test_a_higher_priority_gets_the_teams_guarantee_first(policy):
    """Two of a's jobs that run only on A100 and only on 8 GPUs, for a's 8 A100s, while b floods the
    rest: the higher priority runs though the other came first; of equal priorities the first."""

    def jobs(priorities):
        return [
            view(
                f"a-{name}",
                "a",
                model="imagenet",
                priority=priority,
                requested_gpus=8,
                min_gpus=8,
                progress=1e5,
                age_s=age,
                submit_s=3600.0 - age,
                gpu_types=("dgx-ext",),
            )
            for name, priority, age in (("first", priorities[0], 100.0), ("second", priorities[1], 50.0))
        ] + flooding("b")

    decided = make_policy(policy).allocate(state(jobs((0, 5)))).allocations
    assert decided.get("a-second") == Config("dgx-ext", 1, 8) and "a-first" not in decided
    decided = make_policy(policy).allocate(state(jobs((0, 0)))).allocations
    assert decided.get("a-first") == Config("dgx-ext", 1, 8) and "a-second" not in decided


def test_under_sia_a_higher_priority_grows_first_and_equal_priorities_share():
    """Two of a's waiting jobs that ran on 4 A100s (so may take 8), for a's 8 A100s while b floods
    the rest: of equal priorities each gets 4, as without teams' priorities; the higher priority
    takes all 8 first. (Under goodput the lower one still runs: no job waits while every job's
    smallest allocation fits, unless a higher priority's gain outweighs it.)"""

    def jobs(priorities):
        return [
            view(
                f"a-{name}",
                "a",
                model="imagenet",
                priority=priority,
                max_gpus_seen=4,
                progress=1e5,
                age_s=age,
                submit_s=3600.0 - age,
                gpu_types=("dgx-ext",),
            )
            for name, priority, age in (("first", priorities[0], 100.0), ("second", priorities[1], 50.0))
        ] + flooding("b")

    shared = make_policy("sia").allocate(state(jobs((0, 0)))).allocations
    assert shared["a-first"] == shared["a-second"] == Config("dgx-ext", 1, 4)
    decided = make_policy("sia").allocate(state(jobs((0, 5)))).allocations
    assert decided.get("a-second") == Config("dgx-ext", 1, 8) and "a-first" not in decided


# --- the ILP with teams: optimal under its rows, on both paths ------------------------------------


def team_problem(rng, jobs, config_type, config_gpus, capacity, teams=2):
    """A random IlpProblem whose jobs belong to `teams` teams splitting the capacity (some of it
    unguaranteed), with random borrowing limits (some unlimited) and weights."""
    config_type, config_gpus, capacity = np.asarray(config_type), np.asarray(config_gpus), np.asarray(capacity)
    T = len(capacity)
    speed = rng.lognormal(0, 0.5, size=(jobs, T))[:, config_type]
    knee = rng.uniform(1, 16, size=(jobs, 1))
    raw = speed * config_gpus / (1 + (config_gpus - 1) / knee)
    valid = rng.random((jobs, len(config_type))) < 0.8
    valid[~valid.any(axis=1), 0] = True
    goodput = np.where(valid, raw, np.nan)
    current = np.array([rng.choice(np.flatnonzero(row)) if rng.random() < 0.4 else -1 for row in valid])
    share = rng.dirichlet(np.ones(teams + 1), size=T).T[:teams]  # the last share: nobody's
    return IlpProblem(
        goodput=goodput / np.nanmin(goodput, axis=1, keepdims=True),
        valid=valid,
        current=current,
        restart_factor=rng.uniform(0.3, 1.0, jobs),
        locked=(rng.random(jobs) < 0.1) & (current >= 0),
        config_type=np.asarray(config_type),
        config_gpus=np.asarray(config_gpus),
        capacity=np.asarray(capacity),
        waited=np.where(current < 0, rng.uniform(0, 600, jobs), 0.0),
        job_team=rng.integers(0, teams, size=jobs),
        team_quota=np.floor(share * np.asarray(capacity)).astype(int),
        team_borrow=np.where(rng.random((teams, T)) < 0.5, np.inf, rng.integers(0, 4, size=(teams, T))),
        job_weight=rng.choice([1.0, 2.0, 16.0], size=jobs),
    )


def guarantees(pr, p=-0.5):
    """The formulation's rows, written out from the docstring, as a test of an allocation: each
    team's use within its quota and borrowing limit, beyond its reservation within its bound, and
    the borrows of a type within what the type lends."""
    fixed = np.full(pr.jobs, -1)
    fixed[pr.pinned] = pr.current[pr.pinned]
    free = pr.capacity - np.bincount(
        pr.config_type[fixed[pr.pinned]], weights=pr.config_gpus[fixed[pr.pinned]], minlength=pr.types
    )
    cost = weighted_costs(pr, value_matrix(pr, p), p, 1.1)
    keep = candidates(pr, cost, free)
    K = pr.team_quota.shape[0]
    held = np.zeros((K, pr.types))
    np.add.at(held, (pr.job_team[pr.pinned], pr.config_type[fixed[pr.pinned]]), pr.config_gpus[fixed[pr.pinned]])
    reserved = team_guarantees._reserve(pr, keep, cost, np.minimum(held, pr.team_quota))
    pinned_beyond = np.maximum(held - reserved, 0)
    lend = np.maximum(pr.capacity - reserved.sum(axis=0), pinned_beyond.sum(axis=0))
    bound = np.minimum(np.maximum(pr.team_quota - reserved + pr.team_borrow, pinned_beyond), lend)
    limit = pr.team_quota + np.maximum(pr.team_borrow, pinned_beyond)

    def keeps(choice) -> bool:
        use = np.zeros((K, pr.types))
        on = choice >= 0
        np.add.at(use, (pr.job_team[on], pr.config_type[choice[on]]), pr.config_gpus[choice[on]])
        beyond = use - reserved
        return bool(
            np.all(use <= limit) and np.all(beyond <= bound) and np.all(np.maximum(beyond, 0).sum(axis=0) <= lend)
        )

    return keeps


def brute_force_with_teams(pr, p=-0.5):
    options = [
        [int(pr.current[i])] if pr.pinned[i] else [-1, *map(int, np.flatnonzero(pr.valid[i]))] for i in range(pr.jobs)
    ]
    best, keeps = None, guarantees(pr, p)
    for choice in itertools.product(*options):
        choice = np.array(choice)
        on = choice >= 0
        used = np.bincount(pr.config_type[choice[on]], weights=pr.config_gpus[choice[on]], minlength=pr.types)
        if np.all(used <= pr.capacity) and keeps(choice):
            value = objective(pr, choice, p)
            best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("path", ["direct", "prices"])
def test_the_ilp_with_teams_reaches_the_brute_force_optimum(path, monkeypatch):
    if path == "prices":
        monkeypatch.setattr(sia_ilp, "LARGE_MODEL_ENTRIES", 0)
    rng = np.random.default_rng(7 if path == "direct" else 8)
    for _ in range(25):
        pr = team_problem(rng, 5, [0, 0, 0, 1, 1], [1, 2, 4, 1, 2], rng.integers(2, 9, size=2))
        solution = solve(pr)
        assert solution.status == "optimal" and guarantees(pr)(solution.choice)
        assert objective(pr, solution.choice) == pytest.approx(brute_force_with_teams(pr), abs=1e-6)


def test_the_price_path_gives_the_direct_milps_answer_with_teams(monkeypatch):
    rng = np.random.default_rng(12)
    config_type = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2])
    config_gpus = np.array([1, 2, 4, 8, 12, 1, 2, 4, 8, 1, 2, 4, 8, 16])
    for _ in range(6):
        pr = team_problem(rng, int(rng.integers(40, 90)), config_type, config_gpus, [24, 16, 24], teams=3)
        direct = solve(pr)
        monkeypatch.setattr(sia_ilp, "LARGE_MODEL_ENTRIES", 0)
        priced = solve(pr)
        monkeypatch.setattr(sia_ilp, "LARGE_MODEL_ENTRIES", 10**9)
        assert direct.status == priced.status == "optimal"
        assert guarantees(pr)(priced.choice) and guarantees(pr)(direct.choice)
        assert objective(pr, priced.choice) == pytest.approx(objective(pr, direct.choice), abs=1e-5)


# --- policies without teams, and those that cannot honour them ------------------------------------


@pytest.mark.parametrize("policy", ["fifo", "gavel", "tiresias", "timeslice", "pollux", "chaos:policy=fifo"])
def test_a_policy_that_cannot_honour_teams_refuses_a_round_with_teams(policy):
    name, options = policy_spec(policy)
    chosen = make_policy(name, **options)
    jobs = [view("a-1", "a", requested_gpus=1), view("b-1", "b", requested_gpus=1)]
    assert chosen.honours_teams is False
    with pytest.raises(ValueError, match=r"cannot honour the teams' guarantees.*use the goodput or sia policy"):
        chosen.allocate(state(jobs))
    chosen.allocate(state(jobs, teams=None))  # without teams it decides as ever


def test_sia_goodput_and_chaos_over_them_honour_teams():
    for spec in ("sia", "goodput", "chaos:policy=goodput"):
        name, options = policy_spec(spec)
        assert make_policy(name, **options).honours_teams


@pytest.mark.parametrize("policy", ["sia", "goodput"])
def test_without_teams_the_ilp_has_no_team_rows_and_one_team_holding_everything_changes_nothing(policy, monkeypatch):
    """Without teams (and of equal priorities) the problem carries no team array and no weight, so it
    is solved as ever; one team guaranteed the whole cluster, holding every job, decides as well (the
    same objective: alike jobs may trade places)."""
    solved = []

    def recording(problem, *args):
        solved.append((problem, sia_ilp.solve(problem, *args)))
        return solved[-1][1]

    monkeypatch.setattr(sia, "solve", recording)
    whole = resolve(parse_team_file("teams: {all: {quota: {T4: 24, A100: 16, RTX 2080 Ti: 24}}}"), CLUSTER)
    rounds = [
        filling("x", restarts=12, restart_cost_s=250.0) + flooding("y", 3),
        flooding("x", 14),
        filling("x")[:5] + [view("y-new", "y", model="cifar10", requested_gpus=2)],
    ]
    for jobs in rounds:
        solved.clear()
        make_policy(policy).allocate(state(jobs, teams=None))
        make_policy(policy).allocate(state([replace(j, team="all") for j in jobs], teams=whole))
        (plain, as_ever), (one_team, with_teams) = solved
        assert plain.job_team is plain.team_quota is plain.job_weight is None
        assert one_team.job_team is not None and not with_teams.fallback
        assert objective(plain, with_teams.choice) == pytest.approx(objective(plain, as_ever.choice), abs=1e-6)


def test_goodput_must_run_is_a_cost_the_team_rows_may_leave_unpaid():
    """Every job's smallest allocation fits the cluster (so goodput marks every job must-run), but
    not a's share of it: a floods with 40 one-GPU jobs while b's jobs want their whole quota. The
    solver still answers: b's jobs all run within its guarantee, a runs what its quota holds."""
    a_jobs = [view(f"a-{i}", "a", model="cifar10", requested_gpus=1, age_s=100.0, submit_s=float(i)) for i in range(40)]
    round_state = state(a_jobs + flooding("b", 6))
    assert make_policy("goodput").problem(round_state).must_run.all()
    decided = make_policy("goodput").allocate(round_state)
    assert not decided.events  # no fallback: an answer
    assert {f"b-{i}" for i in range(6)} <= set(decided.allocations)
    assert use_of("a", decided.allocations) == {"aws": 12, "dgx-ext": 8, "rtx": 8}  # a's quota, one GPU a job
    assert len([j for j in decided.allocations if j.startswith("a-")]) == 28
