"""Trace context across the bus: a consumer's span is the child of the producer's span, over
publish/subscribe, request/reply and JetStream pull; OTLP export only when an endpoint is set,
and once over the wire to a real OTLP/HTTP receiver."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from shared.tracing import (
    add_exporter,
    build_tracer_provider,
    extract_trace_context,
    inject_trace_context,
    otlp_exporter_from_env,
    span_context_of,
)

TIMEOUT_S = 3.0


class Ping(msgspec.Struct, frozen=True):
    n: int


@pytest.fixture
def traced():
    """A private tracer provider with an in-memory exporter (the process's global is untouched)."""
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider("test", exporter, environ={})
    yield provider, exporter
    provider.shutdown()


async def finished_span(exporter: InMemorySpanExporter, name: str, timeout: float = TIMEOUT_S):
    """The finished span called `name`, waiting for it: a handler's span ends after it returns."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        matches = [span for span in exporter.get_finished_spans() if span.name == name]
        if matches:
            (span,) = matches
            return span
        if asyncio.get_running_loop().time() > deadline:
            names = [span.name for span in exporter.get_finished_spans()]
            raise AssertionError(f"no finished span {name!r}; have {names}")
        await asyncio.sleep(0.01)


def assert_child_of(child, parent) -> None:
    assert child.context.trace_id == parent.context.trace_id
    assert child.parent is not None and child.parent.span_id == parent.context.span_id


def test_trace_context_round_trips_through_headers(traced):
    provider, _ = traced
    with provider.get_tracer("test").start_as_current_span("produce") as span:
        headers = inject_trace_context()
    assert headers["traceparent"].split("-")[1] == f"{span.get_span_context().trace_id:032x}"
    extracted = extract_trace_context(headers)
    with provider.get_tracer("test").start_as_current_span("consume", context=extracted) as child:
        assert child.parent.span_id == span.get_span_context().span_id
    assert inject_trace_context() == {}  # no active span: nothing to carry


async def test_subscriber_span_is_child_of_publisher_span(connect_bus, name_prefix, traced):
    provider, exporter = traced
    consumer = await connect_bus("consumer", tracer_provider=provider)
    producer = await connect_bus("producer", tracer_provider=provider)
    subject = f"{name_prefix}.ping"
    received: asyncio.Queue = asyncio.Queue()
    await consumer.subscribe(subject, Ping, received.put)

    with provider.get_tracer("test").start_as_current_span("produce"):
        await producer.publish(subject, Ping(1))
    await asyncio.wait_for(received.get(), TIMEOUT_S)

    produced = await finished_span(exporter, "produce")
    consumed = await finished_span(exporter, f"{subject} receive")
    assert_child_of(consumed, produced)
    assert consumed.kind == SpanKind.CONSUMER


async def test_message_without_trace_context_starts_a_new_trace(connect_bus, name_prefix, traced):
    provider, exporter = traced
    bus = await connect_bus(tracer_provider=provider)
    subject = f"{name_prefix}.ping"
    received: asyncio.Queue = asyncio.Queue()
    await bus.subscribe(subject, Ping, lambda ping, raw: received.put_nowait(raw.headers), with_raw=True)

    with provider.get_tracer("test").start_as_current_span("unrelated"):
        pass
    await bus.publish(subject, Ping(1))  # outside any span

    assert await asyncio.wait_for(received.get(), TIMEOUT_S) is None  # plain PUB, no headers
    assert (await finished_span(exporter, f"{subject} receive")).parent is None


async def test_request_handler_span_is_child_of_requester_span(connect_bus, name_prefix, traced):
    provider, exporter = traced
    server = await connect_bus("server", tracer_provider=provider)
    client = await connect_bus("client", tracer_provider=provider)
    subject = f"{name_prefix}.estimate"
    await server.subscribe(subject, Ping, lambda ping: Ping(ping.n * 2), span_name="estimator.goodput")

    with provider.get_tracer("test").start_as_current_span("policy.solve"):
        assert await client.request(subject, Ping(21), Ping, timeout=TIMEOUT_S) == Ping(42)

    solved = await finished_span(exporter, "policy.solve")
    answered = await finished_span(exporter, "estimator.goodput")
    assert_child_of(answered, solved)
    assert answered.kind == SpanKind.SERVER


async def test_service_endpoint_span_is_child_of_requester_span(connect_bus, name_prefix, traced):
    from nats import micro

    provider, exporter = traced
    server = await connect_bus("server", tracer_provider=provider)
    client = await connect_bus("client", tracer_provider=provider)
    subject = f"{name_prefix}.place"
    service = await micro.add_service(server.nc, name=name_prefix.replace(".", "_"), version="0.1.0")
    await server.add_endpoint(service, "place", subject, Ping, lambda ping: Ping(ping.n + 1), span_name="placer.place")

    with provider.get_tracer("test").start_as_current_span("policy.solve"):
        assert await client.request(subject, Ping(1), Ping, timeout=TIMEOUT_S) == Ping(2)

    assert_child_of(await finished_span(exporter, "placer.place"), await finished_span(exporter, "policy.solve"))
    await service.stop()


async def test_a_periodic_endpoint_starts_no_trace_of_its_own_but_is_traced_within_one(
    connect_bus, name_prefix, traced
):
    """`new_traces=False` (node.poll, asked every half second): a request outside any trace gets no
    span; one made within a trace (a round's) is its child as any other."""
    from nats import micro

    provider, exporter = traced
    server = await connect_bus("server", tracer_provider=provider)
    client = await connect_bus("client", tracer_provider=provider)
    subject = f"{name_prefix}.poll"
    service = await micro.add_service(server.nc, name=name_prefix.replace(".", "_"), version="0.1.0")
    await server.add_endpoint(
        service, "poll", subject, Ping, lambda ping: Ping(ping.n + 1), span_name="node.poll", new_traces=False
    )
    for n in range(5):
        assert await client.request(subject, Ping(n), Ping, timeout=TIMEOUT_S) == Ping(n + 1)
    with provider.get_tracer("test").start_as_current_span("executor.advance"):
        assert await client.request(subject, Ping(7), Ping, timeout=TIMEOUT_S) == Ping(8)
    assert_child_of(await finished_span(exporter, "node.poll"), await finished_span(exporter, "executor.advance"))
    await service.stop()


async def test_jetstream_pull_span_is_child_of_publisher_span(connect_bus, name_prefix, traced):
    provider, exporter = traced
    bus = await connect_bus(tracer_provider=provider)
    stream, subject = f"{name_prefix}_SUBMIT", f"{name_prefix}.submit"
    await bus.ensure_stream(stream, [subject])

    with provider.get_tracer("test").start_as_current_span("submit"):
        await bus.js_publish(subject, Ping(1), msg_id="job-1")
    async for delivery in bus.pull(stream, "profiler", subject, Ping, timeout=TIMEOUT_S):
        with delivery.span("profiler.bootstrap"):
            await delivery.ack()
        break

    # The handler path of a consumer does the same without an explicit span.
    with provider.get_tracer("test").start_as_current_span("submit-again"):
        await bus.js_publish(subject, Ping(2), msg_id="job-2")
    consumer = await bus.pull_consumer(stream, "profiler", subject, Ping, span_name="profiler.consume")
    handled: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(consumer.consume(handled.put, timeout=0.5))
    try:
        assert await asyncio.wait_for(handled.get(), TIMEOUT_S) == Ping(2)
        consumed = await finished_span(exporter, "profiler.consume")
        assert_child_of(consumed, await finished_span(exporter, "submit-again"))
    finally:
        task.cancel()
    bootstrapped = await finished_span(exporter, "profiler.bootstrap")
    assert_child_of(bootstrapped, await finished_span(exporter, "submit"))


def test_no_otlp_export_without_endpoint(monkeypatch):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exported = []

    def record_instead_of_sending(self, spans):
        exported.extend(spans)
        return SpanExportResult.SUCCESS

    monkeypatch.setattr(OTLPSpanExporter, "export", record_instead_of_sending)
    for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(variable, raising=False)

    assert otlp_exporter_from_env() is None
    quiet = build_tracer_provider("quiet")
    with quiet.get_tracer("test").start_as_current_span("local only"):
        pass
    quiet.force_flush()
    quiet.shutdown()
    assert exported == []

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # export is patched out
    assert isinstance(otlp_exporter_from_env(), OTLPSpanExporter)
    loud = build_tracer_provider("loud")
    with loud.get_tracer("test").start_as_current_span("exported"):
        pass
    loud.force_flush()
    loud.shutdown()
    assert [span.name for span in exported] == ["exported"]
    assert exported[0].resource.attributes["service.name"] == "loud"


def test_without_an_exporter_spans_are_not_recorded_but_keep_their_trace_context():
    """Nothing exports: a span costs no attributes (a round's thousands of `job.decision` spans are
    not built), yet it has its ids, its children share its trace and its `traceparent` travels; once
    an exporter is added, spans are recorded and exported."""
    quiet = build_tracer_provider("quiet", environ={})
    tracer = quiet.get_tracer("test")
    with tracer.start_as_current_span("round") as root:
        assert not root.is_recording() and root.get_span_context().is_valid
        headers = inject_trace_context()
        with tracer.start_as_current_span("stage") as child:
            assert child.get_span_context().trace_id == root.get_span_context().trace_id
    assert extract_trace_context(headers) is not None
    assert span_context_of(headers["traceparent"]).trace_id == root.get_span_context().trace_id
    exported = InMemorySpanExporter()
    add_exporter(quiet, SimpleSpanProcessor(exported))
    with tracer.start_as_current_span("round") as root:
        assert root.is_recording()
    assert [span.name for span in exported.get_finished_spans()] == ["round"]


@pytest.mark.e2e
def test_setup_tracing_installs_one_provider_per_process():
    """In a child process, so this test's global provider does not leak into other tests."""
    script = textwrap.dedent(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from shared.tracing import setup_tracing

        first = setup_tracing("policy")
        exporter = InMemorySpanExporter()
        again = setup_tracing("placer", exporter=exporter)
        assert again is first and trace.get_tracer_provider() is first
        assert first.resource.attributes["service.name"] == "policy"
        with trace.get_tracer("t").start_as_current_span("round"):
            pass
        assert [span.name for span in exporter.get_finished_spans()] == ["round"]
        """
    )
    repo_root = Path(__file__).resolve().parents[1]
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env["PYTHONPATH"] = str(repo_root)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=repo_root, timeout=60
    )
    assert result.returncode == 0, result.stderr


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_spans_exported_over_otlp_http_keep_parent_links(connect_bus, name_prefix, monkeypatch):
    """Two services, each its own provider exporting OTLP/HTTP to an oteltap receiver."""
    import oteltap  # a dev extra; missing it is a failure, not a skip

    port = _free_loopback_port()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    policy_provider = build_tracer_provider("policy")
    placer_provider = build_tracer_provider("placer")
    subject = f"{name_prefix}.allocations"
    settings = oteltap.OtelTapHttpProtobufReceiverSettings(http_port=port)

    async with oteltap.OtelTapHttpProtobufReceiver(settings) as receiver:
        policy = await connect_bus("policy", tracer_provider=policy_provider)
        placer = await connect_bus("placer", tracer_provider=placer_provider)
        placed: asyncio.Queue = asyncio.Queue()
        await placer.subscribe(subject, Ping, placed.put, span_name="placer.place")
        # Wait for both spans; register before exporting so neither can slip past.
        solve_seen = asyncio.ensure_future(receiver.await_trace(lambda span: span.name == "policy.solve"))
        place_seen = asyncio.ensure_future(receiver.await_trace(lambda span: span.name == "placer.place"))
        await asyncio.sleep(0)

        with policy_provider.get_tracer("test").start_as_current_span("policy.solve"):
            await policy.publish(subject, Ping(1))
        await asyncio.wait_for(placed.get(), TIMEOUT_S)
        await asyncio.sleep(0.05)  # let the placer's span end after its handler returned
        for provider in (policy_provider, placer_provider):
            await asyncio.to_thread(provider.force_flush)
        solve, place = await asyncio.wait_for(asyncio.gather(solve_seen, place_seen), 10)

    for provider in (policy_provider, placer_provider):
        provider.shutdown()
    assert place.trace_id == solve.trace_id
    assert place.parent_span_id == solve.span_id
    assert place.kind == place.SPAN_KIND_CONSUMER


# --- reading a round: per-job decision spans, links to submissions, the services' attributes -------

SUBMISSION_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SUBMISSION_SPAN_ID = 0xB7AD6B7169203331
SUBMISSION = f"00-{SUBMISSION_TRACE_ID:032x}-{SUBMISSION_SPAN_ID:016x}-01"


def test_span_context_of_reads_a_traceparent_and_refuses_anything_else():
    from shared.tracing import span_context_of

    context = span_context_of(SUBMISSION)
    assert (context.trace_id, context.span_id, context.is_remote) == (SUBMISSION_TRACE_ID, SUBMISSION_SPAN_ID, True)
    assert span_context_of("") is None and span_context_of(None) is None
    assert span_context_of("not-a-traceparent") is None
    assert span_context_of(f"00-{0:032x}-{SUBMISSION_SPAN_ID:016x}-01") is None  # an all-zero trace id


def _facts(job_id: str, application: str, cluster, placement=(), trace: str = ""):
    from shared.schema.rounds import JobFacts
    from sim.rounds import job_models

    models = job_models(job_id, application, cluster)
    return JobFacts(
        job_id,
        application,
        submit_s=0.0,
        age_s=600.0,
        requested_gpus=1,
        requested_batch=models.init_batch,
        rigid=False,
        init_batch=models.init_batch,
        max_batch=models.max_batch,
        placement=placement,
        restarts=1 if placement else 0,
        max_gpus_seen=sum(g for _, g in placement),
        trace=trace,
    )


class _OneRoundWiring:
    """The round's stages as calls: given facts, zoo models, the real placer; every job ends after one round."""

    def __init__(self, cluster, facts, held=None, failed=None, unmodelled=(), evict=()):
        self.cluster, self.known = cluster, list(facts)
        self.held, self.failed, self.unmodelled, self.evict = dict(held or {}), dict(failed or {}), unmodelled, evict
        self.applied = []

    async def facts(self, now, jobs):
        from shared.schema.rounds import FactsReply

        return FactsReply(tuple(f for f in self.known if f.job_id in jobs), self.held, self.failed)

    async def models(self, facts):
        from shared.schema.rounds import ModelsReply
        from sim.rounds import job_models

        return ModelsReply(
            tuple(
                job_models(f.job_id, f.application, self.cluster, max_gpus_seen=f.max_gpus_seen)
                for f in facts
                if f.job_id not in self.unmodelled
            ),
            {job: "the estimator has no profile of it yet" for job in self.unmodelled},
        )

    async def place(self, round, allocations, previous, groups, nodes=None):
        from services.placer.core import place
        from shared.schema.rounds import PlacementResult

        assert nodes is None  # a fixed cluster: the placer's own
        placed = place(self.cluster, {j: c for j, c in allocations.items() if j not in self.evict}, previous, groups)
        return PlacementResult(placed.placements, placed.restarts, tuple(self.evict))

    async def apply(self, request):
        self.applied.append(request)

    async def advance(self, now, step, jobs):
        from shared.schema.rounds import AdvanceReply

        return AdvanceReply(tuple(jobs))


class _FixedPolicy:
    """Allocates what it is told (a missing job gets nothing), or fails to solve."""

    name, round_s, adaptive_batch, honours_teams = "fixed", 60.0, True, False

    def __init__(self, allocations, error: Exception | None = None):
        self.allocations, self.error = allocations, error

    def allocate(self, state):
        from policies.base import Decision

        if self.error is not None:
            raise self.error
        return Decision({v.job_id: self.allocations[v.job_id] for v in state.jobs if v.job_id in self.allocations})


def _run_one_round(provider, cluster, policy, wiring, jobs):
    from services.policy.rounds import Arrival, RoundLoop
    from shared.settings import SimSettings

    loop = RoundLoop(
        [Arrival(job, 0.0) for job in jobs], cluster, policy, SimSettings("test"), wiring, tracer_provider=provider
    )
    asyncio.run(loop.run())
    assert len(wiring.applied) == 1


def _decision_spans(exporter):
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "round"]
    decisions = {s.attributes["job.id"]: s for s in spans if s.name == "job.decision"}
    assert len(decisions) == sum(1 for s in spans if s.name == "job.decision")  # one span per job
    for span in decisions.values():
        assert_child_of(span, root)
    return root, decisions


def test_a_decided_round_has_one_decision_span_per_job_with_its_placement_reason_and_submission_link(traced):
    from shared.cluster import build_cluster
    from shared.schema.base import Config

    provider, exporter = traced
    cluster = build_cluster("two-t4-nodes", [{"gpu_type": "aws", "count": 2, "gpus_per_node": 4}])
    facts = [
        _facts("grown", "cifar10", cluster, placement=(("aws-1", 1),), trace=SUBMISSION),
        _facts("starved", "bert", cluster),
        _facts("new", "ncf", cluster),
        _facts("unprofiled", "cifar10", cluster),
        _facts("homeless", "cifar10", cluster),
    ]
    wiring = _OneRoundWiring(
        cluster,
        facts,
        held={"queued": "not profiled yet"},
        failed={"bad": "rejected: no such model"},
        unmodelled=("unprofiled",),
        evict=("homeless",),
    )
    policy = _FixedPolicy({"grown": Config("aws", 1, 2), "new": Config("aws", 1, 4), "homeless": Config("aws", 1, 1)})
    _run_one_round(provider, cluster, policy, wiring, [f.job_id for f in facts] + ["queued", "bad"])

    root, spans = _decision_spans(exporter)
    assert set(spans) == {"grown", "starved", "new", "unprofiled", "homeless", "queued", "bad"}
    assert all(span.attributes["round"] == root.attributes["round"] for span in spans.values())
    placements = wiring.applied[0].placements
    for job in ("grown", "new"):  # what the span says is what the executors were told
        span = spans[job]
        assert span.attributes["decision"] == "allocated" and "reason" not in span.attributes
        assert span.attributes["gpu.type"] == "aws"
        assert span.attributes["gpu.count"] == sum(g for _, g in placements[job])
        assert tuple(span.attributes["nodes"]) == tuple(sorted({n for n, _ in placements[job]}))
        assert span.attributes["job.application"] == {"grown": "cifar10", "new": "ncf"}[job]
    assert spans["grown"].attributes["gpu.count"] == 2 and spans["new"].attributes["gpu.count"] == 4
    assert spans["grown"].attributes["previous.gpu.count"] == 1
    assert spans["grown"].attributes["restart"] is True and spans["new"].attributes["restart"] is False
    assert spans["new"].attributes["placement.changed"] is True  # it starts: a change, not a restart

    why = {job: (span.attributes["decision"], span.attributes.get("reason")) for job, span in spans.items()}
    assert why["starved"] == ("unallocated", "no GPUs allocated by fixed")
    assert why["unprofiled"] == ("waits", "the estimator has no profile of it yet")
    assert why["queued"] == ("waits", "not profiled yet")
    assert why["bad"] == ("failed", "rejected: no such model")
    assert why["homeless"][0] == "evicted" and "1 aws GPUs by fixed" in why["homeless"][1]
    for job in ("starved", "unprofiled", "queued", "bad", "homeless"):
        assert spans[job].attributes["gpu.count"] == 0 and "gpu.type" not in spans[job].attributes

    (link,) = spans["grown"].links  # the job's submission, another trace
    assert (link.context.trace_id, link.context.span_id) == (SUBMISSION_TRACE_ID, SUBMISSION_SPAN_ID)
    assert all(not spans[job].links for job in spans if job != "grown")

    (solve,) = [s for s in exporter.get_finished_spans() if s.name == "policy.solve"]
    assert solve.attributes["jobs"] == 4 and solve.attributes["jobs.allocated"] == 3  # "homeless" too
    assert solve.attributes["gpus.allocated"] == 7 and solve.attributes["allocation.kept"] is False
    assert root.attributes["jobs.allocated"] == 2 and root.attributes["gpus.allocated"] == 6
    assert (root.attributes["jobs.held"], root.attributes["jobs.failed"], root.attributes["evictions"]) == (2, 1, 1)


def test_a_failed_solve_tells_each_job_why_it_kept_its_place(traced):
    from shared.cluster import build_cluster

    provider, exporter = traced
    cluster = build_cluster("one-t4-node", [{"gpu_type": "aws", "count": 1, "gpus_per_node": 4}])
    facts = [_facts("running", "cifar10", cluster, placement=(("aws-0", 2),)), _facts("waiting", "bert", cluster)]
    wiring = _OneRoundWiring(cluster, facts)
    _run_one_round(
        provider, cluster, _FixedPolicy({}, error=RuntimeError("solver crashed")), wiring, ["running", "waiting"]
    )

    _, spans = _decision_spans(exporter)
    assert spans["running"].attributes["decision"] == "kept"
    assert spans["running"].attributes["gpu.count"] == 2 and spans["running"].attributes["restart"] is False
    assert spans["waiting"].attributes["decision"] == "unallocated"
    for span in spans.values():
        assert "solver crashed" in span.attributes["reason"] and "previous allocation kept" in span.attributes["reason"]
    (solve,) = [s for s in exporter.get_finished_spans() if s.name == "policy.solve"]
    assert solve.attributes["allocation.kept"] is True and "solver crashed" in solve.attributes["reason"]


def test_a_huge_round_records_the_jobs_left_where_they_were_last(traced, monkeypatch):
    from services.policy import observer
    from shared.cluster import build_cluster
    from shared.schema.base import Config

    monkeypatch.setattr(observer, "MAX_DECISION_SPANS", 1)
    provider, exporter = traced
    cluster = build_cluster("one-t4-node", [{"gpu_type": "aws", "count": 1, "gpus_per_node": 4}])
    facts = [_facts("running", "cifar10", cluster, placement=(("aws-0", 2),)), _facts("waiting", "bert", cluster)]
    _run_one_round(
        provider,
        cluster,
        _FixedPolicy({"running": Config("aws", 1, 2)}),
        _OneRoundWiring(cluster, facts),
        ["running", "waiting"],
    )

    root, spans = _decision_spans(exporter)
    assert list(spans) == ["waiting"] and root.attributes["job.decisions.omitted"] == 1


def test_sia_decisions_carry_its_predicted_goodput_batch_and_restart_factor(traced):
    from policies.sia import SiaPolicy
    from shared.cluster import build_cluster

    provider, exporter = traced
    # One T4: sia gives it to one of the two new jobs; the other gets nothing, and the span says so.
    cluster = build_cluster("one-t4", [{"gpu_type": "aws", "count": 1, "gpus_per_node": 1}])
    facts = [_facts("c", "cifar10", cluster), _facts("n", "ncf", cluster)]
    wiring = _OneRoundWiring(cluster, facts)
    _run_one_round(provider, cluster, SiaPolicy(), wiring, ["c", "n"])

    _, spans = _decision_spans(exporter)
    (winner,) = wiring.applied[0].placements
    loser = ({"c", "n"} - {winner}).pop()
    won = spans[winner].attributes
    assert (won["gpu.type"], won["gpu.count"], tuple(won["nodes"])) == ("aws", 1, ("aws-0",))
    assert won["goodput.predicted"] > 0 and won["goodput.normalized"] > 0
    assert won["batch"] == won["batch.per_gpu"] * (won["batch.accumulation_steps"] + 1)  # one GPU
    models = {f.job_id: f for f in facts}[winner]
    assert models.init_batch <= won["batch"] <= models.max_batch
    assert won["restart_factor"] == 1.0  # a waiting job starts wherever it goes
    lost = spans[loser].attributes
    assert lost["reason"] == "no GPUs allocated by sia" and "goodput.predicted" not in lost and "batch" not in lost


def test_pollux_exposes_its_predicted_speedup_per_allocated_job():
    from policies.pollux import PolluxPolicy
    from sim.rounds import job_view, round_state

    state = round_state([job_view("c", "cifar10", _homo()), job_view("b", "bert", _homo())], _homo())
    decision = PolluxPolicy(population=10, generations=5).allocate(state)
    assert decision.allocations  # it gives something to someone
    for job, prediction in decision.predictions.items():
        assert prediction.restart_factor is not None
        assert (prediction.speedup is not None and prediction.speedup > 0) == (job in decision.allocations)


def _homo():
    from shared.cluster import load_cluster

    return load_cluster("pollux-homo-64")


def test_placer_span_attributes_count_placed_jobs_and_evictions():
    from services.placer.service import placement_attributes
    from shared.schema.rounds import PlacementResult, PlaceRequest

    request = PlaceRequest(7, {}, {})
    result = PlacementResult({"a": (("aws-0", 2),), "b": (("aws-1", 4), ("aws-2", 4))}, ("a",), ("c",))
    attributes = placement_attributes(request, result)
    assert (attributes["decision.number"], attributes["jobs.placed"], attributes["gpus.placed"]) == (7, 2, 10)
    assert (attributes["restarts"], attributes["evictions"], attributes["evicted.job.ids"]) == (1, 1, ["c"])


class _MemoryKV:
    """The few TypedKV calls the estimator makes, in a dict."""

    def __init__(self):
        self.values, self.revision = {}, 0

    async def get(self, key):
        from types import SimpleNamespace

        return (
            None if key not in self.values else SimpleNamespace(value=self.values[key][0], revision=self.values[key][1])
        )

    async def create(self, key, value):
        self.revision += 1
        self.values[key] = (value, self.revision)
        return self.revision

    async def update(self, key, value, revision):
        return await self.create(key, value)


async def test_estimator_spans_name_the_job(traced):
    from goodput_train.goodput import Observation
    from goodput_train.protocol import ProfilePoint
    from services.estimator.core import Estimator
    from services.estimator.service import SharedEstimates
    from shared.cluster import load_cluster
    from shared.schema.estimates import JobProfiles, Observed, ObservedAll, Profile, ProfilesAll
    from shared.schema.rounds import ModelsRequest

    provider, exporter = traced
    tracer = provider.get_tracer("test")
    estimates = SharedEstimates(Estimator(), _MemoryKV())
    profile = Profile("e-1", "cifar10", "aws", (ProfilePoint(16, 0.05), ProfilePoint(64, 0.12)), 16, 64)
    with tracer.start_as_current_span("estimator.profiles"):
        await estimates.add_all(ProfilesAll((JobProfiles("e-1", (profile,)),)))
    with tracer.start_as_current_span("estimator.observe"):
        seen = Observation(1, 2, 64, 0, 0.15)
        stored = await estimates.observe(ObservedAll((Observed("e-1", "aws", seen), Observed("e-9", "aws", seen))))
    cluster = load_cluster("sia-hetero-64")
    facts = [_facts("e-1", "cifar10", cluster), _facts("e-2", "bert", cluster)]
    with tracer.start_as_current_span("estimator.goodput"):
        reply = await estimates.models(ModelsRequest(tuple(facts)))
    assert [m.job_id for m in reply.models] == ["e-1"] and set(reply.held) == {"e-2"}

    spans = {s.name: s.attributes for s in exporter.get_finished_spans()}
    profiles, observed = spans["estimator.profiles"], spans["estimator.observe"]
    assert (profiles["jobs"], tuple(profiles["job.ids"]), profiles["job.ids.truncated"]) == (1, ("e-1",), False)
    assert stored.revisions[0] > 0 and stored.revisions[1] == 0 and "no profile" in stored.refused["e-9"]
    assert (observed["observations"], observed["learned"], tuple(observed["job.ids"])) == (2, 1, ("e-1", "e-9"))
    goodput = spans["estimator.goodput"]
    assert tuple(goodput["job.ids"]) == ("e-1", "e-2") and tuple(goodput["held.job.ids"]) == ("e-2",)
    assert (goodput["jobs"], goodput["jobs.modelled"], goodput["jobs.held"]) == (2, 1, 1)


async def test_a_profiling_run_is_a_span_with_its_outcome(traced, tmp_path, connect_bus, name_prefix):
    """Real profiling runs, through a node agent served in this process: one refused (no such job),
    one measured, and one of a job cancelled before its turn, which never reaches the agent."""
    import argparse

    from services.node import agent as node
    from services.profiler import measure
    from shared import storage, subjects
    from shared.schema.nodes import NodeInfo

    provider, exporter = traced
    bus = await connect_bus("profiler", tracer_provider=provider)
    await storage.provision(bus)
    gpu_type = f"{name_prefix}-gpu"  # a type only this test's node has (the server is shared)
    parser = argparse.ArgumentParser()
    node.add_arguments(parser)  # the agent's options, at their defaults
    options = parser.parse_args(
        [
            "--node",
            f"{name_prefix}-n",
            "--gpus",
            "1",
            "--gpu-type",
            gpu_type,
            "--workdir",
            str(tmp_path),
            "--jobs-package",
            "tests.jobs",
        ]
    )
    agent = await node.start(bus, options)
    await agent.start()
    members = await storage.open_kv(bus, subjects.NODES_BUCKET, NodeInfo)
    with provider.get_tracer("test").start_as_current_span("profiler.consume"):
        with pytest.raises(measure.ProfilingFailed):
            await measure.profiling_run(bus, members, "p-1", "no_such_job", gpu_type, tracer_provider=provider, user=1)
        run = await measure.profiling_run(bus, members, "p-2", "quick", gpu_type, tracer_provider=provider, user=2)
        with pytest.raises(measure.ProfilingCancelled):
            await measure.profiling_run(
                bus, members, "p-3", "quick", gpu_type, cancelled=lambda: True, tracer_provider=provider, user=3
            )
    assert run.points and run.init_batch > 0
    await agent.stop()

    spans = exporter.get_finished_spans()
    failed, measured, cancelled = [s for s in spans if s.name == "profiler.run"]
    assert (cancelled.attributes["job.id"], cancelled.attributes["outcome"]) == ("p-3", "cancelled")
    assert_child_of(failed, next(s for s in spans if s.name == "profiler.consume"))
    assert (failed.attributes["job.id"], failed.attributes["gpu.type"], failed.attributes["outcome"]) == (
        "p-1",
        gpu_type,
        "failed",
    )
    assert "no job 'no_such_job'" in failed.attributes["reason"] and not failed.status.is_ok
    assert (measured.attributes["job.id"], measured.attributes["job.application"]) == ("p-2", "quick")
    assert tuple(measured.attributes["batch_sizes"]) == tuple(p.local_bsz for p in run.points)
    assert measured.attributes["outcome"] == "measured" and measured.attributes["node"] == f"{name_prefix}-n"
    # The agent's side of each run is a span of its own, under the profiler's.
    served = [s for s in spans if s.name == "node.profile"]
    assert len(served) == 2 and {s.parent.span_id for s in served} == {failed.context.span_id, measured.context.span_id}
