"""Many independent simulations at once: `goodput compare`'s cells (one workload file under one
policy) spread over this machine's cores, or over a Dask cluster.

Each cell is a deterministic simulation, so where it runs changes nothing in its result: the
results come back in the cells' order whatever order they finish in. Dask (`distributed`) is the
engine across machines: pure Python, a scheduler and workers that any machine with goodput
installed can join (`dask scheduler`, `dask worker ADDRESS`), futures that report as each finishes,
and a `LocalCluster` of this machine's processes for `--engine local`. Ray would do the same with a
much larger install and a runtime of its own to operate.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from typing import Any, Callable, Sequence

LOCAL = "local"  # --engine local: Dask's own cluster of processes on this machine


def default_workers() -> int:
    """Processes on this machine: one a core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def sweep(
    task: Callable[[Any], Any],
    items: Sequence[Any],
    *,
    workers: int = 1,
    engine: str | None = None,
    done: Callable[[int, Any], None] | None = None,
) -> list:
    """`task(item)` for every item, in this process (one worker, no engine), in `workers` processes
    of this machine, or on the Dask cluster at `engine` (`LOCAL`: one of `workers` processes started
    here). `done(index, result)` is called as each finishes; the results are in the items' order. A
    task that raises stops the sweep with its error. `task` must be importable by name where it runs."""
    if workers < 1:
        raise ValueError(f"--workers is a number of processes, at least 1, got {workers}")
    report = done or (lambda _i, _r: None)
    results: list = [None] * len(items)
    if engine is None and (workers == 1 or len(items) <= 1):
        for i, item in enumerate(items):
            results[i] = task(item)
            report(i, results[i])
        return results
    if engine is None:
        # Fresh processes, not forks: a fork copies this one's threads' locks in whatever state they are.
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(items)), mp_context=context) as pool:
            futures = {pool.submit(task, item): i for i, item in enumerate(items)}
            try:
                for future in concurrent.futures.as_completed(futures):
                    i = futures[future]
                    results[i] = future.result()
                    report(i, results[i])
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        return results
    return _on_dask(task, items, engine, workers, report, results)


def _on_dask(task, items, engine: str, workers: int, report, results: list) -> list:
    from distributed import Client, LocalCluster, as_completed

    cluster = None
    try:
        if engine == LOCAL:
            cluster = LocalCluster(
                n_workers=min(workers, len(items)), threads_per_worker=1, processes=True, dashboard_address=None
            )
            client = Client(cluster)
        else:
            client = Client(engine, timeout="10s")
    except OSError as error:
        raise ValueError(f"cannot reach the Dask scheduler at {engine}: {error}") from None
    try:
        futures = client.map(task, items, pure=False)
        index = {future.key: i for i, future in enumerate(futures)}
        for future in as_completed(futures):
            i = index[future.key]
            results[i] = future.result()
            report(i, results[i])
        return results
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
