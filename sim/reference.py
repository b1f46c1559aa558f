"""Loaders for the public Pollux/Sia reference data (measured step times, validation runs, workloads).

The data is third-party (see the READMEs in the reference folder), so it is never copied into this
repository: it is read by path at run time. The folder is found in this order: an explicit path (the
CLI's ``--reference`` flag), the ``GOODPUT_REFERENCE`` environment variable, then
``<repo root>/../shared/reference``.

The data is read with ``numpy`` and ``csv`` (a workload's team names are checked by shared/teams.py).
Columns are always read by name, because the column order differs between GPU types in the Sia
traces (e.g. ``placements-rtx.csv`` puts ``placement`` last).

Hybrid-parallel models (gpt_pmp: a 2.8B GPT in a GPipe pipeline, 2 stages on dgx-ext, 8 on rtx) are
measured differently: the smallest placement of a type is one model-parallel replica (its GPUs, one
per stage, on one node), ``local_bsz`` is the micro-batch of one replica and ``step_time`` the
forward time of one stage. `load_model` reads such rows as Sia's simulator does: a replica's step is
a pipeline pass of `PIPELINE_MICROBATCHES` micro-batches, 3 x (stages - 1 + micro-batches) stage
forward times (a backward costs two forwards; the stages - 1 fill the pipeline), plus the measured
all-reduce once per step. The rows then follow the convention of every other model: ``step_time``
is the whole step, ``local_bsz`` the batch of one replica (micro-batches x micro-batch).
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from goodput_train.goodput import Observation
from shared.schema.base import MAX_PRIORITY, MAX_TARGET_EPOCHS
from shared.subjects import DEFAULT_TEAM
from shared.teams import team_problem

DEFAULT_ENV = "GOODPUT_REFERENCE"

# The GPU type of the unsuffixed placements.csv / scalability.csv: Pollux's g4dn (4x T4) nodes.
UNSUFFIXED_GPU_TYPE = "aws"

_PLACEMENT_COLUMNS = ("placement", "local_bsz", "step_time", "sync_time")
_SCALABILITY_COLUMNS = ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time")
_VALIDATION_COLUMNS = ("progress", "iteration", "metric", "grad_sqr", "grad_var")
_WORKLOAD_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")

# Sia's reading of a pipeline-parallel model's rows (its PMPApplication): 48 micro-batches a pass,
# and a backward pass costs two forward passes.
PIPELINE_MICROBATCHES = 48
PIPELINE_PASS_FORWARDS = 3

_MEASUREMENT_FILE = re.compile(r"^(placements|scalability)(?:-(.+))?\.csv$")
_VALIDATION_FILE = re.compile(r"^validation-(\d+)\.csv$")


class ReferenceDataMissing(FileNotFoundError):
    """The reference data folder (or the data expected inside it) is not there."""


def _repo_root() -> Path:
    """The repository root: the parent of the ``shared/`` package folder."""
    return Path(__file__).resolve().parent.parent


def reference_root(path: str | os.PathLike | None = None) -> Path:
    """The reference data folder: explicit path > $GOODPUT_REFERENCE > <repo>/../shared/reference."""
    if path is not None:
        root, source = Path(path), "the given path"
    elif os.environ.get(DEFAULT_ENV):
        root, source = Path(os.environ[DEFAULT_ENV]), f"${DEFAULT_ENV}"
    else:
        root, source = _repo_root().parent / "shared" / "reference", "the default location"
    root = root.expanduser()
    if not root.is_dir():
        raise ReferenceDataMissing(
            f"reference data folder not found: {root} (from {source}). Point goodput at the folder "
            f"holding the Pollux/Sia reference data with --reference PATH or {DEFAULT_ENV}=PATH."
        )
    return root


# --------------------------------------------------------------------------------------------
# CSV helpers


def _read_columns(path: Path, required: tuple[str, ...]) -> tuple[list[str], list[tuple[int, dict]]]:
    """Header and (line number, row) pairs; ValueError naming the file if a column is missing."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                raise ValueError(f"{path}: empty file, expected columns {', '.join(required)}")
            header = [h.strip() for h in header]
            missing = [c for c in required if c not in header]
            if missing:
                raise ValueError(f"{path}: missing column(s) {', '.join(missing)} (found: {', '.join(header)})")
            rows = []
            for row in reader:
                if not any(cell.strip() for cell in row):
                    continue  # blank line
                if len(row) != len(header):
                    raise ValueError(f"{path}, line {reader.line_num}: {len(row)} fields, header has {len(header)}")
                rows.append((reader.line_num, {h: v.strip() for h, v in zip(header, row)}))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text CSV ({exc})") from None
    return header, rows


