"""goodput's training library: what a job's script imports to train adaptively under goodput.

    from goodput_train import AdaptiveTraining

or, from any other training loop, `goodput_train.report(samples=N)` once a step (`goodput_train.report`).

It needs PyTorch and NumPy (and SciPy, msgspec and threadpoolctl for the throughput fit and the
reports), never the scheduler: `pip install ./train` is all a job's image takes. The protocol and
the goodput model (`goodput_train.protocol`, `goodput_train.goodput`) import no PyTorch, so the
scheduler's services read them without it.
"""

from __future__ import annotations

__all__ = ["AdaptiveTraining", "Stopped", "report"]


def __getattr__(name: str):
    # The trainer imports PyTorch: only when a script asks for it, not when a service reads the protocol.
    if name == "report":
        from goodput_train.reporting import report

        return report
    if name in __all__:
        from goodput_train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'goodput_train' has no attribute {name!r}")
