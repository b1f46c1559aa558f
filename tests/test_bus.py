"""The typed NATS layer against a real server: core pub/sub and request/reply, invalid payloads,
JetStream de-duplication and redelivery, KV compare-and-set, and bodies larger than a message."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Annotated

import msgspec
import nats
import pytest
from nats import micro

from launcher.nats import SERVER_LOG, nats_from_binary
from shared.bus import Bus
from shared.bus.consumers import DEAD_REASON_HEADER, Delivery
from shared.bus.encoding import CHUNK_HEADER, MAX_PARTS, ChunkLost
from shared.bus.kv import KVEntry, RevisionConflict
from shared.bus.requests import MAX_ASSEMBLIES
from shared.runner import new_service

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


async def settled(bus, stream: str, consumer: str = "worker"):
    """The consumer's info once no message is waiting for its ack (the server takes an ack a moment
    after the handler's return), or as it is after TIMEOUT_S."""
    for _ in range(int(TIMEOUT_S / 0.05)):
        info = await bus.js.consumer_info(stream, consumer)
        if info.num_ack_pending == 0:
            break
        await asyncio.sleep(0.05)
    return info


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


async def test_a_publish_whose_ack_is_lost_is_sent_again_under_its_id_and_stored_once(connect_bus, name_prefix):
    """An acknowledgement lost (the server closed the connection meanwhile): a publish with an id is
    sent again, up to its attempts, and the stream holds it once; one without an id raises."""
    import nats.errors

    bus = await connect_bus()
    stream, subject = f"{name_prefix}_LOST", f"{name_prefix}.lost"
    await bus.ensure_stream(stream, [subject], duplicate_window=60)
    publish, lost = bus.js.publish, []

    async def losing_the_first_ack(*args, **options):
        ack = await publish(*args, **options)  # stored: only its acknowledgement goes missing
        if not lost:
            lost.append(ack)
            raise nats.errors.TimeoutError
        return ack

    bus.js.publish = losing_the_first_ack
    ack = await bus.js_publish(subject, Ping(1), msg_id="once", attempts=2)
    assert ack.duplicate and ack.seq == lost[0].seq
    lost.clear()
    with pytest.raises(nats.errors.TimeoutError):
        await bus.js_publish(subject, Ping(2), attempts=2)  # no id: sent again it could be stored twice
    assert (await bus.js.stream_info(stream)).state.messages == 2


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
            raise RuntimeError("transient")  # nak: comes back after REDELIVER_AFTER_S

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


async def test_a_concurrent_consumer_has_a_batch_in_hand_at_once_and_acks_each(connect_bus, name_prefix):
    bus = await connect_bus()
    stream, subject = f"{name_prefix}_MANY", f"{name_prefix}.many"
    await bus.ensure_stream(stream, [subject])
    consumer = await bus.pull_consumer(stream, "worker", subject, Ping, ack_wait=30)
    for n in range(8):
        await bus.js_publish(subject, Ping(n))
    in_hand: set[int] = set()
    all_in_hand = asyncio.Event()
    done: asyncio.Queue = asyncio.Queue()

    async def handle(ping: Ping, delivery: Delivery[Ping]) -> None:
        # Each waits until all eight are in hand: one after another, the first would wait forever.
        in_hand.add(ping.n)
        if len(in_hand) == 8:
            all_in_hand.set()
        await all_in_hand.wait()
        if ping.n == 3 and delivery.num_delivered == 1:
            raise RuntimeError("this one fails: it alone comes back")
        done.put_nowait(ping.n)

    task = asyncio.create_task(consumer.consume(handle, batch=8, timeout=0.5, with_delivery=True, concurrent=True))
    try:
        assert sorted([await next_item(done) for _ in range(7)]) == [0, 1, 2, 4, 5, 6, 7]
        assert await next_item(done) == 3  # redelivered, and then handled
    finally:
        task.cancel()
    info = await settled(bus, stream)
    assert info.num_pending == 0 and info.num_ack_pending == 0


