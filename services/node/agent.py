"""A node agent: the workers of one node (`python -m services.node --node NAME`).

It serves only its node: its GPUs (CUDA devices, one per worker; CPU slots standing in for them
where there are none) and their type. It registers the node in KV (`NodeInfo`, renewed every
NODE_HEARTBEAT_S; the entry lapses NODE_TTL_S after the last renewal, and the node is lost) and
answers the executor service, which decides what runs where:

- `start`: a job's workers for one generation (its ranks on this node). The node that hosts rank 0
  picks the rendezvous port on its address and answers it; the executor tells the job's other
  nodes. Nothing of the rendezvous outlives the generation: a restart gets a new one.
- `stop`: SIGTERM (the library checkpoints at the next step, with every rank), killed after the
  grace; or killed at once when a peer was lost.
- `poll`: each job's workers here: exit codes, and the latest report and outcome lines.
- `profile`: a profiling run of a job's script on one GPU of this node (the profiler's, Sia §3.3).

Checkpoints are files in a folder every node shares, or, without one (`--checkpoints jetstream:`
on the executor), objects in JetStream's object store: the agent copies a job's in before its
workers start, and out from the node of rank 0 whenever they saved a new one and when they stop.

Every job's processes here, and every profiling run, run in a box of their own (`box.py`): the
agent decides nothing of a box itself but which slots it holds.

`NodeWorkers` is the node's processes, without the bus; `start` is the service around it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import json
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import msgspec
import nats.js.errors
from nats import micro

from goodput_train.protocol import (
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_PATH_ENV,
    METRICS_PREFIX,
    OUTCOME_PREFIX,
    PROFILE_ENV,
    PROFILE_PREFIX,
    PROTOCOL_PREFIXES,
    SLOT_MEMORY_ENV,
    STATS_PREFIX,
    STOPPED_MARK,
    ProfileRun,
    clean_metrics,
)
from services.node.box import (
    BOX_ROOT,
    JOB_UID_BASE,
    RUNTIME,
    Box,
    BoxError,
    Boxes,
    Rules,
    check,
    default_rules,
    interpreter_paths,
    read_owned,
    shown_folders,
    write_owned,
)
from services.node.code import JobCode, store_fetcher
from services.node.environments import GIB, Environments
from services.node.output import Output, Storing, copy_lines, wake_on
from services.node.processes import (
    ended,
    free_port,
    import_path,
    last_error,
    stop_leftovers,
    torchrun_env,
    wait_ended,
    worker,
)
from shared import storage, subjects
from shared.bus import Bus
from shared.files import make_private
from shared.metrics import CHECKPOINT_DURATION, CHECKPOINT_SIZE, WORKERS, instrument
from shared.runner import new_service, positive_float
from shared.runtime import ENVIRONMENT_MAX_S, JOBS_PACKAGE, STOP_TIMEOUT_S, declared_jobs, job_module
from shared.schema.base import Ack
from shared.schema.nodes import (
    NodeInfo,
    NodeReport,
    ProfileAnswer,
    ProfileRequest,
    Rendezvous,
    StartWorkers,
    StopWorkers,
    WorkersReport,
)

CPU_SLOTS = 4  # a node without CUDA: this many CPU slots, by default
COPY_EVERY_S = 1.0  # how often new checkpoints are copied to the store (no shared folder)
COPY_TIMEOUT_S = 300.0
PROFILE_STDERR_KEPT = 64 * 1024  # bytes: the end of a profiling run's stderr kept with its output
MAX_STDOUT_LINE = 1 << 20  # characters of a worker's stdout line read; the rest of a longer one is dropped
PROFILE_STDOUT_KEPT = 1000  # lines: the end of a profiling run's stdout kept with its output
PROFILES_KEPT = 4  # profile lines of a profiling run kept (the first is its profile)
READ_REST_S = 2.0  # how long a report waits for an exited worker's readers to reach the end of its output
log = logging.getLogger(__name__)


class StoredCheckpoints:
    """The checkpoints store (JetStream's object store) from the agent's threads: a job's
    checkpoint copied in before its workers start, and out whenever they saved a new one."""

    def __init__(self, bus: Bus, loop: asyncio.AbstractEventLoop):
        self.bus, self.loop = bus, loop
        self._store = None

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(COPY_TIMEOUT_S)

    async def _opened(self):
        if self._store is None:
            self._store = await self.bus.js.object_store(subjects.CHECKPOINTS_STORE)
        return self._store

    def fetch(self, name: str, path: Path, uid: int | None = None) -> bool:
        """The stored checkpoint into `path` (atomically, a file of `uid`'s: the job's user, None:
        ours); False, and no file there, if it has none."""

        async def fetch() -> bytes | None:
            try:
                return (await (await self._opened()).get(name)).data
            except nats.js.errors.ObjectNotFoundError:
                return None

        data = self._run(fetch())
        if data is None:
            path.unlink(missing_ok=True)  # a copy of an older job under the id is not this one's
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        write_owned(path, data, uid)  # in the job's folder: through no link it left there
        return True

    def push(self, name: str, path: Path, uid: int | None = None) -> None:
        data = read_owned(path, uid)  # the library renames a whole checkpoint into place

        async def push() -> None:
            await (await self._opened()).put(name, data)

        self._run(push())


@dataclass
class Workers:
    """One generation of a job's workers on this node."""

    order: StartWorkers
    rendezvous: Rendezvous
    slots: tuple[int, ...]  # the node's slots they hold (a GPU's index in its devices)
    checkpoint: Path
    box: Box | None = None  # where they run (set as they start)
    note: str = ""  # the box's word on their end: out of memory
    processes: list[subprocess.Popen] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)
    stats: str = ""  # the latest report line (rank 0's, where it is here)
    outcome: str = ""  # the outcome line of this node's first rank
    # One printed the library's stopped mark, or the agent stopped them while one ran (`_asked`): an
    # exit 0 is then a stop, to be resumed, not the job's end.
    stopped: bool = False
    metrics: dict[str, float | str] = field(default_factory=dict)  # the latest value of each (rank 0's)
    dropped: set[str] = field(default_factory=set)  # metrics refused, each logged once
    pushed: float | None = None  # the modification time of the checkpoint last copied to the store
    drained: set[int] = field(default_factory=set)  # ranks whose readers a report has waited for (`_read_to_end`)
    asked_at: float | None = None  # when the agent first signalled them while one ran (monotonic)

    @property
    def running(self) -> bool:
        return any(ended(p) is None for p in self.processes)

    @property
    def uid(self) -> int | None:
        return self.box.uid if self.box else None


