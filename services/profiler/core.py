"""The profiler's core: a job's 1-GPU bootstrap profile on each GPU type (Sia §3.3).

A real profiling run (the executor issue) times a few steps at ~10 batch sizes on one GPU of each
type and finds the largest batch that fits memory. A hybrid-parallel job is profiled on one replica:
its model-parallel group of GPUs on one node. Here it is trace-backed: the profile a real
run would have measured, read from the reference profiles (or predicted by the built-in model zoo
when there is no reference data), so the simulator and the embedded stack bootstrap like Sia does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np

from shared.cluster import Cluster
from goodput_train.goodput import ThroughputParams, compute_time, iteration_time
from shared.hardware import described, hardware_name, types_named
from shared.reference import ModelTrace, ReferenceDataMissing, discover_models
from shared.schema import JobSpec, NodeInfo, Profile, ProfilePoint, node_applications
from shared.zoo import load_zoo

PROFILE_POINTS = 10     # batch sizes per GPU type
STEPS_PER_POINT = 10    # timed steps at each batch size (what profiling costs in GPU time)


def _spread(values: np.ndarray, count: int) -> np.ndarray:
    """Up to `count` of the sorted unique values, evenly spread, always with both ends."""
    unique = np.unique(values)
    if unique.size <= count:
        return unique
    return unique[np.unique(np.round(np.linspace(0, unique.size - 1, count)).astype(int))]


def _profile(job_id: str, model: str, gpu_type: str, points: list[ProfilePoint], group: int) -> Profile:
    return Profile(
        job_id=job_id,
        model=model,
        gpu_type=gpu_type,
        points=tuple(points),
        min_local=min(p.local_bsz for p in points),
        max_local=max(p.local_bsz for p in points),
        gpu_seconds=STEPS_PER_POINT * group * sum(p.step_time for p in points),
        group_gpus=group,
    )


def trace_profile(trace: ModelTrace, gpu_type: str, job_id: str = "", points: int = PROFILE_POINTS) -> Profile:
    """The profile of one replica of `trace`'s model on `gpu_type` (one GPU, or a hybrid-parallel
    model's group on one node), from its measured steps there.

    The largest measured batch stands for the largest batch that fits memory.
    """
    if gpu_type not in trace.placements:
        raise ValueError(f"no {gpu_type!r} measurements for model {trace.name!r} (has {trace.gpu_types})")
    meas = trace.placements[gpu_type]
    group = trace.group_gpus.get(gpu_type, 1)
    single = meas.select((meas.gpus == group) & (meas.nodes == 1))
    if len(single) == 0:
        raise ValueError(f"model {trace.name!r} has no {group}-GPU measurement on one {gpu_type!r} node")
    chosen = []
    for bsz in _spread(single.local_bsz, points):
        at = single.local_bsz == bsz
        # Repeated measurements of one batch: their median, as a profiler would report.
        chosen.append(ProfilePoint(int(bsz), float(np.median(single.step_time[at])),
                                   float(np.median(single.sync_time[at]))))
    return _profile(job_id, trace.name, gpu_type, chosen, group)


def model_profile(params: ThroughputParams, model: str, gpu_type: str, min_local: int, max_local: int,
                  job_id: str = "", points: int = PROFILE_POINTS, group: int = 1) -> Profile:
    """The profile of one replica (of `group` GPUs) a fitted model predicts: geometric batch sizes
    in [min_local, max_local]."""
    sizes = np.unique(np.round(np.geomspace(min_local, max_local, points)).astype(int))
    chosen = [ProfilePoint(int(b), float(iteration_time(params, 1, 1, b)),
                           float(iteration_time(params, 1, 1, b) - compute_time(params, b)))
              for b in sizes]
    return _profile(job_id, model, gpu_type, chosen, group)


@dataclass(frozen=True)
class ProfileSource:
    """The trace-backed profiler's data: per application, the GPU types it has measurements of, and
    the profile a profiling run would measure on each."""

    origin: str                                   # "reference:<folder>" or "zoo"
    types: Mapping[str, tuple[str, ...]]          # application -> its GPU types
    profile: Callable[[str, str], Profile]        # (application, GPU type) -> its 1-GPU profile


def profile_source(reference: str | None = None, use_zoo: bool = False) -> ProfileSource:
    """The reference profiles when the reference folder is there (or `reference` names it), else
    (or with `use_zoo`) the built-in model zoo's predictions."""
    if not use_zoo:
        try:
            traces = discover_models(reference)
        except ReferenceDataMissing:
            if reference is not None:
                raise
        else:
            return ProfileSource(f"reference:{next(iter(traces.values())).folder.parent}",
                                 {name: tuple(t.gpu_types) for name, t in traces.items()},
                                 lambda model, gpu_type: trace_profile(traces[model], gpu_type))
    zoo = load_zoo()

    def profile(model: str, gpu_type: str) -> Profile:
        z = zoo[model].types[gpu_type]
        return model_profile(z.params, model, gpu_type, z.min_local, z.max_local,
                             group=zoo[model].group_gpus.get(gpu_type, 1))

    return ProfileSource("zoo", {name: tuple(m.types) for name, m in zoo.items()}, profile)


