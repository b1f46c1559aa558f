"""Every NATS subject, stream, consumer and KV bucket name, in one place.

Subjects are `goodput.<stage>.<event>`; one stream holds what must not be lost.
"""

from __future__ import annotations

import re

PREFIX = "goodput"

# What the server lets a login publish, of submissions: its own `goodput.jobs.submit.<login>`, durable and
# fire-and-forget. The server maps it into the services' account as `goodput.jobs.submit.<team>.<login>`
# (`intake`: the login's account says its team, shared/permissions.py), where it waits in the intake
# stream (a login's backlog there bounded) until the gate (the API, as for its submit) judges it; only a
# valid one is stored in the jobs stream.
SUBMIT = f"{PREFIX}.jobs.submit"
INTAKE_STREAM = "GOODPUT_INTAKE"
INTAKE_SUBJECTS = (f"{SUBMIT}.*.*",)
INTAKE_CONSUMER = "intake"
# The jobs stream: a login's valid submissions as the gate stored them (`stored(team, login)`),
# de-duplicated on the job id and body (Nats-Msg-Id) within DEDUP_WINDOW_S, and the API's record of each
# body it refused (`refused(team, login)`, nothing else stored). The team and the login are the subject's
# last tokens: what a team or a login keeps there is what JetStream counts under its subjects.
STORED = f"{PREFIX}.jobs.stored"
REFUSED = f"{PREFIX}.jobs.refused"
# A replayed workload's submissions (`goodput simulate --bus nats`, `goodput up`'s start-up replay):
# they carry their submit time on the run's clock, which a live submission may not.
REPLAY_SUBMIT = f"{PREFIX}.jobs.replay"
SUBMISSIONS = (f"{STORED}.*.*", REPLAY_SUBMIT)
# The profiler's verdict on each submission, exactly one: refused (the Rejected record, with the
# reason), or accepted (`Profiled`: its profiles are with the estimator, the executors may run it).
REJECTED = f"{PREFIX}.jobs.rejected"
PROFILED = f"{PREFIX}.jobs.profiled"
# An order to stop a job (`Cancel`, from the API, its owner's): the executors end it as cancelled.
CANCEL = f"{PREFIX}.jobs.cancel"
JOBS_STREAM = "GOODPUT_JOBS"
JOBS_STREAM_SUBJECTS = (f"{STORED}.*.*", REPLAY_SUBMIT, REJECTED, f"{REFUSED}.*.*", PROFILED, CANCEL)
# Who submits without a login the server knows (the operator, a service; every client of an
# insecure stack): not one of the logins, which may not take the name.
OPERATOR = "operator"
# The team of the operator's jobs and of the logins without one (shared/teams.py).
DEFAULT_TEAM = "default"


def submit(login: str) -> str:
    """Where `login` publishes a submission itself, in its own account (the intake stream)."""
    return f"{SUBMIT}.{login}"


def intake(team: str, login: str) -> str:
    """Where a submission `login` published itself lands in the services' account (the operator,
    who is there, publishes on it directly)."""
    return f"{SUBMIT}.{team}.{login}"


def stored(team: str, login: str) -> str:
    """Where the gate stores a valid submission of `login`'s, of `team`."""
    return f"{STORED}.{team}.{login}"


def refused(team: str, login: str) -> str:
    """Where the API records a body of `login`'s, of `team`, it refused."""
    return f"{REFUSED}.{team}.{login}"


def of_team(team: str) -> str:
    """Every subject of the jobs stream that `team`'s logins keep."""
    return f"{PREFIX}.jobs.*.{team}.*"


def is_submission(subject: str) -> bool:
    """Whether a subject of the jobs stream is a submission's (a login's stored one, a replay's)."""
    return subject == REPLAY_SUBMIT or of_login(subject)[0] == STORED


def owner_of(subject: str) -> tuple[str, str, str]:
    """(the subject without its team and login, the team, the login) for a login's subject
    (`stored`, `refused`, `intake`); (subject, "", "") for any other."""
    parts = subject.rsplit(".", 2)
    if len(parts) == 3 and parts[0] in (STORED, REFUSED, SUBMIT):
        return parts[0], parts[1], parts[2]
    return subject, "", ""


def of_login(subject: str) -> tuple[str, str]:
    """(the subject without its team and login, the login) for a login's subject (`stored`,
    `refused`, `intake`); (subject, "") for any other."""
    base, _, login = owner_of(subject)
    return base, login


DEDUP_WINDOW_S = 24 * 3600.0

# The profiler's durable consumer of submissions (replicas share it: each submission goes to one).
PROFILER_CONSUMER = "profiler"

# Messages a durable consumer could not process after its deliveries, as they came, with the reason
# in their headers (shared.bus): a stream of their own, bounded.
DEAD_LETTER_STREAM = "GOODPUT_DEAD"
DEAD_LETTER_SUBJECTS = (f"{PREFIX}.dead.>",)
DEAD_LETTER_MAX_AGE_S = 7 * 24 * 3600.0
DEAD_LETTER_MAX_MSGS = 100_000