async def test_a_concurrent_consumer_fetches_more_while_a_slow_one_is_still_in_hand(connect_bus, name_prefix):
    bus = await connect_bus()
    stream, subject = f"{name_prefix}_WINDOW", f"{name_prefix}.window"
    await bus.ensure_stream(stream, [subject])
    consumer = await bus.pull_consumer(stream, "worker", subject, Ping, ack_wait=30)
    for n in range(6):
        await bus.js_publish(subject, Ping(n))
    last = asyncio.Event()
    done: asyncio.Queue = asyncio.Queue()

    async def handle(ping: Ping) -> None:
        # The first of a fetch of four waits for the last of all six: a batch handled only once its
        # slowest one is done would never fetch it.
        if ping.n == 0:
            await last.wait()
        if ping.n == 5:
            last.set()
        done.put_nowait(ping.n)

    task = asyncio.create_task(consumer.consume(handle, batch=4, timeout=0.5, concurrent=True))
    try:
        assert sorted([await next_item(done) for _ in range(6)]) == list(range(6))
    finally:
        task.cancel()
    info = await settled(bus, stream)
    assert info.num_pending == 0 and info.num_ack_pending == 0


async def test_a_batch_is_acked_only_once_after_batch_returned_and_comes_back_when_it_raises(connect_bus, name_prefix):
    bus = await connect_bus()
    stream, subject = f"{name_prefix}_SAVED", f"{name_prefix}.saved"
    await bus.ensure_stream(stream, [subject])
    consumer = await bus.pull_consumer(stream, "worker", subject, Ping, ack_wait=30)
    for n in range(5):
        await bus.js_publish(subject, Ping(n))
    taken: list[tuple[int, int]] = []
    saves: asyncio.Queue = asyncio.Queue()

    async def take(ping: Ping, delivery: Delivery[Ping]) -> None:
        taken.append((ping.n, delivery.num_delivered))

    async def save() -> None:
        # What the batch's handlers took is not yet acknowledged: a crash now loses nothing.
        info = await bus.js.consumer_info(stream, "worker")
        saves.put_nowait((len(taken), info.num_ack_pending))
        if len(taken) == 5:
            raise RuntimeError("the store is away: the batch comes back")

    task = asyncio.create_task(consumer.consume(take, batch=8, timeout=0.5, with_delivery=True, after_batch=save))
    try:
        assert await next_item(saves) == (5, 5)
        while len(taken) < 10:  # redelivered after REDELIVER_AFTER_S (in one fetch or more), taken again
            await next_item(saves)
        await asyncio.sleep(0.3)
    finally:
        task.cancel()
    assert taken[:5] == [(n, 1) for n in range(5)] and sorted(taken[5:]) == [(n, 2) for n in range(5)]
    info = await settled(bus, stream)
    assert info.num_pending == 0 and info.num_ack_pending == 0


async def test_a_message_waiting_behind_a_slow_one_of_its_batch_is_kept_in_hand(connect_bus, name_prefix):
    bus = await connect_bus()
    stream, subject = f"{name_prefix}_SLOW", f"{name_prefix}.slow"
    await bus.ensure_stream(stream, [subject])
    consumer = await bus.pull_consumer(stream, "worker", subject, Ping, ack_wait=0.6)
    for n in range(2):
        await bus.js_publish(subject, Ping(n))
    handled: asyncio.Queue = asyncio.Queue()

    async def handle(ping: Ping, delivery: Delivery[Ping]) -> None:
        if ping.n == 0:
            await asyncio.sleep(1.5)  # past ack_wait: the server is told both are in hand meanwhile
        handled.put_nowait((ping.n, delivery.num_delivered))

    task = asyncio.create_task(consumer.consume(handle, batch=2, timeout=0.5, with_delivery=True))
    try:
        assert [await next_item(handled) for _ in range(2)] == [(0, 1), (1, 1)]
        await asyncio.sleep(0.8)
    finally:
        task.cancel()
    assert handled.empty()
    info = await settled(bus, stream)
    assert info.num_ack_pending == 0 and info.num_redelivered == 0


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