class NodeWorkers:
    def __init__(
        self,
        info: NodeInfo,
        workdir: Path,
        jobs_package: str = JOBS_PACKAGE,
        devices: tuple[str, ...] = (),
        store: StoredCheckpoints | None = None,
        output: Output | None = None,
        boxes: Boxes | None = None,
        code: JobCode | None = None,
        environments: Environments | None = None,
    ):
        self.info = info
        self.workdir = workdir
        self.jobs_package = jobs_package
        self.devices = devices  # CUDA device ids, one per GPU; none: CPU slots
        self.store = store  # where jobs' checkpoints are kept when no folder is shared
        self.output = output  # what the workers print, kept for their submitters (None: only stderr, in files)
        # Each job's box (`--box off`: every job as the agent, in no box: only for tests and trusted code).
        self.boxes = boxes or Boxes(workdir, default_rules(info.gpus), runtime=None)
        self.code = code  # the archives of jobs that carry their code (None: only the jobs package's)
        self.environments = environments or Environments(self.boxes, info.name)  # of jobs' requirements
        self.environments.in_use = self._environments_in_use
        self.jobs: dict[str, Workers] = {}
        self.profiling: dict[str, Box] = {}  # job id -> the box of its profiling run here
        self.reserved: dict[str, tuple[int, ...]] = {}  # job id -> the slots of its workers being started
        self.lock = threading.Lock()  # the table of jobs; a stop waits outside it
        self.closing = False

    # ---- the executor's orders ----------------------------------------------------------------

    def start(self, order: StartWorkers) -> Rendezvous:
        """Start a job's workers for a generation (the same order again: the same answer)."""
        with self.lock:
            current = self.jobs.get(order.job_id)
        if current is not None:
            if current.order.generation == order.generation:
                return current.rendezvous
            if current.order.generation > order.generation:
                raise ValueError(
                    f"job {order.job_id}: generation {order.generation} is older than the "
                    f"{current.order.generation} running here"
                )
            self._stop(current, STOP_TIMEOUT_S, kill=False)
        if order.store and self.store is None:
            raise ValueError(f"node {self.info.name} has no checkpoints store for job {order.job_id}")
        with self.lock:
            slots = self.reserved[order.job_id] = self._free(order)  # before a box is made for nothing
        try:
            environment = self._environment(order.job_id, order.requirements, slots, order.team)
            box = self._open_box(
                order.job_id,
                f"{order.job_id}.{order.generation}",
                order.user,
                slots,
                private_network=order.nodes == 1,  # its ranks all here: its rendezvous on its own loopback
                checkpoints=None if order.store else Path(order.checkpoint).parent,
                environment=environment,
            )
            try:
                return self._start(order, box, slots)
            except BaseException:
                box.close()
                raise
        finally:
            with self.lock:
                self.reserved.pop(order.job_id, None)

    def _start(self, order: StartWorkers, box: Box, slots: tuple[int, ...]) -> Rendezvous:
        # ValueError: refused with the reason (no such job module, its code not stored or unsafe)
        target, code = self._target(order.job_id, order.application, order.code, order.entrypoint, box)
        checkpoint = Path(order.checkpoint)
        if order.store:  # no shared folder: this node's copy of the stored one, in the job's folder
            checkpoint = box.folder / order.store
            self.store.fetch(order.store, checkpoint, box.uid)
        with self.lock:
            if self.closing:
                raise ValueError(f"node {self.info.name} is stopping")
            address, port = (
                (order.master_addr, order.master_port)
                if order.master_addr
                else (self.info.address, free_port(self.info.address))
            )
            workers = self.jobs[order.job_id] = Workers(order, Rendezvous(address, port), slots, checkpoint, box)
            self._file(order.job_id, "checkpoint").write_text(str(checkpoint))
            for local, rank in enumerate(order.ranks):
                env = {
                    **torchrun_env(
                        rank,
                        order.world,
                        order.nodes,
                        port,
                        order.job_id,
                        order.gpu_type,
                        local,
                        address,
                        len(order.ranks),
                        order.group,
                    ),
                    **order.env,
                    CHECKPOINT_PATH_ENV: str(box.inside(checkpoint)),
                    CHECKPOINT_DIR_ENV: str(box.inside(checkpoint.parent)),
                }
                if self.devices:  # as torchrun: every rank sees the job's devices here, LOCAL_RANK its own
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices[slot] for slot in slots)
                log_file = open(self.log_path(order.job_id, rank), "w")  # noqa: SIM115 - its reader closes it
                process = worker(
                    box, target, list(order.args), env, subprocess.PIPE, lifeline=True, checkpoint=checkpoint, code=code
                )
                workers.processes.append(process)
                for read, args in (
                    (_forward, (process, workers, local == 0, self._keeper(order.job_id, rank, "stdout", order.team))),
                    (copy_lines, (process.stderr, log_file, self._keeper(order.job_id, rank, "stderr", order.team))),
                ):
                    reader = threading.Thread(
                        target=read, args=args, name=_reader_name(order.job_id, rank), daemon=True
                    )
                    reader.start()
                    workers.readers.append(reader)
                self._file(order.job_id, "pids").write_text(" ".join(str(p.pid) for p in workers.processes))
        self._record_workers()
        return workers.rendezvous

    def stop(self, request: StopWorkers) -> WorkersReport:
        """Stop a job's workers here (blocking), and forget them: what they reported last. A job
        with none here whose profiling run is here (cancelled while profiled): the run is killed
        (a measurement has nothing to save), and its answer to the profiler says it failed."""
        with self.lock:
            workers = self.jobs.pop(request.job_id, None)
        if workers is None:
            profiling = self.profiling.get(request.job_id)
            if profiling is not None:
                profiling.signal(signal.SIGKILL)
            return WorkersReport(request.job_id, -1, (), ())
        self._stop(workers, request.grace_s, request.kill)
        self._record_workers()
        return self._report(workers)

    def poll(self) -> NodeReport:
        with self.lock:
            jobs = list(self.jobs.values())
        reports = tuple(self._report(w) for w in jobs)
        instrument(WORKERS).set(sum(code is None for report in reports for code in report.codes))
        return NodeReport(self.info.name, reports, self.environments.preparing())

    def _record_workers(self) -> None:
        """goodput_workers_running: the ranks whose processes run on this node now."""
        with self.lock:
            jobs = list(self.jobs.values())
        instrument(WORKERS).set(sum(ended(process) is None for workers in jobs for process in workers.processes))

    def profile(self, request: ProfileRequest) -> ProfileAnswer:
        """Run the job's script in profiling mode on one GPU of this node; what it measured, or why not."""
        env = {**torchrun_env(0, 1, 1, 0, request.job_id, self.info.gpu_type), PROFILE_ENV: "1"}
        if request.slot_memory_mb is not None:
            env[SLOT_MEMORY_ENV] = str(request.slot_memory_mb)
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = self.devices[-1]  # the last: starts take the first free ones
        log_path = self.workdir / f"{request.job_id}.profile-{self.info.gpu_type}.log"
        slot = (self.info.gpus - 1,)  # the last: starts take the first free ones
        try:
            environment = self._environment(request.job_id, request.requirements, slot, request.team)
            box = self._open_box(
                request.job_id,
                f"{request.job_id}.profile",
                request.user,
                slot,
                private_network=True,
                environment=environment,
            )
        except (ValueError, BoxError) as error:
            return ProfileAnswer(failure=str(error))
        try:
            return self._profile(request, box, env, log_path)
        finally:
            box.close()

    def _profile(self, request: ProfileRequest, box: Box, env: dict[str, str], log_path: Path) -> ProfileAnswer:
        gpu_type = self.info.gpu_type
        try:
            target, code = self._target(request.job_id, request.application, request.code, request.entrypoint, box)
        except ValueError as error:
            return ProfileAnswer(failure=str(error))
        profiles: list[str] = []
        tail: deque[str] = deque(maxlen=PROFILE_STDOUT_KEPT)
        with open(log_path, "w") as log_file:
            process = worker(box, target, list(request.args), env, log_file, code=code)
            self.profiling[request.job_id] = box
            reader = threading.Thread(
                target=_read_profile,
                args=(process.stdout, profiles, tail),
                name=f"{request.job_id}/profile",
                daemon=True,
            )
            reader.start()
            try:
                returncode = wait_ended(process, request.timeout_s)
                box.signal(signal.SIGKILL)  # still running: past its time; or what it left behind
                wait_ended(process, STOP_TIMEOUT_S)
                note = box.close()  # nothing of it left to hold its output open
                reader.join(READ_REST_S)  # not longer: a process that left its group may hold its stdout
            finally:
                if self.profiling.get(request.job_id) is box:
                    del self.profiling[request.job_id]
        if returncode is None:
            return ProfileAnswer(failure=f"its profiling run on {gpu_type} took longer than {request.timeout_s:.0f} s")
        # What it read so far (a reader still reading, held up by a process that left the group, is not waited for).
        profiles, out = list(profiles), "" if reader.is_alive() else "".join(tail)
        self._keep_profile(request.job_id, out, log_path, request.team)
        if process.returncode != 0:
            return ProfileAnswer(
                failure=f"its script failed while profiling on {gpu_type} (exit code "
                f"{process.returncode}); {note + '; ' if note else ''}the end of its stderr:\n{last_error(log_path)}"
            )
        for line in profiles:
            if line.startswith(PROFILE_PREFIX):
                try:
                    return ProfileAnswer(
                        msgspec.msgpack.decode(base64.b64decode(line.strip()[len(PROFILE_PREFIX) :]), type=ProfileRun)
                    )
                except (ValueError, msgspec.DecodeError) as error:
                    return ProfileAnswer(failure=f"its profiling run printed an unreadable profile: {error}")
        return ProfileAnswer(
            failure=f"its script printed no profile on {gpu_type}: it must train through "
            "AdaptiveTraining.run (goodput_train)"
        )

    def sync(self) -> None:
        """Copy each new checkpoint of a job whose rank 0 runs here to the store (rank 0 writes them)."""
        with self.lock:
            jobs = list(self.jobs.values())
        for workers in jobs:
            self._push(workers)

    def _push(self, workers: Workers) -> None:
        if not workers.order.store or 0 not in workers.order.ranks or self.store is None:
            return
        try:
            saved = workers.checkpoint.lstat().st_mtime
        except FileNotFoundError:
            return
        if saved != workers.pushed:
            try:
                self.store.push(workers.order.store, workers.checkpoint, workers.uid)
                workers.pushed = saved
            except OSError as error:  # not a file of the job's (a link it made): told once, not copied
                workers.pushed = saved
                log.warning("job %s: its checkpoint is not copied to the store: %s", workers.order.job_id, error)
            except Exception:
                log.exception("job %s: its checkpoint could not be copied to the store", workers.order.job_id)

    def stop_all(self) -> None:
        """Stopping for good: every job's workers checkpoint and stop; profiling runs end."""
        with self.lock:
            self.closing = True
            jobs, self.jobs = list(self.jobs.values()), {}
        for box in list(self.profiling.values()):
            box.signal(signal.SIGKILL)
        for workers in jobs:  # every job told at once: their checkpoints overlap
            _asked(workers)
            workers.box.signal(signal.SIGTERM)
        for workers in jobs:
            self._stop(workers, STOP_TIMEOUT_S, kill=False)
        self._record_workers()

    # ---- processes ----------------------------------------------------------------------------

    def _free(self, order: StartWorkers) -> tuple[int, ...]:
        """The slots the new workers take (held by no other job's running or starting workers), or
        ValueError when the node has too few free."""
        taken = {slot for w in self.jobs.values() if w.order.job_id != order.job_id and w.running for slot in w.slots}
        taken |= {slot for job, slots in self.reserved.items() if job != order.job_id for slot in slots}
        free = [slot for slot in range(self.info.gpus) if slot not in taken]
        if len(order.ranks) > len(free):
            raise ValueError(
                f"node {self.info.name} has {len(free)} free of its {self.info.gpus} GPUs, not "
                f"the {len(order.ranks)} job {order.job_id} asks for"
            )
        return tuple(free[: len(order.ranks)])

    def _stop(self, workers: Workers, grace_s: float, kill: bool) -> None:
        """Every process of the job's here signalled (SIGTERM: they checkpoint), given `grace_s`,
        then killed, and its box ended."""
        _asked(workers)
        workers.box.signal(signal.SIGKILL if kill else signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in workers.processes:
            if wait_ended(process, max(0.0, deadline - time.monotonic())) is None:
                workers.box.signal(signal.SIGKILL)
                if wait_ended(process, STOP_TIMEOUT_S) is None:
                    log.warning("job %s: worker %d outlives SIGKILL", workers.order.job_id, process.pid)
        if not kill:
            _record_checkpoint(workers)
        # What any of them left (a daemon, however detached) ended with the box, before its files are read.
        workers.note = workers.note or workers.box.close()
        # What is still there to read, waited for a little only: a process that left the group keeps
        # the pipe open, and its reader waits for it, not the stop.
        _read_to_end(workers, list(workers.order.ranks))
        for process in workers.processes:
            if process.stdin:
                process.stdin.close()
        self._file(workers.order.job_id, "pids").unlink(missing_ok=True)
        self._push(workers)  # the checkpoint it stopped with, before anyone starts it elsewhere

    def _report(self, workers: Workers) -> WorkersReport:
        codes = tuple(ended(p) for p in workers.processes)
        crashed = next((rank for rank, code in zip(workers.order.ranks, codes) if code not in (None, 0)), None)
        _read_to_end(workers, [rank for rank, code in zip(workers.order.ranks, codes) if code is not None])
        error = ""
        if crashed is not None:
            note = workers.note or workers.box.memory_note()
            error = (note + "\n" if note else "") + last_error(self.log_path(workers.order.job_id, crashed))
        if crashed is not None or None not in codes:
            self._file(workers.order.job_id, "pids").unlink(missing_ok=True)
        return WorkersReport(
            workers.order.job_id,
            workers.order.generation,
            workers.order.ranks,
            codes,
            workers.stats,
            workers.outcome,
            error,
            workers.stopped,
            workers.metrics,
        )

    def _keeper(self, job_id: str, rank: int | str, stream: str, team: str) -> Callable[[str], None] | None:
        return None if self.output is None else self.output.keeper(job_id, rank, stream, team)

    def _keep_profile(self, job_id: str, out: str, log_path: Path, team: str) -> None:
        """A profiling run's output once it has ended, as the job's "profile" rank's: its stdout but
        the protocol's, the end of its stderr (read back from its file)."""
        if self.output is None:
            return
        with open(log_path, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - PROFILE_STDERR_KEPT))
            stderr = file.read().decode(errors="replace").splitlines()
        stdout = [line for line in out.splitlines() if not line.startswith(PROTOCOL_PREFIXES)]
        for stream, lines in (("stdout", stdout), ("stderr", stderr)):
            keep = self.output.keeper(job_id, subjects.PROFILE_RANK, stream, team)
            for line in lines:
                keep(line)

    # ---- each job's own folder and user --------------------------------------------------------

    def job_folder(self, job_id: str) -> Path:
        """The job's folder on this node: its HOME and working directory, its TMPDIR (`tmp/`), the
        node's copy of its stored checkpoint; its user's alone."""
        return self.workdir / "jobs" / job_id

    def _open_box(
        self,
        job_id: str,
        name: str,
        user: int | None,
        slots: tuple[int, ...],
        private_network: bool,
        checkpoints: Path | None = None,
        environment: Path | None = None,
    ) -> Box:
        """The job's box here (`Boxes.open`) on `slots`, once none of its workers runs here; ValueError why not."""
        with self.lock:
            mine = self.jobs.get(job_id)
        if mine is not None and mine.running:
            raise ValueError(f"job {job_id}: its workers run on node {self.info.name}; it is not started again")
        try:
            return self.boxes.open(
                job_id, name, self.job_folder(job_id), user, slots, private_network, checkpoints, environment
            )
        except BoxError as error:
            raise ValueError(str(error)) from None

    def _environments_in_use(self) -> set[Path]:
        """The environments this node's jobs' workers and profiling runs are in."""
        with self.lock:
            boxes = [w.box for w in self.jobs.values() if w.box is not None] + list(self.profiling.values())
        return {box.environment for box in boxes if box.environment is not None}

    def _environment(
        self, job_id: str, requirements: tuple[str, ...], slots: tuple[int, ...], team: str
    ) -> Path | None:
        """The environment of the job's requirements on this node, built first if it is not here (None:
        it asks for none); `environments.cannot_run` when they cannot be installed."""
        if not requirements:
            return None
        return self.environments.get(
            job_id, requirements, slots, self._keeper(job_id, subjects.ENVIRONMENT_RANK, "stderr", team), team
        )

    def _target(self, job_id: str, application: str, code: str, entrypoint: str, box: Box) -> tuple[str, Path | None]:
        """What the job's workers run: a module of the jobs package (no folder), or the entrypoint of
        its own code, unpacked in its folder by its user (that folder); ValueError with why it cannot
        run here."""
        if not code:
            return job_module(application, self.jobs_package), None
        if self.code is None:
            raise ValueError(f"node {self.info.name} runs no job's own code (it reaches no code store)")
        marker = self._file(job_id, "code")
        folder = self.code.prepare(box.folder, code, entrypoint, marker, box)
        return entrypoint, folder

    def log_path(self, job_id: str, rank: int) -> Path:
        return self.workdir / f"{job_id}.rank{rank}.log"

    def _file(self, job_id: str, kind: str) -> Path:
        """`<job>.pids`: its workers' process ids while they run (an agent that died leaves them for
        the next: `stop_leftovers`); `<job>.checkpoint`: the checkpoint argument that marks them;
        `<job>.code`: the archive its own code in its folder was unpacked from."""
        return self.workdir / f"{job_id}.{kind}"


