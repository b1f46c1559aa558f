"""JetStream: streams made or brought to a configuration (idempotent), publishes de-duplicated by id,
durable pull consumers created or bound, and every message on a subject read in order (`follow`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from shared.bus.consumers import MAX_DELIVER, Delivery, PullConsumer
from shared.bus.encoding import T
from shared.bus.spans import InvalidHandler

MSG_ID_HEADER = api.Header.MSG_ID.value  # "Nats-Msg-Id": JetStream drops repeats in its window
_STREAM_EXISTS_WITH_OTHER_CONFIG = 10058


class JetStream:
    """A bus's streams and durable consumers."""

    async def ensure_stream(self, name: str, subjects: Iterable[str], **config: Any) -> api.StreamInfo:
        """Create the stream, or bring an existing one to this configuration (idempotent, so
        every replica can call it at start). `config` is nats-py's StreamConfig fields, e.g.
        `duplicate_window=120` (seconds), `max_age`, `storage=api.StorageType.FILE`."""
        config.setdefault("num_replicas", self.replicas)
        stream = api.StreamConfig(name=name, subjects=list(subjects), **config)
        try:
            return await self.js.add_stream(stream)
        except nats.js.errors.BadRequestError as error:
            if error.err_code != _STREAM_EXISTS_WITH_OTHER_CONFIG:
                raise
            return await self.js.update_stream(stream)

    async def js_publish(
        self,
        subject: str,
        msg: Any,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        stream: str | None = None,
        attempts: int = 1,
    ) -> api.PubAck:
        """Store `msg` in the stream that owns `subject` and return the server's PubAck.

        With `msg_id`, a second publish of the same id inside the stream's duplicate window is
        not stored again: its PubAck has `duplicate=True` and the first message's sequence. A
        publish with a `msg_id` whose acknowledgement does not come within `timeout` (lost with a
        connection the server closed, say) is sent again, up to `attempts` in all: it is stored once.
        """
        merged = dict(headers) if headers else {}
        if msg_id is not None:
            merged[MSG_ID_HEADER] = msg_id
        data, headers, attempt = self.encode(msg), self._trace_headers(merged), 1
        while True:
            try:
                return await self.js.publish(subject, data, timeout=timeout, stream=stream, headers=headers)
            except nats.errors.TimeoutError:
                if msg_id is None or attempt >= attempts:
                    raise
                attempt += 1

    async def pull_consumer(
        self,
        stream: str,
        durable: str,
        subject_filter: str | Iterable[str],
        msg_type: type[T],
        *,
        span_name: str | None = None,
        on_invalid: InvalidHandler | None = None,
        dead_letters: str | None = None,
        **consumer_config: Any,
    ) -> PullConsumer[T]:
        """A durable pull consumer with explicit ack on `stream`, created or updated to this
        configuration. `subject_filter` is one subject or several. `consumer_config` is nats-py's
        ConsumerConfig fields, e.g. `ack_wait` (seconds before an unacked message is redelivered)
        and `max_deliver` (default MAX_DELIVER). A message dead-lettered is stored on the subject
        `dead_letters` (a JetStream subject), as it came, with the reason in its headers."""
        consumer_config.setdefault("max_deliver", MAX_DELIVER)
        filters = [subject_filter] if isinstance(subject_filter, str) else list(subject_filter)
        config = api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            **({"filter_subject": filters[0]} if len(filters) == 1 else {"filter_subjects": filters}),
            ack_policy=api.AckPolicy.EXPLICIT,
            **consumer_config,
        )
        await self.js.add_consumer(stream, config)
        return await self.bind_consumer(
            stream,
            durable,
            msg_type,
            span_name=span_name or f"{filters[0]} receive",
            on_invalid=on_invalid,
            dead_letters=dead_letters,
        )

    async def bind_consumer(
        self,
        stream: str,
        durable: str,
        msg_type: type[T],
        *,
        span_name: str | None = None,
        on_invalid: InvalidHandler | None = None,
        dead_letters: str | None = None,
    ) -> PullConsumer[T]:
        """The durable pull consumer `durable` of `stream`, as it exists on the server (created by
        whoever may: `pull_consumer`, or the operator's setup); nats-py's NotFoundError if it does not."""
        info = await self.js.consumer_info(stream, durable)
        subscription = await self.js.pull_subscribe_bind(durable=durable, stream=stream)
        consumer = PullConsumer(
            bus=self,
            subscription=subscription,
            msg_type=msg_type,
            span_name=span_name or f"{durable} receive",
            on_invalid=on_invalid or self._on_invalid,
            max_deliver=info.config.max_deliver or MAX_DELIVER,
            ack_wait_s=info.config.ack_wait or 30.0,
            dead_letters=dead_letters,
        )
        self._pull_consumers.add(consumer)
        return consumer

    async def pull(
        self,
        stream: str,
        durable: str,
        subject_filter: str,
        msg_type: type[T],
        *,
        batch: int = 10,
        timeout: float = 1.0,
        **consumer_options: Any,
    ) -> AsyncIterator[Delivery[T]]:
        """Deliveries from a durable pull consumer, without end: `async for d in bus.pull(...)`.
        Process each inside `with d.span():` and settle it with `ack`, `nak` or `term`."""
        consumer = await self.pull_consumer(stream, durable, subject_filter, msg_type, **consumer_options)
        try:
            while True:
                for delivery in await consumer.fetch(batch, timeout):
                    yield delivery
        finally:
            with contextlib.suppress(nats.errors.Error):
                await consumer.unsubscribe()

    async def follow(
        self, subject: str, msg_type: type[T], *, idle_timeout: float | None = 3600.0, new_only: bool = False
    ) -> AsyncIterator[T]:
        """Every message stored on `subject`, from the first (`new_only`: from now on), then each as
        it is stored (an ordered consumer: no acks, nothing missed or repeated). TimeoutError after
        `idle_timeout` seconds without one (None: wait for ever)."""
        policy = api.DeliverPolicy.NEW if new_only else api.DeliverPolicy.ALL
        subscription = await self.js.subscribe(subject, ordered_consumer=True, deliver_policy=policy)
        try:
            while True:
                raw = await subscription.next_msg(timeout=idle_timeout)
                yield self.decode(raw.data, msg_type)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await subscription.unsubscribe()