def _parse(path: Path, line: int, column: str, text: str, kind: type):
    """One cell as float or int; ints may be written as integral floats (``20.0`` in some files)."""
    try:
        value = float(text)
        if kind is int:
            if not value.is_integer():
                raise ValueError
            return int(value)
        if not np.isfinite(value):
            raise ValueError
        return value
    except ValueError:
        raise ValueError(f"{path}, line {line}: column {column!r} has {text!r}, expected {kind.__name__}") from None


def _column(path: Path, rows: list[tuple[int, dict]], column: str, kind: type) -> np.ndarray:
    arr = np.array(
        [_parse(path, line, column, row[column], kind) for line, row in rows],
        dtype=np.int64 if kind is int else np.float64,
    )
    arr.setflags(write=False)  # shared, frozen data
    return arr


# --------------------------------------------------------------------------------------------
# Step-time measurements


@dataclass(frozen=True, eq=False)
class Measurements:
    """One ``placements*.csv`` or ``scalability*.csv``: one row per measured configuration.

    Arrays are read-only. ``placement`` is the digit string (GPUs per node) for placements files and
    ``""`` for scalability rows.
    """

    nodes: np.ndarray
    gpus: np.ndarray
    local_bsz: np.ndarray
    step_time: np.ndarray
    sync_time: np.ndarray
    placement: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.local_bsz)

    @property
    def compute_time(self) -> np.ndarray:
        """Time of one accumulation step (no all-reduce), as the peers' simulators define it."""
        return self.step_time - self.sync_time

    def observations(self, group: int = 1) -> list[Observation]:
        """The rows as throughput observations: one micro-batch per step (s = 0), GPUs counted in
        model-parallel replicas of `group` GPUs (1: data-parallel, a replica is a GPU)."""
        if np.any(self.gpus % group):
            raise ValueError(f"a row uses GPUs that are not whole replicas of {group} GPUs")
        return [
            Observation(int(n), int(g) // group, int(m), 0, float(t), float(c))
            for n, g, m, t, c in zip(self.nodes, self.gpus, self.local_bsz, self.step_time, self.compute_time)
        ]

    def select(self, mask) -> Measurements:
        """The rows picked by a boolean mask or an index array."""
        mask = np.asarray(mask)
        picked = [self.placement[i] for i in np.arange(len(self))[mask]]
        arrays = {}
        for name in ("nodes", "gpus", "local_bsz", "step_time", "sync_time"):
            arr = getattr(self, name)[mask]
            arr.setflags(write=False)
            arrays[name] = arr
        return Measurements(placement=tuple(picked), **arrays)


def pipeline_steps(rows: Measurements, stages: int) -> Measurements:
    """A pipeline-parallel model's rows (stage forward time per micro-batch) as whole steps of one
    replica pass (module docstring): local_bsz x micro-batches, 3 (stages - 1 + micro-batches)
    forwards plus the all-reduce."""
    compute = PIPELINE_PASS_FORWARDS * (stages - 1 + PIPELINE_MICROBATCHES) * rows.step_time
    step, local = compute + rows.sync_time, rows.local_bsz * PIPELINE_MICROBATCHES
    for arr in (step, local):
        arr.setflags(write=False)
    return replace(rows, local_bsz=local, step_time=step)


def load_measurements(path: str | os.PathLike) -> Measurements:
    """Read a placements or scalability file, telling them apart by their columns."""
    path = Path(path)
    header, rows = _read_columns(path, ("local_bsz", "step_time", "sync_time"))
    if "placement" in header:
        placement = []
        for line, row in rows:
            p = row["placement"]
            if not p.isdigit() or "0" in p:
                raise ValueError(
                    f"{path}, line {line}: placement {p!r} is not a string of digits 1-9 (GPUs used on each node)"
                )
            placement.append(p)
        nodes = np.array([len(p) for p in placement], dtype=np.int64)
        gpus = np.array([sum(int(d) for d in p) for p in placement], dtype=np.int64)
        nodes.setflags(write=False)
        gpus.setflags(write=False)
    elif "num_nodes" in header and "num_replicas" in header:
        nodes = _column(path, rows, "num_nodes", int)
        gpus = _column(path, rows, "num_replicas", int)
        placement = [""] * len(rows)
    else:
        raise ValueError(
            f"{path}: neither a placements file (column placement) nor a scalability file "
            f"(columns num_nodes, num_replicas); found: {', '.join(header)}"
        )
    if not rows:
        raise ValueError(f"{path}: no data rows")
    return Measurements(
        nodes=nodes,
        gpus=gpus,
        local_bsz=_column(path, rows, "local_bsz", int),
        step_time=_column(path, rows, "step_time", float),
        sync_time=_column(path, rows, "sync_time", float),
        placement=tuple(placement),
    )


# --------------------------------------------------------------------------------------------
# Validation runs


@dataclass(frozen=True, eq=False)
class ValidationRun:
    """One ``validation-<B>.csv``: per-epoch progress and gradient statistics at total batch B."""

    batch_size: int
    progress: np.ndarray
    iteration: np.ndarray
    metric: np.ndarray
    grad_sqr: np.ndarray
    grad_var: np.ndarray

    def __len__(self) -> int:
        return len(self.progress)


def load_validation(path: str | os.PathLike) -> ValidationRun:
    """Read one validation run; the batch size comes from the file name, as in the peers' code."""
    path = Path(path)
    match = _VALIDATION_FILE.match(path.name)
    if not match:
        raise ValueError(f"{path}: expected a file named validation-<batch size>.csv")
    _, rows = _read_columns(path, _VALIDATION_COLUMNS)
    if not rows:
        raise ValueError(f"{path}: no data rows")
    return ValidationRun(
        batch_size=int(match.group(1)),
        progress=_column(path, rows, "progress", float),
        iteration=_column(path, rows, "iteration", int),
        metric=_column(path, rows, "metric", float),
        grad_sqr=_column(path, rows, "grad_sqr", float),
        grad_var=_column(path, rows, "grad_var", float),
    )


# --------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True, eq=False)
class ModelTrace:
    """Everything measured for one model (one trace folder)."""

    name: str
    folder: Path
    placements: dict[str, Measurements]  # gpu_type -> measurements
    scalability: dict[str, Measurements]  # gpu_type -> measurements
    validation: dict[int, ValidationRun]  # total batch size -> run

    @property
    def init_batch(self) -> int:
        """Smallest batch with a validation run (the peers' M0 / init_batch_size)."""
        if not self.validation:
            raise ValueError(f"{self.folder}: no validation-<B>.csv files for {self.name}")
        return min(self.validation)

    @property
    def max_batch(self) -> int:
        """Largest batch with a validation run (the peers' max_batch_size)."""
        if not self.validation:
            raise ValueError(f"{self.folder}: no validation-<B>.csv files for {self.name}")
        return max(self.validation)

    @property
    def gpu_types(self) -> list[str]:
        return sorted(self.placements)

    @property
    def group_gpus(self) -> dict[str, int]:
        """GPUs of one model-parallel replica on each type where the model is hybrid-parallel: the
        smallest GPU count measured there. Types measured on one GPU (data-parallel) are left out."""
        return _group_gpus(self.placements)

    def local_bsz_limits(self, gpu_type: str) -> tuple[int, int]:
        """Per-replica batch limits on a type (per GPU for a data-parallel model): min/max local_bsz
        in its placements."""
        try:
            m = self.placements[gpu_type]
        except KeyError:
            raise KeyError(
                f"{self.name} has no placements for GPU type {gpu_type!r} (has: {', '.join(self.gpu_types)})"
            ) from None
        return int(m.local_bsz.min()), int(m.local_bsz.max())


def _measurement_files(folder: Path, kind: str) -> dict[str, Path]:
    """gpu_type -> file for one kind; an unsuffixed file is 'aws' unless a -aws file also exists."""
    files: dict[str, Path] = {}
    unsuffixed = None
    for f in sorted(folder.iterdir()):
        m = _MEASUREMENT_FILE.match(f.name)
        if not m or m.group(1) != kind or not f.is_file():
            continue
        if m.group(2) is None:
            unsuffixed = f
        else:
            files[m.group(2)] = f
    if unsuffixed is not None and UNSUFFIXED_GPU_TYPE not in files:
        files[UNSUFFIXED_GPU_TYPE] = unsuffixed  # Sia's copies are byte-identical to -aws: skipped
    return dict(sorted(files.items()))


def _group_gpus(placements: dict[str, Measurements]) -> dict[str, int]:
    return {t: int(m.gpus.min()) for t, m in placements.items() if m.gpus.min() > 1}


def load_model(folder: str | os.PathLike) -> ModelTrace:
    """Load one trace folder; the model name is the folder name. A hybrid-parallel model's rows
    are read as whole pipeline steps (`pipeline_steps`)."""
    folder = Path(folder)
    placements = {t: load_measurements(f) for t, f in _measurement_files(folder, "placements").items()}
    scalability = {t: load_measurements(f) for t, f in _measurement_files(folder, "scalability").items()}
    for gpu_type, stages in _group_gpus(placements).items():
        placements[gpu_type] = pipeline_steps(placements[gpu_type], stages)
        if gpu_type in scalability:
            scalability[gpu_type] = pipeline_steps(scalability[gpu_type], stages)
    validation = {}
    for f in sorted(folder.glob("validation-*.csv")):
        run = load_validation(f)
        validation[run.batch_size] = run
    return ModelTrace(folder.name, folder, placements, scalability, validation)


def discover_models(root: str | os.PathLike | None = None) -> dict[str, ModelTrace]:
    """Every model under ``root`` (any folder holding placements*.csv), by model name.

    ``root`` may be the whole reference folder or its ``pollux``/``sia`` part (None: reference_root()).
    When a name appears in two folders (the whole folder holds both Pollux's and Sia's traces), the
    folder with more GPU types wins, i.e. Sia's; its aws files equal Pollux's byte for byte. A tie
    is ambiguous and raises ValueError asking for a narrower root. Other CSVs (philly.csv, workloads,
    adaptdl seed/profiles) are ignored because they are not named placements*.csv.
    """
    root = reference_root(root)
    folders = sorted({f.parent for f in root.rglob("placements*.csv") if _MEASUREMENT_FILE.match(f.name)})
    models: dict[str, ModelTrace] = {}
    for folder in folders:
        model = load_model(folder)
        other = models.get(model.name)
        if other is None or len(model.gpu_types) > len(other.gpu_types):
            models[model.name] = model
        elif len(model.gpu_types) == len(other.gpu_types):
            raise ValueError(
                f"model {model.name!r} found in both {other.folder} and {model.folder} with the same "
                "number of GPU types; pass a narrower reference folder (e.g. .../reference/sia)"
            )
    if not models:
        raise ReferenceDataMissing(
            f"no model traces (folders with placements*.csv) found under {root}; point "
            f"--reference or {DEFAULT_ENV} at the Pollux/Sia reference data folder"
        )
    return dict(sorted(models.items()))


# --------------------------------------------------------------------------------------------
# Workloads


@dataclass(frozen=True)
class WorkloadJob:
    """One job submission from a workload file; num_replicas/batch_size are the user's request,
    `team` the team it belongs to and `priority` its order within the team (docs/teams.md)."""

    name: str
    time: float
    application: str
    num_replicas: int
    batch_size: int
    team: str = DEFAULT_TEAM
    priority: int = 0
    target_epochs: float | None = None  # the work its user declares (JobSpec.target_epochs); None: none


def load_workload(path: str | os.PathLike) -> list[WorkloadJob]:
    """Read a workload CSV (columns by name, extra columns ignored), sorted by submit time. The
    optional columns `team` (empty: the default team) and `priority` (an integer, empty: 0) say
    whose each job is and its order within its team; a name that cannot be a team's is refused.
    The optional column `target_epochs` (empty: none) is the work each job's user declares."""
    path = Path(path)
    _, rows = _read_columns(path, _WORKLOAD_COLUMNS)
    jobs = []
    for line, row in rows:
        for column in ("name", "application"):
            if not row[column]:
                raise ValueError(f"{path}, line {line}: empty {column!r}")
        time = _parse(path, line, "time", row["time"], float)
        if time < 0:
            raise ValueError(f"{path}, line {line}: negative time {row['time']!r}")
        num_replicas = _parse(path, line, "num_replicas", row["num_replicas"], int)
        batch_size = _parse(path, line, "batch_size", row["batch_size"], int)
        if num_replicas < 1 or batch_size < 1:
            raise ValueError(f"{path}, line {line}: num_replicas and batch_size must be >= 1")
        team = row.get("team") or DEFAULT_TEAM
        problem = None if team == DEFAULT_TEAM else team_problem(team)
        if problem is not None:
            raise ValueError(f"{path}, line {line}: column 'team': {problem}")
        priority = _parse(path, line, "priority", row["priority"], int) if row.get("priority") else 0
        if abs(priority) > MAX_PRIORITY:
            raise ValueError(f"{path}, line {line}: priority {priority} is not within -{MAX_PRIORITY}..{MAX_PRIORITY}")
        target = _parse(path, line, "target_epochs", row["target_epochs"], float) if row.get("target_epochs") else None
        if target is not None and not 0 < target <= MAX_TARGET_EPOCHS:
            raise ValueError(f"{path}, line {line}: target_epochs {target} is not within (0, {MAX_TARGET_EPOCHS:g}]")
        jobs.append(
            WorkloadJob(row["name"], time, row["application"], num_replicas, batch_size, team, priority, target)
        )
    jobs.sort(key=lambda j: j.time)  # stable: ties keep file order
    return jobs
