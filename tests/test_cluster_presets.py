"""The scaled sia-hetero presets (shared/cluster.py) and their calibration (shared/settings.py)."""

from __future__ import annotations

from shared.cluster import PRESETS, build_cluster, load_cluster
from shared.settings import settings_for


def test_scaled_presets_are_sia_hetero_64_times_n():
    small = load_cluster("sia-hetero-64")
    for gpus in (512, 2048, 8192, 16384):
        name = f"sia-hetero-{gpus}"
        cluster = load_cluster(name)
        assert cluster.total_gpus == gpus
        for t in small.gpu_types:
            assert cluster.capacity(t) == small.capacity(t) * gpus // 64
            assert cluster.gpus_per_node(t) == small.gpus_per_node(t)
        assert settings_for(None, name).name == "sia"


def test_the_cached_configurations_are_the_computed_set_and_a_new_list_each_call():
    cluster = load_cluster("sia-hetero-16384")
    assert len(cluster.configurations()) == 2824
    assert cluster.configurations() is not cluster.configurations()
    fresh = build_cluster("x", PRESETS["sia-hetero-64"])
    assert fresh.configurations() == load_cluster("sia-hetero-64").configurations()
    assert [c.gpus for c in fresh.configurations() if c.gpu_type == "aws"] == [1, 2, 4, 8, 12, 16, 20, 24]
