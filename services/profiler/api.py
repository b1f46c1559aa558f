"""The user API: `goodput.api.*`, a NATS micro service (`api` in `$SRV.INFO`) that answers every
request, in the request's encoding (JSON or msgpack), so a client in any language needs only a NATS
client. The profiler's replicas serve it (one queue group): it is the gate of submissions, and
validates one as the profiler would before anything is stored.

- `submit`: a JobSpec -> SubmitAnswer. Only a valid submission is stored (in the jobs stream, as if
  published to goodput.jobs.submit) under the Nats-Msg-Id `<id>.<digest of the body>`: a refused
  body reserves nothing, so the corrected one is taken under the same id; the same body again is a
  repeat. The id goes to the first valid submission stored: the API marks the id while it stores
  (so of two bodies racing here, the second is refused at once, storing nothing), and a body
  stored first through the JetStream subject takes the id over from the mark (the profiler reads
  the stream in order, as the executors do); that answer says so. The profiler's verdict follows
  (a real profiling run may still refuse it; `job` says so).
- `job`: {"id"} -> its JobStatus (404 when no job has that id); `jobs`: filters and paging.
- `cancel`: {"id"} -> CancelAnswer: the order goes to the jobs stream, the executors end the job.
- `schemas`: every request's and answer's JSON Schema (generated from the Structs).

Refusals are recorded as the profiler records them (a Rejected on the jobs stream), so `job` shows
why a submission was refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgspec
from nats import micro
from opentelemetry import trace

from services.profiler.core import id_taken, malformed_reason
from services.runner import new_service
from shared import subjects
from shared.bus import Bus, NotFound, Refused, RevisionConflict, TypedKV
from shared.schema import (
    JOB_STATES,
    MARK_TTL_S,
    Ack,
    Cancel,
    CancelAnswer,
    JobOwner,
    JobRecords,
    JobRequest,
    JobsPage,
    JobSpec,
    JobsQuery,
    JobsRequest,
    JobStatus,
    SubmitAnswer,
    job_statuses,
    readable_fields,
    rejection,
    spec_digest,
    submission_msg_id,
)
from shared.storage import MAX_SUBMISSION_BYTES

ENDED = ("finished", "failed", "rejected")
ENCODING = "JSON or msgpack; answered in the request's encoding"
RECORDS_TIMEOUT_S = 10.0
CANCEL_WAIT_S = 10.0          # how long `cancel` waits for the executors to take the order before it answers
CANCEL_POLL_S = 0.2
CONCURRENCY = 64              # requests one replica serves at once: each mostly waits on JetStream and the executors


@dataclass(frozen=True)
class Endpoint:
    name: str
    subject: str
    request: type
    response: type
    description: str

    @property
    def metadata(self) -> dict[str, str]:
        """What $SRV.INFO says of it: its messages (by their names in the `schemas` answer), encoding."""
        return {"request": self.request.__name__, "response": _name(self.response), "encoding": ENCODING,
                "schemas": subjects.API_SCHEMAS, "description": self.description}


ENDPOINTS = (
    Endpoint("submit", subjects.API_SUBMIT, JobSpec, SubmitAnswer,
             "submit a job; only a valid submission is stored, a refused one gets the reason"),
    Endpoint("job", subjects.API_JOB, JobRequest, JobStatus, "a job's state, as `goodput status --json` shows it"),
    Endpoint("jobs", subjects.API_JOBS, JobsRequest, JobsPage, "the jobs in submission order: filters and paging"),
    Endpoint("cancel", subjects.API_CANCEL, JobRequest, CancelAnswer,
             "cancel a job: queued, it never starts; running, its workers checkpoint and stop"),
    Endpoint("schemas", subjects.API_SCHEMAS, Ack, dict, "the JSON Schema of every request and answer"),
)


def _name(kind: type) -> str:
    return "object" if kind is dict else kind.__name__


@functools.cache
def schemas() -> dict[str, Any]:
    """{"$defs": every message's JSON Schema, "endpoints": subject -> its request's and answer's names}."""
    types = list(dict.fromkeys(t for e in ENDPOINTS for t in (e.request, e.response) if t is not dict))
    _, definitions = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    return {"$defs": definitions,
            "endpoints": {e.subject: {"request": e.request.__name__, "response": _name(e.response),
                                      "description": e.description} for e in ENDPOINTS}}


def page(jobs: list[JobStatus], request: JobsRequest) -> JobsPage:
    """The page `request` asks for of `jobs` (in submission order)."""
    if request.state is not None and request.state not in JOB_STATES:
        raise ValueError(f"unknown state {request.state!r}: one of {', '.join(JOB_STATES)}")
    chosen = [j for j in jobs if (request.state is None or j.state == request.state)
              and (request.application is None or j.application == request.application)]
    end = request.offset + request.limit
    return JobsPage(tuple(chosen[request.offset:end]), len(chosen), end if end < len(chosen) else None)


def notes(spec: JobSpec) -> tuple[str, ...]:
    """What a submitter may not expect of an accepted job."""
    found = []
    if not spec.rigid and spec.requested_gpus > 1:
        found.append(f"requested_gpus {spec.requested_gpus} is a hint: the scheduler gives the job the GPUs (and "
                     "batch) that maximise its goodput, which change as it trains; `rigid: true` holds it to exactly "
                     "that many")
    if spec.min_gpus > spec.requested_gpus:
        found.append(f"min_gpus {spec.min_gpus} is more than requested_gpus {spec.requested_gpus}: it never runs on "
                     f"fewer than {spec.min_gpus}")
    return tuple(found)


Problem = Callable[[JobSpec], str | None | Awaitable[str | None]]


async def start(bus: Bus, owners: TypedKV[JobOwner], problem: Problem) -> micro.Service:
    """Serve the API on `bus` (started, stopped with it). `problem(spec)`: why a well-formed live
    submission cannot be scheduled on this cluster, or None (the profiler's own check; a coroutine
    function when it asks, e.g. which applications the live node agents run)."""

    async def statuses(prefix: str = "") -> list[JobStatus]:
        try:
            records = await bus.request(subjects.RECORDS, JobsQuery(prefix), JobRecords, timeout=RECORDS_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - no executor answers: the caller is told so
            raise ValueError(f"the executors do not answer ({type(error).__name__}); try again") from None
        return job_statuses(records.jobs)

    async def status_of(job_id: str) -> JobStatus | None:
        trace.get_current_span().set_attribute("job.id", job_id)
        found = next((j for j in await statuses(job_id) if j.id == job_id), None)
        if found is None or found.state == "rejected":
            held = await owners.get(job_id)
            # Stored, not yet read by the executors. A refusal they show is then an earlier body's (a
            # refused stored submission gives the id up): the corrected one is profiling.
            if held is not None and (found is None or not held.value.marking):
                return JobStatus(job_id, "profiling")
        return found

    async def refuse(data: bytes, reason: str, job_id: str | None = None) -> SubmitAnswer:
        """Record the refusal as the profiler records one (listed, with what could be read of the
        body: its id and application) and answer it."""
        if job_id is None:
            job_id = readable_fields(data).get("id")
        await bus.js_publish(subjects.REJECTED, rejection(subjects.API_SUBMIT, reason, data, job_id))
        return SubmitAnswer(False, job_id, "rejected", reason)

    async def repeat(job_id: str) -> SubmitAnswer:
        now = await status_of(job_id)
        if now is not None and now.state == "rejected":     # within JetStream's day, the same body refused before
            return SubmitAnswer(False, job_id, now.state, f"the same submission was refused before: {now.reason}")
        return SubmitAnswer(True, job_id, now.state if now else "profiling",
                            "the same submission was stored before: not stored again")

    async def answered(raw: msgspec.Raw) -> SubmitAnswer:
        """`submit`'s answer; a refusal is service error 400 too, its answer the body (Refused)."""
        answer = await submit(bytes(raw))
        if not answer.accepted:
            raise Refused(answer.reason, answer)
        return answer

    async def unreadable(_: str, data: bytes, error: Exception) -> None:
        """A body that is no JSON object nor msgpack map: refused like any malformed one."""
        answer = await refuse(data, malformed_reason(error))
        raise Refused(answer.reason, answer)

    async def submit(data: bytes) -> SubmitAnswer:
        if len(data) > MAX_SUBMISSION_BYTES:
            return await refuse(data, f"a submission is at most {MAX_SUBMISSION_BYTES // 1024} KiB; this one is "
                                      f"{len(data) / 1024:.0f} KiB")
        try:
            spec = bus.decode(data, JobSpec)
        except msgspec.DecodeError as error:
            return await refuse(data, malformed_reason(error))
        trace.get_current_span().set_attribute("job.id", spec.id)
        reason = problem(spec)
        if inspect.isawaitable(reason):
            reason = await reason
        if reason is not None:
            return await refuse(data, reason, spec.id)
        digest = spec_digest(spec)
        mark = await claim(spec.id, digest)
        if isinstance(mark, SubmitAnswer):
            return mark
        try:
            ack = await bus.js_publish(subjects.SUBMIT, spec, msg_id=submission_msg_id(spec), timeout=10)
        except BaseException:
            with contextlib.suppress(Exception):      # not stored: the id is free again
                await owners.delete(spec.id, mark)
            raise
        if ack.duplicate:                             # stored before, and then refused (else it would hold the id)
            with contextlib.suppress(RevisionConflict):
                await owners.delete(spec.id, mark)
            return await repeat(spec.id)
        try:              # the mark becomes this submission's claim, unless one stored before took the id
            await owners.update(spec.id, JobOwner(ack.seq, digest, subjects.SUBMIT), mark)
        except RevisionConflict:
            held = await owners.get(spec.id)
            if held is None or (held.value.submission != ack.seq and held.value.digest != digest):
                return SubmitAnswer(False, spec.id, "rejected", id_taken(spec.id))    # the profiler refuses it
        return SubmitAnswer(True, spec.id, "profiling", notes=notes(spec))

    async def claim(job_id: str, digest: str) -> int | SubmitAnswer:
        """Mark the id as being stored (the mark's revision), or the answer when it is held: a
        repeat of the same body, or another body's."""
        mark = JobOwner(0, digest, subjects.SUBMIT, since=time.time())
        for _ in range(3):
            try:
                return await owners.create(job_id, mark)
            except RevisionConflict:
                held = await owners.get(job_id)
            if held is None:
                continue
            if held.value.marking and time.time() - held.value.since > MARK_TTL_S:    # its replica died
                with contextlib.suppress(RevisionConflict):
                    return await owners.update(job_id, mark, held.revision)
                continue
            if held.value.digest == digest:
                return await repeat(job_id)
            return SubmitAnswer(False, job_id, "rejected", id_taken(job_id))
        raise RuntimeError(f"job {job_id}: its id changes hands too fast to claim")

    async def job(request: JobRequest) -> JobStatus:
        found = await status_of(request.id)
        if found is None:
            raise NotFound(f"no job {request.id!r}: none was submitted under this id")
        return found

    async def jobs(request: JobsRequest) -> JobsPage:
        return page(await statuses(request.prefix), request)

    async def cancel(request: JobRequest) -> CancelAnswer:
        now = await status_of(request.id)
        if now is None:
            raise NotFound(f"no job {request.id!r}: none was submitted under this id")
        if now.state == "cancelled":
            return CancelAnswer(True, request.id, now.state, "it was cancelled before")
        if now.state in ENDED:
            return CancelAnswer(False, request.id, now.state, f"job {request.id} has ended ({now.state}): "
                                                               "nothing to cancel")
        await bus.js_publish(subjects.CANCEL, Cancel(request.id), msg_id=f"{request.id}.cancel", timeout=10)
        deadline = asyncio.get_running_loop().time() + CANCEL_WAIT_S
        while now is not None and now.state != "cancelled" and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(CANCEL_POLL_S)
            now = await status_of(request.id)
        if now is not None and now.state == "cancelled":
            return CancelAnswer(True, request.id, now.state)
        return CancelAnswer(True, request.id, now.state if now else "unknown",
                            "the order is stored; the executors end the job as they read it")

    handlers = {"submit": answered, "job": job, "jobs": jobs, "cancel": cancel, "schemas": lambda _: schemas()}
    request_types = {"submit": msgspec.Raw}          # decoded by `submit` itself, to answer a bad body
    service = new_service(bus, subjects.API_SERVICE, "the user API: submit, look up, list and cancel jobs")
    for endpoint in ENDPOINTS:
        await bus.add_endpoint(service, endpoint.name, endpoint.subject,
                               request_types.get(endpoint.name, endpoint.request), handlers[endpoint.name],
                               span_name=f"api.{endpoint.name}", metadata=endpoint.metadata,
                               on_invalid=unreadable if endpoint.name == "submit" else None,
                               concurrency=CONCURRENCY)
    await service.start()
    bus.on_close(service.stop)
    return service


# ---- docs/api.md's generated part ---------------------------------------------------------------

DOCS = "docs/api.md"
BEGIN, END = "<!-- schemas: begin (python -m services.profiler.api writes this part) -->", "<!-- schemas: end -->"


def schemas_markdown() -> str:
    """The endpoints and every message's JSON Schema, as docs/api.md shows them."""
    import json

    document = schemas()
    lines = [BEGIN, "", "| subject | request | answer | what |", "|---|---|---|---|"]
    lines += [f"| `{e.subject}` | `{e.request.__name__}` | `{_name(e.response)}` "
              f"| {e.description} |" for e in ENDPOINTS]
    for name, schema in document["$defs"].items():
        lines += ["", f"### {name}", "", "```json", json.dumps(schema, indent=2, sort_keys=True), "```"]
    return "\n".join([*lines, "", END])


def write_docs(path: str = DOCS) -> bool:
    """Bring the generated part of `path` up to date; whether it changed."""
    from pathlib import Path

    text = Path(path).read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    updated = text[:start] + schemas_markdown() + text[end:]
    Path(path).write_text(updated)
    return updated != text


if __name__ == "__main__":
    print(f"{DOCS}: {'updated' if write_docs() else 'up to date'}")
