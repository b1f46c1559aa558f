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
