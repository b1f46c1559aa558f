"""Heterogeneous bootstrap and projection (services/estimator/core.py), the goodput matrix (policies/table.py),
the trace-backed profiler (sim/profiles.py), the cluster configuration set, the
models report and the model zoo."""

import json

import msgspec
import numpy as np
import pytest

from cli.main import main
from goodput_train.goodput import GoodputModel, Observation, ThroughputParams, iteration_time, throughput
from policies.table import goodput_table
from reports.models import FITTED_TARGET, report_model
from services.estimator.core import profile_observations, project, type_models
from shared.cluster import build_cluster, load_cluster
from shared.schema.base import Config
from shared.schema.rounds import JobModels
from sim.profiles import PROFILE_POINTS, model_profile, trace_profile
from sim.reference import discover_models
from sim.zoo import ZOO_PATH, build_zoo, load_zoo

FAST = ThroughputParams(0.01, 0.0002, 0.004, 0.001, 0.02, 0.002, 2.0)  # type "a"
SLOW = ThroughputParams(0.03, 0.0006, 0.0, 0.0, 0.0, 0.0, 1.0)  # type "b": compute 3x "a"


@pytest.fixture(scope="module")
def traces():
    return discover_models()


def profile_of(params, gpu_type, lo=4, hi=128):
    return model_profile(params, "synthetic", gpu_type, lo, hi)


def runs(params, configs, batches=(8, 32, 128)):
    return [Observation(n, g, m, 0, float(iteration_time(params, n, g, m))) for n, g in configs for m in batches]


# --- configuration set ------------------------------------------------------------------------


def test_sia_hetero_64_configuration_set_has_19_columns():
    cluster = load_cluster("sia-hetero-64")
    configs = cluster.configurations()
    assert len(configs) == 19
    assert cluster.total_gpus == 64
    assert [str(c) for c in configs if c.gpu_type == "aws"] == [
        "aws:1x1",
        "aws:1x2",
        "aws:1x4",
        "aws:2x4",
        "aws:3x4",
        "aws:4x4",
        "aws:5x4",
        "aws:6x4",
    ]
    assert Config("dgx-ext", 2, 16) in configs and Config("rtx", 3, 24) in configs


def test_nodes_that_are_not_a_power_of_two_are_split():
    cluster = build_cluster("odd", [{"gpu_type": "x", "count": 2, "gpus_per_node": 6}])
    assert sorted(n.gpus for n in cluster.nodes) == [2, 2, 4, 4]
    assert cluster.capacity("x") == 12
    assert [str(c) for c in cluster.configurations()] == ["x:1x1", "x:1x2", "x:1x4", "x:2x4"]


def test_cluster_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="unknown cluster"):
        load_cluster("no-such-cluster")
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes:\n  - {gpu_type: a, count: 0, gpus_per_node: 4}\n")
    with pytest.raises(ValueError, match="count >= 1"):
        load_cluster(str(bad))
    good = tmp_path / "ok.yaml"
    good.write_text("name: lab\nnodes:\n  - {gpu_type: a100, count: 2, gpus_per_node: 8}\n")
    assert load_cluster(str(good)).capacity("a100") == 16


# --- bootstrap and projection -----------------------------------------------------------------


def test_two_gpus_are_twice_one_gpu_until_measured():
    models = type_models({"a": profile_of(FAST, "a")}, {})
    one = throughput(models["a"], 1, 1, 32)
    assert throughput(models["a"], 1, 2, 32) == pytest.approx(2 * one)


