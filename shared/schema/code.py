"""A job's own code on its way into the code store (`goodput.api.code.*`, the user API): a login
sends the archive in chunks (CodeChunk, each in one message), named by the archive's digest; the
API checks the whole one (its digest, `shared.code_archive.check`) and stores it under the digest.
An archive already there is not sent again: `code.has`, or the answer to the first chunk, says so."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.code_archive import LIMITS, MAX_ARG, MAX_ARGS, MAX_ENTRYPOINT
from shared.requirements import MAX_REQUIREMENT, MAX_REQUIREMENTS

CHUNK_BYTES = 512 * 1024  # a chunk's data: in JSON (base64) it still fits nats-server's 1 MiB message

Digest = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$", description="an archive's sha256, in hex")]
Entrypoint = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=MAX_ENTRYPOINT,
        description="a .py script by its path inside the code (relative), or a module's dotted name",
    ),
]
Arguments = Annotated[tuple[Annotated[str, msgspec.Meta(max_length=MAX_ARG)], ...], msgspec.Meta(max_length=MAX_ARGS)]
Requirements = Annotated[
    tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUIREMENT)], ...],
    msgspec.Meta(max_length=MAX_REQUIREMENTS, description="Python packages, one requirement each (as pip reads them)"),
]


class CodeChunk(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Login -> API (`goodput.api.code.put`): bytes [offset, offset + len(data)) of the archive whose
    sha256 is `digest` and whose length is `size`. Chunks come in order (offset 0 starts the upload);
    the one that completes it has the API check and store the archive."""

    digest: Digest
    size: Annotated[int, msgspec.Meta(ge=1, le=LIMITS.compressed)]
    offset: Annotated[int, msgspec.Meta(ge=0, le=LIMITS.compressed)]
    data: Annotated[bytes, msgspec.Meta(max_length=CHUNK_BYTES)]  # base64 in JSON


class CodeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Login -> API (`goodput.api.code.has`): is this archive stored, or how much of it has come?"""

    digest: Digest


class CodeAnswer(msgspec.Struct, frozen=True):
    """API -> login: `stored`: the archive is in the code store (a job may name it); else `received`:
    the bytes of this login's upload of it the API holds (the next chunk's offset)."""

    digest: str
    stored: bool
    received: int = 0
    reason: str = ""