def _reader_name(job_id: str, rank: int) -> str:
    return f"{job_id}/{rank}"


def _asked(workers: Workers) -> None:
    """Before the agent signals a job's workers: if one still runs, their exits are a stop it asked
    for (reported `stopped`), not the job's end; workers that had all exited before were done."""
    if workers.running:
        workers.stopped = True
        if workers.asked_at is None:
            workers.asked_at = time.monotonic()


def _record_checkpoint(workers: Workers) -> None:
    """A gentle stop of running workers, once they exited: goodput_checkpoint_duration_seconds from
    the agent's signal, and goodput_checkpoint_size_bytes of the job's checkpoint file, when there is
    one. Recorded by the node of rank 0 only (it writes the checkpoint), so each stop of a job
    counts once."""
    if workers.asked_at is None or 0 not in workers.order.ranks:
        return
    instrument(CHECKPOINT_DURATION).record(time.monotonic() - workers.asked_at)
    try:
        saved = workers.checkpoint.lstat()
    except OSError:  # none written (yet): its size is not known
        return
    if stat.S_ISREG(saved.st_mode):  # not a link or folder the job left in its place
        instrument(CHECKPOINT_SIZE).record(saved.st_size)


def _lines(stream: IO[str], limit: int = MAX_STDOUT_LINE) -> Iterator[str]:
    """Each line of a worker's stdout, at most its first `limit` characters (the rest of a longer one
    is read and dropped): what a job prints never fills the agent's memory."""
    while line := stream.readline(limit):
        if len(line) == limit and not line.endswith("\n"):
            while (rest := stream.readline(limit)) and not rest.endswith("\n"):
                pass
        yield line


