"""Real jobs on this machine: each GPU of a placement is a CPU slot running one worker process of
the job (a module of the allowed jobs package, `python -m examples.jobs.<application>` by default),
data-parallel over gloo.

`LocalExecutors` is the node agent's core, without the bus: it starts a job's workers for a
placement (torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; and
GOODPUT_NODES, GOODPUT_JOB_ID, GOODPUT_GPU_TYPE), stops them with SIGTERM when the placement
changes (the library checkpoints and exits) and starts them again on the new one (the library
resumes from the checkpoint at the new world size), collects the `JobStats` the workers print,
and notices when a job finishes, or crashes (restarted from its last checkpoint; after
`max_crashes` it fails, with the last line its workers wrote to stderr).

Only a module that declares itself a job (`GOODPUT_JOB = True` at its top level, read from its
source, never run here) may be started: the package's helpers are not jobs. A worker gets a minimal
environment (`worker_env`), never the agent's: its NATS credentials stay with the agent.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import importlib.util
import json
import logging
import os
import pkgutil
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import msgspec

from deploy.nats import free_loopback_port
from goodput_train.protocol import (ADAPTIVE_ENV, CHECKPOINT_ENV, GPU_TYPE_ENV, JOB_ENV, OUTCOME_PREFIX,
                                        REPORT_ENV, REPORT_EVERY_S, STATS_PREFIX)
from shared.cluster import Cluster, Spots
from shared.schema import CANCELLED, JobStats

JOBS_PACKAGE = "examples.jobs"          # the code submissions may run by default: a module of this package
JOB_MARKER = "GOODPUT_JOB"             # a job module says `GOODPUT_JOB = True`; its helpers are not jobs
STOP_TIMEOUT_S = 60.0
MAX_CRASHES = 3
ROOT = Path(__file__).resolve().parents[2]
# What a worker inherits from the agent: what Python, PyTorch and the devices need, nothing else
# (the agent's NATS credentials, tokens and TLS keys are not a job's).
WORKER_ENV_NAMES = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH",
                              "VIRTUAL_ENV", "LD_LIBRARY_PATH"})
WORKER_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "TORCH_")
NEVER_TO_WORKERS = "GOODPUT_NATS_"
log = logging.getLogger(__name__)


def declares_job(path: str | Path | None) -> bool:
    """Whether a module's source says `GOODPUT_JOB = True` at its top level (parsed, not run)."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (TypeError, OSError, SyntaxError, ValueError):    # no source (built-in, compiled), or not Python
        return False
    return any(isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is True
               and any(isinstance(target, ast.Name) and target.id == JOB_MARKER for target in node.targets)
               for node in tree.body)


def declared_jobs(package: str = JOBS_PACKAGE) -> list[str]:
    """The modules of `package` that declare themselves jobs."""
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(info.name for info in pkgutil.iter_modules(spec.submodule_search_locations)
                  if not info.ispkg and declares_job(info.module_finder.find_spec(info.name).origin))


def job_module(application: str, package: str = JOBS_PACKAGE) -> str:
    """The module a job's `application` names; ValueError unless it is one of `package`'s declared jobs."""
    module = f"{package}.{application}"
    try:
        spec = importlib.util.find_spec(module) if application.isidentifier() else None
    except ModuleNotFoundError:               # the package itself is not there
        spec = None
    if spec is not None and spec.submodule_search_locations is None and declares_job(spec.origin):
        return module
    why = (f"{module} does not declare itself a job (`{JOB_MARKER} = True`)" if spec is not None
           else "a submission names its code by one of the package's jobs; it may not carry a command or a path")
    jobs = ", ".join(declared_jobs(package)) or "none"
    raise ValueError(f"no job {application!r} in {package}: {why} (its jobs: {jobs})")


def worker_env(env: dict[str, str], parent: dict[str, str] | None = None) -> dict[str, str]:
    """A worker's whole environment: the allowed part of the agent's (`parent`, default ours), one
    thread (a CPU slot is one core), then `env`; never a NATS credential."""
    parent = os.environ if parent is None else parent
    allowed = {name: value for name, value in parent.items()
               if name in WORKER_ENV_NAMES or name.startswith(WORKER_ENV_PREFIXES)}
    return {name: value for name, value in {**allowed, "OMP_NUM_THREADS": "1", **env}.items()
            if not name.startswith(NEVER_TO_WORKERS)}


