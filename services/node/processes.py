"""A job's worker processes, as a node agent starts them: which code a submission may run, the
environment a worker gets, and what it leaves behind.

Only a module that declares itself a job (`GOODPUT_JOB = True` at its top level, read from its
source, never run here) may be started: the package's helpers are not jobs. A worker gets a minimal
environment (`worker_env`), never the agent's: its NATS credentials stay with the agent. Its stdin
is its lifeline (the library stops, checkpointed, when it ends), so no worker outlives its agent.
Each worker leads a session of its own: what is left of its group once it has exited is killed
(`ended`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO

from goodput_train.protocol import GPU_TYPE_ENV, JOB_ENV, LIFELINE_ENV
from services.node.box import Box
from shared.runtime import STOP_TIMEOUT_S

JOB_MAIN = "services.node.job_main"  # what runs a job's module in a worker
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


def worker(
    box: Box,
    module: str,
    arguments: list[str],
    env: dict[str, str],
    log: IO | int,
    lifeline: bool = False,
    checkpoint: Path | None = None,
    code: Path | None = None,
) -> subprocess.Popen:
    """One process of a job, in its `box`: one thread (the slot's), its stdout for us, its stderr to
    `log` (a file, or subprocess.PIPE: for us too); with `lifeline`, its stdin held by us (the
    library stops when it ends). It finds the project and the jobs package on PYTHONPATH only
    (`import_path`), read-only for it; run through `job_main`, it exits quietly once we are gone.
    `checkpoint`: a training worker's, its mark (`job_arguments`). `code`: the folder of the job's
    own code, its working directory; `module` is then its entrypoint there (a script or a module)."""
    if lifeline:
        env = {**env, LIFELINE_ENV: "1"}
    env = {**env, **box.env(), "PYTHONPATH": import_path(module if code is None else "")}
    # Nothing of the job's folder is imported before `job_main` runs: not the working directory
    # (-P; `-m` would put it first on sys.path), not the user site packages of its HOME (-s).
    command = [
        box.python,  # its environment's, when it asks for packages
        *("-P", "-s", "-m", JOB_MAIN),
        *job_arguments(module, arguments, None if checkpoint is None else box.inside(checkpoint), code is not None),
    ]
    return box.spawn(
        command,
        worker_env(env),
        code or box.folder,
        stdout=subprocess.PIPE,
        stderr=log,
        stdin=subprocess.PIPE if lifeline else subprocess.DEVNULL,
        text=True,
        errors="replace",
    )


def ended(process: subprocess.Popen) -> int | None:
    """A worker's exit code (None: it runs). Once it has exited, what is left of its process group
    (children that would keep its files, its GPU and its output pipe) is killed first, while its
    exited leader, not yet reaped, still holds the group's id: no other process's group is hit."""
    if process.returncode is None:
        try:
            if os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return None  # it runs: not reaped here, where it could exit before its group is killed
        except ChildProcessError:  # reaped already, by the caller that killed its group
            pass
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    return process.poll()


def wait_ended(process: subprocess.Popen, timeout_s: float) -> int | None:
    """A worker's exit code once it has exited (`ended`), None if it still runs after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (code := ended(process)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return code


def job_arguments(target: str, arguments: list[str], checkpoint: Path | None = None, code: bool = False) -> list[str]:
    """`job_main`'s arguments: its own first (the checkpoint mark, whether the target is the job's own
    code), then the target and the job's arguments, which it passes on."""
    own = [*(("--checkpoint", str(checkpoint)) if checkpoint is not None else ()), *(("--code",) if code else ())]
    return [*own, target, *arguments]


def import_path(module: str, parent: dict[str, str] | None = None) -> str:
    """A worker's PYTHONPATH: ROOT (the project, `job_main`), the folder that holds `module`'s top
    package (the operator's jobs package, wherever the agent found it), then the agent's own."""
    parent = os.environ if parent is None else parent
    try:
        spec = importlib.util.find_spec(module.partition(".")[0])
    except (ImportError, ValueError):
        spec = None
    found = [str(Path(place).parent) for place in (spec.submodule_search_locations or [])] if spec else []
    paths = [str(ROOT), *found, *filter(None, parent.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(paths))


def torchrun_env(
    rank: int,
    world: int,
    nodes: int,
    port: int,
    job_id: str,
    gpu_type: str,
    local_rank: int | None = None,
    master: str = "127.0.0.1",
    local_world: int | None = None,
    group: int = 0,
) -> dict[str, str]:
    """A worker's place in its job, as torchrun gives it (one role; the rendezvous store is rank 0's,
    not an agent's), and what goodput adds."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world if local_world is None else local_world),
        "GROUP_RANK": str(group),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": job_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "GOODPUT_NODES": str(nodes),
        JOB_ENV: job_id,
        GPU_TYPE_ENV: gpu_type,
    }


def free_port(address: str) -> int:
    """A port free now on `address` (rank 0's rendezvous binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


ERROR_LINES = 10  # a crash's reason: the end of its stderr (a traceback's last frames and the exception)
ERROR_LINE_CHARS = 300
ERROR_TAIL_BYTES = 64 * 1024  # read from the log's end only: it may be long


def last_error(log: Path, lines: int = ERROR_LINES) -> str:
    """The last `lines` non-empty lines a worker wrote to stderr, each cut to ERROR_LINE_CHARS."""
    try:
        with open(log, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - ERROR_TAIL_BYTES))
            text = file.read().decode(errors="replace")
    except FileNotFoundError:
        return "no error output"
    kept = [line.rstrip()[:ERROR_LINE_CHARS] for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join(kept) if kept else "no error output"


def stop_leftovers(workdir: Path, mark: str = "--checkpoint") -> None:
    """Workers an agent before this one left running (it was killed; their lifeline makes them
    stop too): each told to stop — it checkpoints — and waited for. `<workdir>/*.pids` name them; a
    process id is taken for a worker of ours only while its command line runs `job_main` with `mark`
    and the job's checkpoint as its own first arguments (ids are reused)."""
    leftovers = []
    for pids in workdir.glob("*.pids"):
        checkpoint = pids.with_suffix(".checkpoint").read_text() if pids.with_suffix(".checkpoint").exists() else ""
        expected = f"\0{JOB_MAIN}\0{mark}\0{checkpoint}\0".encode()
        for pid in (int(p) for p in pids.read_text().split() if p.isdigit() and int(p) != os.getpid()):
            try:
                if checkpoint and expected in Path(f"/proc/{pid}/cmdline").read_bytes():
                    _signal_leftover(pid, signal.SIGTERM)
                    leftovers.append(pid)
            except (FileNotFoundError, ProcessLookupError):
                pass  # gone already
        pids.unlink()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(alive(pid) for pid in leftovers) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            _signal_leftover(pid, signal.SIGKILL)


def _signal_leftover(pid: int, sig: int) -> None:
    """A leftover worker signalled with its group (its children), where it leads one (an older
    agent's workers did not)."""
    os.killpg(pid, sig) if os.getpgid(pid) == pid else os.kill(pid, sig)


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, exited and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