def _read_profile(stream: IO[str], profiles: list[str], tail: deque[str]) -> None:
    """A profiling run's stdout: its profile lines (the first PROFILES_KEPT), the last lines of the
    rest (`tail`, bounded)."""
    for line in _lines(stream):
        if line.startswith(PROFILE_PREFIX):
            if len(profiles) < PROFILES_KEPT:
                profiles.append(line)
        else:
            tail.append(line)


def _read_to_end(workers: Workers, ranks: list[int], timeout_s: float = READ_REST_S) -> None:
    """The readers of workers that have exited, waited for (at most `timeout_s` in all): what a report
    reads of them (the last lines of their stderr file, their last protocol lines) is then all there.
    Each rank's once: a reader held up by a process that still has the pipe open (one that left the
    worker's group) does not hold up every report after."""
    deadline = time.monotonic() + timeout_s
    names = {_reader_name(workers.order.job_id, rank) for rank in ranks if rank not in workers.drained}
    workers.drained.update(ranks)
    for reader in workers.readers:
        if reader.name in names:
            reader.join(max(0.0, deadline - time.monotonic()))


def _forward(
    process: subprocess.Popen, workers: Workers, first: bool, keep: Callable[[str], None] | None = None
) -> None:
    """A worker's stdout, line by line: the latest report (rank 0 prints them), the first rank's
    outcome, its metrics, the stopped mark; every other line to `keep` (the job's own output)."""
    for line in _lines(process.stdout):
        if keep is not None and not line.startswith(PROTOCOL_PREFIXES):
            keep(line.rstrip("\r\n"))
        line = line.strip()
        if line.startswith(STATS_PREFIX):
            workers.stats = line
        elif line.startswith(OUTCOME_PREFIX) and (first or not workers.outcome):
            if len(line) <= MAX_OUTCOME_LINE:  # it travels in every report of the job
                workers.outcome = line
            elif "outcome" not in workers.dropped:
                workers.dropped.add("outcome")
                log.warning("job %s: outcome lines over %d characters dropped", workers.order.job_id, MAX_OUTCOME_LINE)
        elif line.startswith(METRICS_PREFIX):
            _take_metrics(workers, line[len(METRICS_PREFIX) :])
        elif line == STOPPED_MARK:
            workers.stopped = True


