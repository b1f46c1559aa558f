"""A job's worker processes, as a node agent starts them: which code a submission may run, the
environment a worker gets, and what it leaves behind.

Only a module that declares itself a job (`GOODPUT_JOB = True` at its top level, read from its
source, never run here) may be started: the package's helpers are not jobs. A worker gets a minimal
environment (`worker_env`), never the agent's: its NATS credentials stay with the agent. Its stdin
is its lifeline (the library stops, checkpointed, when it ends), so no worker outlives its agent.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import pkgutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from goodput_train.protocol import GPU_TYPE_ENV, JOB_ENV, LIFELINE_ENV
from shared.files import PRIVATE_UMASK

JOBS_PACKAGE = "examples.jobs"  # the code submissions may run by default: a module of this package
JOB_MARKER = "GOODPUT_JOB"  # a job module says `GOODPUT_JOB = True`; its helpers are not jobs
JOB_MAIN = "services.executor.job_main"  # what runs a job's module in a worker
STOP_TIMEOUT_S = 60.0
ROOT = Path(__file__).resolve().parents[2]
# What a worker inherits from the agent: what Python, PyTorch and the devices need, nothing else
# (the agent's NATS credentials, tokens and TLS keys are not a job's).
WORKER_ENV_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "PYTHONPATH",
        "VIRTUAL_ENV",
        "LD_LIBRARY_PATH",
    }
)
WORKER_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "TORCH_")
NEVER_TO_WORKERS = "GOODPUT_NATS_"


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
    """The modules of `package` that declare themselves jobs."""
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(
        info.name
        for info in pkgutil.iter_modules(spec.submodule_search_locations)
        if not info.ispkg and declares_job(info.module_finder.find_spec(info.name).origin)
    )


def job_module(application: str, package: str = JOBS_PACKAGE) -> str:
    """The module a job's `application` names; ValueError unless it is one of `package`'s declared jobs."""
    module = f"{package}.{application}"
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


def worker_env(env: dict[str, str], parent: dict[str, str] | None = None) -> dict[str, str]:
    """A worker's whole environment: the allowed part of the agent's (`parent`, default ours), one
    thread (a CPU slot is one core), then `env`; never a NATS credential."""
    parent = os.environ if parent is None else parent
    allowed = {
        name: value
        for name, value in parent.items()
        if name in WORKER_ENV_NAMES or name.startswith(WORKER_ENV_PREFIXES)
    }
    return {
        name: value
        for name, value in {**allowed, "OMP_NUM_THREADS": "1", **env}.items()
        if not name.startswith(NEVER_TO_WORKERS)
    }


def worker(module: str, arguments: list[str], env: dict[str, str], log: IO, lifeline: bool = False) -> subprocess.Popen:
    """One process of a job: one thread (the slot's), its stdout for us, its stderr to `log`; with
    `lifeline`, its stdin held by us (the library stops when it ends). It finds the jobs package
    from ROOT, its working directory (`-m` puts that first on sys.path), or from PYTHONPATH; run
    through `job_main`, it exits quietly once we are gone. What it writes (its checkpoints, any file of
    its own code) is its owner's only, whatever the umask of the process that starts it."""
    if lifeline:
        env = {**env, LIFELINE_ENV: "1"}
    return subprocess.Popen(
        [sys.executable, "-m", JOB_MAIN, module, *arguments],
        env=worker_env(env),
        stdout=subprocess.PIPE,
        stderr=log,
        stdin=subprocess.PIPE if lifeline else subprocess.DEVNULL,
        text=True,
        errors="replace",
        cwd=ROOT,
        umask=PRIVATE_UMASK,
    )


def torchrun_env(
    rank: int,
    world: int,
    nodes: int,
    port: int,
    job_id: str,
    gpu_type: str,
    local_rank: int | None = None,
    master: str = "127.0.0.1",
) -> dict[str, str]:
    """A worker's place in its job, as torchrun gives it, and what goodput adds."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "GOODPUT_NODES": str(nodes),
        JOB_ENV: job_id,
        GPU_TYPE_ENV: gpu_type,
    }


def free_port(address: str) -> int:
    """A port free now on `address` (rank 0's rendezvous binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def last_error(log: Path) -> str:
    """The last line a worker wrote to stderr (a traceback's ends with the exception)."""
    lines = (
        [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    )
    return lines[-1] if lines else "no error output"


def stop_leftovers(workdir: Path, mark: str = "--checkpoint") -> None:
    """Workers an agent before this one left running (it was killed; their lifeline makes them
    stop too): each told to stop — it checkpoints — and waited for. `<workdir>/*.pids` name them; a
    process id is taken for a worker of ours only while its command line holds `mark` and the
    job's checkpoint argument (ids are reused)."""
    leftovers = []
    for pids in workdir.glob("*.pids"):
        checkpoint = pids.with_suffix(".checkpoint").read_text() if pids.with_suffix(".checkpoint").exists() else ""
        expected = f"{mark}\0{checkpoint}\0".encode()
        for pid in (int(p) for p in pids.read_text().split() if p.isdigit() and int(p) != os.getpid()):
            try:
                if checkpoint and Path(f"/proc/{pid}/cmdline").read_bytes().endswith(expected):
                    os.kill(pid, signal.SIGTERM)
                    leftovers.append(pid)
            except (FileNotFoundError, ProcessLookupError):
                pass  # gone already
        pids.unlink()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(alive(pid) for pid in leftovers) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, exited and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
