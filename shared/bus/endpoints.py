"""Typed handlers of received messages, each run in a span parented on the producer's: a `nats.micro`
endpoint's requests (held to each requester's limits, refused with a reason, answered in JSON to a
JSON client) and a plain subscription's messages."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats import micro
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import INVALID_SPAN, SpanKind
from opentelemetry.trace import get_current_span as trace_of

from shared.bus.encoding import NotFound, Refused, T, answers_in_json, explained
from shared.bus.requesters import (
    TOO_MANY,
    Requester,
    RequesterLimits,
    _Admission,
    _current_requester,
    is_inbox,
    requester_of,
)
from shared.bus.spans import InvalidHandler, _mark_failed, _mark_invalid, _receive_attributes, _settle
from shared.metrics import BUS_DURATION, BUS_REQUESTS, instrument
from shared.tracing import extract_trace_context

log = logging.getLogger(__package__)  # "shared.bus" in every file: one logger to configure

# A refusal's service error code, as `goodput_bus_requests_total`'s outcome says it.
_OUTCOMES = {"404": "not_found", TOO_MANY: "throttled", "500": "error"}


@dataclass
class _Outcome:
    """How one received message was handled."""

    answer: Any  # the reply, or on_invalid's answer to an undecodable message
    refusal: str | None  # why it was refused (undecodable, or the handler's ValueError)
    headers: dict[str, str] | None  # reply headers carrying the handling span's context
    code: str = "400"  # the refusal's service error code (404: what it asks for is not there)


class Endpoints:
    """A bus's handlers: `add_endpoint` and `subscribe`, and the decoding and handling they share."""

    async def _handle(
        self,
        subject: str,
        headers: dict[str, str] | None,
        data: bytes,
        msg_type: type[T],
        handler: Callable[[T], Any],
        name: str,
        kind: SpanKind,
        attributes: dict[str, Any],
        report_invalid: InvalidHandler,
        new_traces: bool = True,
    ) -> _Outcome | None:
        """Decode and handle one message inside a span parented on the producer's; None when the
        handler failed (recorded on the span and logged: one bad message must not stop the rest).
        `new_traces=False`: a message that carries no trace context is handled without a span."""
        context = extract_trace_context(headers)
        untraced = not new_traces and not trace_of(context).get_span_context().is_valid
        with (
            contextlib.nullcontext(INVALID_SPAN)
            if untraced
            else self._tracer.start_as_current_span(
                name,
                context=context,
                kind=kind,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            )
        ) as span:
            try:
                message = self.decode(data, msg_type)
            except msgspec.DecodeError as decode_error:
                error = explained(decode_error, data)
                _mark_invalid(span, error)
                try:
                    answer = await _settle(report_invalid(subject, data, error))
                except Refused as refused:
                    return _Outcome(refused.answer, str(refused), self._trace_headers(), refused.code)
                return _Outcome(answer, f"invalid {msg_type.__name__}: {error}", self._trace_headers())
            try:
                answer = await _settle(handler(message))
            except Refused as error:  # refused, with an answer that says why
                _mark_invalid(span, error)
                return _Outcome(error.answer, str(error), self._trace_headers(), error.code)
            except ValueError as error:  # well formed, but it cannot be served: say why
                _mark_invalid(span, error)
                return _Outcome(None, str(error), self._trace_headers())
            except NotFound as error:  # what it asks for is not there
                _mark_invalid(span, error)
                return _Outcome(None, error.args[0] if error.args else str(error), self._trace_headers(), "404")
            except Exception as error:
                _mark_failed(span, error)
                log.exception("handler for %s failed", subject)
                return None
            return _Outcome(answer, None, self._trace_headers())

    async def add_endpoint(
        self,
        service: micro.Service,
        name: str,
        subject: str,
        msg_type: type[T],
        handler: Callable[[T], Any],
        *,
        queue: str | None = None,
        span_name: str | None = None,
        on_invalid: InvalidHandler | None = None,
        parts: bool = True,
        metadata: dict[str, str] | None = None,
        concurrency: int = 1,
        limits: RequesterLimits = RequesterLimits(),
        new_traces: bool = True,
    ) -> None:
        """A typed request endpoint of a NATS service (`nats.micro`: it shows in $SRV.INFO and
        $SRV.STATS): `handler(request)` returns the reply. A request that does not decode is
        answered as a service error 400 with `on_invalid`'s answer (e.g. a Rejected) as its data,
        one the handler refuses with ValueError as error 400 with that reason (a `Refused`, from the
        handler or `on_invalid`: its code, and its answer as the body), and a handler that
        fails otherwise as error 500; `Bus.request` raises them as micro's ServiceError. A handler's
        NotFound is error 404. A JSON request refused without an answer gets `{"error", "code"}`
        as its body too, for clients that do not read headers. Replicas share `queue` (default: the
        service's own queue group). `parts=False`: the requests are small (a status), and one in
        parts is refused at once. `metadata`: the endpoint's, in $SRV.INFO. `concurrency`: how many
        requests are served at once (1: one after another, in the order they came; more, for a
        handler that mostly waits on other services: each in a task, the next one waiting while
        that many are in hand). `limits`: what each requester the server names (`requester()`) may
        ask of this replica; beyond them a request is answered error 429 with why, undecoded.
        `new_traces=False`: a request outside any trace is served without a span (a periodic call,
        such as the executor's look at the workers every half second, would flood the traces);
        one made within a trace (a round's) is traced as any other."""
        span = span_name or f"{subject} receive"
        report_invalid = on_invalid or self._on_invalid
        gate = asyncio.Semaphore(concurrency) if concurrency > 1 else None
        admission = _Admission(limits)

        async def on_request(request: micro.Request) -> None:
            reply = request._msg.reply
            if not reply:
                return
            who = requester_of(request.headers)
            if who is not None and is_inbox(reply):
                refusal = admission.refusal(who)
                if refusal is not None:
                    instrument(BUS_REQUESTS).add(1, {"endpoint": name, "outcome": _OUTCOMES[TOO_MANY]})
                    # Not decoded (that is what it would cost): a JSON client still reads why in the body.
                    body = self.encode({"error": refusal, "code": int(TOO_MANY)}, json=True)
                    await request.respond_error(TOO_MANY, refusal, body if answers_in_json(request.data) else b"")
                    return
            served = self._receive(
                request.subject,
                request.headers,
                reply,
                parts,
                lambda headers, data: serve(request, reply, headers, data, who),
                request.data,
                lambda reason: request.respond_error("400", reason),
            )
            if served is None or gate is None:
                if served is not None:
                    await served
                if who is not None and is_inbox(reply):
                    admission.done(who)  # answered (or in parts: held to MAX_ASSEMBLIES instead)
                return
            await gate.acquire()
            task = asyncio.ensure_future(served)
            self._background.add(task)

            def finished(done: asyncio.Future) -> None:
                self._background.discard(done)
                gate.release()
                if who is not None:
                    admission.done(who)

            task.add_done_callback(finished)

        async def serve(
            request: micro.Request,
            reply: str,
            request_headers: dict[str, str] | None,
            data: bytes,
            who: Requester | None,
        ) -> None:
            _current_requester.set(who)
            started = time.perf_counter()
            # An empty request is the empty object: every field its default (`nats req SUBJECT ''`).
            outcome = await self._handle(
                request.subject,
                request_headers,
                data or b"{}",
                msg_type,
                handler,
                span,
                SpanKind.SERVER,
                {"messaging.destination.name": request.subject},
                report_invalid,
                new_traces,
            )
            code = "500" if outcome is None else outcome.code if outcome.refusal is not None else ""
            instrument(BUS_DURATION).record(time.perf_counter() - started, {"endpoint": name})
            instrument(BUS_REQUESTS).add(
                1, {"endpoint": name, "outcome": _OUTCOMES.get(code, "refused" if code else "ok")}
            )
            if outcome is None:
                await request.respond_error("500", f"{name} failed on this request")
                return
            answer = outcome.answer
            if answer is None and outcome.refusal is not None and answers_in_json(data):
                answer = {"error": outcome.refusal, "code": int(outcome.code)}
            body = b"" if answer is None else self.encode(answer, json=answers_in_json(data))
            headers = dict(outcome.headers or {})
            if outcome.refusal is not None:  # as micro's respond_error, in parts if need be
                headers.update(
                    {micro.request.ERROR_HEADER: outcome.refusal, micro.request.ERROR_CODE_HEADER: outcome.code}
                )
            await self._respond(reply, body, headers)

        options = {"queue_group": queue} if queue else {}
        await service.add_endpoint(name=name, subject=subject, handler=on_request, metadata=metadata, **options)
        await self.flush()  # when this returns, the server routes requests to the endpoint

    async def subscribe(
        self,
        subject: str,
        msg_type: type[T],
        handler: Callable[..., Any],
        *,
        queue: str | None = None,
        with_raw: bool = False,
        span_name: str | None = None,
        on_invalid: InvalidHandler | None = None,
    ) -> Subscription:
        """Call `handler(message)` (or `handler(message, raw_msg)` with `with_raw`) for each
        message that decodes as `msg_type`, inside a span parented on the producer's. The
        subscription is live on the server when this returns.

        A queue group spreads messages over replicas. If the message is a request and the
        handler returns a value, that value is the reply. A handler that raises is recorded on
        its span and logged; the subscription keeps going.
        """
        name = span_name or f"{subject} receive"
        report_invalid = on_invalid or self._on_invalid

        async def on_message(raw: Msg) -> None:
            # A plain subscription answers nothing it did not handle: a refusal is only logged.
            served = self._receive(
                raw.subject,
                raw.headers,
                raw.reply,
                True,
                lambda headers, data: serve(raw, headers, data),
                raw.data,
                None,
            )
            if served is not None:
                await served

        async def serve(raw: Msg, headers: dict[str, str] | None, data: bytes) -> None:
            kind = SpanKind.SERVER if raw.reply else SpanKind.CONSUMER
            call = (lambda message: handler(message, raw)) if with_raw else handler
            outcome = await self._handle(
                raw.subject, headers, data, msg_type, call, name, kind, _receive_attributes(raw), report_invalid
            )
            if raw.reply and outcome is not None and outcome.answer is not None:
                await self._respond(raw.reply, self.encode(outcome.answer, json=answers_in_json(data)), outcome.headers)

        subscription = await self.nc.subscribe(subject, queue=queue or "", cb=on_message)
        await self.flush()  # when subscribe returns, the server routes to it
        return subscription
