"""OpenTelemetry setup for every goodput process, and W3C trace context for message headers.

One trace per scheduling round crosses five processes, so each process names itself (the
`service.name` resource) and carries the round's trace context in NATS message headers as a W3C
`traceparent`. Export goes over OTLP/HTTP (Jaeger, Tempo and the OpenTelemetry Collector accept it)
only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; otherwise
spans are not recorded (`WhileExported`), but each still has its trace context, so parent links
and the ids in headers and logs work.

The process-wide tracer provider is the only global state here: `setup_tracing` installs it once.
Tests that want their own spans build a private provider with `build_tracer_provider` and hand it
to whatever they test (the bus takes a `tracer_provider`), so tests never fight over the global.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, MutableMapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# Either variable turns OTLP export on; the traces-only one wins, as the OTLP exporter reads it so.
OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

# W3C trace context only: the contract says `traceparent` travels in headers, whatever a process's
# OTEL_PROPAGATORS would pick for other transports.
_W3C = TraceContextTextMapPropagator()


def otlp_exporter_from_env(environ: Mapping[str, str] | None = None) -> SpanExporter | None:
    """The OTLP/HTTP span exporter the environment asks for, or None when no endpoint is set.

    The exporter itself reads the endpoint, headers and timeout from the same variables, so we
    only decide whether to export at all; its package is imported only when it is needed.
    """
    environ = os.environ if environ is None else environ
    if not any(environ.get(name) for name in OTLP_ENDPOINT_VARIABLES):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


class WhileExported(Sampler):
    """Spans are recorded while something exports them (`exporting`); until then each still gets
    its trace context (ids, parent, links; the `traceparent` it travels with), and costs nothing
    more: a round of 10,000 jobs builds no attributes nor thousands of `job.decision` spans for
    no one."""

    def __init__(self) -> None:
        self.exporting = False

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        parent = trace.get_current_span(parent_context).get_span_context()
        state = parent.trace_state if parent.is_valid else None
        if self.exporting:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, state)
        return SamplingResult(Decision.DROP, None, state)

    def get_description(self) -> str:
        return "WhileExported"


def build_tracer_provider(
    service_name: str,
    exporter: SpanExporter | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> TracerProvider:
    """A new tracer provider for `service_name`, not installed globally.

    `exporter` (an in-memory exporter in tests) gets a SimpleSpanProcessor, so a span is exported
    the moment it ends and a test can assert on it at once. The environment's OTLP exporter, if
    any, gets a BatchSpanProcessor, so exporting never blocks the event loop of a service.
    """
    sampler = WhileExported()
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}), sampler=sampler)
    if exporter is not None:
        add_exporter(provider, SimpleSpanProcessor(exporter))
    otlp = otlp_exporter_from_env(environ)
    if otlp is not None:
        add_exporter(provider, BatchSpanProcessor(otlp))
    return provider


def add_exporter(provider: TracerProvider, processor) -> None:
    """Export the provider's spans through `processor`: from now on they are recorded."""
    provider.add_span_processor(processor)
    if isinstance(provider.sampler, WhileExported):
        provider.sampler.exporting = True


_process_provider: TracerProvider | None = None


def setup_tracing(service_name: str, exporter: SpanExporter | None = None) -> TracerProvider:
    """Install this process's tracer provider once and return it; later calls return the same one.

    A process is one service, so the first name wins. An `exporter` given on a later call is added
    to the installed provider (a SimpleSpanProcessor), so a test can observe a process's spans.
    """
    global _process_provider
    if _process_provider is None:
        _process_provider = build_tracer_provider(service_name, exporter)
        trace.set_tracer_provider(_process_provider)
    elif exporter is not None:
        add_exporter(_process_provider, SimpleSpanProcessor(exporter))
    return _process_provider


def inject_trace_context(
    headers: MutableMapping[str, str] | None = None,
    context: otel_context.Context | None = None,
) -> MutableMapping[str, str]:
    """Write the current (or given) span's `traceparent`/`tracestate` into `headers` and return it.

    With no recording span in the context nothing is written, so headers stay empty.
    """
    headers = {} if headers is None else headers
    _W3C.inject(headers, context=context)
    return headers


def span_context_of(traceparent: str | None) -> trace.SpanContext | None:
    """The span context a W3C `traceparent` names (e.g. a job's submission, for a span's Link), or
    None when it is empty or not a valid traceparent."""
    return _span_context_of(traceparent) if traceparent else None


@functools.lru_cache(maxsize=16384)  # a job's submission is the same every round: parse it once
def _span_context_of(traceparent: str) -> trace.SpanContext | None:
    context = trace.get_current_span(_W3C.extract({"traceparent": traceparent}, context=otel_context.Context()))
    span_context = context.get_span_context()
    return span_context if span_context.is_valid else None


def extract_trace_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The context a receiver's span should be parented on: the producer's span, if the headers
    carry one; an empty context (so the receiver starts a new trace) otherwise."""
    return _W3C.extract(headers or {}, context=otel_context.Context())
