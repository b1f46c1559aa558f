"""Many callers' requests sent as few (`services.profiler.gathered.Gathered`): each caller its own answer, a
request at most `most` items, a failed request failing its callers only."""

import asyncio

from services.profiler.gathered import Gathered


async def test_callers_at_once_share_requests_and_each_gets_its_own_answer():
    sent: list[list[int]] = []

    async def send(items: list[int]) -> list[int]:
        sent.append(items)
        await asyncio.sleep(0)  # in flight a while: what is asked meanwhile waits for the next request
        return [item * 10 for item in items]

    gathered = Gathered(send, most=32, in_flight=2)
    answers = await asyncio.gather(*(gathered(n) for n in range(100)))
    assert answers == [n * 10 for n in range(100)]
    assert sorted(n for items in sent for n in items) == list(range(100))
    assert all(len(items) <= 32 for items in sent) and len(sent) <= 5, [len(items) for items in sent]
    assert gathered.senders == set() and gathered.waiting == []


async def test_a_failed_request_fails_its_callers_and_the_next_one_goes_on():
    async def send(items: list[str]) -> list[str]:
        if "bad" in items:
            raise ConnectionError("estimator away")
        return [item.upper() for item in items]

    gathered = Gathered(send, most=2, in_flight=1)
    first = await asyncio.gather(gathered("bad"), gathered("b"), gathered("c"), return_exceptions=True)
    assert [type(a).__name__ for a in first[:2]] == ["ConnectionError", "ConnectionError"] and first[2] == "C"
    assert await gathered("d") == "D"


async def test_an_answer_of_another_length_fails_every_caller_of_its_request():
    async def send(items: list[int]) -> list[int]:
        return items[:-1]

    gathered = Gathered(send, most=8)
    answers = await asyncio.gather(gathered(1), gathered(2), return_exceptions=True)
    assert [str(a) for a in answers] == ["2 asked, 1 answered"] * 2
