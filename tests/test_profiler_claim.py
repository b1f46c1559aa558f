"""The profiler's hold on a job's id (`Profiler.claim`), over an owners' bucket in memory that counts
what it is asked: a submission the API stored (and claimed) costs one read; a replay's, one write;
the same job sent again is a repeat, another body under a held id is refused, a mark is taken over."""

from types import SimpleNamespace

from services.profiler.service import Profiler
from shared import subjects
from shared.bus.kv import KVEntry, RevisionConflict
from shared.cluster import load_cluster
from shared.schema.jobs import JobOwner, JobSpec, spec_digest
from shared.submissions import id_taken
from sim.profiles import profile_source


class CountingKV:
    """The owners' bucket in memory, with a KV's revisions (as TypedKV writes them), and what it
    was asked, in order."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[JobOwner, int]] = {}
        self.revision = 0
        self.asked: list[str] = []

    def _write(self, key: str, value: JobOwner) -> int:
        self.revision += 1
        self.entries[key] = (value, self.revision)
        return self.revision

    async def create(self, key, value):
        self.asked.append("create")
        if key in self.entries:
            raise RevisionConflict
        return self._write(key, value)

    async def get(self, key):
        self.asked.append("get")
        found = self.entries.get(key)
        return None if found is None else KVEntry(key, *found)

    async def update(self, key, value, revision):
        self.asked.append("update")
        if key not in self.entries or self.entries[key][1] != revision:
            raise RevisionConflict
        return self._write(key, value)


STORED = subjects.stored("default", "alice")


def profiler() -> tuple[Profiler, CountingKV]:
    owners = CountingKV()
    return Profiler(None, load_cluster("sia-hetero-64"), owners, source=profile_source(use_zoo=True)), owners


def came(sequence: int, subject: str = STORED) -> SimpleNamespace:
    return SimpleNamespace(stream_sequence=sequence, subject=subject)


async def test_a_stored_submission_the_api_claimed_costs_one_read():
    judge, owners = profiler()
    spec = JobSpec("a", "cifar10")
    await owners.create("a", JobOwner(7, spec_digest(spec), STORED))
    owners.asked.clear()
    assert await judge.claim(spec, came(7)) is None
    assert owners.asked == ["get"]


async def test_a_replays_submission_is_written_at_once():
    judge, owners = profiler()
    assert await judge.claim(JobSpec("r", "cifar10"), came(3, subjects.REPLAY_SUBMIT)) is None
    assert owners.asked == ["create"] and owners.entries["r"][0].submission == 3


async def test_a_repeat_another_body_and_a_mark_taken_over():
    judge, owners = profiler()
    spec, other = JobSpec("a", "cifar10"), JobSpec("a", "imagenet")
    await owners.create("a", JobOwner(7, spec_digest(spec), STORED))
    assert await judge.claim(spec, came(9)) == "repeat"  # the same job sent again: the first's verdict stands
    assert await judge.claim(other, came(10)) == id_taken("a")
    await owners.create("m", JobOwner(0, spec_digest(spec), STORED))  # the API is storing one
    assert await judge.claim(JobSpec("m", "cifar10"), came(11)) is None
    assert owners.entries["m"][0].submission == 11
    assert await judge.claim(JobSpec("free", "cifar10"), came(12)) is None  # never claimed: read, then written
    assert owners.asked[-2:] == ["get", "create"]