# ---- bodies larger than max_payload ---------------------------------------------------------------


class Blob(msgspec.Struct, frozen=True):
    tag: int
    data: bytes


def several_mb(tag: int) -> Blob:
    return Blob(tag, os.urandom(3 * 1024 * 1024 + 12345))  # 3 MiB and a bit: four parts at 1 MiB


async def test_large_requests_and_replies_travel_in_parts(connect_bus, name_prefix):
    """Two replicas of a service in one queue group answer two requesters at once; every request
    and every reply is over the server's max_payload, both ways."""
    subject = f"{name_prefix}.reverse"
    seen: list[int] = []

    async def reverse(blob: Blob) -> Blob:
        seen.append(blob.tag)
        await asyncio.sleep(0.05)  # the two requests overlap on the replicas
        return Blob(blob.tag, blob.data[::-1])

    for replica in ("a", "b"):
        bus = await connect_bus(f"replica-{replica}")
        service = await micro.add_service(bus.nc, name=f"{name_prefix}_svc", version="0.1.0")
        await bus.add_endpoint(service, "reverse", subject, Blob, reverse)
    first, second = await connect_bus("first"), await connect_bus("second")
    assert first.nc.max_payload == 1024 * 1024  # the server's default: these bodies cannot go whole
    blobs = [several_mb(1), several_mb(2), several_mb(3)]
    assert all(len(first.encode(b)) > 3 * first.nc.max_payload for b in blobs)

    replies = await asyncio.gather(
        first.request(subject, blobs[0], Blob, timeout=TIMEOUT_S),
        second.request(subject, blobs[1], Blob, timeout=TIMEOUT_S),
        first.request(subject, blobs[2], Blob, timeout=TIMEOUT_S),
    )

    assert replies == [Blob(b.tag, b.data[::-1]) for b in blobs]
    assert sorted(seen) == [1, 2, 3]  # each request handled once, by one replica


async def test_large_reply_of_a_plain_subscription(connect_bus, name_prefix):
    server, client = await connect_bus("server"), await connect_bus("client")
    subject = f"{name_prefix}.blob"
    await server.subscribe(subject, Ping, lambda ping: several_mb(ping.n))

    reply = await client.request(subject, Ping(7), Blob, timeout=TIMEOUT_S)

    assert reply.tag == 7 and len(reply.data) > 3 * client.nc.max_payload


async def test_a_lost_reply_part_raises_chunk_lost(connect_bus, name_prefix):
    server, client = await connect_bus("server"), await connect_bus("client")
    subject = f"{name_prefix}.broken"

    async def answer_first_part_only(raw) -> None:  # a responder that dies after its first part
        await server.nc.publish(raw.reply, b"\x92\x01", headers={CHUNK_HEADER: "0/3"})

    await server.nc.subscribe(subject, cb=answer_first_part_only)
    await server.flush()
    client.chunk_timeout_s = 0.3
    with pytest.raises(ChunkLost, match=f"reply on {subject}: part 2 of 3 did not come within 0.3 s"):
        await client.request(subject, Ping(1), Blob, timeout=TIMEOUT_S)


async def _echo_endpoint(server, name_prefix):
    """An endpoint answering Ping n with Pong n; its subject, and the pings it handled."""
    subject = f"{name_prefix}.echo"
    handled: list[Ping] = []

    def echo(ping: Ping) -> Pong:
        handled.append(ping)
        return Pong(ping.n)

    service = await micro.add_service(server.nc, name=f"{name_prefix}_svc", version="0.1.0")
    await server.add_endpoint(service, "echo", subject, Ping, echo)
    return subject, handled


