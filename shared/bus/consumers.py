"""A durable pull consumer's messages: `Delivery` (one decoded message, its span, and ack, nak or term)
and `PullConsumer` (fetching, the consume loop, redelivery after growing delays, dead letters)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from shared.bus.encoding import T, explained
from shared.bus.spans import TRACEPARENT, InvalidHandler, _mark_failed, _mark_invalid, _receive_attributes, _settle
from shared.tracing import extract_trace_context

if TYPE_CHECKING:
    from shared.bus import Bus

log = logging.getLogger(__package__)  # "shared.bus" in every file: one logger to configure

# Durable consumers: deliveries of one message before it is dead-lettered, and the redelivery delays.
MAX_DELIVER = 5
REDELIVER_AFTER_S = 1.0  # doubled at each redelivery, up to REDELIVER_MAX_S
REDELIVER_MAX_S = 30.0
FETCH_RETRY_MAX_S = 10.0  # a failing fetch is tried again after 0.5 s, doubling up to this
DRAIN_TIMEOUT_S = 0.05  # after a fetch's first message, how long the others may take
DEAD_REASON_HEADER = "Goodput-Dead-Reason"
DEAD_SUBJECT_HEADER = "Goodput-Dead-Subject"


class Delivery(Generic[T]):
    """One decoded JetStream message and the means to settle it."""

    def __init__(self, message: T, raw: Msg, tracer: trace.Tracer, span_name: str) -> None:
        self.message = message
        self.raw = raw
        self._tracer = tracer
        self._span_name = span_name
        self.settled = False

    @property
    def subject(self) -> str:
        return self.raw.subject

    @property
    def num_delivered(self) -> int:
        """1 on first delivery; more when it was redelivered (not acked in time, or nakked)."""
        return self.raw.metadata.num_delivered

    @property
    def stream_sequence(self) -> int:
        return self.raw.metadata.sequence.stream

    @property
    def traceparent(self) -> str:
        """The producer's W3C trace context ("" when it sent none)."""
        return (self.raw.headers or {}).get(TRACEPARENT, "")

    @contextlib.contextmanager
    def span(self, name: str | None = None) -> Iterator[trace.Span]:
        """Make the processing of this message a span whose parent is the producer's span."""
        with self._tracer.start_as_current_span(
            name or self._span_name,
            context=extract_trace_context(self.raw.headers),
            kind=SpanKind.CONSUMER,
            attributes=_receive_attributes(self.raw),
        ) as span:
            yield span

    async def ack(self) -> None:
        await self.raw.ack()
        self.settled = True

    async def nak(self, delay: float | None = None) -> None:
        """Ask for redelivery now (or after `delay` seconds)."""
        await self.raw.nak(delay)
        self.settled = True

    async def term(self) -> None:
        """Never redeliver this message."""
        await self.raw.term()
        self.settled = True

    async def in_progress(self) -> None:
        """Still working: restart the ack_wait timer."""
        await self.raw.in_progress()


class Window:
    """How many of a concurrent consumer's messages are in hand, of at most `size`."""

    def __init__(self, size: int) -> None:
        self.size, self.in_hand = size, 0
        self._freed = asyncio.Event()

    def done(self) -> None:
        self.in_hand -= 1
        self._freed.set()

    async def half_free(self) -> None:
        """Return once at most half of the window is in hand."""
        while self.in_hand > self.size // 2:
            self._freed.clear()
            await self._freed.wait()


