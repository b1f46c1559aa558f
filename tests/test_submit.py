"""Job submissions: validated at the door, stored in JetStream once per id, refused with a reason."""

import asyncio

import nats
import nats.errors
import pytest

from cli.main import main
from cli.submit import load_job, submit
from shared import credentials, storage, subjects
from shared.cluster import load_cluster
from shared.schema.jobs import JobSpec, Rejected, rejection
from shared.schema.nodes import NodeInfo
from shared.submissions import agents_models, malformed_reason, submission_problem


def write(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_job_file_becomes_a_jobspec(tmp_path):
    spec = load_job(write(tmp_path, "id: cifar-7\napplication: cifar10\nrequested_gpus: 4\nrequested_batch: 512\n"))
    assert spec == JobSpec("cifar-7", "cifar10", requested_gpus=4, requested_batch=512)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("id: a\napplication: cifar10\ngpus: 4\n", "unknown field `gpus`"),
        ("id: a\napplication: cifar10\nrequested_batch: -32\n", "requested_batch"),
        ("id: a b\napplication: cifar10\n", "$.id"),
        ("id: job.\napplication: cifar10\n", "$.id"),  # a KV key may not end in '.'
        ("id: a..b\napplication: cifar10\n", "$.id"),
        ("application: cifar10\n", "missing required field `id`"),
        ("id: a\napplication: bert\nstrong_scaling: true\n", "needs requested_batch"),
        ("id: [unclosed\n", "not valid YAML"),
        ('id: a\napplication: cifar10\nrequested_gpus: "4"\n', "Expected `int`, got `str`"),  # as the schema says
        ("id: a\napplication: cifar10\nrigid: 1\n", "Expected `bool`, got `int`"),
        ("", "holds nothing, not a job: a mapping of fields"),
        ("- id: a\n", "holds a list, not a job"),
        ("id: a\nentrypoint: train.py\n", "its code is a folder: `goodput submit JOB --code DIR`"),
    ],
)
def test_bad_job_files_are_refused_with_the_reason(tmp_path, text, reason):
    with pytest.raises(ValueError, match=None) as error:
        load_job(write(tmp_path, text))
    assert reason in str(error.value)


def test_a_json_job_file_is_read_and_refused_as_json(tmp_path):
    assert load_job(write(tmp_path, '{"id": "a", "application": "cifar10"}', "job.json")) == JobSpec("a", "cifar10")
    with pytest.raises(ValueError) as error:
        load_job(write(tmp_path, '{"id": "a", "application": ', "job.json"))
    assert str(error.value).endswith("job.json is not valid JSON: Expecting value at line 1, column 28")


CLUSTER = load_cluster("sia-hetero-64")  # 24 aws (T4), 16 dgx-ext (A100), 24 rtx
MODELS = {"cifar10": ("aws", "dgx-ext", "rtx"), "bert": ("dgx-ext",)}


def problem(spec: JobSpec, live: bool = True) -> str | None:
    return submission_problem(spec, CLUSTER, MODELS, live)


def test_submission_problems_name_what_is_unknown():
    assert "tpu-v9" in problem(JobSpec("a", "cifar10", gpu_types=("dgx-ext", "tpu-v9")))
    assert "resnet" in problem(JobSpec("b", "resnet")) and "cifar10" in problem(JobSpec("b", "resnet"))
    assert "no profile on GPU type(s) T4 (aws)" in problem(JobSpec("b", "bert", gpu_types=("aws",)))
    # Hardware names stand for the types: "T4" is aws, "RTX2080Ti" rtx; an unknown one lists them.
    assert problem(JobSpec("e", "cifar10", gpu_types=("T4", "rtx-2080-ti"))) is None
    assert "RTX 2080 Ti (rtx)" in problem(JobSpec("f", "cifar10", gpu_types=("H100",)))
    assert problem(JobSpec("c", "cifar10", gpu_types=("aws",))) is None


def test_with_real_executors_the_applications_are_those_the_live_node_agents_run():
    """An application no live agent runs is unknown; a type whose agents are away for a moment is
    left to the job's profiling run (not refused); no agent says: the profiling run decides."""
    cluster = load_cluster("sia-hetero-64")
    nodes = [
        NodeInfo("a-0", "aws", 4, "10.0.0.1", applications=("tiny_lm", "mlp_blobs")),
        NodeInfo("d-0", "dgx-ext", 8, "10.0.0.2", applications=("tiny_lm",)),
    ]
    models = agents_models(nodes, cluster.gpu_types)
    unknown = submission_problem(JobSpec("a", "nosuchjob"), cluster, models, live=True)
    assert unknown.startswith("unknown application 'nosuchjob'") and "(known: mlp_blobs, tiny_lm)" in unknown
    assert submission_problem(JobSpec("b", "tiny_lm"), cluster, models, live=True) is None
    assert submission_problem(JobSpec("c", "mlp_blobs", gpu_types=("rtx",)), cluster, models, live=True) is None
    assert "no profile on GPU type(s) A100 (dgx-ext)" in submission_problem(
        JobSpec("d", "mlp_blobs", gpu_types=("dgx-ext",)), cluster, models, live=True
    )
    assert agents_models([NodeInfo("a-0", "aws", 4, "10.0.0.1")], cluster.gpu_types) is None


