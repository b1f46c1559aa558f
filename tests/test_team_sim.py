"""The simulator speaks teams: a workload's `team` and `priority` columns reach the jobs, `goodput
simulate --teams` holds each team's guarantee and borrowing limit and reports each team's results,
the round's spans say who borrows and whose reclaim shrank a job, and a live run's team file is read
every round (a bad one leaves the last good one in force)."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import get_tracer

from cli.main import main
from policies.base import make_policy, team_policies
from services.policy.rounds import TRACER_NAME, Arrival, RoundLoop
from services.simulated.truth import job_sources
from services.simulated.world import SimulatedExecutors, as_workload_job
from shared import storage, subjects
from shared.cluster import build_cluster
from shared.schema.jobs import JobSpec
from shared.schema.teams import TeamFile, TeamSpec
from shared.settings import simulation_settings
from shared.subjects import DEFAULT_TEAM
from shared.tracing import build_tracer_provider
from sim.reference import WorkloadJob, load_workload
from sim.run import Simulation, simulate
from sim.simulator import DirectWiring, Simulator
from sim.workload import write_workload

ZOO = job_sources(use_zoo=True)
CLUSTER = build_cluster("two-t4-nodes", [{"gpu_type": "aws", "count": 2, "gpus_per_node": 4}])
CLUSTER_FILE = "name: two-t4-nodes\nnodes: [{gpu_type: aws, count: 2, gpus_per_node: 4}]\n"
# vision may borrow any idle T4; nlp none beyond its guarantee.
TEAMS = TeamFile({"vision": TeamSpec({"T4": 4}), "nlp": TeamSpec({"T4": 4}, {"T4": 0})})
TEAM_FILE = "teams:\n  vision: {quota: {T4: 4}}\n  nlp: {quota: {T4: 4}, borrow: {T4: 0}}\n"
# vision's job has the cluster to itself until nlp's jobs come and take back nlp's guarantee.
WORKLOAD = [
    WorkloadJob("vision.big", 0, "cifar10", 8, 1024, "vision"),
    WorkloadJob("nlp.a", 600, "cifar10", 4, 512, "nlp"),
    WorkloadJob("nlp.b", 660, "bert", 2, 24, "nlp", 5),
]


def _files(tmp_path, workload: str) -> list[str]:
    (tmp_path / "w.csv").write_text(workload)
    (tmp_path / "cluster.yaml").write_text(CLUSTER_FILE)
    (tmp_path / "teams.yaml").write_text(TEAM_FILE)
    return [
        "--workload",
        str(tmp_path / "w.csv"),
        "--cluster",
        str(tmp_path / "cluster.yaml"),
        "--teams",
        str(tmp_path / "teams.yaml"),
        "--zoo",
        "--no-fairness",
        "--out",
        str(tmp_path / "r.json"),
    ]


def test_the_team_and_priority_columns_reach_each_simulated_job(tmp_path):
    path = tmp_path / "w.csv"
    path.write_text(
        "name,time,application,num_replicas,batch_size,priority,team\n"
        "a,0,cifar10,2,256,7,vision\n"
        "b,30,bert,1,12,,\n"  # empty cells: the default team, priority 0
        "c,60,ncf,1,32768,-3,nlp\n"
    )
    jobs = load_workload(path)
    assert [(j.name, j.team, j.priority) for j in jobs] == [
        ("a", "vision", 7),
        ("b", DEFAULT_TEAM, 0),
        ("c", "nlp", -3),
    ]
    write_workload(jobs, tmp_path / "again.csv")
    assert load_workload(tmp_path / "again.csv") == jobs

    executors = SimulatedExecutors(CLUSTER, simulation_settings("none", "sia-hetero-64"), 10)
    for job in jobs:
        executors.add(job, ZOO.truths[job.application])
    facts = {f.job_id: (f.team, f.priority) for f in executors.facts(0.0, ["a", "b", "c"])}
    assert facts == {"a": ("vision", 7), "b": (DEFAULT_TEAM, 0), "c": ("nlp", -3)}
    assert executors.jobs["c"].record().team == "nlp"
    # A submission's team and priority, as the simulated executors service takes it.
    submitted = as_workload_job(JobSpec("d", "cifar10", team="vision", priority=2), ZOO.truths["cifar10"])
    assert (submitted.team, submitted.priority) == ("vision", 2)


@pytest.mark.parametrize(
    "row, problem",
    [
        ("a,0,cifar10,2,256,Vision Team,0", "line 2: column 'team'"),
        ("a,0,cifar10,2,256,vision,5000", "line 2: priority 5000"),
        ("a,0,cifar10,2,256,vision,high", "line 2: column 'priority'"),
    ],
)
def test_a_bad_team_or_priority_in_a_workload_is_refused_with_its_line(tmp_path, row, problem):
    path = tmp_path / "w.csv"
    path.write_text(f"name,time,application,num_replicas,batch_size,team,priority\n{row}\n")
    with pytest.raises(ValueError, match=problem):
        load_workload(path)


def test_a_job_of_a_team_the_team_file_does_not_name_is_a_clear_error(tmp_path, capsys):
    workload = "name,time,application,num_replicas,batch_size,team\na,0,cifar10,2,256,vision\nb,0,ncf,1,32768,infra\n"
    assert main(["simulate", *_files(tmp_path, workload)]) == 2
    error = capsys.readouterr().err
    assert "'infra' (job b)" in error and "does not" in error and "vision, nlp" in error
    assert not (tmp_path / "r.json").exists()


def test_teams_with_a_policy_that_cannot_hold_them_is_a_clear_error_naming_those_that_can(tmp_path, capsys):
    assert {"goodput", "sia"} <= set(team_policies()) and "fifo" not in team_policies()
    workload = "name,time,application,num_replicas,batch_size,team\na,0,cifar10,2,256,vision\n"
    assert main(["simulate", *_files(tmp_path, workload), "--policy", "fifo"]) == 2
    error = capsys.readouterr().err
    assert "'fifo' cannot honour" in error and "goodput" in error and "sia" in error
    options = _files(tmp_path, workload)[2:]  # compare takes --workloads
    assert main(["compare", *options, "--workloads", str(tmp_path / "w.csv"), "--policies", "sia", "gavel"]) == 2
    assert "'gavel' cannot honour" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'tiresias' cannot honour"):
        simulate(Simulation(WORKLOAD, str(tmp_path / "cluster.yaml"), "tiresias", teams=TEAMS), sources=ZOO)


def test_compare_with_teams_runs_the_policies_that_hold_them_and_reports_each_team(tmp_path, capsys):
    workload = "name,time,application,num_replicas,batch_size,team\na,0,cifar10,2,256,vision\nb,0,ncf,1,32768,nlp\n"
    options = _files(tmp_path, workload)[2:]
    assert main(["compare", *options, "--workloads", str(tmp_path / "w.csv")]) == 0
    table = capsys.readouterr().out
    assert "vision avg JCT h" in table and "nlp avg JCT h" in table
    results = table[: table.index("| workloads | policy | compute s")]  # the first table, not the JCT's parts
    policies = [line.split("|")[2].strip() for line in results.splitlines() if line.startswith("| w.csv")]
    assert policies == [p for p in ("goodput", "sia", "pollux", "gavel") if p in team_policies()]


def test_a_team_file_that_does_not_fit_the_cluster_is_refused(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER_FILE)
    too_much = TeamFile({"vision": TeamSpec({"T4": 6}), "nlp": TeamSpec({"T4": 4})})
    with pytest.raises(ValueError, match="does not fit cluster two-t4-nodes: the guarantees of T4 add up to 10"):
        simulate(Simulation(WORKLOAD, str(tmp_path / "cluster.yaml"), "goodput", teams=too_much), sources=ZOO)


def test_two_teams_share_a_cluster_within_their_guarantees_and_borrowing_limits(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER_FILE)
    result = simulate(
        Simulation(WORKLOAD, str(tmp_path / "cluster.yaml"), "goodput", teams=TEAMS), sources=ZOO, fairness=False
    )

    assert result["jobs_unfinished"] == 0
    teams = result["teams"]
    assert list(teams) == ["vision", "nlp"]
    assert (teams["vision"]["jobs"], teams["nlp"]["jobs"]) == (1, 2)
    assert teams["nlp"]["quota"] == {"T4": 4} and teams["nlp"]["borrow"] == {"T4": 0}
    for name in teams:
        mine = [j for j in result["jobs"] if j["team"] == name]
        assert teams[name]["avg_jct_s"] == pytest.approx(sum(j["jct_s"] for j in mine) / len(mine))
        assert teams[name]["gpu_hours"] == pytest.approx(sum(j["gpu_seconds"] for j in mine) / 3600, abs=1e-3)
    for entry in result["timeline"]:  # nlp never beyond its guarantee (borrow 0), no one beyond the cluster
        assert entry["teams"]["nlp"].get("T4", 0) <= 4
        assert sum(held.get("T4", 0) for held in entry["teams"].values()) <= 8
    # vision borrowed the idle half before nlp came, and gave it back the round nlp's jobs came.
    assert teams["vision"]["borrowed_gpu_hours"] > 0 and teams["nlp"]["borrowed_gpu_hours"] == 0
    came = next(e for e in result["timeline"] if e["t"] >= 600)
    assert came["teams"]["nlp"]["T4"] == 4 and came["teams"]["vision"]["T4"] == 4
    assert teams["vision"]["reclaimed"] >= 1
    assert any("vision.big shrunk to 4 (from 8 T4 GPUs): team nlp takes back" in e for e in result["events"])
    borrowed_s = sum(e["borrowed"]["vision"] * 60 for e in result["timeline"])  # a decision a round of 60 s
    assert teams["vision"]["borrowed_gpu_hours"] == pytest.approx(borrowed_s / 3600, abs=1e-3)

    plot = tmp_path / "teams.png"
    from sim.run import plot as draw

    draw(result, plot)
    assert plot.stat().st_size > 10_000


def test_the_rounds_spans_say_each_jobs_team_what_it_borrows_and_whose_reclaim_shrank_it():
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider("test", exporter, environ={})
    settings = simulation_settings("none", "sia-hetero-64")
    sim = Simulator(WORKLOAD, CLUSTER, make_policy("goodput"), settings, ZOO.truths, ZOO.profile, teams=TEAMS)
    sim.loop.observer.tracer = get_tracer(TRACER_NAME, tracer_provider=provider)
    sim.run()
    provider.shutdown()
    spans = exporter.get_finished_spans()

    first = next(s for s in spans if s.name == "job.decision" and s.attributes["job.id"] == "vision.big")
    assert first.attributes["team"] == "vision" and first.attributes["borrowed"] == 4
    (reclaimed,) = [s for s in spans if s.name == "job.decision" and "reclaimed" in s.attributes]
    assert reclaimed.attributes["job.id"] == "vision.big" and reclaimed.attributes["reclaimed"] == "nlp"
    assert reclaimed.attributes["gpu.count"] == 4 and reclaimed.attributes["borrowed"] == 0
    rounds = {s.attributes["round"]: s for s in spans if s.name == "round" and "team.vision.gpus" in s.attributes}
    assert rounds[0].attributes["team.vision.gpus"] == 8 and rounds[0].attributes["team.vision.borrowed"] == 4
    assert list(rounds[0].attributes["team.nlp.use"]) == ["T4 0/4"]
    at_reclaim = rounds[reclaimed.attributes["round"]]
    assert at_reclaim.attributes["team.vision.reclaimed"] == 1
    assert list(at_reclaim.attributes["team.nlp.use"]) == ["T4 4/4"]
    assert [r.team for r in sim.records() if r.reclaims] == ["vision"]  # the executors recorded it
    (reclaim,) = next(r for r in sim.records() if r.name == "vision.big").reclaims
    assert (reclaim.by_team, reclaim.gpus_before, reclaim.gpus_after) == ("nlp", 8, 4)


class _ScriptedTeams:
    """A live run's team file round by round: a TeamFile, None (no key), or a ValueError (unreadable)."""

    def __init__(self, script):
        self.script, self.asked = list(script), 0

    async def team_file(self):
        answer = self.script[min(self.asked, len(self.script) - 1)]
        self.asked += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_live_runs_team_file_is_read_every_decision_and_one_that_cannot_be_used_keeps_the_last():
    over_the_cluster = TeamFile({"vision": TeamSpec({"T4": 8}), "nlp": TeamSpec({"T4": 4})})
    unreadable = ValueError("the team file in KV goodput_teams/teams cannot be read: Expected `object`")
    source = _ScriptedTeams([TEAMS, over_the_cluster, over_the_cluster, unreadable, TEAMS, None])
    jobs = [WorkloadJob("vision.long", 0, "bert", 4, 48, "vision")]
    settings = simulation_settings("none", "sia-hetero-64", horizon_s=5 * 60)  # six rounds
    wiring = DirectWiring(jobs, CLUSTER, settings, ZOO.truths, ZOO.profile, 10)
    loop = RoundLoop([Arrival("vision.long", 0)], CLUSTER, make_policy("goodput"), settings, wiring, teams=source)
    asyncio.run(loop.run())

    in_force = [bool(r.team_gpus) for r in loop.rounds]
    assert in_force == [True, True, True, True, True, False]  # the last good file held until the key went
    problems = [e for e in loop.events if "the team file cannot be used" in e]
    assert len(problems) == 2  # each reason once, though the file stayed bad for two rounds
    assert "T4 add up to 12" in problems[0] and "the last valid one stays in force" in problems[0]
    assert "cannot be read" in problems[1]


async def test_a_live_runs_teams_are_the_operators_team_file_in_kv(connect_bus):
    from services.policy.wiring import KvTeams

    bus = await connect_bus("operator")
    await storage.provision(bus)
    kv = await bus.open_kv(subjects.TEAMS_BUCKET, TeamFile)
    source = KvTeams(bus)
    try:
        await kv.delete(subjects.TEAMS_KEY)
        assert await source.team_file() is None
        await kv.put(subjects.TEAMS_KEY, TEAMS)
        assert await source.team_file() == TEAMS
        await (await bus.js.key_value(subjects.TEAMS_BUCKET)).put(subjects.TEAMS_KEY, b"\x93not a team file")
        with pytest.raises(ValueError, match="cannot be read"):
            await source.team_file()
    finally:
        await kv.delete(subjects.TEAMS_KEY)
