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


async def test_one_trace_per_round_across_the_services(monkeypatch):
    """The services export to a real OTLP/HTTP receiver: a round's spans share its trace."""
    import asyncio
    import socket

    import oteltap

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")   # the services inherit it
    settings = oteltap.OtelTapHttpProtobufReceiverSettings(http_port=port)
    wanted = ("policy.solve", "estimator.goodput", "placer.place", "executor.apply")
    async with oteltap.OtelTapHttpProtobufReceiver(settings) as receiver:
        waits = {name: asyncio.ensure_future(receiver.await_trace(lambda span, n=name: span.name == n))
                 for name in ("round",) + wanted}
        await asyncio.sleep(0)
        await asyncio.to_thread(simulate, WORKLOAD[:2], "sia-hetero-64", "sia", sources=ZOO, bus="nats")
        spans = dict(zip(waits, await asyncio.wait_for(asyncio.gather(*waits.values()), 20)))
    # The first span of each name belongs to the first round; all hang from that round's root span.
    root = spans["round"]
    assert not root.parent_span_id
    for name in wanted:
        assert spans[name].trace_id == root.trace_id, name
    assert spans["placer.place"].parent_span_id == root.span_id
    assert spans["estimator.goodput"].parent_span_id == root.span_id