class PullConsumer(Generic[T]):
    """A bound durable pull consumer that decodes as it fetches."""

    def __init__(
        self,
        *,
        bus: Bus,
        subscription: JetStreamContext.PullSubscription,
        msg_type: type[T],
        span_name: str,
        on_invalid: InvalidHandler,
        max_deliver: int = MAX_DELIVER,
        ack_wait_s: float = 30.0,
        dead_letters: str | None = None,
    ) -> None:
        self._bus = bus
        self.ack_wait_s = ack_wait_s
        self._subscription = subscription
        self._msg_type = msg_type
        self._span_name = span_name
        self._on_invalid = on_invalid
        self.max_deliver = max_deliver
        self._dead_letters = dead_letters
        self._stopped = False
        self._busy = False  # the last fetch brought messages

    async def fetch(self, batch: int = 10, timeout: float = 1.0) -> list[Delivery[T]]:
        """Up to `batch` messages, waiting at most `timeout` seconds for the first; [] when none came.
        Messages that do not decode go to `on_invalid` and are terminated, not returned."""
        # nats-py's fetch of n takes what is there at once, but when nothing is, it waits until n
        # came or the time is up. The last fetch brought some: take what is there (one request);
        # else, or when nothing was, wait for one, then take what else is there at once.
        raws = []
        if batch > 1 and self._busy:
            with contextlib.suppress(asyncio.TimeoutError):
                raws = await self._subscription.fetch(batch, DRAIN_TIMEOUT_S)
        if not raws:
            try:
                raws = await self._subscription.fetch(1, timeout)
            except asyncio.TimeoutError:  # nats.errors.TimeoutError is one
                self._busy = False
                return []
            if batch > 1:
                with contextlib.suppress(asyncio.TimeoutError):
                    raws += await self._subscription.fetch(batch - 1, DRAIN_TIMEOUT_S)
        self._busy = True
        deliveries = []
        for raw in raws:
            try:
                message = self._bus.decode(raw.data, self._msg_type)
            except msgspec.DecodeError as error:
                await self._reject(raw, explained(error, raw.data))
                continue
            deliveries.append(Delivery(message, raw, self._bus._tracer, self._span_name))
        return deliveries

    async def consume(
        self,
        handler: Callable[..., Any],
        *,
        batch: int = 10,
        timeout: float = 5.0,
        with_delivery: bool = False,
        on_dead: Callable[[Delivery[T], Exception], Any] | None = None,
        concurrent: bool = False,
        after_batch: Callable[[], Any] | None = None,
    ) -> None:
        """Run `handler(message)` (or `handler(message, delivery)`) for every message until
        cancelled, each inside its span: ack when it returns (unless it settled the delivery
        itself), nak when it raises, so the message comes back to this or another replica after a
        delay that doubles each time. On its last delivery a message whose handler raises is
        dead-lettered: `on_dead(delivery, error)` (e.g. the job's rejection), stored on the dead
        letters subject, and terminated. A fetch that fails is tried again; nothing ends the loop
        but cancellation. `timeout` is how long one fetch waits for a message (it returns at once
        when one comes): an idle consumer asks once per `timeout`. `concurrent`: up to `batch`
        messages are handled at once (a handler that waits on the bus most of its time), more
        fetched as soon as half of them are done; else those of a fetch one after another, in the
        stream's order. `after_batch()`: run once the handlers of a
        fetched batch returned, and only then are the batch's messages acknowledged (e.g. the state
        they changed saved at once: nothing is acknowledged that a crash could lose); when it raises,
        they come back after a delay, as a failed handler's would."""
        retry_s = 0.5
        # Concurrent: a window of `batch` messages in hand, more fetched as soon as half of them are
        # done (not once the slowest of a fetch is); each fetch's messages handled in a task.
        window = Window(batch) if concurrent and after_batch is None else None
        groups: set[asyncio.Future] = set()
        try:
            while True:
                if window is not None:
                    await window.half_free()
                try:
                    deliveries = await self.fetch(batch - (window.in_hand if window else 0), timeout)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # noqa: BLE001 - NATS away, the consumer gone: try again, say so
                    if self._stopped or self._bus.nc.is_closed or self._bus.nc.is_draining:
                        return  # stopped on purpose: nothing to say
                    log.warning(
                        "fetching from %s failed (%s: %s); trying again in %.1f s",
                        self._span_name,
                        type(error).__name__,
                        error,
                        retry_s,
                    )
                    await asyncio.sleep(retry_s)
                    retry_s = min(2 * retry_s, FETCH_RETRY_MAX_S)
                    continue
                retry_s = 0.5
                group = self._handle_group(deliveries, handler, with_delivery, on_dead, concurrent, after_batch, window)
                if window is None:
                    await group
                else:
                    window.in_hand += len(deliveries)
                    task = asyncio.ensure_future(group)
                    groups.add(task)
                    task.add_done_callback(groups.discard)
        finally:
            for task in list(groups):
                task.cancel()

    async def _handle_group(
        self,
        deliveries: list[Delivery[T]],
        handler: Callable[..., Any],
        with_delivery: bool,
        on_dead: Callable[[Delivery[T], Exception], Any] | None,
        concurrent: bool,
        after_batch: Callable[[], Any] | None,
        window: Window | None = None,
    ) -> None:
        """The messages of one fetch, handled at once (`concurrent`) or in order, kept in hand with the
        server meanwhile; acked each as it is handled, or all once `after_batch()` returned. Each
        handled frees its place in `window`."""
        ack = after_batch is None

        async def handle(delivery: Delivery[T]) -> bool:
            try:
                return await self._handle(delivery, handler, with_delivery, on_dead, ack)
            finally:
                if window is not None:
                    window.done()

        working = asyncio.ensure_future(self._working(deliveries))
        try:
            if concurrent:
                handled = await asyncio.gather(*(handle(d) for d in deliveries))
            else:
                handled = [await handle(d) for d in deliveries]
            if not ack and any(handled):
                await self._settle_batch([d for d, done in zip(deliveries, handled) if done], after_batch)
        finally:
            working.cancel()

    async def _settle_batch(self, handled: list[Delivery[T]], after_batch: Callable[[], Any]) -> None:
        """The deliveries whose handlers returned, acknowledged once `after_batch()` returned; if it
        raises, each is asked again after a delay (its last delivery: dead-lettered), as when its
        own handler raised."""
        try:
            await _settle(after_batch())
        except Exception as error:  # noqa: BLE001 - redeliver, keep consuming
            for delivery in handled:
                await self._failed(delivery, error, None)
            return
        for delivery in handled:
            if not delivery.settled:
                with contextlib.suppress(nats.errors.Error):  # unacked: it comes back
                    await delivery.ack()

    async def _handle(
        self,
        delivery: Delivery[T],
        handler: Callable[..., Any],
        with_delivery: bool,
        on_dead: Callable[[Delivery[T], Exception], Any] | None,
        ack: bool = True,
    ) -> bool:
        """One delivery, in its span: handled, then acked (unless not `ack`); or failed (`_failed`).
        Whether its handler returned."""
        with delivery.span() as span:
            try:
                args = (delivery.message, delivery) if with_delivery else (delivery.message,)
                await _settle(handler(*args))
            except Exception as error:  # noqa: BLE001 - redeliver, keep consuming
                _mark_failed(span, error)
                if not delivery.settled:
                    await self._failed(delivery, error, on_dead)
                return False
            if ack and not delivery.settled:
                with contextlib.suppress(nats.errors.Error):  # unacked: it comes back
                    await delivery.ack()
            return True

    async def _working(self, deliveries: list[Delivery[T]]) -> None:
        """While a fetched batch is in hand (a job profiled on real slots takes minutes; a message
        may wait behind the ones before it), tell the server each unsettled message is in hand, so it
        is not redelivered to another replica meanwhile."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for delivery in deliveries:
                if not delivery.settled:
                    with contextlib.suppress(nats.errors.Error):
                        await delivery.in_progress()

    async def _failed(
        self, delivery: Delivery[T], error: Exception, on_dead: Callable[[Delivery[T], Exception], Any] | None
    ) -> None:
        """A delivery whose handler raised: redelivered later, or on its last delivery dead-lettered."""
        attempt = delivery.num_delivered
        reason = f"{type(error).__name__}: {error}"
        if attempt < self.max_deliver:
            delay = min(REDELIVER_AFTER_S * 2 ** (attempt - 1), REDELIVER_MAX_S)
            log.warning(
                "handler for %s failed (delivery %d of %d: %s); redelivered in %.0f s",
                delivery.subject,
                attempt,
                self.max_deliver,
                reason,
                delay,
            )
            with contextlib.suppress(nats.errors.Error):
                await delivery.nak(delay)
            return
        log.error(
            "handler for %s failed on the last of %d deliveries (%s); dead-lettered", delivery.subject, attempt, reason
        )
        try:
            if on_dead is not None:
                await _settle(on_dead(delivery, error))
        except Exception as failed:  # noqa: BLE001 - it is dead-lettered all the same
            log.warning("the dead-letter handler of %s failed: %s", delivery.subject, failed)
        try:
            if self._dead_letters is not None:
                await self._bus.js.publish(
                    self._dead_letters,
                    delivery.raw.data,
                    headers={DEAD_REASON_HEADER: reason[:1000], DEAD_SUBJECT_HEADER: delivery.subject},
                )
        except Exception as failed:  # noqa: BLE001 - the message is dropped all the same: it cannot be processed
            log.warning("storing a dead letter of %s failed: %s", delivery.subject, failed)
        with contextlib.suppress(nats.errors.Error):
            await delivery.term()

    async def unsubscribe(self) -> None:
        """Stop fetching; the durable consumer stays on the server for the next replica."""
        self._stopped = True
        self._bus._pull_consumers.discard(self)
        await self._subscription.unsubscribe()

    async def _reject(self, raw: Msg, error: msgspec.DecodeError) -> None:
        with self._bus._tracer.start_as_current_span(
            self._span_name,
            context=extract_trace_context(raw.headers),
            kind=SpanKind.CONSUMER,
            attributes=_receive_attributes(raw),
        ) as span:
            _mark_invalid(span, error)
            try:
                await _settle(self._on_invalid(raw.subject, raw.data, error))
            finally:
                await raw.term()