MAX_METRICS_LINE = 16_384  # characters: MAX_METRICS short names and values fit many times over
MAX_OUTCOME_LINE = 16_384  # characters: a few numbers and the batches it trained at
MAX_DROPS_LOGGED = 100  # per job's workers: a script that keeps sending bad ones is not a log flood


def _take_metrics(workers: Workers, text: str) -> None:
    """A metrics line's values over the ones before (the latest of each name, at most MAX_METRICS
    names); what is refused is logged once per reason."""
    try:
        if len(text) > MAX_METRICS_LINE:
            raise ValueError(f"a line of {len(text)} characters, over {MAX_METRICS_LINE}")
        values = json.loads(text)
        if not isinstance(values, dict):
            raise ValueError(f"a metrics line is a JSON object, not {type(values).__name__}")
    except (ValueError, RecursionError) as error:  # RecursionError: JSON nested too deep
        values, problems = {}, [f"unreadable metrics: {error}"]
    else:
        problems = []
    kept, dropped = clean_metrics({**workers.metrics, **values})
    workers.metrics = kept  # replaced whole: the poll reads it from another thread
    for why in (*problems, *dropped):
        if why not in workers.dropped and len(workers.dropped) < MAX_DROPS_LOGGED:
            workers.dropped.add(why)
            log.warning("job %s: metric dropped: %s", workers.order.job_id, why[:200])