ID_RULES = ("a job id is 1 to 128 letters, digits, '_', '-' and single '.' between them, beginning with a letter "
            "or digit")
SMALLEST_SUBMISSION = ('a submission names at least its id and application: {"id": "my-job-1", "application": '
                       '"cifar10"} (an empty body is the empty object)')
SUBMISSION_RULES = ("a submission may not carry commands or file paths: the job's code is named by `application`, "
                    "a model or job module the cluster knows")


MAX_QUOTED = 300      # of msgspec's reason, which quotes the sender's field names


def id_taken(job_id: str) -> str:
    """Why a second, different submission under an id is refused."""
    return (f"job {job_id} already exists: another submission holds this id (a job's id belongs to its first valid "
            "submission); submit under another id")


def malformed_reason(error: Exception) -> str:
    """Why a body is not a submission, as its sender should read it: msgspec's reason, the rules it
    broke, and for an unknown field the field it may have meant."""
    import difflib
    import re

    text = str(error)
    unknown = re.search(r"unknown field `([^`]*)`", text)
    if len(text) > MAX_QUOTED:                # it quotes what was sent: a 60 KB field name is not read
        text = text[:MAX_QUOTED] + "…"
    hint = ""
    if unknown:
        fields = [f for f in JobSpec.__struct_fields__ if f != "version"]
        near = difflib.get_close_matches(unknown.group(1)[:64], fields, n=1)
        hint = (f"; did you mean `{near[0]}`?" if near else "") + f" (the fields: {', '.join(fields)})"
    rules = (f"; {SUBMISSION_RULES}" if unknown or "`$.application`" in text
             else f"; {ID_RULES}" if "`$.id`" in text
             else f"; {SMALLEST_SUBMISSION}" if "missing required field" in text else "")
    return f"malformed submission: {text}{hint}{rules}"


def submission_problem(spec: JobSpec, cluster: Cluster, models: Mapping[str, Iterable[str]] | None,
                       live: bool) -> str | None:
    """Why a well-formed submission cannot be scheduled on `cluster` (None if it can): an application
    with no profile (`models`, application -> its GPU types; None: profiles are measured, any
    application may be), GPU types this cluster does not have (or none the application runs on), a
    GPU count larger than the GPUs it may use, or a submit time on a live submission."""
    if live and spec.submit_s is not None:
        return ("submit_s is for replayed workloads; a live submission arrives when it is submitted: "
                "leave submit_s out")
    if not live and spec.submit_s is None:
        return "a replayed submission needs its submit_s"
    known_types = set(cluster.gpu_types)
    named, unknown = named_types(spec, cluster)
    if unknown:
        return f"unknown GPU type(s) {', '.join(unknown)}; this cluster has {described(cluster.gpu_types)}"
    allowed = set(named) or known_types
    if models is not None:
        if spec.application not in models:
            near = sorted(models)
            return f"unknown application {spec.application!r}: no profile for it (known: {', '.join(near)})"
        allowed &= set(models[spec.application])
        if not allowed:
            return (f"application {spec.application!r} has no profile on GPU type(s) "
                    f"{described(named or cluster.gpu_types)}")
    usable = sum(n.gpus for n in cluster.nodes if n.gpu_type in allowed)
    for field, gpus in (("requested_gpus", spec.requested_gpus if spec.rigid else 0), ("min_gpus", spec.min_gpus)):
        if gpus > usable:
            return (f"{field} {gpus} is more than the {usable} GPUs it may use: cluster {cluster.name} has "
                    f"{cluster.total_gpus} GPUs ({_type_counts(cluster)})")
    if spec.requested_gpus > cluster.total_gpus:
        return (f"requested_gpus {spec.requested_gpus} is more than cluster {cluster.name}'s "
                f"{cluster.total_gpus} GPUs ({_type_counts(cluster)})")
    return None


def agents_models(nodes: Iterable[NodeInfo], gpu_types: Iterable[str]) -> dict[str, tuple[str, ...]] | None:
    """`models` for `submission_problem` with real executors: each application the live node agents
    say they run, on the types of those agents' nodes and on every type of `gpu_types` no live agent
    speaks for (its nodes may be away for a moment: the job's profiling run waits for them). None
    while no agent says what it runs: the profiling run decides then."""
    nodes = list(nodes)
    said = node_applications(nodes)
    if said is None:
        return None
    unsaid = tuple(t for t in gpu_types if not any(n.gpu_type == t and n.applications for n in nodes))
    return {application: types + tuple(t for t in unsaid if t not in types) for application, types in said.items()}


def named_types(spec: JobSpec, cluster: Cluster) -> tuple[list[str], list[str]]:
    """The cluster's GPU types a submission's `gpu_types` name (by key or hardware name: "aws" or
    "T4"), in cluster order; and the names that name none."""
    named = {t for name in spec.gpu_types for t in types_named(name, cluster.gpu_types)}
    unknown = [name for name in spec.gpu_types if not types_named(name, cluster.gpu_types)]
    return [t for t in cluster.gpu_types if t in named], unknown


def _type_counts(cluster: Cluster) -> str:
    return ", ".join(f"{cluster.capacity(t)} {hardware_name(t)}" for t in cluster.gpu_types)
