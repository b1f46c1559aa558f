"""Who sent a request, as the server says (`requester()`), and what each requester may ask of one
endpoint (`RequesterLimits`: a token bucket, and requests in hand); and where a reply may go
(`is_inbox`: never a subject the requester names but may not publish to)."""

from __future__ import annotations

import json
import time
from contextvars import ContextVar
from dataclasses import dataclass

INBOX = "_INBOX"  # what every reply subject begins with (nats-py's default, or _INBOX_<role>)
RESPONSE = "_R_"  # ... or, for a request that came through an import, the server's mapping of it
REQUEST_INFO_HEADER = "Nats-Request-Info"  # the server's word of who sent a request through an import
TOO_MANY = "429"


def is_inbox(reply: str) -> bool:
    """Whether a reply subject is an inbox (`_INBOX.…`, `_INBOX_<role>.…`, the server's `_R_.…`), the
    only place a service answers: never a JetStream API subject or a KV key a requester names."""
    first, dot, rest = reply.partition(".")
    return (first.startswith(INBOX) or first == RESPONSE) and bool(dot and rest)


@dataclass(frozen=True)
class Requester:
    """Who sent a request, as the server says: its account and user."""

    account: str
    user: str


_current_requester: ContextVar[Requester | None] = ContextVar("requester", default=None)


def requester() -> Requester | None:
    """Who sent the request being handled, as the server says (one that came through an import of
    another account); None for a request from within the service's own account, or on a server
    without accounts."""
    return _current_requester.get()


def requester_of(headers: dict[str, str] | None) -> Requester | None:
    """The requester a request's `Nats-Request-Info` names (None: it has none)."""
    info = (headers or {}).get(REQUEST_INFO_HEADER)
    if info is None:
        return None
    try:
        document = json.loads(info)
        return Requester(str(document["acc"]), str(document.get("user", "")))
    except (ValueError, KeyError, TypeError):  # only a client of the service's own account writes it itself
        return Requester("", "")


@dataclass(frozen=True)
class RequesterLimits:
    """What each requester the server names may ask of one endpoint's replica (see `Bus.add_endpoint`)."""

    rate_per_s: float = 100.0  # requests a second (a token bucket) ...
    burst: int = 500  # ... this many at once after a quiet while
    in_flight: int = 16  # requests in hand at once


class _Admission:
    """Each requester's token bucket and requests in hand, for one endpoint."""

    def __init__(self, limits: RequesterLimits) -> None:
        self.limits = limits
        self.tokens: dict[Requester, tuple[float, float]] = {}  # requester -> (tokens, when)
        self.in_hand: dict[Requester, int] = {}

    def refusal(self, who: Requester) -> str | None:
        """Why `who`'s request is refused now, or None (then it is counted in hand: `done` when answered)."""
        if self.in_hand.get(who, 0) >= self.limits.in_flight:
            return f"over your limit: at most {self.limits.in_flight} requests in hand at once; wait for their answers"
        now = time.monotonic()
        tokens, then = self.tokens.get(who, (float(self.limits.burst), now))
        tokens = min(float(self.limits.burst), tokens + (now - then) * self.limits.rate_per_s)
        if tokens < 1.0:
            self.tokens[who] = (tokens, now)
            return (
                f"over your limit: at most {self.limits.rate_per_s:g} requests a second ({self.limits.burst} "
                f"at once); try again in {(1.0 - tokens) / self.limits.rate_per_s:.2f} s"
            )
        self.tokens[who] = (tokens - 1.0, now)
        self.in_hand[who] = self.in_hand.get(who, 0) + 1
        return None

    def done(self, who: Requester) -> None:
        self.in_hand[who] -= 1
        if not self.in_hand[who]:
            del self.in_hand[who]


def _requester(reply: str) -> str:
    """Who asked: the reply subject without its last token (one client's inbox)."""
    return reply.rpartition(".")[0]
