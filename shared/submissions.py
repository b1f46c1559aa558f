"""What a submission may be: its id's rules, the reasons a malformed one is refused, and whether
a well-formed one can run on this cluster. The API refuses at once what these say; the profiler
judges the stored submissions by the same rules."""

from __future__ import annotations

from typing import Iterable, Mapping

from shared.cluster import Cluster
from shared.hardware import described, hardware_name, types_named
from shared.schema.jobs import JobSpec
from shared.schema.nodes import NodeInfo, node_applications

ID_RULES = (
    "a job id is 1 to 128 letters, digits, '_', '-' and single '.' between them, beginning with a letter or digit"
)
SMALLEST_SUBMISSION = (
    'a submission names at least its id and application: {"id": "my-job-1", "application": '
    '"cifar10"}, or its id and its own code: {"id": "my-job-1", "code": "<the archive\'s sha256>", '
    '"entrypoint": "train.py"} (an empty body is the empty object)'
)
SUBMISSION_RULES = (
    "a submission may not carry commands: the job's code is named by `application`, a model or job "
    "module the cluster knows, or is its own archive in the code store (`code`, `entrypoint`, `args`)"
)


MAX_QUOTED = 300  # of msgspec's reason, which quotes the sender's field names


def id_taken(job_id: str) -> str:
    """Why a second, different submission under an id is refused."""
    return (
        f"job {job_id} already exists: another submission holds this id (a job's id belongs to its first valid "
        "submission); submit under another id"
    )


def malformed_reason(error: Exception) -> str:
    """Why a body is not a submission, as its sender should read it: msgspec's reason, the rules it
    broke, and for an unknown field the field it may have meant."""
    import difflib
    import re

    text = str(error)
    unknown = re.search(r"unknown field `([^`]*)`", text)
    if len(text) > MAX_QUOTED:  # it quotes what was sent: a 60 KB field name is not read
        text = text[:MAX_QUOTED] + "…"
    hint = ""
    if unknown:
        fields = [f for f in JobSpec.__struct_fields__ if f != "version"]
        near = difflib.get_close_matches(unknown.group(1)[:64], fields, n=1)
        hint = (f"; did you mean `{near[0]}`?" if near else "") + f" (the fields: {', '.join(fields)})"
    rules = (
        f"; {SUBMISSION_RULES}"
        if unknown or ("`$.application`" in text and "of length" not in text)
        else f"; {ID_RULES}"
        if "`$.id`" in text
        else f"; {SMALLEST_SUBMISSION}"
        if "missing required field" in text
        else ""
    )
    return f"malformed submission: {text}{hint}{rules}"


def submission_problem(
    spec: JobSpec, cluster: Cluster, models: Mapping[str, Iterable[str]] | None, live: bool, own_code: bool = False
) -> str | None:
    """Why a well-formed submission cannot be scheduled on `cluster` (None if it can): an application
    with no profile (`models`, application -> its GPU types; None: profiles are measured, any
    application may be), GPU types this cluster does not have (or none the application runs on), a
    GPU count larger than the GPUs it may use, or a submit time on a live submission. A job that
    carries its code runs where executors run a job's own code (`own_code`: real ones), whatever
    the applications its nodes list."""
    if spec.code is not None and not own_code:
        return (
            "a job that carries its code runs on real executors (`goodput up --executors real`); this "
            "cluster is simulated: name an application instead"
        )
    if live and spec.submit_s is not None:
        return "submit_s is for replayed workloads; a live submission arrives when it is submitted: leave submit_s out"
    if not live and spec.submit_s is None:
        return "a replayed submission needs its submit_s"
    known_types = set(cluster.gpu_types)
    named, unknown = named_types(spec, cluster)
    if unknown:
        return f"unknown GPU type(s) {', '.join(unknown)}; this cluster has {described(cluster.gpu_types)}"
    allowed = set(named) or known_types
    if models is not None and spec.code is None:
        if spec.application not in models:
            near = sorted(models)
            return f"unknown application {spec.application!r}: no profile for it (known: {', '.join(near)})"
        allowed &= set(models[spec.application])
        if not allowed:
            return (
                f"application {spec.application!r} has no profile on GPU type(s) "
                f"{described(named or cluster.gpu_types)}"
            )
    usable = sum(n.gpus for n in cluster.nodes if n.gpu_type in allowed)
    for field, gpus in (
        ("requested_gpus", spec.requested_gpus if spec.fixed_gpus else 0),
        ("min_gpus", spec.gpu_range[0]),
    ):
        if gpus > usable:
            return (
                f"{field} {gpus} is more than the {usable} GPUs it may use: cluster {cluster.name} has "
                f"{cluster.total_gpus} GPUs ({_type_counts(cluster)})"
            )
    if spec.requested_gpus > cluster.total_gpus:
        return (
            f"requested_gpus {spec.requested_gpus} is more than cluster {cluster.name}'s "
            f"{cluster.total_gpus} GPUs ({_type_counts(cluster)})"
        )
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
