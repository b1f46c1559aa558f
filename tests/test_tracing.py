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
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from shared.tracing import (
    build_tracer_provider,
    extract_trace_context,
    inject_trace_context,
    otlp_exporter_from_env,
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