def test_a_request_larger_than_the_cluster_is_refused_naming_its_size():
    assert "64 GPUs" in problem(JobSpec("a", "cifar10", requested_gpus=10_000))
    # A rigid job must fit the GPUs of the types it may use: 24 T4s.
    assert "24 GPUs it may use" in problem(JobSpec("b", "cifar10", requested_gpus=32, rigid=True, gpu_types=("aws",)))
    assert "min_gpus 17" in problem(JobSpec("c", "bert", min_gpus=17, requested_gpus=17))
    assert problem(JobSpec("d", "cifar10", requested_gpus=16, rigid=True, gpu_types=("dgx-ext",))) is None


def test_only_a_replay_may_say_when_a_job_was_submitted():
    spec = JobSpec("a", "cifar10", submit_s=30.0)
    assert "submit_s" in problem(spec, live=True) and problem(spec, live=False) is None


def test_rejection_records_the_start_of_the_payload():
    record = rejection(subjects.SUBMIT, "bad", b"x" * 10_000, job_id="j")
    assert isinstance(record, Rejected) and len(record.payload) == 512 and record.job_id == "j"


async def test_every_submission_is_stored_in_the_intake_for_the_gate_to_judge(nats_server, connect_bus):
    """The intake keeps message ids for 100 ms only (another login's would drop this one's): the same
    body twice is stored twice, and the gate calls the second a repeat."""
    spec = JobSpec("dup-test-1", "cifar10")
    await storage.provision(await connect_bus("operator"))  # the operator's part: the stream
    for body in (spec, spec, JobSpec("dup-test-1", "cifar10", requested_gpus=2)):
        await submit(body, nats_server)
    bus = await connect_bus()
    info = await bus.js.stream_info(subjects.INTAKE_STREAM)
    stored = [
        await bus.js.get_msg(subjects.INTAKE_STREAM, seq)
        for seq in range(info.state.first_seq, info.state.last_seq + 1)
    ]
    # Other tests share the server's stream: count by id, on the intake subject of a client with no login's.
    mine = [
        bus.decode(m.data, JobSpec)
        for m in stored
        if m.subject == subjects.intake(subjects.DEFAULT_TEAM, subjects.OPERATOR)
    ]
    assert [s.requested_gpus for s in mine if s.id == "dup-test-1"] == [spec.requested_gpus] * 2 + [2]


def test_a_server_without_the_service_is_not_called_unreachable():
    why = credentials.unreachable("nats://127.0.0.1:4222", nats.errors.NoRespondersError(), {})
    assert "answers, but no goodput service answered" in why and "cannot reach" not in why


def test_submit_command_reports_an_unreachable_server(tmp_path, capsys):
    job = write(tmp_path, "id: a\napplication: cifar10\n")
    assert main(["submit", str(job), "--server", "nats://127.0.0.1:1"]) == 2
    assert "cannot reach NATS" in capsys.readouterr().err


def test_submit_command_sends_each_file_and_says_which_were_not(tmp_path, capsys, nats_server, no_login):
    """`goodput submit a.yaml b.yaml c.yaml`: one bad file is said, the others go still; exit 2."""
    from launcher.setup import provision_now

    provision_now(nats_server)
    files = [write(tmp_path, f"id: multi-{n}\napplication: cifar10\n", f"{n}.yaml") for n in "ab"]
    bad = write(tmp_path, "id: multi-c\napplication: cifar10\ngpus: 4\n", "c.yaml")
    assert main(["submit", str(files[0]), str(bad), str(files[1]), "--stream", "--server", nats_server]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"multi-{n}: stored; the API judges it next (`goodput status multi-{n}`)" for n in "ab"
    ], out
    assert "c.yaml" in err and "unknown field `gpus`" in err and "1 of 3 jobs not submitted" in err, err
    # The same again: stored, and the gate's to call repeats.
    assert main(["submit", *map(str, files), "--stream", "--server", nats_server]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"multi-{n}: stored; the API judges it next (`goodput status multi-{n}`)" for n in "ab"
    ]


async def test_a_body_that_is_no_json_object_on_the_stream_is_refused_saying_what_a_submission_is(
    connect_bus, nats_server, name_prefix
):
    """A body published to the submissions stream by a client that is not ours (nats-py, raw bytes)
    that is neither a JSON object nor msgpack: the reason the profiler records says what a
    submission is, not msgpack's reading of it ("Expected `object`, got `int`")."""
    bus = await connect_bus()
    stream, subject = f"{name_prefix}_SUBMISSIONS", f"{name_prefix}.submit"
    await bus.ensure_stream(stream, [subject])
    reasons: asyncio.Queue[str] = asyncio.Queue()
    consumer = await bus.pull_consumer(
        stream,
        "profiler",
        subject,
        JobSpec,  # as the profiler reads the stream
        on_invalid=lambda _, data, error: reasons.put_nowait(malformed_reason(error)),
    )
    nc = await nats.connect(nats_server)
    try:
        for body in (b"hello", b"[1, 2]", b"42"):
            await nc.jetstream().publish(subject, body)
    finally:
        await nc.close()
    assert await consumer.fetch(batch=3, timeout=5) == []
    for body in ("hello", "[1, 2]", "42"):
        reason = reasons.get_nowait()
        assert "a message is a JSON object (or a msgpack map)" in reason and body in reason, reason
        assert "Expected" not in reason, reason
