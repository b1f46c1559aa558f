"""Per-step overhead of goodput's framework callbacks against the same script without them.

    .venv/bin/python benchmarks/bench_integrations.py [--steps 100] [--rounds 8] [--only lightning|huggingface]

Each framework trains the CNN of bench_trainer_overhead.py on its generated images (batch 32, Adam,
one process, one thread: a CPU slot), `--rounds` times with goodput's callback and as many without,
alternating (in turn first), each run `--steps` optimizer steps from a fresh Trainer (one run of
each before, set aside). A timing callback, in both, takes each step's wall time (from one step's
end to the next: data, forward, backward, the optimizer step, the framework's work and the
callback's); the first 10 steps of a run are warm-up. The mean step times over all runs are
compared (a mean: the noise sample's steps cost more than the others), and the median of the
paired runs' ratios.

The callback's work a step: the learning-rate factor and the progress count; every `noise_every`
(16) steps a pair of steps' gradients for the noise sample (a copy of one, Adam's preconditioner,
two norms); every 4 the stop's agreement (nothing on one replica); a report every GOODPUT_REPORT_S
(set to 30 s, as the executor does). Target: at most 2%.

On a busy machine the runs' means move by more than the overhead; the time spent inside the
callback's per-step hooks (its own work, timed there) against the step time with it does not:
own_work_pct. The last line of each framework is its headline, as key=value: overhead_pct (the
means'), paired_median_pct, own_work_pct, steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["GOODPUT_REPORT_S"] = "30"
os.environ.pop("GOODPUT_CHECKPOINT", None)

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_trainer_overhead import images, model  # noqa: E402

WARMUP = 10
BATCH = 32
# The callbacks' hooks that run every step (their own work, timed inside them).
STEP_HOOKS = {
    "lightning": ("on_before_optimizer_step", "_after_optimizer_step", "on_train_batch_end"),
    "huggingface": ("on_pre_optimizer_step", "on_optimizer_step", "on_step_end"),
}


class HookTime:
    """Seconds spent inside a callback's per-step hooks, summed over the steps after the warm-up."""

    def __init__(self):
        self.seconds = 0.0
        self.counting = False

    def wrap(self, callback, names) -> None:
        for name in names:
            setattr(callback, name, self._timed(getattr(callback, name)))

    def _timed(self, hook):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                if self.counting:
                    self.seconds += time.perf_counter() - start

        return timed


hook_time = HookTime()


def lightning_run(steps: int, with_goodput: bool) -> list[float]:
    import lightning.pytorch as L

    from goodput_train.lightning import GoodputCallback

    class Timer(L.Callback):
        def __init__(self):
            self.ends: list[float] = []

        def on_train_batch_end(self, *args) -> None:
            self.ends.append(time.perf_counter())
            hook_time.counting = len(self.ends) >= WARMUP

    class Images(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(images(), batch_size=BATCH, shuffle=True)

    timer = Timer()
    goodput = GoodputCallback()
    hook_time.wrap(goodput, STEP_HOOKS["lightning"])
    trainer = L.Trainer(
        max_steps=steps + WARMUP,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, goodput] if with_goodput else [timer],
    )
    trainer.fit(Images())
    return [b - a for a, b in zip(timer.ends[WARMUP - 1 :], timer.ends[WARMUP:])]


def huggingface_run(steps: int, with_goodput: bool) -> list[float]:
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from goodput_train.huggingface import GoodputCallback

    class Timer(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, *args, **kwargs) -> None:
            self.ends.append(time.perf_counter())
            hook_time.counting = len(self.ends) >= WARMUP

    class Images(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model()

        def forward(self, pixels, labels):
            return {"loss": nn.functional.cross_entropy(self.net(pixels), labels)}

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.data = images()

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            x, y = self.data[i]
            return {"pixels": x, "labels": y}

    timer = Timer()
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            output_dir=folder,
            per_device_train_batch_size=BATCH,
            max_steps=steps + WARMUP,
            learning_rate=1e-3,
            save_strategy="no",
            logging_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            remove_unused_columns=False,
            lr_scheduler_type="constant",
        )
        trainer = Trainer(model=Images(), args=args, train_dataset=Rows(), callbacks=[timer])
        if with_goodput:
            goodput = GoodputCallback(trainer)
            hook_time.wrap(goodput, STEP_HOOKS["huggingface"])
            trainer.add_callback(goodput)
        trainer.train()
    return [b - a for a, b in zip(timer.ends[WARMUP - 1 :], timer.ends[WARMUP:])]


def compare(name: str, run, steps: int, rounds: int) -> None:
    times: dict[bool, list[float]] = {True: [], False: []}
    ratios = []
    run(WARMUP, True), run(WARMUP, False)  # the process's first allocations and imports, set aside
    hook_time.seconds = 0.0
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        means = {}
        for with_goodput in order:
            taken = run(steps, with_goodput)
            times[with_goodput] += taken
            means[with_goodput] = statistics.fmean(taken)
        ratios.append(means[True] / means[False])
        print(
            f"{name} round {r}: with {means[True] * 1e3:.2f} ms, without {means[False] * 1e3:.2f} ms a step", flush=True
        )
    with_, without = statistics.fmean(times[True]), statistics.fmean(times[False])
    print(
        f"{name}: overhead_pct={100 * (with_ / without - 1):.2f} "
        f"paired_median_pct={100 * (statistics.median(ratios) - 1):.2f} "
        f"own_work_pct={100 * hook_time.seconds / sum(times[True]):.2f} steps={len(times[True])}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--only", choices=("lightning", "huggingface"))
    options = parser.parse_args()
    torch.set_num_threads(1)
    runs = {"lightning": lightning_run, "huggingface": huggingface_run}
    for name, run in runs.items():
        if options.only in (None, name):
            compare(name, run, options.steps, options.rounds)


if __name__ == "__main__":
    main()