async def test_a_lost_request_part_drops_the_request_and_the_endpoint_goes_on(connect_bus, name_prefix, caplog):
    server, client = await connect_bus("server"), await connect_bus("client")
    subject, handled = await _echo_endpoint(server, name_prefix)
    server.chunk_timeout_s = 0.3
    gone = client.nc.new_inbox()  # a requester that sent its first part and died: no one answers here
    with caplog.at_level(logging.WARNING, logger="shared.bus"):
        await client.nc.publish(subject, client.encode(Ping(1))[:2], reply=gone, headers={CHUNK_HEADER: "0/2"})
        # Answered while the other waits for its part: a request in parts never holds up the endpoint.
        assert await client.request(subject, Ping(2), Pong, timeout=TIMEOUT_S) == Pong(2)
        dropped = f"request on {subject}: part 2 of 2 did not come within 0.3 s; the request is dropped"
        while dropped not in caplog.text:
            await asyncio.sleep(0.05)

    assert handled == [Ping(2)]


async def test_a_bad_part_header_drops_the_request_and_the_endpoint_goes_on(connect_bus, name_prefix, caplog):
    """A peer's part header never sizes a buffer: not `i/n`, or more parts than MAX_PARTS, is refused."""
    server, client = await connect_bus("server"), await connect_bus("client")
    subject, handled = await _echo_endpoint(server, name_prefix)
    with caplog.at_level(logging.WARNING, logger="shared.bus"):
        for mark in ("x/y", f"0/{MAX_PARTS + 1}", "3/2", "-1/2"):
            await client.nc.publish(
                subject, client.encode(Ping(1)), reply=client.nc.new_inbox(), headers={CHUNK_HEADER: mark}
            )
        assert await client.request(subject, Ping(2), Pong, timeout=TIMEOUT_S) == Pong(2)

    assert handled == [Ping(2)]
    assert caplog.text.count(f"bad {CHUNK_HEADER} header") == 4


async def test_a_request_whose_reply_is_not_an_inbox_is_dropped_unhandled(connect_bus, name_prefix, caplog):
    """No one makes a service publish where they may not: a reply naming the JetStream API or a KV key."""
    server, client = await connect_bus("server"), await connect_bus("client")
    subject, handled = await _echo_endpoint(server, name_prefix)
    pinged: list[Ping] = []
    await server.subscribe(f"{name_prefix}.plain", Ping, lambda ping: pinged.append(ping) or Pong(ping.n))
    with caplog.at_level(logging.WARNING, logger="shared.bus"):
        for target in (subject, f"{name_prefix}.plain"):
            for reply in ("$JS.API.STREAM.DELETE.GOODPUT_JOBS", "$KV.goodput_runs.live", "_INBOX", "_INBOXED"):
                await client.nc.publish(target, client.encode(Ping(1)), reply=reply)
        assert await client.request(subject, Ping(2), Pong, timeout=TIMEOUT_S) == Pong(2)
        assert await client.request(f"{name_prefix}.plain", Ping(3), Pong, timeout=TIMEOUT_S) == Pong(3)
    assert handled == [Ping(2)] and pinged == [Ping(3)]
    assert caplog.text.count("which is not an inbox; dropped") == 8


async def test_requests_in_parts_are_refused_where_not_taken_and_bounded_per_requester(connect_bus, name_prefix):
    """A status endpoint (parts=False) refuses a request in parts at once; elsewhere one requester
    has at most MAX_ASSEMBLIES coming in, and the endpoint answers whole requests all the while."""
    server, client = await connect_bus("server"), await connect_bus("client")
    subject, handled = await _echo_endpoint(server, name_prefix)
    service = await micro.add_service(server.nc, name=f"{name_prefix}_status", version="0.1.0")
    await server.add_endpoint(service, "status", f"{name_prefix}.status", Ping, lambda ping: Pong(ping.n), parts=False)
    first = client.encode(Ping(1))[:2]
    refusal = await client.nc.request(f"{name_prefix}.status", first, timeout=TIMEOUT_S, headers={CHUNK_HEADER: "0/2"})
    assert (
        refusal.headers["Nats-Service-Error-Code"] == "400"
        and "in one message" in refusal.headers["Nats-Service-Error"]
    )

    silent = client.nc.new_inbox()  # a requester that never sends its other parts
    answers = await client.nc.subscribe(f"{silent}.*")
    for index in range(MAX_ASSEMBLIES + 1):
        await client.nc.publish(subject, first, reply=f"{silent}.{index}", headers={CHUNK_HEADER: "0/2"})
    assert await client.request(subject, Ping(2), Pong, timeout=TIMEOUT_S) == Pong(2)
    while True:  # the server asks for the parts it takes; refuses the one over
        message = await answers.next_msg(timeout=TIMEOUT_S)
        if message.headers and message.headers.get("Nats-Service-Error-Code") == "400":
            break
    assert message.subject == f"{silent}.{MAX_ASSEMBLIES}" and "too many" in message.headers["Nats-Service-Error"]
    assert handled == [Ping(2)]
    await answers.unsubscribe()