def test_projection_is_exact_when_compute_scales_by_a_constant():
    slow_sync = ThroughputParams(*(3 * np.array(FAST[:6])), FAST.gamma)  # type b = 3x type a everywhere
    models = type_models(
        {"a": profile_of(FAST, "a"), "b": profile_of(slow_sync, "b")},
        {"a": runs(FAST, [(1, 2), (1, 4), (2, 8), (4, 16)])},
    )
    for nodes, gpus in [(1, 2), (1, 4), (2, 8), (4, 16)]:
        # xput_b(N) = xput_b(1) / xput_a(1) * xput_a(N)
        expected = (
            throughput(models["b"], 1, 1, 32)
            / throughput(models["a"], 1, 1, 32)
            * throughput(models["a"], nodes, gpus, 32)
        )
        assert throughput(models["b"], nodes, gpus, 32) == pytest.approx(expected, rel=0.02)
        assert throughput(models["b"], nodes, gpus, 32) < gpus * throughput(models["b"], 1, 1, 32)


def test_projection_is_dropped_once_the_job_ran_multi_gpu_on_the_type():
    profiles = {"a": profile_of(FAST, "a"), "b": profile_of(SLOW, "b")}
    projected = type_models(profiles, {"a": runs(FAST, [(1, 4), (2, 8)])})["b"]
    assert projected.alpha_n > 0  # a's network, scaled
    truth_b = SLOW._replace(alpha_r=0.05, beta_r=0.01, alpha_n=0.2, beta_n=0.02, gamma=1.5)
    own = type_models(
        profiles | {"b": profile_of(truth_b, "b")},
        {"a": runs(FAST, [(1, 4), (2, 8)]), "b": runs(truth_b, [(1, 2), (1, 4), (2, 8), (4, 16)])},
    )["b"]
    assert iteration_time(own, 2, 8, 32) == pytest.approx(float(iteration_time(truth_b, 2, 8, 32)), rel=0.03)


def test_project_keeps_target_compute():
    p = project(SLOW, FAST, 32)
    assert (p.alpha_c, p.beta_c) == (SLOW.alpha_c, SLOW.beta_c)
    ratio = (SLOW.alpha_c + 32 * SLOW.beta_c) / (FAST.alpha_c + 32 * FAST.beta_c)
    assert p.alpha_n == pytest.approx(ratio * FAST.alpha_n)


# --- the goodput matrix -----------------------------------------------------------------------


def job(job_id, **kw):
    base = dict(
        params={"a": FAST, "b": SLOW},
        local_limits={"a": (4, 128), "b": (4, 64)},
        init_batch=32,
        max_batch=4096,
        grad_sqr=1.0,
        grad_var=10.0,
    )
    return JobModels(job_id, **(base | kw))


CONFIGS = [
    Config("a", 1, 1),
    Config("a", 1, 2),
    Config("a", 1, 4),
    Config("a", 2, 8),
    Config("b", 1, 1),
    Config("b", 1, 2),
    Config("b", 2, 8),
]


def test_matrix_values_equal_single_model_optimisation():
    j = job("j", max_gpus_seen=4)
    table = goodput_table([j], CONFIGS)
    from goodput_train.goodput import BatchLimits

    for c, cfg in enumerate(CONFIGS):
        if table.valid[0, c]:
            lo, hi = j.local_limits[cfg.gpu_type]
            best = j.model(cfg.gpu_type).best_batch(cfg.nodes, cfg.gpus, BatchLimits(32, 4096, lo, hi))
            assert table.goodput[0, c] == pytest.approx(float(best.goodput))
            assert (table.m[0, c], table.s[0, c]) == (int(best.m), int(best.s))


def test_row_normalisation_scales_the_smallest_valid_cell_to_min_gpus():
    table = goodput_table([job("x", max_gpus_seen=4), job("y", max_gpus_seen=8, min_gpus=2)], CONFIGS)
    for i, min_gpus in enumerate([1, 2]):
        row = table.normalized[i][table.valid[i]]
        assert row.min() == pytest.approx(min_gpus)
        ratio = table.goodput[i][table.valid[i]] / table.goodput[i][table.valid[i]].min()
        assert np.allclose(row, min_gpus * ratio)
    assert np.all(table.normalized[~table.valid] == 0) and np.all(table.goodput[~table.valid] == 0)


