"""The user API's endpoints as a client sees them: each one's name, subject, request and answer
messages and what it does, and the JSON Schema document of every message (`schemas()`, answered on
`goodput.api.schemas` and printed by `goodput schemas`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import msgspec

from shared import subjects
from shared.schema.api import (
    CancelAnswer,
    JobRequest,
    JobsPage,
    JobsRequest,
    JobStatus,
    SubmitAnswer,
    TeamsAnswer,
    TeamsRequest,
)
from shared.schema.base import Ack
from shared.schema.code import CodeAnswer, CodeChunk, CodeRequest
from shared.schema.decisions import ExplainRequest, Explanation, RoundsPage, RoundsRequest
from shared.schema.jobs import JobSpec
from shared.schema.logs import LogsPage, LogsRequest

ENCODING = "JSON or msgpack; answered in the request's encoding"


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
        return {
            "request": self.request.__name__,
            "response": message_name(self.response),
            "encoding": ENCODING,
            "schemas": subjects.API_SCHEMAS,
            "description": self.description,
        }


ENDPOINTS = (
    Endpoint(
        "submit",
        subjects.API_SUBMIT,
        JobSpec,
        SubmitAnswer,
        "submit a job; only a valid submission is stored, a refused one gets the reason",
    ),
    Endpoint("job", subjects.API_JOB, JobRequest, JobStatus, "a job's state, as `goodput status --json` shows it"),
    Endpoint("jobs", subjects.API_JOBS, JobsRequest, JobsPage, "the jobs in submission order: filters and paging"),
    Endpoint(
        "cancel",
        subjects.API_CANCEL,
        JobRequest,
        CancelAnswer,
        "cancel a job: queued, it never starts; running, its workers checkpoint and stop",
    ),
    Endpoint("schemas", subjects.API_SCHEMAS, Ack, dict, "the JSON Schema of every request and answer"),
    Endpoint(
        "logs",
        subjects.API_LOGS,
        LogsRequest,
        LogsPage,
        "a job's output, to its team: each rank's stdout and stderr lines, a page at a time",
    ),
    Endpoint(
        "code-put",
        subjects.API_CODE_PUT,
        CodeChunk,
        CodeAnswer,
        "upload a job's code archive in chunks; checked whole, then stored under your login and its sha256",
    ),
    Endpoint("code-has", subjects.API_CODE_HAS, CodeRequest, CodeAnswer, "whether your archive is stored already"),
    Endpoint(
        "teams",
        subjects.API_TEAMS,
        TeamsRequest,
        TeamsAnswer,
        "each team's guaranteed GPUs per type, their use, what it borrows and what it lends (your team's)",
    ),
    Endpoint(
        "explain",
        subjects.API_EXPLAIN,
        ExplainRequest,
        Explanation,
        "why a job has what it has, in sentences, from the rounds' recorded decisions (your team's jobs)",
    ),
    Endpoint(
        "rounds",
        subjects.API_ROUNDS,
        RoundsRequest,
        RoundsPage,
        "the last rounds' summaries (GPUs by type and state, goodput, times) and the latest's nodes",
    ),
)


def message_name(kind: type) -> str:
    """A message's name in the `schemas` document (a plain JSON object's: `object`)."""
    return "object" if kind is dict else kind.__name__


@functools.cache
def schemas() -> dict[str, Any]:
    """{"$defs": every message's JSON Schema, "endpoints": subject -> its request's and answer's names}."""
    types = list(dict.fromkeys(t for e in ENDPOINTS for t in (e.request, e.response) if t is not dict))
    _, definitions = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    return {
        "$defs": definitions,
        "endpoints": {
            e.subject: {
                "request": e.request.__name__,
                "response": message_name(e.response),
                "description": e.description,
            }
            for e in ENDPOINTS
        },
    }
