"""A job's Python packages (`JobSpec.requirements`): the lines it asks for, checked as the API takes
them, and the name of the environment they make on a node.

Each line is one requirement as pip and uv read them (PEP 508: `transformers==4.46.3`,
`lightning>=2.4`, `pkg[extra]; python_version >= "3.11"`, `pkg @ https://...`); options (`-r`,
`--index-url`, `-e`) are refused: a node installs from the package index its operator gave it, and
a job names its packages, not where they come from (a URL, at most: an http(s) one). `goodput submit` reads a requirements.txt
into these lines (`lines`), so the environment's name is a hash of what was asked, not of a path.
"""

from __future__ import annotations

import hashlib
import json

from packaging.requirements import InvalidRequirement, Requirement

MAX_REQUIREMENTS = 256
MAX_REQUIREMENT = 512  # characters of one line


def requirement_problem(line: str) -> str | None:
    """Why `line` is not one requirement a node installs; None when it is."""
    if not line or line != line.strip() or len(line) > MAX_REQUIREMENT:
        return f"requirement {line[:80]!r}: one requirement of 1 to {MAX_REQUIREMENT} characters, no spaces around it"
    if line.startswith("-"):
        return (
            f"requirement {line[:80]!r}: pip options are not taken (the nodes install from their own "
            "package index): list the packages only"
        )
    try:
        requirement = Requirement(line)
    except InvalidRequirement as error:
        return f"requirement {line[:80]!r} is not one pip reads: {error}"
    if "$" in line:  # the installer would expand ${NAME}: the node's settings are not a job's to read
        return f"requirement {line[:80]!r}: no $ (the installer would read the node's environment)"
    if requirement.url is not None and not requirement.url.lower().startswith(("https://", "http://")):
        return (
            f"requirement {line[:80]!r}: a package by URL is one at an http(s) address (not a file, not a repository)"
        )
    return None


def lines(text: str) -> list[str]:
    """The requirements of a requirements.txt: one per line, without comments and blank lines."""
    kept = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if line:
            kept.append(line)
    return kept


def environment_key(requirements: tuple[str, ...] | list[str], base: str) -> str:
    """The name of the environment these requirements make over a node's packages (`base`: what the
    node's interpreter and packages are): the same on every node alike, another for any change."""
    asked = json.dumps({"requirements": list(requirements), "base": base}, separators=(",", ":"))
    return hashlib.sha256(asked.encode()).hexdigest()[:32]