# ---- the service ---------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """An option that must be a whole number above 0 (argparse type: refused before anything starts)."""
    value = positive_float(text)
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", required=True, help="the node this agent serves (1-64 letters, digits, '-', '_')")
    parser.add_argument(
        "--workdir",
        help="its workers' logs and folders; a restarted agent must find its own "
        "(default: a folder under the system's temporary one)",
    )
    parser.add_argument(
        "--jobs-package", default=JOBS_PACKAGE, help="the package whose modules jobs may run (default: %(default)s)"
    )
    parser.add_argument(
        "--gpus", type=int, help=f"node: its GPUs (default: its CUDA devices, else {CPU_SLOTS} CPU slots)"
    )
    parser.add_argument(
        "--gpu-type", help="node: its GPU type, as the cluster names it (default: the CUDA device's name, else cpu)"
    )
    parser.add_argument(
        "--address",
        default="127.0.0.1",
        help="node: the address its workers listen on for their peers on other nodes (a pod IP; default: %(default)s)",
    )
    parser.add_argument(
        "--box",
        choices=("runc", "off"),
        default="runc",
        help="node: each job in a box of its own (runc: its own user, cgroup and namespaces; the agent must "
        "be root), or 'off': every job's code as the agent's user, in no box, only for code you trust "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--job-uids",
        type=positive_int,
        default=JOB_UID_BASE,
        help="node: the first uid of the jobs' users, unique on the host (default: %(default)s)",
    )
    parser.add_argument(
        "--slot-cpus",
        type=positive_float,
        help="node: a job's CPU cores per slot it holds (default: the machine's cores shared by its slots)",
    )
    parser.add_argument(
        "--slot-memory",
        type=positive_float,
        help="node: a job's memory per slot it holds, in MB: past it the kernel ends the job's processes "
        "(default: the machine's memory shared by its slots)",
    )
    parser.add_argument(
        "--slot-processes",
        type=positive_int,
        default=Rules.processes,
        help="node: a job's processes and threads per slot it holds (default: %(default)s)",
    )
    parser.add_argument(
        "--worker-file-size",
        type=float,
        default=Rules.file_mb,
        help="node: the largest file a worker may write, in MB (default: %(default)g)",
    )
    parser.add_argument(
        "--worker-python", default=sys.executable, help="node: the workers' interpreter (default: the agent's)"
    )
    parser.add_argument(
        "--environment-timeout",
        type=positive_float,
        default=900.0,
        help=f"node: the longest the build of a job's environment (its requirements) may take, in s, at most "
        f"{ENVIRONMENT_MAX_S:.0f} (default: %(default)g)",
    )
    parser.add_argument(
        "--environment-max-gb",
        type=positive_float,
        default=20.0,
        help="node: the most disk a job's environment may take, in GiB (default: %(default)g)",
    )


