"""Every NATS subject, stream, consumer and KV bucket name, in one place.

Subjects are `goodput.<stage>.<event>`; one stream holds what must not be lost.
"""

from __future__ import annotations

PREFIX = "goodput"

# Submissions: users publish JobSpecs here; the JOBS stream stores each one before it is acknowledged,
# de-duplicated on the job id (Nats-Msg-Id) within DEDUP_WINDOW_S.
SUBMIT = f"{PREFIX}.jobs.submit"
# A submission that failed validation: the Rejected record, kept in the JOBS stream (dead letters).
REJECTED = f"{PREFIX}.jobs.rejected"
JOBS_STREAM = "GOODPUT_JOBS"
JOBS_STREAM_SUBJECTS = (SUBMIT, REJECTED)
DEDUP_WINDOW_S = 24 * 3600.0

# The profiler's durable consumer of submissions (replicas share it: each submission goes to one).
PROFILER_CONSUMER = "profiler"

# Services (nats.micro names; replicas of one service share its queue group).
PLACER_SERVICE = "placer"
PLACE = f"{PREFIX}.placer.place"            # request PlaceRequest -> PlacementResult
PROFILER_SERVICE = "profiler"
EXECUTOR_CONSUMER = "executor"              # simulated executors' durable consumer of submissions
EXECUTOR_SERVICE = "executor"
FACTS = f"{PREFIX}.executor.facts"          # FactsRequest -> FactsReply
APPLY = f"{PREFIX}.executor.apply"          # ApplyRequest -> Ack
ADVANCE = f"{PREFIX}.executor.advance"      # AdvanceRequest -> AdvanceReply (simulated executors)
RECORDS = f"{PREFIX}.executor.records"      # Ack -> JobRecords (simulated executors)
EXECUTOR_STATUS = f"{PREFIX}.executor.status"   # Ack -> Count
ESTIMATOR_SERVICE = "estimator"
MODELS = f"{PREFIX}.estimator.models"       # ModelsRequest -> ModelsReply
OBSERVE = f"{PREFIX}.estimator.observe"     # Observed -> Ack
PROFILES = f"{PREFIX}.estimator.profiles"   # JobProfiles -> Ack
ESTIMATOR_STATUS = f"{PREFIX}.estimator.status"   # Ack -> Count
POLICY_SERVICE = "policy"
RUN = f"{PREFIX}.policy.run"                # RunRequest -> RunReport (a simulation on the virtual clock)
ESTIMATES_BUCKET = "goodput_estimates"      # KV: job id -> EstimateRecord
EXECUTOR_BUCKET = "goodput_executor_jobs"   # KV: job id -> the simulated job's whole state