def worker(module: str, arguments: list[str], env: dict[str, str], log: IO) -> subprocess.Popen:
    """One process of a job: one thread (the slot's), its stdout for us, its stderr to `log`. It
    finds the jobs package from ROOT, its working directory (`-m` puts that first on sys.path), or
    from PYTHONPATH."""
    return subprocess.Popen([sys.executable, "-m", module, *arguments], env=worker_env(env), stdout=subprocess.PIPE,
                            stderr=log, text=True, errors="replace", cwd=ROOT)


def torchrun_env(rank: int, world: int, nodes: int, port: int, job_id: str, gpu_type: str) -> dict[str, str]:
    """A worker's place in its job, as torchrun gives it, and what goodput adds."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "GOODPUT_NODES": str(nodes), JOB_ENV: job_id, GPU_TYPE_ENV: gpu_type}


def last_error(log: Path) -> str:
    """The last line a worker wrote to stderr (a traceback's ends with the exception)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] \
        if log.exists() else []
    return lines[-1] if lines else "no error output"


@dataclass
class LocalJob:
    job_id: str
    application: str
    placement: Spots = ()
    workers: list[subprocess.Popen] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)     # one per worker: its stdout
    lines: queue.Queue = field(default_factory=queue.Queue)
    stats: JobStats | None = None
    result: dict | None = None           # its outcome line, once it has finished
    restarts: int = 0
    crashes: int = 0
    failure: str | None = None
    announced: bool = False              # its finish returned by `poll` once
    heard: bool = False                  # its workers have reported since they were last started
    adaptive: bool = True                # its workers re-tune their batch (else they keep it)

    @property
    def running(self) -> bool:
        return bool(self.workers)