async def test_json_bodies_are_read_as_json_and_a_json_request_is_answered_in_json(connect_bus, name_prefix):
    """Any client may speak JSON: a plain nats request with a JSON object gets a JSON reply (a refusal
    too), JetStream JSON bodies decode for a consumer, and msgpack goes on as before."""
    server, client = await connect_bus("server"), await connect_bus("client")
    subject, handled = await _echo_endpoint(server, name_prefix)
    reply = await client.nc.request(subject, b' {"n": 2.0, "text": "hi"}', timeout=TIMEOUT_S)
    assert msgspec.json.decode(reply.data) == {"n": 2}
    refused = await client.nc.request(subject, b'{"n": -1}', timeout=TIMEOUT_S)
    assert refused.headers["Nats-Service-Error-Code"] == "400" and "n" in refused.headers["Nats-Service-Error"]
    assert await client.request(subject, Ping(3), Pong, timeout=TIMEOUT_S) == Pong(3)  # msgpack, as before
    assert handled == [Ping(2, "hi"), Ping(3)]

    stream, subject = f"{name_prefix}_JSON", f"{name_prefix}.json"
    await client.ensure_stream(stream, [subject])
    await client.js.publish(subject, b'{"n": 7}')
    consumer = await client.pull_consumer(stream, "reader", subject, Ping)
    [delivery] = await consumer.fetch(1, timeout=TIMEOUT_S)
    assert delivery.message == Ping(7)


async def test_kv_value_larger_than_a_message(connect_bus, name_prefix):
    bus, other = await connect_bus("writer"), await connect_bus("reader")
    bucket = f"{name_prefix}_big"
    kv, kv_other = await bus.kv(bucket, Blob), await other.kv(bucket, Blob)

    async def stored_parts() -> int:
        info = await bus.js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}._parts.>")
        return len(info.state.subjects or {})

    first = several_mb(1)
    created = await kv.create("run.1", first)
    assert await kv_other.get("run.1") == KVEntry("run.1", first, created)
    big = several_mb(2)
    updated = await kv.update("run.1", big, revision=created)
    read = await kv_other.get("run.1")
    assert (read.value, read.revision) == (big, updated)
    assert await stored_parts() == 4  # the first value's parts are purged

    with pytest.raises(RevisionConflict):  # a stale writer's parts are purged too
        await kv_other.update("run.1", several_mb(3), revision=created)
    assert await stored_parts() == 4 and (await kv.get("run.1")).value == big

    await kv.put("run", Blob(0, b"small"))  # a key that is a prefix of the other's
    await kv_other.update("run.1", Blob(4, b"small now"), revision=updated)
    assert await stored_parts() == 0
    assert sorted(await kv.keys()) == ["run", "run.1"]
    assert (await kv.get("run.1")).value == Blob(4, b"small now")


