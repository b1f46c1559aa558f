"""The goodput matrix over the configurations some job may take, and its cache of best batches
(policies/table.py: `usable_columns`, `BatchCache`); the ILP's table (policies/sia.py, `ilp_table`)."""

from __future__ import annotations

import msgspec
import numpy as np

from goodput_train.goodput import ThroughputParams
from policies.table import BatchCache, goodput_table, usable_columns
from shared.cluster import load_cluster
from shared.schema.rounds import JobModels

FAST = ThroughputParams(0.01, 0.0002, 0.004, 0.001, 0.02, 0.002, 2.0)
SLOW = ThroughputParams(0.03, 0.0006, 0.0, 0.0, 0.0, 0.0, 1.0)


def jobs() -> list[JobModels]:
    base = dict(local_limits={"aws": (4, 128), "rtx": (4, 64)}, init_batch=32, max_batch=4096, grad_sqr=1.0)
    out = []
    for i in range(12):
        params = {"aws": FAST, "rtx": SLOW} if i % 3 else {"rtx": SLOW}
        out.append(
            JobModels(
                f"j{i}",
                params=params,
                grad_var=10.0 + i % 4,  # four jobs of each key but one
                max_gpus_seen=[0, 2, 8, 24][i % 4],
                fixed_gpus=4 if i == 5 else None,
                group_gpus={"rtx": 2} if i == 7 else {},
                **{k: v for k, v in base.items() if k != "local_limits"},
                local_limits={t: base["local_limits"][t] for t in params},
            )
        )
    return out


def test_usable_columns_are_those_of_some_valid_cell():
    configs = load_cluster("sia-hetero-512").configurations()
    full = goodput_table(jobs(), configs)
    columns = usable_columns(jobs(), configs)
    assert np.array_equal(columns, np.flatnonzero(full.valid.any(axis=0)))
    assert 0 < columns.size < len(configs) // 2


def test_the_cache_gives_the_same_table_and_searches_each_key_once():
    configs = load_cluster("sia-hetero-64").configurations()
    plain = goodput_table(jobs(), configs)
    cache = BatchCache()
    first = goodput_table(jobs(), configs, cache)
    assert cache.searched < cache.cells  # jobs of one key share their cells
    # The next round: one job's model changed, another grew; only its cells are searched anew.
    changed = jobs()
    changed[1] = msgspec.structs.replace(changed[1], grad_var=99.0)
    changed[2] = msgspec.structs.replace(changed[2], max_gpus_seen=16)
    second = goodput_table(changed, configs, cache)
    again = goodput_table(changed, configs)
    for a, b in ((plain, first), (again, second)):
        for name in ("goodput", "normalized", "valid", "m", "s"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert 0 < cache.searched < cache.cells