def test_scaling_rules_new_jobs_one_gpu_then_at_most_double():
    table = goodput_table(
        [job("new"), job("ran2", max_gpus_seen=2), job("ran4", max_gpus_seen=4), job("min4", min_gpus=4)], CONFIGS
    )
    gpus = np.array([c.gpus for c in CONFIGS])
    assert set(gpus[table.valid[0]]) == {1}  # new jobs start at one GPU
    assert set(gpus[table.valid[1]]) == {1, 2, 4}  # at most twice the most it ever had
    assert set(gpus[table.valid[2]]) == {1, 2, 4, 8}
    assert set(gpus[table.valid[3]]) == {4}  # never below its minimum, even when new


def test_rigid_and_strong_scaling_jobs():
    rigid = job("rigid", fixed_gpus=8, max_gpus_seen=0)
    strong = job("strong", fixed_batch=256, max_gpus_seen=8)
    table = goodput_table([rigid, strong], CONFIGS)
    assert {CONFIGS[c].gpus for c in np.flatnonzero(table.valid[0])} == {8}  # both types offered
    assert table.valid[0].sum() == 2
    for c in np.flatnonzero(table.valid[1]):
        cfg = CONFIGS[c]
        total = cfg.gpus * table.m[1, c] * (table.s[1, c] + 1)
        assert 0.9 * 256 <= total <= 256
        # goodput = throughput at the fixed batch, no efficiency discount
        assert table.goodput[1, c] == pytest.approx(
            float(throughput(strong.params[cfg.gpu_type], cfg.nodes, cfg.gpus, table.m[1, c], table.s[1, c]))
        )


def test_types_without_a_model_are_invalid():
    only_a = job("a-only", params={"a": FAST}, local_limits={"a": (4, 128)}, max_gpus_seen=8)
    table = goodput_table([only_a], CONFIGS)
    assert not table.valid[0, [c for c, cfg in enumerate(CONFIGS) if cfg.gpu_type == "b"]].any()


# --- the trace-backed profiler ----------------------------------------------------------------


def test_trace_profile_is_a_one_gpu_sweep(traces):
    cifar = traces["cifar10"]
    prof = trace_profile(cifar, "rtx", job_id="j1")
    assert 5 <= len(prof.points) <= PROFILE_POINTS
    assert (prof.min_local, prof.max_local) == cifar.local_bsz_limits("rtx")
    assert [p.local_bsz for p in prof.points] == sorted(p.local_bsz for p in prof.points)
    assert prof.gpu_seconds < 20  # Sia: < 20 GPU-seconds a type
    single = cifar.placements["rtx"].select(cifar.placements["rtx"].gpus == 1)
    first = prof.points[0]
    assert first.step_time == pytest.approx(float(np.median(single.step_time[single.local_bsz == first.local_bsz])))


def test_trace_profile_errors(traces):
    with pytest.raises(ValueError, match="no 'tpu' measurements"):
        trace_profile(traces["cifar10"], "tpu")


def test_profile_observations_carry_compute_time():
    prof = profile_of(FAST, "a")
    obs = profile_observations(prof)
    assert all(o.gpus == 1 and o.s == 0 for o in obs)
    assert obs[0].t_grad == pytest.approx(FAST.alpha_c + FAST.beta_c * obs[0].m)


# --- report and zoo on the reference data -----------------------------------------------------


def test_fitted_models_meet_the_pollux_error_target_on_cifar10(traces):
    for rep in report_model(traces["cifar10"]):
        assert rep.multi_gpu and rep.error["median"] <= FITTED_TARGET, rep
        assert rep.bootstrap, "every cifar10 type can be bootstrapped from another"