async def test_a_message_that_always_fails_is_dead_lettered_once_and_the_consumer_goes_on(connect_bus, name_prefix):
    bus = await connect_bus()
    stream, subject, dead = f"{name_prefix}_POISON", f"{name_prefix}.poison", f"{name_prefix}.dead"
    await bus.ensure_stream(stream, [subject])
    await bus.ensure_stream(f"{name_prefix}_DEAD", [dead])
    consumer = await bus.pull_consumer(stream, "worker", subject, Ping, max_deliver=2, dead_letters=dead)
    await bus.js_publish(subject, Ping(1))  # fails every time
    await bus.js_publish(subject, Ping(2))  # fine
    tries: list[int] = []
    handled: asyncio.Queue = asyncio.Queue()
    buried: asyncio.Queue = asyncio.Queue()

    async def handle(ping: Ping, delivery: Delivery[Ping]) -> None:
        if ping.n == 1:
            tries.append(delivery.num_delivered)
            raise RuntimeError("poison")
        handled.put_nowait(ping)

    task = asyncio.create_task(
        consumer.consume(
            handle, with_delivery=True, timeout=0.5, on_dead=lambda delivery, error: buried.put_nowait(str(error))
        )
    )
    try:
        assert await next_item(handled) == Ping(2)  # the one behind it is not held up
        assert await next_item(buried) == "poison"  # on its last delivery, once
        for _ in range(100):  # then stored and terminated
            info = await bus.js.consumer_info(stream, "worker")
            if info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        stored = await bus.js.get_last_msg(f"{name_prefix}_DEAD", dead)
    finally:
        task.cancel()
    assert tries == [1, 2] and buried.empty()
    assert bus.decode(stored.data, Ping) == Ping(1) and "poison" in stored.headers[DEAD_REASON_HEADER]
    assert info.num_pending == 0 and info.num_ack_pending == 0


# ---- bodies nested too deep ----------------------------------------------------------------------

DEEP = 20_000
DEEP_BODIES = {  # a Ping with a field nested DEEP levels: none reaches a handler
    "JSON list": b'{"n": 1, "text": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    "JSON object": b'{"n": 1, "extra": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}",
    "msgpack list": b"\x82\xa1n\x01\xa5extra" + b"\x91" * DEEP + b"\xc0",
}
BRACKETS = "[[[[" * 40 + "{{{{" * 40 + "]]]]" + '"\\[{'  # in a string they are no nesting


async def test_a_body_nested_too_deep_is_answered_400_with_the_reason_and_one_with_brackets_in_a_string_is_served(
    connect_bus, name_prefix
):
    """A body nested deeper than MAX_DEPTH, JSON or msgpack, is refused at once with the reason, by
    an endpoint that serves one request at a time and one that serves several; a string full of
    brackets is no nesting."""
    server, client = await connect_bus("server"), await connect_bus("client")
    subject, handled = await _echo_endpoint(server, name_prefix)
    service = await micro.add_service(server.nc, name=f"{name_prefix}_many", version="0.1.0")
    await server.add_endpoint(service, "echo", f"{name_prefix}.many", Ping, lambda ping: Pong(ping.n), concurrency=4)
    for target in (subject, f"{name_prefix}.many"):
        for name, body in DEEP_BODIES.items():
            reply = await client.nc.request(target, body, timeout=TIMEOUT_S)
            headers = reply.headers or {}
            assert headers.get("Nats-Service-Error-Code") == "400", (target, name, headers)
            assert "nests at most 64 levels deep" in headers.get("Nats-Service-Error", ""), (target, name, headers)

    for body in (
        msgspec.json.encode(Ping(5, BRACKETS)),
        client.encode(Ping(6, BRACKETS)),
        client.encode(Ping(7, "—" * 200)),
    ):  # in UTF-8, 0x80 and 0x94: msgpack map and array bytes
        reply = await client.nc.request(subject, body, timeout=TIMEOUT_S)
        assert "Nats-Service-Error-Code" not in (reply.headers or {}), reply.headers
    assert handled == [Ping(5, BRACKETS), Ping(6, BRACKETS), Ping(7, "—" * 200)]