def dead_letters(consumer: str) -> str:
    """Where a consumer's dead letters are stored."""
    return f"{PREFIX}.dead.{consumer}"


# The user API (a nats.micro service; JSON or msgpack in, answered in the request's encoding).
API_SERVICE = "api"
API_SUBMIT = f"{PREFIX}.api.submit"  # JobSpec -> SubmitAnswer (only a valid submission is stored)
API_JOB = f"{PREFIX}.api.job"  # JobRequest -> JobStatus
API_JOBS = f"{PREFIX}.api.jobs"  # JobsRequest -> JobsPage
API_CANCEL = f"{PREFIX}.api.cancel"  # JobRequest -> CancelAnswer
API_SCHEMAS = f"{PREFIX}.api.schemas"  # Ack -> {message name: its JSON Schema}
API_LOGS = f"{PREFIX}.api.logs"  # LogsRequest -> LogsPage
# A job's own code into the code store: CodeChunk -> CodeAnswer (chunks of an archive), CodeRequest -> CodeAnswer.
API_CODE_PUT = f"{PREFIX}.api.code.put"
API_CODE_HAS = f"{PREFIX}.api.code.has"
# Each team's guarantee, use and lending per GPU type (the operator sees every team; a login its own).
API_TEAMS = f"{PREFIX}.api.teams"
# Why a job has what it has, in sentences, from the rounds' recorded decisions: ExplainRequest -> Explanation.
API_EXPLAIN = f"{PREFIX}.api.explain"
# The last rounds, as the dashboard shows them, and the nodes of the latest: RoundsRequest -> RoundsPage.
API_ROUNDS = f"{PREFIX}.api.rounds"
API_SUBJECTS = (
    API_SUBMIT,
    API_JOB,
    API_JOBS,
    API_CANCEL,
    API_SCHEMAS,
    API_LOGS,
    API_CODE_PUT,
    API_CODE_HAS,
    API_TEAMS,
    API_EXPLAIN,
    API_ROUNDS,
)

# Services (nats.micro names; replicas of one service share its queue group).
PLACER_SERVICE = "placer"
PLACE = f"{PREFIX}.placer.place"  # request PlaceRequest -> PlacementResult
PROFILER_SERVICE = "profiler"
# The executors' durable consumers of the jobs stream: submissions, then each one's Profiled or
# Rejected, in the stream's order (simulated executors; the node agent).
EXECUTOR_CONSUMER = "executor"
NODE_AGENT_CONSUMER = "node-agent"
JOBS_EVENTS = f"{PREFIX}.jobs.>"
EXECUTOR_SERVICE = "executor"
FACTS = f"{PREFIX}.executor.facts"  # FactsRequest -> FactsReply
APPLY = f"{PREFIX}.executor.apply"  # ApplyRequest -> Ack
ADVANCE = f"{PREFIX}.executor.advance"  # AdvanceRequest -> AdvanceReply (simulated executors)
LIVE_JOBS = f"{PREFIX}.executor.live"  # LiveJobsRequest -> LiveJobs (simulated executors, live clock)
RECORDS = f"{PREFIX}.executor.records"  # Ack -> JobRecords (simulated executors)
EXECUTOR_STATUS = f"{PREFIX}.executor.status"  # Ack -> Count
EXECUTOR_DRAIN = f"{PREFIX}.executor.drain"  # DrainRequest -> DrainAnswer (operator)
EXECUTOR_NODES = f"{PREFIX}.executor.nodes"  # Ack -> NodeStatuses (real executors: each node, alive or not)
# The node agents of real executors, one per node: the executor service starts, stops and polls
# the workers on each (`node_subject`), and a profiler asks one of a type for a profiling run.
NODE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a node agent's name: a subject token and a KV key
NODE_SERVICE = "node"
NODE_ENDPOINTS = ("start", "stop", "poll", "profile")
NODE_SUBJECTS = f"{PREFIX}.node.*.*"
NODES_BUCKET = "goodput_nodes"  # KV: node name -> NodeInfo, renewed by its agent; lapses when lost
NODE_TTL_S = 10.0
NODE_HEARTBEAT_S = 2.0
DRAINED_BUCKET = "goodput_drained"  # KV: node name -> DrainRequest, while it is drained
# Jobs' checkpoints for clusters without a folder every node shares (`--checkpoints jetstream:`):
# JetStream's object store, an object per job, which the node agents copy in and out.
CHECKPOINTS_STORE = "goodput_checkpoints"
# Jobs' own code (`goodput submit --code DIR`): an archive per object, named by its sha256; the API
# stores what logins upload (API_CODE_PUT), the node agents read it.
CODE_STORE = "goodput_code"
# What jobs print: each rank's stdout and stderr lines, in batches (LogBatch, each of one rank) its node
# agent stores on `job_logs(team, job)`, in its team's stream (`logs_stream(team)`), which holds only
# that team's: one team's output ages out only its own, and a job's only its own beyond its share (the
# plan's limits, shared/storage.py). The API reads them to the job's team (API_LOGS), from that team's
# stream. The team is one token (a team's name has no dot), the job the rest (a job id may have dots).
LOGS = f"{PREFIX}.logs"
LOGS_SUBJECTS = (f"{LOGS}.>",)  # every team's: what the node agents store on
LOGS_STREAM = "GOODPUT_LOGS"  # DEFAULT_TEAM's stream; another team's is LOGS_STREAM_<team>
PROFILE_RANK = "profile"  # the rank of a job's profiling runs' output
ENVIRONMENT_RANK = "env"  # ... and of the installer that built its environment (its requirements)


