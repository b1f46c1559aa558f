"""The estimator's core: per-(job, GPU type) throughput models, from profiles and observations.

Heterogeneity (Sia §3.3). A job has one throughput model per GPU type, bootstrapped from its 1-GPU
profile on that type:
- fitted on the type's own data when the job has run multi-GPU there;
- otherwise projected from a type A where it has: xput_B(N) = xput_B(1) / xput_A(1) * xput_A(N).
  Iteration time is homogeneous of degree one in every alpha and beta, so the projection is B's own
  compute terms plus A's sync terms scaled by B's compute time over A's;
- otherwise the 1-GPU fit alone, whose priors make K GPUs exactly K times one GPU.

Hybrid-parallel jobs (Sia §5.3) count in replicas, each a model-parallel group of GPUs on one node:
their models are per replica, as their profiles and observations are. The goodput matrix these
models make over a cluster's configurations is `policies.table`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from goodput_train.goodput import (
    Observation,
    ThroughputParams,
    compute_time,
    fit_throughput,
)
from goodput_train.protocol import ProfilePoint
from shared.schema.estimates import EstimateRecord, Profile
from shared.schema.rounds import JobFacts, JobModels

PROFILE_FITS_KEPT = 1024  # distinct bootstrap profiles whose fits are kept (a few per application and type)
OBSERVED_FITS_KEPT = 4096  # fits of a profile with observations kept (`fit_observed`)


def profile_observations(profile: Profile) -> list[Observation]:
    """A bootstrap profile as 1-GPU observations (compute time = step time - sync time; unknown when
    the measured sync is not below the step)."""
    return [
        Observation(
            1, 1, p.local_bsz, 0, p.step_time, p.step_time - p.sync_time if p.sync_time < p.step_time else math.nan
        )
        for p in profile.points
    ]


@functools.lru_cache(maxsize=PROFILE_FITS_KEPT)
def fit_profile(points: tuple[ProfilePoint, ...]) -> ThroughputParams:
    """The fit of a bootstrap profile alone, once for every job whose profile holds these points:
    a burst of one application's jobs, profiled from the same traces, is fitted once, not per job."""
    return fit_throughput(profile_observations(Profile("", "", "", points, 1, 1)))


@functools.lru_cache(maxsize=OBSERVED_FITS_KEPT)
def _fit_observed(points: tuple[ProfilePoint, ...], seen: tuple[Observation, ...]) -> ThroughputParams:
    return fit_throughput(profile_observations(Profile("", "", "", points, 1, 1)) + list(seen))


def fit_observed(profile: Profile, seen: Sequence[Observation]) -> ThroughputParams:
    """The fit of a bootstrap profile with the configurations the job ran on its type, kept: jobs of
    one model that ran the same configurations and measured the same times (a simulation's, above
    all) share it, as the same observations always give the same fit. A declared profile is no
    measurement: what the job reported stands alone."""
    return _fit_observed(() if profile.declared else profile.points, tuple(Observation(*o) for o in seen))


def is_multi_gpu(observations: Sequence[Observation]) -> bool:
    return any(o.gpus > 1 for o in observations)


def project(target: ThroughputParams, source: ThroughputParams, m_ref: float) -> ThroughputParams:
    """Target's compute terms with the source's sync terms, scaled by the ratio of compute times at m_ref."""
    ratio = float(compute_time(target, m_ref) / compute_time(source, m_ref))
    return ThroughputParams(
        target.alpha_c,
        target.beta_c,
        ratio * source.alpha_r,
        ratio * source.beta_r,
        ratio * source.alpha_n,
        ratio * source.beta_n,
        source.gamma,
    )


@dataclass(frozen=True)
class JobEstimate:
    """A job's throughput knowledge: its bootstrap profiles, the configurations it ran, and one model
    fitted per GPU type on that type's own data. Updating refits only the type that learned something."""

    profiles: Mapping[str, Profile]
    observations: Mapping[str, tuple[Observation, ...]]
    fitted: Mapping[str, ThroughputParams]

    @classmethod
    def build(
        cls, profiles: Mapping[str, Profile], observations: Mapping[str, Sequence[Observation]] | None = None
    ) -> "JobEstimate":
        observations = {t: tuple(observations.get(t, ())) for t in profiles} if observations else {}
        fitted = {
            t: fit_observed(p, observations[t]) if observations.get(t) else fit_profile(p.points)
            for t, p in profiles.items()
        }
        return cls(dict(profiles), observations, fitted)

    def observe(self, gpu_type: str, observation: Observation) -> "JobEstimate":
        """With one more measured configuration; unchanged if that configuration was seen already."""
        known = self.observations.get(gpu_type, ())
        key = observation[:4]
        if gpu_type not in self.profiles or any(o[:4] == key for o in known):
            return self
        seen = known + (observation,)
        params = fit_observed(self.profiles[gpu_type], seen)
        return JobEstimate(self.profiles, {**self.observations, gpu_type: seen}, {**self.fitted, gpu_type: params})

    def models(self) -> dict[str, ThroughputParams]:
        """One throughput model per profiled GPU type (see the module docstring)."""
        fitted = dict(self.fitted)
        reported = [t for t, p in self.profiles.items() if p.declared and self.observations.get(t)]
        if reported:  # a declared type it has not reported from yet: as fast as one it has
            best = max(reported, key=lambda t: len(self.observations[t]))
            fitted.update({t: fitted[best] for t, p in self.profiles.items() if p.declared and t not in reported})
        explored = [t for t in self.profiles if is_multi_gpu(self.observations.get(t, ()))]
        if not explored:
            return fitted
        # The most-explored type is the best source for projecting the others' communication.
        source = max(explored, key=lambda t: sum(o.gpus > 1 for o in self.observations[t]))
        return {
            t: params
            if t in explored
            else project(params, fitted[source], min(self.profiles[t].max_local, self.profiles[source].max_local))
            for t, params in fitted.items()
        }

    @property
    def local_limits(self) -> dict[str, tuple[int, int]]:
        return {t: (p.min_local, p.max_local) for t, p in self.profiles.items()}

    @property
    def group_gpus(self) -> dict[str, int]:
        """GPUs of one replica on the types where the job is hybrid-parallel (what it was profiled on)."""
        return {t: p.group_gpus for t, p in self.profiles.items() if p.group_gpus > 1}


