"""Where the dashboard reads the cluster: the user API, through one NATS connection logged in as the
user (`ApiSource`). The app asks a source only these four things, so a test gives it a fake one."""

from __future__ import annotations

import asyncio

import msgspec
import nats.errors
from nats.micro.request import ServiceError

from shared import subjects
from shared.schema.api import MAX_PAGE, JobsPage, JobsRequest, JobStatus, TeamsAnswer, TeamsRequest
from shared.schema.decisions import ExplainRequest, Explanation, RoundsPage, RoundsRequest

REQUEST_TIMEOUT_S = 10.0


class Unavailable(Exception):
    """The API does not answer this request (no service serves it, or not in time): why, in words."""


class UnknownJob(LookupError):
    """No job of that id is the login's to see (the API's 404)."""


class ApiSource:
    """The user API on a connected `shared.bus.Bus`: what the login may see, and nothing else."""

    def __init__(self, bus, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.bus, self.timeout_s = bus, timeout_s

    async def _ask(self, subject: str, request, answer_type):
        try:
            return await self.bus.request(subject, request, answer_type, timeout=self.timeout_s)
        except nats.errors.NoRespondersError:
            raise Unavailable(f"no service answers {subject}") from None
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            raise Unavailable(f"{subject} did not answer within {self.timeout_s:.0f} s") from None
        except ServiceError as error:
            if error.code == "404":
                raise UnknownJob(error.description) from None
            raise Unavailable(f"{subject} refused: {error.description}") from None
        except msgspec.DecodeError as error:  # an API of another version
            raise Unavailable(f"{subject} answered what this dashboard cannot read ({error})") from None
        except nats.errors.Error as error:  # the connection is down: it reconnects by itself
            raise Unavailable(f"NATS: {error or type(error).__name__}") from None

    async def jobs(self) -> list[JobStatus]:
        """Every job of the login's, page by page, in submission order."""
        jobs: list[JobStatus] = []
        offset: int | None = 0
        while offset is not None:
            page = await self._ask(subjects.API_JOBS, JobsRequest(offset=offset, limit=MAX_PAGE), JobsPage)
            jobs += page.jobs
            offset = page.next_offset
        return jobs

    async def rounds(self, limit: int) -> RoundsPage:
        return await self._ask(subjects.API_ROUNDS, RoundsRequest(limit=limit), RoundsPage)

    async def explain(self, job_id: str, rounds: int) -> Explanation:
        return await self._ask(subjects.API_EXPLAIN, ExplainRequest(job_id, rounds), Explanation)

    async def teams(self) -> TeamsAnswer:
        return await self._ask(subjects.API_TEAMS, TeamsRequest(), TeamsAnswer)