def box_problem(box: str, python: str, jobs_package: str) -> tuple[str, list[Path]]:
    """Why a node agent here cannot give each job a box (`--box`; "" when it can), with the fix, and
    the folders its boxes show."""
    shown = shown_folders(python, interpreter_paths(python, import_path(jobs_package)))
    return check(None if box == "off" else RUNTIME, python, shown), shown


def node_boxes(args: argparse.Namespace, workdir: Path, gpus: int, stack: str) -> Boxes:
    """The node's boxes as its options say, or SystemExit with why they cannot be had here and the fix."""
    rules = default_rules(gpus, args.slot_cpus, args.slot_memory, args.slot_processes)
    rules = dataclasses.replace(rules, file_mb=args.worker_file_size or None)
    problem, shown = box_problem(args.box, args.worker_python, args.jobs_package)
    if problem:
        raise SystemExit(f"node {args.node}: {problem}")
    runtime = None if args.box == "off" else RUNTIME
    return Boxes(workdir, rules, args.worker_python, runtime, shown, stack, args.job_uids)


def detected_gpus() -> tuple[str, tuple[str, ...]]:
    """This machine's CUDA devices: their type (the device's name, as a key) and ids; none: ('cpu', ())."""
    try:
        import torch

        if torch.cuda.is_available():
            name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
            return name, tuple(str(i) for i in range(torch.cuda.device_count()))
    except ImportError:
        pass
    return "cpu", ()


