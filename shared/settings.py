"""The scheduler's and the simulated world's settings in one place, with the two peers' calibrations
as presets.

The numbers that decide a schedule besides the policy (SIMULATORS.md in the reference
folder): how long a checkpoint-restart really takes, what the policy believes it takes (S in Sia's
restart factor), Sia's per-model goodput calibration, and which jobs are rigid whatever the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from goodput_train.goodput import RETUNE_THRESHOLD

DEFAULT_POLICY = "goodput"  # what `goodput up`, `simulate` and the manifests run unless told otherwise
ROUND_S = 60.0  # how often a policy re-decides, unless it is defined by another round (Gavel: 360 s)
FEEDBACK_ITERATIONS = 1  # default k for "time to the first k iterations"
# Submissions the profiler judges at once from traces: each waits on the bus most of its time
# (docs/services.md, a burst). Their profiles go to the estimator together, PROFILES_IN_FLIGHT
# requests at once, and it stores each request's jobs side by side.
JUDGED_AT_ONCE = 64
PROFILES_IN_FLIGHT = 4
# A round ends with an observation from each job that trained (thousands): the executors send them
# OBSERVED_IN_ONE_REPORT a request, REPORTS_AT_ONCE requests in flight, and the estimator stores
# OBSERVED_AT_ONCE jobs' at once in each.
OBSERVED_IN_ONE_REPORT = 64
REPORTS_AT_ONCE = 4
OBSERVED_AT_ONCE = 64


@dataclass(frozen=True)
class SimSettings:
    name: str
    round_s: float = ROUND_S
    restart_delay_s: dict[str, float] = field(default_factory=dict)  # true delay per model
    default_restart_delay_s: float = 30.0
    restart_estimate_s: dict[str, float] = field(default_factory=dict)  # the policy's S per model
    default_restart_estimate_s: float = 30.0
    slowdown: dict[str, float] = field(default_factory=dict)  # true goodput is divided by this
    default_slowdown: float = 1.0
    max_local: dict[str, int] = field(default_factory=dict)  # per-model cap on the per-GPU batch
    rigid: dict[str, tuple[int, int]] = field(default_factory=dict)  # model -> (GPUs, batch) it always runs at
    retune_threshold: float = RETUNE_THRESHOLD
    horizon_s: float = 14 * 24 * 3600.0  # give up on jobs still running after this long
    interference: float = 0.0  # distributed jobs sharing a node train this much slower
    profile_request: bool = False  # each job also measured at its request on every type (Gavel's matrix)

    def restart_delay(self, model: str) -> float:
        return self.restart_delay_s.get(model, self.default_restart_delay_s)

    def restart_estimate(self, model: str) -> float:
        return self.restart_estimate_s.get(model, self.default_restart_estimate_s)

    def goodput_factor(self, model: str) -> float:
        return 1.0 / self.slowdown.get(model, self.default_slowdown)


PRESETS = {
    # Sia's simulator: per-model restart delays and goodput calibration.
    "sia": SimSettings(
        name="sia",
        restart_delay_s={"cifar10": 50, "deepspeech2": 25, "bert": 120, "yolov3": 80, "imagenet": 250, "ncf": 15},
        restart_estimate_s={"deepspeech2": 25, "imagenet": 250, "cifar10": 30, "bert": 120, "yolov3": 45},
        slowdown={"cifar10": 1.8, "ncf": 1.5},
        default_slowdown=1.2,
        rigid={"ncf": (1, 32768)},
    ),
    # Pollux's simulator: 30 s restarts for every job, no calibration, yolov3's per-GPU batch capped at 8,
    # NCF fixed at one GPU and batch 32768.
    "pollux": SimSettings(
        name="pollux",
        max_local={"yolov3": 8},
        rigid={"ncf": (1, 32768)},
    ),
    # Neither peer's calibration: true models as they are.
    "none": SimSettings(name="none"),
}

# The calibration a cluster preset implies when none is named.
CLUSTER_DEFAULT = {
    "sia-hetero-64": "sia",
    "sia-hetero-512": "sia",
    "sia-hetero-2048": "sia",
    "sia-hetero-8192": "sia",
    "sia-hetero-16384": "sia",
    "pollux-homo-64": "pollux",
}


def settings_for(name: str | None, cluster: str) -> SimSettings:
    name = name or CLUSTER_DEFAULT.get(cluster, "none")
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown calibration {name!r}; choose one of {', '.join(PRESETS)}") from None


def simulation_settings(
    calibration: str | None,
    cluster: str,
    restart_delay_s: float | None = None,
    round_s: float | None = None,
    horizon_s: float | None = None,
    interference: float = 0.0,
    profile_request: bool = False,
) -> SimSettings:
    """The calibration's settings with the run's overrides: every restart delay, the round, the
    horizon, the slowdown of distributed jobs sharing a node, whether each job is also profiled at
    its request on every type."""
    if not 0.0 <= interference < 1.0:
        raise ValueError(f"interference is a slowdown fraction in [0, 1), got {interference}")
    settings = replace(settings_for(calibration, cluster), interference=interference, profile_request=profile_request)
    if restart_delay_s is not None:
        settings = replace(settings, restart_delay_s={}, default_restart_delay_s=restart_delay_s)
    if round_s is not None:
        settings = replace(settings, round_s=round_s)
    if horizon_s is not None:
        settings = replace(settings, horizon_s=horizon_s)
    return settings