def type_models(
    profiles: Mapping[str, Profile], observations: Mapping[str, Sequence[Observation]]
) -> dict[str, ThroughputParams]:
    """One throughput model per GPU type the job was profiled on, from everything it ran."""
    return JobEstimate.build(profiles, observations).models()


def job_models(
    facts: JobFacts,
    params: Mapping[str, ThroughputParams],
    local_limits: Mapping[str, tuple[int, int]],
    group_gpus: Mapping[str, int],
) -> JobModels:
    """The estimator's view of a job this round: its models with the facts its executors reported."""
    return JobModels(
        job_id=facts.job_id,
        params=params,
        local_limits=local_limits,
        init_batch=facts.init_batch,
        max_batch=facts.max_batch,
        grad_sqr=facts.grad_sqr,
        grad_var=facts.grad_var,
        min_gpus=facts.requested_gpus if facts.rigid else facts.min_gpus,
        max_gpus_seen=facts.max_gpus_seen,
        fixed_gpus=facts.requested_gpus if facts.rigid else None,
        fixed_batch=facts.requested_batch if facts.rigid or facts.fixed_batch else None,
        group_gpus=dict(group_gpus),
        max_gpus=facts.max_gpus,
        remaining_samples=remaining_samples(facts),
    )


def remaining_samples(facts: JobFacts) -> float | None:
    """Examples at M0 left to a job's declared target (JobModels.remaining_samples): the epochs it
    has left at the size of the epoch under way; None without a declaration, an epoch's size, or
    once it has run past what it declared."""
    target, done = facts.target_epochs, facts.epochs
    if target is None or facts.epoch_samples <= 0 or done >= target:
        return None
    return (target - done) * facts.epoch_samples


class Estimator:
    """The estimator's state: each job's `JobEstimate`, and its models computed once per update.

    `max_local` caps the per-GPU batch of a model everywhere (a memory limit known beforehand)."""

    def __init__(self, max_local: Mapping[str, int] | None = None):
        self.max_local = dict(max_local or {})
        self.estimates: dict[str, JobEstimate] = {}
        self._models: dict[str, tuple[JobEstimate, dict]] = {}

    def add(self, job_id: str, profiles: Mapping[str, Profile]) -> None:
        """Bootstrap a job; a job already known keeps what it learned (a profile delivered twice)."""
        if job_id not in self.estimates:
            self.estimates[job_id] = JobEstimate.build(profiles)

    def observe(self, job_id: str, gpu_type: str, observation: Observation) -> bool:
        """Learn from a configuration the job ran; False when it had been seen (nothing changed)."""
        before = self.estimates[job_id]
        self.estimates[job_id] = before.observe(gpu_type, observation)
        return self.estimates[job_id] is not before

    def record(self, job_id: str) -> EstimateRecord:
        """What to keep durably to rebuild the job's estimate."""
        estimate = self.estimates[job_id]
        return EstimateRecord(job_id, tuple(estimate.profiles.values()), dict(estimate.observations))

    def restore(self, record: EstimateRecord) -> None:
        """The job's estimate rebuilt from its record (the same fits as when it was learned); a job
        known already refits only the types whose observations changed."""
        profiles = {p.gpu_type: p for p in record.profiles}
        known = self.estimates.get(record.job_id)
        if known is None or dict(known.profiles) != profiles:
            self.estimates[record.job_id] = JobEstimate.build(profiles, record.observations)
            return
        observations = {t: tuple(record.observations.get(t, ())) for t in profiles}
        changed = {t for t in profiles if observations[t] != tuple(known.observations.get(t, ()))}
        if changed:
            fitted = {
                **known.fitted,
                **{t: fit_observed(profiles[t], observations[t]) for t in changed},
            }
            self.estimates[record.job_id] = JobEstimate(known.profiles, observations, fitted)

    def _type_models(self, job_id: str) -> dict:
        estimate = self.estimates[job_id]
        cached = self._models.get(job_id)
        if cached is None or cached[0] is not estimate:
            cached = self._models[job_id] = (estimate, estimate.models())
        return cached[1]

    def models(self, facts: Sequence[JobFacts]) -> list[JobModels]:
        out = []
        for f in facts:
            if f.job_id not in self.estimates:
                raise ValueError(f"no profile for job {f.job_id!r} yet")
            estimate = self.estimates[f.job_id]
            limits = estimate.local_limits
            cap = self.max_local.get(f.application)
            if cap:
                limits = {t: (lo, min(hi, cap)) for t, (lo, hi) in limits.items()}
            out.append(job_models(f, self._type_models(f.job_id), limits, estimate.group_gpus))
        return out
