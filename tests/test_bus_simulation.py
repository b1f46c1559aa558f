"""`goodput simulate --bus nats`: the five services over a real NATS server give the schedule that
the direct wiring gives, job for job."""

from shared.reference import WorkloadJob
from sim.run import job_sources, simulate

ZOO = job_sources(use_zoo=True)
WORKLOAD = [WorkloadJob("cifar10-0", 0, "cifar10", 2, 256), WorkloadJob("bert-1", 30, "bert", 1, 12),
            WorkloadJob("cifar10-2", 200, "cifar10", 4, 512), WorkloadJob("deepspeech2-3", 400, "deepspeech2", 2, 40),
            WorkloadJob("ncf-4", 500, "ncf", 1, 32768)]


def test_nats_wiring_reproduces_the_direct_schedule():
    direct = simulate(WORKLOAD, "sia-hetero-64", "sia", sources=ZOO)
    over_nats = simulate(WORKLOAD, "sia-hetero-64", "sia", sources=ZOO, bus="nats")
    assert direct["jobs_unfinished"] == 0
    assert over_nats["jobs"] == direct["jobs"]                  # same JCTs, restarts, GPU time, feedback
    assert over_nats["rounds"] == direct["rounds"]
    assert [r["gpus"] for r in over_nats["timeline"]] == [r["gpus"] for r in direct["timeline"]]