async def start(bus: Bus, args: argparse.Namespace) -> micro.Service:
    if not subjects.NODE_NAME.match(args.node):
        raise SystemExit(f"--node {args.node!r}: a node name is 1-64 letters, digits, '-' or '_'")
    detected_type, devices = await asyncio.to_thread(detected_gpus)
    gpus = args.gpus or len(devices) or CPU_SLOTS
    if devices and gpus > len(devices):
        raise SystemExit(f"--gpus {gpus}: this machine has {len(devices)} CUDA devices")
    # It says which jobs it runs (its jobs package's): the API refuses an unknown application at once.
    jobs = tuple(await asyncio.to_thread(declared_jobs, args.jobs_package))
    info = NodeInfo(
        args.node, args.gpu_type or detected_type, gpus, args.address, agent=uuid.uuid4().hex[:12], applications=jobs
    )
    workdir = Path(args.workdir or Path(tempfile.gettempdir()) / f"goodput-node-{args.node}")
    members = await storage.open_kv(bus, subjects.NODES_BUCKET, NodeInfo)
    # This stack's name on the host, the same for all its agents: its jobs' users are its own (`box.Claims`).
    stack = str((await bus.js.stream_info(storage.BUCKETS[subjects.NODES_BUCKET].stream)).created)
    boxes = await asyncio.to_thread(node_boxes, args, workdir, gpus, stack)
    # What a killed agent before this one left running is stopped first: nothing of a job's is left
    # to change its folder while it is walked. Jobs' folders are their users' (its box gives them
    # back): only the agent's own files are made private.
    await asyncio.to_thread(stop_leftovers, workdir)
    left = await asyncio.to_thread(boxes.leftovers)
    if left:
        log.info("node %s: ended %d boxes an agent before this one left: %s", args.node, len(left), ", ".join(left))
    # With the logs and checkpoint copies an agent before this one left; the boxes' root stays open.
    make_private(workdir, skip=("jobs", BOX_ROOT))
    boxes.prepare()
    await storage.open_stream(bus, subjects.LOGS_STREAM)  # where what the workers print is kept
    woken = asyncio.Event()
    storing = Storing(bus, Output(wake_on(asyncio.get_running_loop(), woken)))
    node = NodeWorkers(
        info,
        workdir,
        args.jobs_package,
        devices[:gpus],
        StoredCheckpoints(bus, asyncio.get_running_loop()),
        storing.output,
        boxes,
        JobCode(workdir / "archives", store_fetcher(bus, asyncio.get_running_loop())),
        Environments(boxes, info.name, args.environment_timeout, int(args.environment_max_gb * GIB)),
    )

    async def heartbeat() -> None:
        while True:
            try:
                # Its jobs as they are now: a module added to the jobs package is found without a restart.
                jobs = tuple(await asyncio.to_thread(declared_jobs, args.jobs_package))
                await members.put(info.name, msgspec.structs.replace(info, applications=jobs))
            except Exception:
                log.exception("renewing node %s failed", info.name)
            await asyncio.sleep(subjects.NODE_HEARTBEAT_S)

    async def copy_checkpoints() -> None:
        while True:
            await asyncio.sleep(COPY_EVERY_S)
            await asyncio.to_thread(node.sync)

    async def leave() -> None:
        beating.cancel()
        copying.cancel()
        await asyncio.to_thread(node.stop_all)
        await storing.finish(keeping, woken)  # the last lines of the workers just stopped
        try:
            await members.delete(info.name)  # gone now, not in NODE_TTL_S
        except Exception:  # noqa: BLE001 - it lapses on its own
            log.warning(
                "could not remove node %s from the members; it lapses in %.0f s", info.name, subjects.NODE_TTL_S
            )

    service = await new_service(
        bus,
        subjects.NODE_SERVICE,
        f"node {info.name}: {gpus} {info.gpu_type}",
        {"node": info.name, "gpu_type": info.gpu_type, "gpus": str(gpus)},
    )
    handlers = {
        "start": (StartWorkers, node.start),
        "stop": (StopWorkers, node.stop),
        "poll": (Ack, lambda _: node.poll()),
        "profile": (ProfileRequest, node.profile),
    }
    for endpoint in subjects.NODE_ENDPOINTS:
        kind, handle = handlers[endpoint]
        await bus.add_endpoint(
            service,
            endpoint,
            subjects.node_subject(info.name, endpoint),
            kind,
            lambda request, handle=handle: asyncio.to_thread(handle, request),
            span_name=f"node.{endpoint}",
            concurrency=8,
            new_traces=endpoint != "poll",  # the executor looks every half second: a round's look is traced
        )
    await members.put(info.name, info)
    beating = asyncio.get_running_loop().create_task(heartbeat())
    copying = asyncio.get_running_loop().create_task(copy_checkpoints())
    keeping = asyncio.get_running_loop().create_task(storing.keep_storing(woken))
    bus.on_close(leave)
    log.info("node %s: %d %s, workers on %s, work in %s", info.name, gpus, info.gpu_type, info.address, workdir)
    say = log.warning if boxes.runtime is None else log.info
    say(
        "node %s: jobs %s",
        info.name,
        f"in boxes of their own ({boxes.rules})" if boxes.runtime else "in NO box (--box off)",
    )
    return service
