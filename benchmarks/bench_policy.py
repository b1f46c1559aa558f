"""Benchmark of the policies' runtime and the simulator, measured inside simulator runs on the reference data.

    .venv/bin/python benchmarks/bench_policy.py [--policies sia goodput] [--scale-hours 1.0] [--reference DIR]
        [--teams FILE]

Each policy in turn (default `sia`, then `goodput`), so their figures come from one run:

1. One 160-job, 8-hour Philly workload on sia-hetero-64, run whole: the policy's time per round
   (p50/p95; targets 10 / 20 ms) and the whole simulation's wall time (target <= 30 s).
2. The scale workload scale_32x (5,120 jobs) on the 2,048-GPU sia-hetero-2048 cluster, its first
   hours simulated: the policy's time per round (target p95 <= 1 s), and the whole round's
   (goodput matrix + policy + placer).

With `--cluster NAME` (a preset or a cluster file), instead: the `goodput` policy (or `--policies`)
on that cluster for `--rounds` rounds of a workload grown for it (`grown_workload`): Philly
workload-1 (160 jobs) with every job repeated k times at its own arrival time, as Sia's scale_Nx
workloads are (k = the cluster's GPUs / 256 by default: 64 on sia-hetero-16384, 10,240 jobs), and
the arrivals compressed 1,000x (all within the first 28 s), so that every job is active from the
first round on. `--workload FILE` replays a file instead (`--repeat`, `--compress` apply to it too).
Each round's policy time (the goodput matrix included), its active jobs, and for a greedy round
its bound on the gap to the optimum are printed; `--quality` also solves every round's ILP exactly
(outside the timing) and prints the fast answer's objective against it. The run ends with its
headline: `p50_ms=... p95_ms=... max_ms=... active_jobs=...` (active jobs: the fewest in a round).

With `--teams FILE` (a team file for sia-hetero-64), the same two runs measure what teams cost the
policy instead: every round is decided twice, on the round's state without teams and with them (in
alternating order, on one goodput matrix evaluated before either is timed), and the run goes on
with the decision with teams. Each job's team is the file's first or second by crc32 of its id
(mod the teams' count); on sia-hetero-2048 every quota and borrowing limit is scaled by the ratio
of the two clusters' GPUs of its type (x32). Target: at most +20% policy time with teams.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import zlib
from pathlib import Path
from unittest import mock

import numpy as np

import policies.sia as sia_module
import policies.sia_ilp as sia_ilp
import policies.sia_ilp.exact as sia_ilp_exact
import policies.sia_ilp.large as sia_ilp_large
import sim.run
from policies.base import Decision, RoundState, make_policy, policy_spec
from services.simulated.truth import job_sources
from shared.cluster import Cluster, load_cluster
from shared.schema.teams import TeamFile, Teams, TeamSpec
from shared.teams import load_team_file, resolve
from sim.reference import WorkloadJob, load_workload, reference_root
from sim.run import Simulation, simulate


def report(label: str, result: dict, took: float) -> None:
    policy, rnd = result["policy_runtime_ms"], result["round_runtime_ms"]
    print(f"{label}")
    print(
        f"  rounds {result['rounds']}, jobs finished {result['jobs_finished']}/{len(result['jobs'])}, "
        f"mean active jobs {result['contention']:.0f}, wall time {took:.1f} s"
    )
    print(f"  policy ms  p50 {policy['p50']:8.1f}   p95 {policy['p95']:8.1f}   max {policy['max']:8.1f}")
    print(f"  round ms   p50 {rnd['p50']:8.1f}   p95 {rnd['p95']:8.1f}   max {rnd['max']:8.1f}")


class SideBySide:
    """A policy that decides every round twice, without teams and with them, and times both; the run
    goes on with the decision with teams."""

    honours_teams = True

    def __init__(self, policy: str, teams: Teams):
        self.inner = make_policy(*policy_spec(policy)[:1], **policy_spec(policy)[1])
        self.name, self.round_s, self.adaptive_batch = self.inner.name, self.inner.round_s, self.inner.adaptive_batch
        self.teams, self.names = teams, list(teams.teams)
        self.plain_ms: list[float] = []
        self.teams_ms: list[float] = []
        self.differ = 0  # rounds where the teams changed the decision
        self.seen: set[str] = set()  # every job scheduled

    def team_of(self, job_id: str) -> str:
        return self.names[zlib.crc32(job_id.encode()) % len(self.names)]

    def allocate(self, state: RoundState) -> Decision:
        self.seen.update(j.job_id for j in state.jobs)
        plain = RoundState(state.now_s, state.cluster, state.jobs)
        jobs = tuple(dataclasses.replace(j, team=self.team_of(j.job_id)) for j in state.jobs)
        with_teams = RoundState(state.now_s, state.cluster, jobs, self.teams)
        with_teams.__dict__["table"] = plain.table  # one matrix (the teams do not change it), outside the timing
        order = [(plain, self.plain_ms), (with_teams, self.teams_ms)]
        decided = {}
        for one, times in order if len(self.plain_ms) % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            decided[id(one)] = self.inner.allocate(one)
            times.append((time.perf_counter() - start) * 1e3)
        self.differ += decided[id(plain)].allocations != decided[id(with_teams)].allocations
        return decided[id(with_teams)]


def scaled_teams(file: TeamFile, small: Cluster, large: Cluster) -> Teams:
    """The team file resolved on `small`, every quota and borrowing limit scaled by `large`'s GPUs of
    the type over `small`'s, resolved on `large`."""
    teams = resolve(file, small)
    factor = {t: large.capacity(t) // small.capacity(t) for t in small.gpu_types}
    return resolve(
        TeamFile(
            {
                name: TeamSpec(
                    {t: n * factor[t] for t, n in team.quota.items()},
                    {t: n * factor[t] for t, n in team.borrow.items() if n is not None},
                    team.weight,
                )
                for name, team in teams.teams.items()
            }
        ),
        large,
    )


def side_by_side(label: str, policy: str, teams: Teams, workload: Path, cluster: str, sources, **options) -> None:
    """One run with every round decided without teams and with them; their times and ratio."""
    measured = SideBySide(policy, teams)
    start = time.perf_counter()
    with mock.patch.object(sim.run, "make_policy", lambda *_, **__: measured):
        result = simulate(Simulation(workload, cluster, policy, **options), sources=sources, fairness=False)
    plain, with_teams = np.array(measured.plain_ms), np.array(measured.teams_ms)
    counts = {name: 0 for name in measured.names}
    for job_id in measured.seen:
        counts[measured.team_of(job_id)] += 1
    print(label)
    print(
        f"  rounds {len(plain)}, mean active jobs {result['contention']:.0f}, jobs by team "
        + ", ".join(f"{n} {c}" for n, c in counts.items())
        + f" (crc32 of the id); teams changed the decision in {measured.differ} rounds; wall {time.perf_counter() - start:.0f} s"
    )
    for name, ms in (("without teams", plain), ("with teams", with_teams)):
        p50, p95 = np.percentile(ms, [50, 95])
        print(f"  {name:14s} policy ms  p50 {p50:8.1f}   p95 {p95:8.1f}   max {ms.max():8.1f}   mean {ms.mean():8.1f}")
    ratios = [
        f"{q}: {np.percentile(with_teams, v) / np.percentile(plain, v):.3f}" for q, v in (("p50", 50), ("p95", 95))
    ]
    ratios.append(f"mean: {with_teams.mean() / plain.mean():.3f}")
    ratios.append(f"median of per-round ratios: {np.median(with_teams / plain):.3f}")
    print("  with / without teams  " + ", ".join(ratios) + "  (target <= 1.20)")


def grown_workload(base: Path, repeat: int, compress: float) -> list[WorkloadJob]:
    """Every job of `base` repeated `repeat` times at its arrival time (names `NAME-xK`), as Sia's
    scale_Nx workloads are, with every arrival time divided by `compress`."""
    jobs = load_workload(base)
    return sorted(
        (
            dataclasses.replace(job, name=f"{job.name}-x{k}" if repeat > 1 else job.name, time=job.time / compress)
            for job in jobs
            for k in range(repeat)
        ),
        key=lambda job: job.time,
    )


class Timed:
    """A policy timed round by round: its time (the goodput matrix included), the round's active
    jobs, and each ILP solution's gap bound; with `quality`, each round's ILP also solved exactly,
    outside the timing."""

    honours_teams = True

    def __init__(self, policy: str, quality: bool):
        self.inner = make_policy(*policy_spec(policy)[:1], **policy_spec(policy)[1])
        self.name, self.round_s, self.adaptive_batch = self.inner.name, self.inner.round_s, self.inner.adaptive_batch
        self.quality = quality
        self.rounds: list[tuple[int, float, float | None]] = []  # (active jobs, ms, relative gap bound)
        self.ratios: list[float] = []  # each round's fast objective / its exact objective
        self.solved: list = []

    def allocate(self, state: RoundState) -> Decision:
        self.solved.clear()
        real = sia_module.solve

        def recorded(problem, *args, **kwargs):
            solution = real(problem, *args, **kwargs)
            self.solved.append((problem, args, solution))
            return solution

        with mock.patch.object(sia_module, "solve", recorded):
            start = time.perf_counter()
            decision = self.inner.allocate(state)
            ms = (time.perf_counter() - start) * 1e3
        gap = None
        for problem, args, solution in self.solved:
            if solution.gap and solution.objective:
                gap = solution.gap / abs(solution.objective)
            if self.quality and solution.objective:
                exact = exact_solve(problem, *args)
                if exact.objective:
                    self.ratios.append(solution.objective / exact.objective)
        self.rounds.append((len(state.jobs), ms, gap))
        print(
            f"  round {len(self.rounds):3d}  active jobs {len(state.jobs):6d}  policy {ms:8.1f} ms"
            + ("" if gap is None else f"  greedy, gap bound {gap:.2%} of the objective"),
            flush=True,
        )
        return decision


def exact_solve(problem, *args):
    """The ILP solved as the fast paths would not: the priced path's MILPs proven to the solver's
    gap (1e-7), given all the time they take, never the greedy allocation."""
    with (
        mock.patch.object(sia_ilp, "HUGE_MODEL_ENTRIES", 1 << 62),
        mock.patch.object(sia_ilp_large, "LARGE_MIP_REL_GAP", sia_ilp_exact.MIP_REL_GAP),
        mock.patch.object(sia_ilp, "LARGE_MODEL_BUDGET_S", 600.0),
    ):
        p, lam, solver, _ = args
        return sia_ilp.solve(problem, p, lam, solver, 600.0)


def cluster_run(args, sources, workloads: Path) -> None:
    """The policy on `args.cluster` for `args.rounds` rounds of the grown workload; its headline."""
    spec = load_cluster(args.cluster)
    base = Path(args.workload) if args.workload else workloads / "philly" / "workload-1.csv"
    repeat = args.repeat or max(1, spec.total_gpus // 256)
    jobs = grown_workload(base, repeat, args.compress)
    for policy in args.policies:
        timed = Timed(policy, args.quality)
        print(
            f"{policy} on {args.cluster} ({spec.total_gpus:,} GPUs, {len(spec.configurations()):,} configurations): "
            f"{base.name} x{repeat} = {len(jobs):,} jobs, arrivals / {args.compress:g}, {args.rounds} rounds"
        )
        start = time.perf_counter()
        # The run's own result document (each job's JCT split, over thousands of jobs) is not wanted here.
        with (
            mock.patch.object(sim.run, "make_policy", lambda *_, **__: timed),
            mock.patch.object(sim.run, "results", lambda *_, **__: {}),
        ):
            simulate(
                Simulation(jobs, args.cluster, policy, horizon_s=args.rounds * 60.0), sources=sources, fairness=False
            )
        ms = np.array([r[1] for r in timed.rounds])
        active = [r[0] for r in timed.rounds]
        gaps = [r[2] for r in timed.rounds if r[2] is not None]
        p50, p95 = np.percentile(ms, [50, 95])
        print(f"  wall time {time.perf_counter() - start:.0f} s; mean active jobs {np.mean(active):.0f}")
        if gaps:
            print(
                f"  greedy rounds {len(gaps)}: gap bound mean {np.mean(gaps):.2%}, max {max(gaps):.2%} of the objective"
            )
        if timed.ratios:
            r = np.array(timed.ratios)
            print(
                f"  quality: {r.size} rounds solved exactly too; fast / exact objective mean {r.mean():.5f}, "
                f"max {r.max():.5f}, {int(np.sum(r > 1 + 1e-9))} rounds above 1 (p < 0 minimises: 1 is the optimum)"
            )
        print(f"p50_ms={p50:.1f} p95_ms={p95:.1f} max_ms={ms.max():.1f} active_jobs={min(active)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="reference folder (default: $GOODPUT_REFERENCE, else ../shared/reference)")
    parser.add_argument("--scale-hours", type=float, default=1.0, help="simulated hours of the scale run")
    parser.add_argument(
        "--policies", nargs="+", help="policies to measure, in turn (default: sia and goodput; goodput with --cluster)"
    )
    parser.add_argument("--teams", help="a team file for sia-hetero-64: measure the policy with and without teams")
    parser.add_argument("--cluster", help="measure the policy on this cluster (a preset or file) instead")
    parser.add_argument("--rounds", type=int, default=5, help="--cluster: rounds to run")
    parser.add_argument("--workload", help="--cluster: this workload file (default: Philly workload-1, grown)")
    parser.add_argument("--repeat", type=int, help="--cluster: copies of every job (default: the GPUs / 256, >= 1)")
    parser.add_argument("--compress", type=float, default=1000.0, help="--cluster: arrival times divided by this")
    parser.add_argument("--quality", action="store_true", help="--cluster: solve every round exactly too, untimed")
    args = parser.parse_args()
    args.policies = args.policies or (["goodput"] if args.cluster else ["sia", "goodput"])
    for policy in args.policies:  # a bad name refused before minutes of runs
        try:
            policy_spec(policy)
        except ValueError as error:
            parser.error(str(error))
    root = reference_root(args.reference)
    workloads = Path(root) / "sia" / "sia-simulator" / "workloads"
    sources = job_sources(args.reference)
    if args.cluster:
        cluster_run(args, sources, workloads)
        return
    if args.teams:
        try:
            file = load_team_file(args.teams)
            small, large = load_cluster("sia-hetero-64"), load_cluster("sia-hetero-2048")
            teams, teams_large = resolve(file, small), scaled_teams(file, small, large)
        except ValueError as error:
            parser.error(str(error))
        for policy in args.policies:
            side_by_side(
                f"{policy} with and without teams {args.teams}, Philly workload-1 (160 jobs), sia-hetero-64",
                policy,
                teams,
                workloads / "philly" / "workload-1.csv",
                "sia-hetero-64",
                sources=sources,
            )
        for policy in args.policies:
            side_by_side(
                f"{policy} with and without teams {args.teams} (quotas x32), scale_32x workload-1, "
                f"sia-hetero-2048, first {args.scale_hours:g} h",
                policy,
                teams_large,
                workloads / "scale" / "scale_32x" / "workload-1.csv",
                "sia-hetero-2048",
                sources=sources,
                horizon_s=args.scale_hours * 3600,
            )
        return

    for policy in args.policies:
        start = time.perf_counter()
        result = simulate(
            Simulation(workloads / "philly" / "workload-1.csv", "sia-hetero-64", policy),
            sources=sources,
            fairness=False,
        )  # the simulation itself, without each job's alone run
        report(
            f"{policy}, Philly workload-1 (160 jobs), sia-hetero-64 — targets: policy p50 <= 10 ms, "
            "p95 <= 20 ms; simulation <= 30 s",
            result,
            time.perf_counter() - start,
        )

    for policy in args.policies:
        start = time.perf_counter()
        result = simulate(
            Simulation(
                workloads / "scale" / "scale_32x" / "workload-1.csv",
                "sia-hetero-2048",
                policy,
                horizon_s=args.scale_hours * 3600,
            ),
            sources=sources,
            fairness=False,
        )
        report(
            f"{policy}, scale_32x workload-1 (5,120 jobs), sia-hetero-2048, first {args.scale_hours:g} h — "
            "target: policy p95 <= 1 s",
            result,
            time.perf_counter() - start,
        )


if __name__ == "__main__":
    main()
