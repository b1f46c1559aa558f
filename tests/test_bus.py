"""The typed NATS layer against a real server: core pub/sub and request/reply, invalid payloads,
JetStream de-duplication and redelivery, and KV compare-and-set."""

from __future__ import annotations

import asyncio
from typing import Annotated

import msgspec
import pytest

from shared.bus import Delivery, RevisionConflict

TIMEOUT_S = 3.0


class Ping(msgspec.Struct, frozen=True):
    n: Annotated[int, msgspec.Meta(ge=0)]
    text: str = ""


class Pong(msgspec.Struct, frozen=True):
    n: int


class Problem(msgspec.Struct, frozen=True):
    reason: str


async def next_item(queue: asyncio.Queue, timeout: float = TIMEOUT_S):
    return await asyncio.wait_for(queue.get(), timeout)


async def test_publish_subscribe_round_trip(connect_bus, name_prefix):
    consumer, producer = await connect_bus("consumer"), await connect_bus("producer")
    received: asyncio.Queue = asyncio.Queue()
    subject = f"{name_prefix}.ping"

    def handle(ping: Ping, raw) -> None:
        received.put_nowait((ping, raw.subject))

    await consumer.subscribe(subject, Ping, handle, with_raw=True)

    await producer.publish(subject, Ping(3, "hello"))

    assert await next_item(received) == (Ping(3, "hello"), subject)


async def test_queue_group_delivers_each_message_once(connect_bus, name_prefix):
    bus = await connect_bus()
    subject = f"{name_prefix}.work"
    seen_by: dict[str, list[int]] = {"a": [], "b": []}
    done: asyncio.Queue = asyncio.Queue()

    def worker(name):
        async def handle(ping: Ping) -> None:
            seen_by[name].append(ping.n)
            done.put_nowait(ping.n)

        return handle

    await bus.subscribe(subject, Ping, worker("a"), queue="workers")
    await bus.subscribe(subject, Ping, worker("b"), queue="workers")
    for n in range(20):
        await bus.publish(subject, Ping(n))
    handled = [await next_item(done) for _ in range(20)]

    assert sorted(handled) == list(range(20))
    assert sorted(seen_by["a"] + seen_by["b"]) == list(range(20))


async def test_request_reply_is_typed(connect_bus, name_prefix):
    server, client = await connect_bus("server"), await connect_bus("client")
    subject = f"{name_prefix}.echo"
    await server.subscribe(subject, Ping, lambda ping: Pong(ping.n + 1))

    assert await client.request(subject, Ping(41), Pong, timeout=TIMEOUT_S) == Pong(42)
    with pytest.raises(msgspec.ValidationError):
        await client.request(subject, Ping(1), Problem, timeout=TIMEOUT_S)  # a Pong is no Problem


async def test_malformed_payload_goes_to_on_invalid_and_subscription_survives(connect_bus, name_prefix):
    invalid: asyncio.Queue = asyncio.Queue()
    received: asyncio.Queue = asyncio.Queue()

    def on_invalid(subject: str, data: bytes, error: Exception) -> Problem:
        invalid.put_nowait((subject, data, error))
        return Problem(reason=str(error))

    bus = await connect_bus(on_invalid=on_invalid)
    subject = f"{name_prefix}.ping"
    await bus.subscribe(subject, Ping, received.put)

    await bus.nc.publish(subject, b"\xc1 not msgpack")  # 0xc1 is never valid msgpack
    bad_subject, bad_data, error = await next_item(invalid)
    assert (bad_subject, bad_data) == (subject, b"\xc1 not msgpack")
    assert isinstance(error, msgspec.DecodeError)

    await bus.publish(subject, {"n": -1})  # well-formed msgpack, out of range for Ping
    _, _, error = await next_item(invalid)
    assert isinstance(error, msgspec.ValidationError)
    assert "`$.n`" in str(error) and ">= 0" in str(error)

    # A malformed request is answered with what on_invalid returned.
    problem = await bus.request(subject, {"n": "three"}, Problem, timeout=TIMEOUT_S)
    assert "Expected `int`, got `str`" in problem.reason
    await next_item(invalid)

    await bus.publish(subject, Ping(7))
    assert await next_item(received) == Ping(7)
    assert received.empty() and invalid.empty()


async def test_handler_error_does_not_stop_subscription(connect_bus, name_prefix):
    bus = await connect_bus()
    subject = f"{name_prefix}.ping"
    received: asyncio.Queue = asyncio.Queue()

    async def handle(ping: Ping) -> None:
        if ping.n == 0:
            raise RuntimeError("boom")
        received.put_nowait(ping)

    await bus.subscribe(subject, Ping, handle)
    await bus.publish(subject, Ping(0))
    await bus.publish(subject, Ping(1))

    assert await next_item(received) == Ping(1)


