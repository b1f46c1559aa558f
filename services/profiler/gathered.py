"""Many callers' requests sent as few: what tasks ask while a request is in flight goes in the next
one. A burst of submissions judged at once becomes a request of dozens, not dozens of requests,
each caller still awaiting its own answer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Gathered(Generic[T, R]):
    """`await gathered(item)`: `item`'s answer from `send(items)`, which answers each of a list in
    order. Items asked in the same turn of the event loop, or while `in_flight` requests are out,
    are sent together, at most `most` a request. A request that raises raises in each of its callers."""

    def __init__(self, send: Callable[[list[T]], Awaitable[Sequence[R]]], most: int, in_flight: int = 2) -> None:
        self.send, self.most, self.in_flight = send, most, in_flight
        self.waiting: list[tuple[T, asyncio.Future[R]]] = []
        self.senders: set[asyncio.Task] = set()

    async def __call__(self, item: T) -> R:
        answer: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self.waiting.append((item, answer))
        if len(self.senders) < self.in_flight:
            sender = asyncio.ensure_future(self._sending())
            self.senders.add(sender)
            sender.add_done_callback(self.senders.discard)
        return await answer

    async def _sending(self) -> None:
        await asyncio.sleep(0)  # the callers of this turn of the loop join the first request
        while self.waiting:
            batch, self.waiting = self.waiting[: self.most], self.waiting[self.most :]
            try:
                answers = await self.send([item for item, _ in batch])
                if len(answers) != len(batch):
                    raise ValueError(f"{len(batch)} asked, {len(answers)} answered")
            except asyncio.CancelledError:
                for _, answer in batch:
                    answer.cancel()
                raise
            except Exception as error:  # noqa: BLE001 - each of its callers hears of it
                for _, answer in batch:
                    if not answer.done():
                        answer.set_exception(error)
                continue
            for (_, answer), value in zip(batch, answers):
                if not answer.done():  # its caller may have been cancelled meanwhile
                    answer.set_result(value)
