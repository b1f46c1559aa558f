"""What goodput keeps in JetStream: every stream, KV bucket and durable consumer, with its limits,
in one place.

Only the operator creates or changes them (`provision`: `goodput up` at start, `python -m
launcher.setup` as a one-shot in the manifests). A service opens what it uses (`open_stream`,
`open_kv`, `open_consumer`) and fails with a clear message when it is missing or differs from
this plan, so no service (and no user) may create a stream with a configuration of its own. One
exception, still the plan's: a team's logs stream (`logs_plan`) is made by the first node agent
that stores a line of that team's (`ensure_logs`), since teams come with their logins; the server
lets the agents make the logs streams of the teams it knows, and none other.

Limits, so one user cannot fill the disk: each stream and bucket has max bytes (and an age where
old entries may go); the jobs stream refuses new messages when full rather than dropping stored
ones, and any message over MAX_SUBMISSION_BYTES. The sum of the limits (`total_bytes`, with
LOG_TEAMS teams' logs) is what the JetStream store must hold.

So that no one login fills or stalls what all share (`LOGIN_LIMITS`): what a login publishes itself
waits in the intake stream, at most LoginLimits.backlog messages of it at once (JetStream refuses
the next: "maximum messages per subject exceeded"); in the jobs stream a login keeps at most
`submissions` valid submissions and `refusals` records of refused bodies (counted by JetStream,
under the login's subjects: they leave as they age out), and all logins together at most
USERS_SHARE of the stream, so there is always room for the profiler's verdicts. A team's logins
together keep at most `TEAM_LIMITS` (counted under the team's subjects), so one team flooding with
many logins fills only its own share. How fast a login may ask is the bus's
(`shared.bus.RequesterLimits`, on every endpoint).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js import api

from shared import subjects
from shared.bus import Bus
from shared.bus.consumers import MAX_DELIVER, PullConsumer
from shared.bus.kv import TypedKV

T = TypeVar("T")
log = logging.getLogger(__name__)

KIB, MIB, GIB = 1024, 1024**2, 1024**3
DAY_S = 24 * 3600.0
MAX_SUBMISSION_BYTES = 64 * KIB  # a JobSpec is a few hundred bytes; anything this large is not one
# A valid submission as the jobs stream stores it (its args and names): what the counts below bound,
# so that one login's (80 MiB) or one team's (400 MiB) fill less than USERS_SHARE of the 1 GiB stream.
MAX_STORED_BYTES = 4 * KIB
MAX_INTAKE_BYTES = 16 * KIB  # ... and one a login stores itself, raw, at most this
LEASE_TTL_S = 5.0  # the policy lease: a dead leader is replaced within this
# What jobs print, a stream per team (`logs_plan`): a team's output kept is at most TEAM_LOGS_BYTES, and
# a job's at most LOG_BATCHES_PER_JOB batches (each at most 64 lines and 32 KiB: a quarter of its team's
# bytes), the oldest going first past either, so one team's flood ages out only its own jobs' lines,
# and one job's only its own. The plan holds room for LOG_TEAMS teams' (`total_bytes`).
TEAM_LOGS_BYTES = 64 * MIB
LOG_BATCHES_PER_JOB = 512
LOG_TEAMS = 4  # the store holds more where it has room: `goodput up`'s has 1 GiB beyond the plan
SETUP_HINT = (
    "the operator creates it: `goodput up` does at start, a deployment runs `python -m launcher.setup` "
    "(the setup job in the manifests)"
)


@dataclass(frozen=True)
class LoginLimits:
    """What one login may keep and ask, so that it never fills or stalls what every login shares."""

    submissions: int = 20_000  # valid submissions kept in the jobs stream (its 30 days), each MAX_STORED_BYTES at most
    refusals: int = 1_000  # records of its refused bodies kept there (beyond: answered, not recorded)
    backlog: int = 5_000  # its own submissions waiting in the intake stream (each at most MAX_INTAKE_BYTES)


LOGIN_LIMITS = LoginLimits()


@dataclass(frozen=True)
class TeamLimits:
    """What one team's logins keep together, so that a team that floods fills only its own share of
    the jobs stream and the other teams still submit (DEFAULT_TEAM's logins are one team too)."""

    submissions: int = 100_000  # valid submissions kept in the jobs stream, each MAX_STORED_BYTES at most
    refusals: int = 5_000  # records of its refused bodies kept there (beyond: answered, not recorded)


TEAM_LIMITS = TeamLimits()
USERS_SHARE = 0.75  # of the jobs stream: what logins' records may fill; the rest is the verdicts'


class StorageMismatch(RuntimeError):
    """A stream, bucket or consumer a service needs is missing, or not as the plan says."""


@dataclass(frozen=True)
class Stream:
    name: str
    subjects: tuple[str, ...]
    limits: dict[str, Any] = field(default_factory=dict)  # nats-py StreamConfig fields


@dataclass(frozen=True)
class Bucket:
    name: str
    max_bytes: int
    history: int = 1
    ttl_s: float | None = None  # None: entries stay until deleted

    @property
    def stream(self) -> str:
        return f"KV_{self.name}"


@dataclass(frozen=True)
class Durable:
    stream: str
    name: str
    filters: tuple[str, ...]
    ack_wait_s: float = 30.0  # a handler that takes longer says it is still at work (Delivery.in_progress)


def logs_plan(team: str, **limits: Any) -> Stream:
    """The stream of what `team`'s jobs print: rotated, a job's oldest batches going first past its
    share, any of the team's past its bytes or age, so a chatty job neither fills the disk nor
    refuses, nor ages out another team's. DEFAULT_TEAM's is the operator's (`provision`); another
    team's is made by the first node agent that stores its lines (`ensure_logs`), which may make that
    team's only (shared/permissions.py). `limits`: others than the plan's (a test's)."""
    return Stream(
        subjects.logs_stream(team),
        (subjects.team_logs(team),),
        {
            "max_bytes": TEAM_LOGS_BYTES,
            "max_age": 7 * DAY_S,
            "max_msgs_per_subject": LOG_BATCHES_PER_JOB,
            "max_msg_size": 64 * KIB,
            "discard": api.DiscardPolicy.OLD,
            **limits,
        },
    )


async def ensure_logs(bus: Bus, team: str, **limits: Any) -> None:
    """Create `team`'s logs stream, or bring it to the plan (`logs_plan`'s `limits`): nothing asked
    but its info when it is so."""
    stream = logs_plan(team, **limits)
    try:
        info = await bus.js.stream_info(stream.name)
        if not _differences(info.config, {"subjects": list(stream.subjects), **stream.limits}):
            return
    except nats.js.errors.NotFoundError:
        pass
    await bus.ensure_stream(stream.name, stream.subjects, **stream.limits)


STREAMS = {
    s.name: s
    for s in (
        # What logins publish themselves, until the gate has judged it (then deleted: a work queue); a
        # login's backlog is bounded, the stream refusing its next message rather than another's. Its
        # window of message ids is the least JetStream allows (100 ms): the window is the stream's, not
        # a login's, so another login's id (the same job file, or a guess) would drop yours as a
        # repeat. The gate tells a repeat itself (the same body under an id it holds).
        Stream(
            subjects.INTAKE_STREAM,
            subjects.INTAKE_SUBJECTS,
            {
                "retention": api.RetentionPolicy.WORK_QUEUE,
                "duplicate_window": 0.1,
                "max_bytes": 512 * MIB,
                "max_age": 7 * DAY_S,
                "max_msg_size": MAX_INTAKE_BYTES,
                "discard": api.DiscardPolicy.NEW,
                "max_msgs_per_subject": LOGIN_LIMITS.backlog,
                "discard_new_per_subject": True,
            },
        ),
        # Stored submissions and verdicts: refused when full, never dropped; a message is at most 64 KiB.
        Stream(
            subjects.JOBS_STREAM,
            subjects.JOBS_STREAM_SUBJECTS,
            {
                "duplicate_window": subjects.DEDUP_WINDOW_S,
                "max_bytes": 1 * GIB,
                "max_age": 30 * DAY_S,
                "max_msg_size": MAX_SUBMISSION_BYTES,
                "discard": api.DiscardPolicy.NEW,
            },
        ),
        # What no consumer could process: the newest kept a week.
        Stream(
            subjects.DEAD_LETTER_STREAM,
            subjects.DEAD_LETTER_SUBJECTS,
            {
                "max_age": subjects.DEAD_LETTER_MAX_AGE_S,
                "max_msgs": subjects.DEAD_LETTER_MAX_MSGS,
                "max_bytes": 256 * MIB,
                "max_msg_size": MAX_SUBMISSION_BYTES + 4 * KIB,
                "discard": api.DiscardPolicy.OLD,
            },
        ),
        # Each run's rounds; a live run's oldest go first.
        Stream(
            subjects.RUN_LOG_STREAM,
            subjects.RUN_LOG_SUBJECTS,
            {
                "duplicate_window": subjects.RUN_LOG_DEDUP_S,
                "max_bytes": 512 * MIB,
                "max_age": 30 * DAY_S,
                "discard": api.DiscardPolicy.OLD,
            },
        ),
        logs_plan(subjects.DEFAULT_TEAM),  # what DEFAULT_TEAM's jobs print; each other team's, its own
        # The live run's decisions: each job's last rounds, and the rounds' summaries, for `goodput
        # explain` and the dashboard; the oldest go first past a subject's bound, the age or the bytes.
        Stream(
            subjects.DECISIONS_STREAM,
            subjects.DECISIONS_SUBJECTS,
            {
                "max_bytes": 256 * MIB,
                "max_age": subjects.DECISIONS_MAX_AGE_S,
                "max_msgs_per_subject": subjects.DECISIONS_PER_SUBJECT,
                "max_msg_size": 1 * MIB,
                "discard": api.DiscardPolicy.OLD,
            },
        ),
    )
}

BUCKETS = {
    b.name: b
    for b in (
        Bucket(subjects.RUNS_BUCKET, 512 * MIB),
        Bucket(subjects.LEASE_BUCKET, 1 * MIB, ttl_s=LEASE_TTL_S),
        Bucket(subjects.ESTIMATES_BUCKET, 512 * MIB),
        Bucket(subjects.EXECUTOR_BUCKET, 1 * GIB),
        Bucket(subjects.NODE_JOBS_BUCKET, 512 * MIB),
        Bucket(subjects.JOB_OWNERS_BUCKET, 128 * MIB),
        Bucket(subjects.NODES_BUCKET, 16 * MIB, ttl_s=subjects.NODE_TTL_S),  # an agent that stops renewing is lost
        Bucket(subjects.DRAINED_BUCKET, 16 * MIB),
        Bucket(subjects.TEAMS_BUCKET, 1 * MIB),
    )
}

# Object stores: name -> max bytes. The checkpoints of jobs on clusters with no shared folder
# (`--checkpoints jetstream:`): enough for small models; larger ones belong on a shared volume.
# Jobs' own code: archives of at most 32 MiB (shared.code_archive), named by their digest, kept as
# long as a submission is (an older job's code is gone with it); a full store refuses the next upload.
OBJECT_STORES = {subjects.CHECKPOINTS_STORE: 1 * GIB, subjects.CODE_STORE: 512 * MIB}
OBJECT_STORE_MAX_AGE_S = {subjects.CODE_STORE: 30 * DAY_S}  # the others keep what they hold

CONSUMERS = {
    c.name: c
    for c in (
        Durable(subjects.INTAKE_STREAM, subjects.INTAKE_CONSUMER, subjects.INTAKE_SUBJECTS),
        Durable(subjects.JOBS_STREAM, subjects.PROFILER_CONSUMER, subjects.SUBMISSIONS),
        Durable(subjects.JOBS_STREAM, subjects.EXECUTOR_CONSUMER, (subjects.JOBS_EVENTS,)),
        Durable(subjects.JOBS_STREAM, subjects.NODE_AGENT_CONSUMER, (subjects.JOBS_EVENTS,)),
    )
}


def total_bytes() -> int:
    """The most the plan's streams and buckets may hold together."""
    return (
        sum(s.limits.get("max_bytes", 0) for s in STREAMS.values())
        + (LOG_TEAMS - 1) * TEAM_LOGS_BYTES  # the other teams' logs streams (DEFAULT_TEAM's is in STREAMS)
        + sum(b.max_bytes for b in BUCKETS.values())
        + sum(OBJECT_STORES.values())
    )


def _bucket_limits(bucket: Bucket, ttl_s: float | None) -> dict[str, Any]:
    """The fields of a bucket's stream the plan sets (nats-py writes a bucket's `ttl` as `max_age`)."""
    return {"max_bytes": bucket.max_bytes, "max_msgs_per_subject": bucket.history, "max_age": ttl_s or 0.0}


async def provision(bus: Bus, lease_ttl_s: float = LEASE_TTL_S) -> None:
    """Create every stream, bucket and consumer of the plan, or bring one that exists to it (the
    operator's part; idempotent). `lease_ttl_s`: the policy lease's time to live. A JetStream that
    does not answer in time (a cluster still electing its leaders, each replicated stream a group of
    its own) is asked again, for up to PROVISION_WAIT_S."""
    for stream in STREAMS.values():
        await _patiently(lambda s=stream: bus.ensure_stream(s.name, s.subjects, **s.limits))
    for bucket in BUCKETS.values():
        await _patiently(lambda b=bucket: _provision_bucket(bus, b, lease_ttl_s))
    for name, max_bytes in OBJECT_STORES.items():
        await _patiently(
            lambda n=name, m=max_bytes: bus.js.create_object_store(
                n,
                config=api.ObjectStoreConfig(
                    bucket=n, max_bytes=m, replicas=bus.replicas, ttl=OBJECT_STORE_MAX_AGE_S.get(n)
                ),
            )
        )
    for durable in CONSUMERS.values():
        await _patiently(lambda d=durable: bus.js.add_consumer(d.stream, _consumer_config(d)))


PROVISION_WAIT_S = 120.0


# A cluster still forming: its meta leader may not yet see every peer (placement finds none online,
# 10005) or JetStream may not yet be up on it (503); both pass within seconds.
_FORMING_CODES = frozenset({10005})


async def _patiently(step) -> None:
    """An idempotent JetStream step, asked again while the cluster is still forming."""
    deadline = asyncio.get_running_loop().time() + PROVISION_WAIT_S
    while True:
        try:
            await step()
            return
        except (nats.errors.TimeoutError, nats.js.errors.APIError) as error:
            forming = not isinstance(error, nats.js.errors.APIError) or (
                error.code == 503 or error.err_code in _FORMING_CODES
            )
            if not forming or asyncio.get_running_loop().time() > deadline:
                raise
            log.warning("JetStream is not ready (%s; a cluster still forming?); asking again", error)
            await asyncio.sleep(0.5)


async def _provision_bucket(bus: Bus, bucket: Bucket, lease_ttl_s: float) -> None:
    ttl_s = lease_ttl_s if bucket.name == subjects.LEASE_BUCKET else bucket.ttl_s
    await bus.kv(bucket.name, bytes, history=bucket.history, ttl=ttl_s, max_bytes=bucket.max_bytes)
    info = await bus.js.stream_info(bucket.stream)
    if _differences(info.config, _bucket_limits(bucket, ttl_s)):  # made before with other limits
        for name, value in _bucket_limits(bucket, ttl_s).items():
            setattr(info.config, name, value)
        await bus.js.update_stream(info.config)


def _consumer_config(durable: Durable) -> api.ConsumerConfig:
    filters = list(durable.filters)
    return api.ConsumerConfig(
        name=durable.name,
        durable_name=durable.name,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=durable.ack_wait_s,
        max_deliver=MAX_DELIVER,
        **({"filter_subject": filters[0]} if len(filters) == 1 else {"filter_subjects": filters}),
    )


def _differences(config: Any, expected: dict[str, Any]) -> list[str]:
    """`name is X, the plan says Y` for each expected field the configuration does not match."""
    found = []
    for name, want in expected.items():
        have = getattr(config, name, None)
        if isinstance(want, float) or isinstance(have, float):
            same = abs(float(have or 0.0) - float(want or 0.0)) < 1e-6
        elif name == "subjects":
            same = sorted(have or []) == sorted(want)
        else:
            same = have == want
        if not same:
            found.append(f"{name} is {have!r}, the plan says {want!r}")
    return found


async def _info(bus: Bus, name: str, what: str) -> api.StreamInfo:
    try:
        return await bus.js.stream_info(name)
    except nats.js.errors.NotFoundError:
        raise StorageMismatch(f"the {what} {name} does not exist: {SETUP_HINT}") from None


async def open_stream(bus: Bus, name: str) -> api.StreamInfo:
    """The stream, checked against the plan; StorageMismatch naming what differs."""
    stream = STREAMS[name]
    info = await _info(bus, name, "stream")
    problems = _differences(info.config, {"subjects": list(stream.subjects), **stream.limits})
    if problems:
        raise StorageMismatch(f"the stream {name} differs from the plan ({'; '.join(problems)}): {SETUP_HINT}")
    return info


async def open_kv(bus: Bus, bucket: str, value_type: type[T]) -> TypedKV[T]:
    """The bucket, checked against the plan (a lease bucket's TTL is the operator's choice)."""
    plan = BUCKETS[bucket]
    info = await _info(bus, plan.stream, "KV bucket")
    expected = _bucket_limits(plan, plan.ttl_s)
    if plan.ttl_s is not None:
        del expected["max_age"]
    problems = _differences(info.config, expected)
    if problems:
        raise StorageMismatch(f"the KV bucket {bucket} differs from the plan ({'; '.join(problems)}): {SETUP_HINT}")
    return await bus.open_kv(bucket, value_type)


async def bucket_ttl(bus: Bus, bucket: str) -> float:
    """The time to live the operator gave a bucket's entries (the policy lease's)."""
    return float((await _info(bus, BUCKETS[bucket].stream, "KV bucket")).config.max_age or 0.0)


async def open_consumer(bus: Bus, durable: str, msg_type: type[T], **options: Any) -> PullConsumer[T]:
    """Bind to one of the plan's durable consumers (`options`: Bus.bind_consumer's)."""
    plan = CONSUMERS[durable]
    await open_stream(bus, plan.stream)
    try:
        return await bus.bind_consumer(plan.stream, durable, msg_type, **options)
    except nats.js.errors.NotFoundError:
        raise StorageMismatch(f"the consumer {durable} of {plan.stream} does not exist: {SETUP_HINT}") from None
    except nats.errors.Error as error:
        raise StorageMismatch(f"cannot bind the consumer {durable} of {plan.stream} ({error}): {SETUP_HINT}") from None