async def test_a_stored_body_nested_too_deep_is_invalid_and_terminated(connect_bus, name_prefix):
    """A JetStream consumer hands a body nested too deep to on_invalid, with the reason, and
    terminates it (never redelivered); the message behind it is handled."""
    invalid: asyncio.Queue = asyncio.Queue()
    bus = await connect_bus(on_invalid=lambda subject, data, error: invalid.put_nowait(error))
    stream, subject = f"{name_prefix}_DEEP", f"{name_prefix}.deep"
    await bus.ensure_stream(stream, [subject])
    consumer = await bus.pull_consumer(stream, "worker", subject, Ping, ack_wait=1)
    for body in DEEP_BODIES.values():
        await bus.js.publish(subject, body)
    await bus.js_publish(subject, Ping(1))
    handled: asyncio.Queue = asyncio.Queue()

    task = asyncio.create_task(consumer.consume(handled.put, timeout=0.5))
    try:
        errors = [await next_item(invalid) for _ in DEEP_BODIES]
        assert await next_item(handled) == Ping(1)
        await asyncio.sleep(0.3)
    finally:
        task.cancel()
    assert all(
        isinstance(error, msgspec.DecodeError) and "nests at most 64 levels deep" in str(error) for error in errors
    ), errors
    info = await bus.js.consumer_info(stream, "worker")
    assert info.num_pending == 0 and info.num_ack_pending == 0 and info.num_redelivered == 0
    assert invalid.empty() and handled.empty()


def test_a_listener_the_server_cuts_as_a_slow_consumer_loses_only_what_was_queued_on_it(tmp_path):
    """While a service's loop is held, another client floods its endpoint past the server's
    max_pending: the server closes the service's listener. The requests it had in hand are still
    answered (on its other connection), and once the listener is back a new one is too."""
    flood, flooded, held = 512, threading.Event(), threading.Event()

    def flooder(url: str, subject: str) -> None:
        async def run() -> None:
            nc = await nats.connect(url)
            for _ in range(flood):
                await nc.publish(subject, b"x" * 64 * 1024, reply=nc.new_inbox())
            await nc.flush()
            await nc.close()

        held.wait(TIMEOUT_S)
        asyncio.run(run())
        flooded.set()

    async def scenario(url: str) -> None:
        back = asyncio.Event()

        async def reconnected() -> None:
            back.set()

        server = await Bus.connect(url, "svc", reconnected_cb=reconnected)
        client = await Bus.connect(url, "client")
        subject, started, release = "held.echo", asyncio.Event(), asyncio.Event()

        async def echo(ping: Ping) -> Pong:
            if ping.n == 1:
                started.set()
                await release.wait()
            if ping.n == 2:  # the service reads nothing while the flood comes
                held.set()
                flooded.wait(30)
            return Pong(ping.n)

        service = await new_service(server, "held", "a service whose listener is flooded")
        await server.add_endpoint(service, "echo", subject, Ping, echo, concurrency=4)
        assert await server.listener() is not server.nc
        threading.Thread(target=flooder, args=(url, subject), daemon=True).start()
        in_hand = asyncio.ensure_future(client.request(subject, Ping(1), Pong, timeout=30))
        await started.wait()
        blocking = asyncio.ensure_future(client.request(subject, Ping(2), Pong, timeout=30))
        await asyncio.wait_for(back.wait(), 30)  # the listener was cut and is back
        release.set()
        assert (await in_hand, await blocking) == (Pong(1), Pong(2))
        assert await client.request(subject, Ping(3), Pong, timeout=TIMEOUT_S) == Pong(3)
        assert server.nc.stats["reconnects"] == 0  # its work's connection was never cut
        await client.close()
        await server.close()

    with nats_from_binary(tmp_path, config="max_pending: 1048576\n") as url:
        asyncio.run(scenario(url))
    cut = [line for line in (tmp_path / SERVER_LOG).read_text().splitlines() if "Slow Consumer Detected" in line]
    assert cut and all(':svc requests"' in line for line in cut), cut