def test_models_report_command_writes_json(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["models", "report", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    pairs = {(m["model"], m["gpu_type"]) for m in doc["models"]}
    assert ("imagenet", "dgx-ext") in pairs and ("bert", "rtx") in pairs
    assert all({"median", "p90"} <= set(m["error"]) for m in doc["models"])
    assert "fitted model, median error" in capsys.readouterr().out


def test_missing_reference_is_a_clear_error(tmp_path, capsys):
    assert main(["models", "report", "--reference", str(tmp_path / "absent"), "--out", str(tmp_path / "r.json")]) == 2
    assert "absent" in capsys.readouterr().err


def test_committed_zoo_is_what_the_zoo_command_makes(traces):
    fresh = build_zoo(traces)
    committed = json.loads(ZOO_PATH.read_text())
    assert committed["models"].keys() == fresh["models"].keys()
    for name, model in fresh["models"].items():
        for gpu_type, entry in model["types"].items():
            stored = committed["models"][name]["types"][gpu_type]
            assert np.allclose(list(stored["params"].values()), list(entry["params"].values()), rtol=1e-6)


def test_zoo_pgns_curve_and_profiles():
    zoo = load_zoo()
    cifar = zoo["cifar10"]
    assert cifar.epochs == 100 and cifar.init_batch == 128
    assert cifar.pgns_at(0) == pytest.approx(128 * cifar.grad_var[0] / cifar.grad_sqr[0])
    assert cifar.pgns_at(cifar.total_progress * 2) == cifar.pgns_at(cifar.progress[-2] + 1)
    zt = cifar.types["rtx"]
    prof = model_profile(zt.params, "cifar10", "rtx", zt.min_local, zt.max_local)
    assert prof.min_local == zt.min_local and prof.max_local == zt.max_local
    assert GoodputModel(zt.params, None, None, 128).throughput(1, 1, zt.max_local) > 0


def test_jobs_with_one_bootstrap_profile_share_its_fit_and_an_observation_refits_only_theirs(monkeypatch):
    """...and a job that then runs what another ran, and measures the same, shares that fit too."""
    from services.estimator import core

    fits = []
    real_fit = core.fit_throughput
    monkeypatch.setattr(
        core, "fit_throughput", lambda observations: fits.append(len(observations)) or real_fit(observations)
    )
    core.fit_profile.cache_clear()
    core._fit_observed.cache_clear()
    zoo = load_zoo()["cifar10"].types["aws"]
    profile = model_profile(zoo.params, "cifar10", "aws", zoo.min_local, zoo.max_local)
    first = core.JobEstimate.build({"aws": msgspec.structs.replace(profile, job_id="a")})
    second = core.JobEstimate.build({"aws": msgspec.structs.replace(profile, job_id="b")})
    assert len(fits) == 1 and first.fitted == second.fitted  # one fit for both jobs
    seen = Observation(1, 2, 64, 0, 0.5)
    moved = second.observe("aws", seen)
    assert len(fits) == 2 and fits[-1] == len(profile.points) + 1  # the job's own refit, with what it ran
    assert moved.fitted["aws"] != first.fitted["aws"]
    assert first.observe("aws", seen).fitted == moved.fitted and len(fits) == 2  # the same runs: no new fit
    assert first.observe("aws", seen._replace(t_iter=0.6)).fitted != moved.fitted and len(fits) == 3


class RecordsKV:
    """The estimates' bucket in memory, with a KV's revisions, and what it was asked, in order."""

    def __init__(self) -> None:
        self.entries: dict = {}
        self.revision = 0
        self.asked: list[str] = []

    async def create(self, key, value):
        from shared.bus.kv import RevisionConflict

        self.asked.append("create")
        if key in self.entries:
            raise RevisionConflict
        self.revision += 1
        self.entries[key] = (value, self.revision)
        return self.revision

    async def get(self, key):
        from shared.bus.kv import KVEntry

        self.asked.append("get")
        return KVEntry(key, *self.entries[key]) if key in self.entries else None


async def test_a_new_jobs_profiles_are_stored_in_one_write_and_a_job_stored_before_keeps_its_record():
    from services.estimator.core import Estimator
    from services.estimator.service import SharedEstimates
    from shared.schema.estimates import JobProfiles

    zoo = load_zoo()["cifar10"].types["aws"]
    profile = model_profile(zoo.params, "cifar10", "aws", zoo.min_local, zoo.max_local)
    records = RecordsKV()
    first = SharedEstimates(Estimator(), records)
    assert (await first.add(JobProfiles("a", (profile,)))).revision == 1
    assert records.asked == ["create"]  # no read first: a burst's jobs are new
    learned = first.estimator.estimates["a"].observe("aws", Observation(1, 2, 64, 0, 0.5))
    first.estimator.estimates["a"] = learned
    records.entries["a"] = (first.estimator.record("a"), 2)  # what it learned since, as another replica wrote it
    other = SharedEstimates(Estimator(), records)
    records.asked.clear()
    assert (await other.add(JobProfiles("a", (profile,)))).revision == 2  # delivered again, to another replica
    assert records.asked == ["create", "get"]  # refused, then read: the record stands
    assert other.estimator.record("a") == first.estimator.record("a")


async def test_profiles_judged_at_once_are_stored_each_and_one_that_cannot_be_is_its_jobs_trouble_only():
    from services.estimator.core import Estimator
    from services.estimator.service import SharedEstimates
    from shared.schema.estimates import JobProfiles, ProfilesAll

    class FullKV(RecordsKV):
        async def create(self, key, value):
            if key == "full":
                raise OSError("insufficient resources")
            return await super().create(key, value)

    zoo = load_zoo()["cifar10"].types["aws"]
    profile = model_profile(zoo.params, "cifar10", "aws", zoo.min_local, zoo.max_local)
    estimates = SharedEstimates(Estimator(), FullKV())
    stored = await estimates.add_all(ProfilesAll(tuple(JobProfiles(name, (profile,)) for name in ("a", "full", "b"))))
    assert stored.revisions[0] > 0 and stored.revisions[1] == 0 and stored.revisions[2] > 0, stored
    assert list(stored.refused) == ["full"] and "insufficient resources" in stored.refused["full"]
    assert set(estimates.revisions) == {"a", "b"}


def test_a_jobs_models_do_not_depend_on_its_age_and_the_policy_asks_again_only_of_jobs_whose_facts_changed():
    from services.estimator.core import Estimator
    from services.policy.wiring import KeptModels
    from shared.schema.rounds import JobFacts

    zoo = load_zoo()["cifar10"].types["aws"]
    profile = model_profile(zoo.params, "cifar10", "aws", zoo.min_local, zoo.max_local)
    estimator = Estimator()
    for job in ("a", "b", "c"):
        estimator.add(job, {"aws": msgspec.structs.replace(profile, job_id=job)})
    facts = [JobFacts(job, "cifar10", 0.0, 60.0, 1, 128, False, 128, 4096) for job in ("a", "b")]
    kept = KeptModels()
    assert kept.split(facts) == ([], facts)  # nothing kept yet: every job is asked of
    kept.keep(facts, estimator.models(facts))
    older = [msgspec.structs.replace(f, age_s=f.age_s + 60) for f in facts]
    assert estimator.models(older) == estimator.models(facts)  # what lets a job keep its models
    learned = msgspec.structs.replace(older[1], estimate_revision=2)  # "b" learned: its record is newer
    new = JobFacts("c", "cifar10", 60.0, 0.0, 1, 128, False, 128, 4096)
    models, ask = kept.split([older[0], learned, new])
    assert models == estimator.models(facts[:1]) and ask == [learned, new]
    kept.keep([older[0], learned], [*models, *estimator.models([learned])])  # "c" held: not kept
    assert set(kept.last) == {"a", "b"} and kept.split([new]) == ([], [new])