def logs_stream(team: str) -> str:
    """The stream of `team`'s jobs' output (DEFAULT_TEAM's: LOGS_STREAM)."""
    return LOGS_STREAM if team == DEFAULT_TEAM else f"{LOGS_STREAM}_{team}"


def team_logs(team: str) -> str:
    """The subjects of `team`'s logs stream."""
    return f"{LOGS}.{team}.>"


def job_logs(team: str, job_id: str) -> str:
    """Where the output of `team`'s job `job_id` (its id within the cluster) is stored, every rank's."""
    return f"{LOGS}.{team}.{job_id}"


def node_subject(node: str, endpoint: str) -> str:
    """A node agent's endpoint (one of NODE_ENDPOINTS)."""
    return f"{PREFIX}.node.{node}.{endpoint}"


def node_of_subject(subject: str, endpoint: str) -> str | None:
    """The node a `node_subject(node, endpoint)` names; None for any other subject."""
    before, after = node_subject("\0", endpoint).split("\0")
    if not (subject.startswith(before) and subject.endswith(after)) or len(subject) <= len(before) + len(after):
        return None
    return subject[len(before) : -len(after)]


ESTIMATOR_SERVICE = "estimator"
MODELS = f"{PREFIX}.estimator.models"  # ModelsRequest -> ModelsReply
OBSERVE = f"{PREFIX}.estimator.observe"  # ObservedAll -> StoredAll
PROFILES = f"{PREFIX}.estimator.profiles"  # ProfilesAll -> StoredAll
ESTIMATOR_STATUS = f"{PREFIX}.estimator.status"  # Ack -> Count
POLICY_SERVICE = "policy"
POLICY_STATUS = f"{PREFIX}.policy.status"  # Ack -> PolicyStatus (who leads now, the live run)
# Replays on the virtual clock: the driver creates the run's RunCheckpoint in RUNS_BUCKET; the leader
# runs it, writing the checkpoint after every step, and appends each round's RunStep to the run's log.
RUNS_BUCKET = "goodput_runs"  # KV: run id -> RunCheckpoint
LIVE_RUN = "live"  # the run that schedules the jobs submitted live
RUN_LOG_STREAM = "GOODPUT_RUNS"
RUN_LOG_SUBJECTS = (f"{PREFIX}.runs.*.log",)
RUN_LOG_DEDUP_S = 600.0  # a new leader repeating a round logs it once


# The policy leader's record of each decided round, kept for a bounded time: each job's JobDecision on
# `job_decisions(key)` (its cluster id, `team.id`), and the round's RoundSummary on ROUND_DECISIONS. The
# API reads them to explain a job (API_EXPLAIN) and to show the last rounds (API_ROUNDS).
DECISIONS_STREAM = "GOODPUT_DECISIONS"
DECISIONS = f"{PREFIX}.decisions"
ROUND_DECISIONS = f"{DECISIONS}.round"
DECISIONS_SUBJECTS = (f"{DECISIONS}.>",)
DECISIONS_MAX_AGE_S = 7 * 24 * 3600.0
DECISIONS_PER_SUBJECT = 500  # a job's last decisions, the last rounds' summaries


def job_decisions(job_key: str) -> str:
    """Where a job's decisions are recorded (`job_key`: its id in the cluster, `team.id`)."""
    return f"{DECISIONS}.job.{job_key}"


def run_log(run_id: str) -> str:
    """The subject of a run's log of RunSteps."""
    return f"{PREFIX}.runs.{run_id}.log"


# Leadership of the policy rounds: one key, held by whoever created it and renews it within the TTL.
LEASE_BUCKET = "goodput_policy_lease"  # KV: LEADER_KEY -> Lease
LEADER_KEY = "leader"
ESTIMATES_BUCKET = "goodput_estimates"  # KV: job id -> EstimateRecord
EXECUTOR_BUCKET = "goodput_executor_jobs"  # KV: job id -> the simulated job's whole state
NODE_JOBS_BUCKET = "goodput_node_jobs"  # KV: job id -> NodeJob, a real job as its node agent keeps it
JOB_OWNERS_BUCKET = "goodput_job_owners"  # KV: job id -> JobOwner, the submission that holds the id
# The operator's team file (shared/teams.py), as `goodput up --teams` or `goodput teams apply` stored it:
# the policy reads it at every round, the API to answer `teams`.
TEAMS_BUCKET = "goodput_teams"  # KV: TEAMS_KEY -> TeamFile
TEAMS_KEY = "teams"
