"""What the executor and the node agents agree on about a job's processes: which modules of the
operator's jobs package a submission may run (`GOODPUT_JOB = True` at a module's top level, read
from its source, never run here: the package's helpers are not jobs), how long a stop waits for a
job's workers to checkpoint before they are killed, and how long a node may build a job's
environment."""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import sys
from pathlib import Path

JOBS_PACKAGE = "examples.jobs"  # the code submissions may run by default: a module of this package
JOB_MARKER = "GOODPUT_JOB"  # a job module says `GOODPUT_JOB = True`; its helpers are not jobs
STOP_TIMEOUT_S = 60.0  # a stop's grace: SIGTERM, then this long to checkpoint, then SIGKILL
# The longest a node may take to build a job's environment (its requirements): a start or a
# profiling run that builds one is waited for this much longer.
ENVIRONMENT_MAX_S = 1800.0
# A build that failed answers the same requirements this long, on its node and in the executor (a
# job asking them fails at once, with its lines); then they are tried again (the index may have changed).
ENVIRONMENT_FAILED_KEPT_S = 600.0


def declares_job(path: str | Path | None) -> bool:
    """Whether a module's source says `GOODPUT_JOB = True` at its top level (parsed, not run)."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (TypeError, OSError, SyntaxError, ValueError):  # no source (built-in, compiled), or not Python
        return False
    return any(
        isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and node.value.value is True
        and any(isinstance(target, ast.Name) and target.id == JOB_MARKER for target in node.targets)
        for node in tree.body
    )


def declared_jobs(package: str = JOBS_PACKAGE) -> list[str]:
    """The modules of `package` that declare themselves jobs, as they are now (one added since is found)."""
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    rescan(spec.submodule_search_locations)
    return sorted(
        info.name
        for info in pkgutil.iter_modules(spec.submodule_search_locations)
        if not info.ispkg and declares_job(info.module_finder.find_spec(info.name).origin)
    )


def rescan(locations) -> None:
    """Forget what the import system remembers of these folders' files (each folder's finder), so a
    module added to them since is found; nothing else's caches are touched."""
    for location in locations:
        finder = sys.path_importer_cache.get(location)
        if finder is not None:
            finder.invalidate_caches()


def job_module(application: str, package: str = JOBS_PACKAGE) -> str:
    """The module a job's `application` names; ValueError unless it is one of `package`'s declared jobs."""
    module = f"{package}.{application}"
    rescan(getattr(sys.modules.get(package), "__path__", None) or ())  # a module added since is found
    try:
        spec = importlib.util.find_spec(module) if application.isidentifier() else None
    except ModuleNotFoundError:  # the package itself is not there
        spec = None
    if spec is not None and spec.submodule_search_locations is None and declares_job(spec.origin):
        return module
    why = (
        f"{module} does not declare itself a job (`{JOB_MARKER} = True`)"
        if spec is not None
        else "a submission names its code by one of the package's jobs; it may not carry a command or a path"
    )
    jobs = ", ".join(declared_jobs(package)) or "none"
    raise ValueError(f"no job {application!r} in {package}: {why} (its jobs: {jobs})")