async def test_js_publish_with_same_msg_id_stores_once(connect_bus, name_prefix):
    bus = await connect_bus()
    stream = f"{name_prefix}_SUBMIT"
    subject = f"{name_prefix}.submit"
    await bus.ensure_stream(stream, [subject], duplicate_window=60)
    await bus.ensure_stream(stream, [subject], duplicate_window=60, max_msgs=1000)  # idempotent, updates

    first = await bus.js_publish(subject, Ping(1), msg_id="job-1")
    again = await bus.js_publish(subject, Ping(1), msg_id="job-1")
    other = await bus.js_publish(subject, Ping(2), msg_id="job-2")

    assert not first.duplicate and again.duplicate
    assert again.seq == first.seq and other.seq == first.seq + 1
    info = await bus.js.stream_info(stream)
    assert info.state.messages == 2
    assert info.config.max_msgs == 1000


async def test_durable_pull_redelivers_unacked_only(connect_bus, name_prefix):
    bus = await connect_bus()
    stream, subject = f"{name_prefix}_JOBS", f"{name_prefix}.jobs"
    await bus.ensure_stream(stream, [subject])
    consumer = await bus.pull_consumer(stream, "worker", subject, Ping, ack_wait=0.5)
    for n in (1, 2):
        await bus.js_publish(subject, Ping(n))

    first = await consumer.fetch(batch=2, timeout=TIMEOUT_S)
    assert [d.message for d in first] == [Ping(1), Ping(2)]
    assert [d.num_delivered for d in first] == [1, 1]
    await first[0].ack()  # Ping(2) is left unacked, as if its worker died

    # A fresh connection binding the same durable (a restarted replica) gets it back.
    restarted = await connect_bus("restarted")
    rebound = await restarted.pull_consumer(stream, "worker", subject, Ping, ack_wait=0.5)
    redelivered = await rebound.fetch(batch=2, timeout=TIMEOUT_S)
    assert [(d.message, d.num_delivered) for d in redelivered] == [(Ping(2), 2)]
    await redelivered[0].ack()
    assert await rebound.fetch(batch=2, timeout=0.8) == []


async def test_consume_acks_naks_and_terminates_invalid(connect_bus, name_prefix):
    invalid: asyncio.Queue = asyncio.Queue()
    bus = await connect_bus(on_invalid=lambda subject, data, error: invalid.put_nowait(data))
    stream, subject = f"{name_prefix}_WORK", f"{name_prefix}.work"
    await bus.ensure_stream(stream, [subject])
    consumer = await bus.pull_consumer(stream, "worker", subject, Ping, ack_wait=5)
    await bus.js.publish(subject, b"garbage")
    await bus.js_publish(subject, Ping(1))
    handled: asyncio.Queue = asyncio.Queue()

    async def handle(ping: Ping, delivery: Delivery[Ping]) -> None:
        handled.put_nowait((ping, delivery.num_delivered))
        if delivery.num_delivered == 1:
            raise RuntimeError("transient")  # nak: comes straight back

    task = asyncio.create_task(consumer.consume(handle, with_delivery=True, timeout=0.5))
    try:
        assert await next_item(invalid) == b"garbage"
        assert await next_item(handled) == (Ping(1), 1)
        assert await next_item(handled) == (Ping(1), 2)
        await asyncio.sleep(0.3)
    finally:
        task.cancel()
    info = await bus.js.consumer_info(stream, "worker")
    assert info.num_pending == 0 and info.num_ack_pending == 0 and info.num_redelivered == 0
    assert handled.empty() and invalid.empty()


async def test_kv_create_and_compare_and_set(connect_bus, name_prefix):
    bus = await connect_bus()
    kv = await bus.kv(f"{name_prefix}_state", Ping, history=5)
    assert (await bus.kv(f"{name_prefix}_state", Ping)).bucket == kv.bucket  # reopening is fine

    created = await kv.create("job-1", Ping(1))
    with pytest.raises(RevisionConflict):
        await kv.create("job-1", Ping(9))

    updated = await kv.update("job-1", Ping(2), revision=created)
    with pytest.raises(RevisionConflict):
        await kv.update("job-1", Ping(3), revision=created)  # stale: someone updated since
    entry = await kv.get("job-1")
    assert (entry.value, entry.revision) == (Ping(2), updated)

    await kv.put("job-2", Ping(5))
    assert sorted(await kv.keys()) == ["job-1", "job-2"]
    with pytest.raises(RevisionConflict):
        await kv.delete("job-1", revision=created)
    await kv.delete("job-1", revision=updated)
    assert await kv.get("job-1") is None
    assert await kv.keys() == ["job-2"]
    assert await kv.get("never") is None
    await kv.create("job-1", Ping(4))  # a deleted key can be created again
