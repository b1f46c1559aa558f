"""What every message a bus receives shares: the span it is handled in (its attributes, and how an
invalid or failed one is marked on it), the default `on_invalid`, and callbacks that may be async."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

log = logging.getLogger(__package__)  # "shared.bus" in every file: one logger to configure

# What a subscriber learns about a payload it cannot decode; may return a reply (e.g. Rejected).
InvalidHandler = Callable[[str, bytes, Exception], Any]

TRACEPARENT = "traceparent"  # the W3C trace context header (shared.tracing writes it)
_TRACER_NAME = "goodput.bus"


async def _settle(result: Any) -> Any:
    """Await `result` if a callback was async; lets handlers be plain functions or coroutines."""
    if inspect.isawaitable(result):
        return await result
    return result


def _report_invalid(subject: str, data: bytes, error: Exception) -> None:
    """Default `on_invalid`: say which subject sent what kind of garbage, then move on."""
    log.warning("invalid message on %s (%d bytes): %s", subject, len(data), error)


def _receive_attributes(raw: Msg) -> dict[str, Any]:
    return {
        "messaging.system": "nats",
        "messaging.destination.name": raw.subject,
        "messaging.message.body.size": len(raw.data),
    }


def _mark_invalid(span: trace.Span, error: Exception) -> None:
    span.set_attribute("goodput.invalid_reason", str(error))
    span.set_status(Status(StatusCode.ERROR, f"invalid message: {error}"))


def _mark_failed(span: trace.Span, error: Exception) -> None:
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, str(error)))