class LocalExecutors:
    def __init__(self, cluster: Cluster, workdir: Path, max_crashes: int = MAX_CRASHES,
                 report_every_s: float = REPORT_EVERY_S, jobs_package: str = JOBS_PACKAGE,
                 checkpoint_every_s: float | None = None):
        self.cluster = cluster
        self.workdir = workdir
        self.max_crashes = max_crashes
        self.report_every_s = report_every_s
        self.jobs_package = jobs_package
        self.checkpoint_every_s = checkpoint_every_s      # None: each job's own (the library's 5 min)
        self.jobs: dict[str, LocalJob] = {}
        self.closing = False                 # stopping for good: a worker that exits is not restarted

    def add(self, job_id: str, application: str) -> None:
        try:
            job_module(application, self.jobs_package)
        except ValueError as error:
            raise ValueError(f"job {job_id}: {error}") from None
        self.jobs.setdefault(job_id, LocalJob(job_id, application))

    def apply(self, placements: dict[str, Spots]) -> None:
        """Give each job its placement: a changed one stops its workers (they checkpoint) and
        starts them again on the new slots."""
        if self.closing:
            return
        for job in self.jobs.values():
            spots = tuple(placements.get(job.job_id, ()))
            if spots == job.placement or job.result is not None or job.failure:
                continue
            if job.running:
                self._stop(job)
                if job.result is not None:          # it finished as it was being stopped
                    continue
                job.restarts += 1
            job.placement = spots
            if spots:
                self._start(job)

    def poll(self) -> list[str]:
        """Take the workers' reports; the jobs that finished since the last poll (also one that
        finished just as it was being stopped). A worker that crashed takes the others of its job
        down (they would wait for it in a collective) and the job restarts from its checkpoint."""
        for job in self.jobs.values():
            self._read(job)
            codes = [w.poll() for w in job.workers]
            crashed = any(code not in (None, 0) for code in codes)
            if not job.running or (None in codes and not crashed):
                continue
            for worker in job.workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
            self._end(job)
            job.workers, job.readers = [], []
            if crashed and job.result is None and not self.closing:
                job.crashes += 1
                if job.crashes >= self.max_crashes:
                    rank = next(rank for rank, code in enumerate(codes) if code not in (None, 0))   # the first to crash
                    job.failure = (f"its workers crashed {job.crashes} times (exit code {codes[rank]} on rank {rank}); "
                                   f"the last error: {last_error(self._log(job, rank))}")
                else:
                    self._start(job)                  # from its last checkpoint
        finished = [job for job in self.jobs.values() if job.result is not None and not job.announced]
        for job in finished:
            job.announced = True
        return [job.job_id for job in finished]

    def cancel(self, job_id: str) -> None:
        """Stop a job for good, as its user asked: its workers checkpoint and stop; it gives up its slots."""
        job = self.jobs[job_id]
        if job.running:
            self._stop(job)
        job.failure, job.placement = CANCELLED, ()

    def stop_all(self) -> None:
        self.closing = True
        for job in self.jobs.values():
            if job.running:
                self._stop(job)

    # ---- workers --------------------------------------------------------------------------

    def _start(self, job: LocalJob) -> None:
        world = sum(g for _, g in job.placement)
        gpu_type = self.cluster.placement_type(job.placement)
        port = free_loopback_port()
        module = job_module(job.application, self.jobs_package)
        arguments = ["--checkpoint", str(self._checkpoint(job))]
        job.heard = False
        for rank in range(world):
            env = {**torchrun_env(rank, world, len(job.placement), port, job.job_id, gpu_type or ""),
                   REPORT_ENV: str(self.report_every_s), ADAPTIVE_ENV: str(int(job.adaptive))}
            if self.checkpoint_every_s is not None:
                env[CHECKPOINT_ENV] = str(self.checkpoint_every_s)
            with open(self._log(job, rank), "w") as log:
                process = worker(module, arguments, env, log)
            reader = threading.Thread(target=_forward, args=(process, job.lines), daemon=True)
            reader.start()
            job.workers.append(process)
            job.readers.append(reader)
            self._pids(job).write_text(" ".join(str(w.pid) for w in job.workers))    # at once: we may die next

    def _checkpoint(self, job: LocalJob) -> Path:
        return self.workdir / f"{job.job_id}.pt"

    def _pids(self, job: LocalJob) -> Path:
        """Its workers' process ids, while they run: an agent that died leaves them for the next."""
        return self.workdir / f"{job.job_id}.pids"

    def stop_leftovers(self) -> None:
        """Workers an agent before this one left running (it was killed): each told to stop — it
        checkpoints — and waited for. A process id is taken for a worker of ours only while its
        command line ends with the job's own checkpoint argument (ids are reused)."""
        leftovers = []
        for pids in self.workdir.glob("*.pids"):
            mark = f"--checkpoint\0{self.workdir / pids.stem}.pt\0".encode()
            for pid in (int(p) for p in pids.read_text().split() if p.isdigit() and int(p) != os.getpid()):
                try:
                    if Path(f"/proc/{pid}/cmdline").read_bytes().endswith(mark):
                        os.kill(pid, signal.SIGTERM)
                        leftovers.append(pid)
                except (FileNotFoundError, ProcessLookupError):
                    pass                                     # gone already
            pids.unlink()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(_alive(pid) for pid in leftovers) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _log(self, job: LocalJob, rank: int) -> Path:
        return self.workdir / f"{job.job_id}.rank{rank}.log"

    def _stop(self, job: LocalJob) -> None:
        for worker in job.workers:
            worker.send_signal(signal.SIGTERM)
        for worker in job.workers:
            try:
                worker.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        self._end(job)
        job.workers, job.readers = [], []

    def _end(self, job: LocalJob) -> None:
        """After the workers exited: every line they wrote, read."""
        for reader in job.readers:
            reader.join(timeout=STOP_TIMEOUT_S)
        self._read(job)
        self._pids(job).unlink(missing_ok=True)

    def _read(self, job: LocalJob) -> None:
        while True:
            try:
                line = job.lines.get_nowait()
            except queue.Empty:
                return
            try:
                if line.startswith(STATS_PREFIX):
                    job.stats = msgspec.msgpack.decode(base64.b64decode(line[len(STATS_PREFIX):]), type=JobStats)
                    job.heard = True
                elif line.startswith(OUTCOME_PREFIX):
                    outcome = json.loads(line[len(OUTCOME_PREFIX):])
                    if not outcome.get("stopped"):        # a SIGTERM's outcome: it will be started again
                        job.result = outcome
            except (ValueError, msgspec.DecodeError) as error:   # a job's own output must not stop us
                log.warning("job %s: unreadable report %r: %s", job.job_id, line[:80], error)


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie, exited and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _forward(worker: subprocess.Popen, lines: queue.Queue) -> None:
    """A worker's stdout, line by line (rank 0 reports; every rank prints its outcome)."""
    for line in worker.stdout:
        lines.put(line.strip())
