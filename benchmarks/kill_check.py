"""kill -9 one service in the middle of a replay over NATS, restart it, and compare every job's
outcome with the direct wiring's. `--victim policy` runs two policy replicas and kills the one
leading; the standby resumes the run, and the killed one comes back as a standby.

    .venv/bin/python benchmarks/kill_check.py --victim executor [--workload PATH] [--after 5]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from launcher.nats import embedded_nats
from launcher.replay import replay
from launcher.stack import running_services, service_arguments
from services.simulated.truth import job_sources
from shared.settings import settings_for
from sim.reference import load_workload, reference_root
from sim.run import Simulation, simulate


async def killed_run(jobs, victim: str, after_s: float, reference: str | None) -> tuple[list, float]:
    arguments = service_arguments("sia-hetero-64", reference, reference is None, None, 1, None)
    replicas = {"policy": 2} if victim == "policy" else {}
    with tempfile.TemporaryDirectory() as folder, embedded_nats(Path(folder)) as nats:
        with running_services(nats, arguments, Path(folder), replicas, lease_ttl_s=2.0) as stack:
            bus = await nats.connect("kill-check")
            try:
                await stack.wait_ready(bus)
                start = time.perf_counter()
                run = asyncio.ensure_future(
                    replay(bus, stack, jobs, "sia", {}, settings_for(None, "sia-hetero-64").name, request_timeout_s=2.0)
                )
                await asyncio.sleep(after_s)
                if run.done():
                    raise SystemExit(f"the replay ended before {after_s} s: kill sooner")
                if victim == "policy":
                    victim = await stack.policy_leader(bus)
                stack.kill(victim)
                await asyncio.sleep(0.5)
                stack.start(victim)
                _, records = await run
                return list(records.jobs), time.perf_counter() - start
            finally:
                await bus.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--victim", required=True, choices=["profiler", "estimator", "placer", "executor", "policy"])
    parser.add_argument("--workload", help="default: the Sia Philly workload-1 (160 jobs)")
    parser.add_argument("--after", type=float, default=5.0, help="seconds into the replay to kill it")
    args = parser.parse_args()
    root = reference_root()
    workload = args.workload or str(Path(root) / "sia/sia-simulator/workloads/philly/workload-1.csv")
    jobs = load_workload(workload)
    direct = simulate(Simulation(jobs, "sia-hetero-64", "sia"), sources=job_sources(), fairness=False)
    records, took = asyncio.run(killed_run(jobs, args.victim, args.after, str(root)))
    outcome = {r.name: (r.finish_s, r.restarts, round(r.gpu_seconds, 3)) for r in records}
    expected = {j["name"]: (j["finish_s"], j["restarts"], j["gpu_seconds"]) for j in direct["jobs"]}
    same = sum(outcome.get(name) == value for name, value in expected.items())
    finished = sum(r.finish_s is not None for r in records)
    print(
        f"kill -9 {args.victim} at {args.after:g} s into a {len(jobs)}-job replay ({took:.1f} s): "
        f"{finished}/{len(jobs)} jobs finished, each once; {same}/{len(jobs)} outcomes equal the direct run's"
    )


if __name__ == "__main__":
    main()
