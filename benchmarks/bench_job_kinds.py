"""Each kind of job from submission to its first step, and what a resize by checkpoint-restart costs
it, phase by phase, on `goodput up --executors real --nodes 2 --slots 2` (CPU slots, boxed).

    python benchmarks/bench_job_kinds.py [--only KIND ...]

The kinds are docs/jobs.md's scripts, as the page shows them but for one line that prints when a
run's first step is done (`first step at S on W ranks`): the library's adaptive job, a torchrun
script (rigid), the elastic torchrun script, the Lightning and the Hugging Face scripts (each with
its requirements: `lightning`, `transformers`, which the node has), and the torchrun script that
needs einops (its environment built on the first start, `packages`; found built on a second job,
`packages (built)`). One job at a time, on an otherwise idle stack.

Submission to first step is split at the job's state, read from the user API every 0.1 s: queued
(the profiler's and the round's, `running` once its workers start) and starting (its box, its
environment, its code, the interpreter and the script's own set-up to the first step's line, by the
line's time as its node agent read it). A resize is a drain of a node where the job runs, once it
has trained 3 s: the round's decision (until its status says its workers stop), the stop (SIGTERM,
the checkpoint, the exit; until its status says they start elsewhere), the start (its box and
processes, until its status has no transition left) and the resume (the interpreter, the imports,
the rendezvous, the checkpoint's load, to the first step's line of the new run). A phase shorter
than the 0.1 s between two looks at its status reads as 0. A rigid torchrun job is not resized: a
move restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared import credentials  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.schema.api import JobRequest, JobStatus  # noqa: E402
from shared.subjects import API_JOB  # noqa: E402
from tests.test_local_stack import Up  # noqa: E402

MARKED = "first step at (\\d+) on (\\d+) ranks"


def page(first_line: str, language: str = "python") -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", (ROOT / "docs" / "jobs.md").read_text(), re.S)
    return next(block for block in blocks if block.startswith(first_line))


def marked(script: str, anchor: str, step: str, world: str) -> str:
    """`script` printing its first step's line (once a run) where `anchor` (in it once) is."""
    assert script.count(anchor) == 1, anchor
    indent = re.match(r"\s*", anchor).group(0)
    said = f'print(f"first step at {{{step}}} on {{{world}}} ranks", flush=True)'
    return "_said = []\n" + script.replace(anchor, f"{anchor}\n{indent}if not _said:\n{indent}    _said.append({said})")


def adaptive() -> str:
    world = "__import__('os').environ.get('WORLD_SIZE', '1')"
    return marked(
        page('"""A small regression trained adaptively under goodput'),
        "    inputs, targets = batch",
        "training.steps",
        world,
    )


def torchrun_script(first_line: str, after: str, step: str) -> str:
    return marked(page(first_line), after, step, "world")


LIGHTNING_MARK = """
class FirstStep(L.Callback):
    def on_train_batch_end(self, trainer, *_):
        if not getattr(self, "said", False):
            self.said = True
            print(f"first step at {trainer.global_step} on {trainer.world_size} ranks", flush=True)

"""
HF_MARK = """
from transformers import TrainerCallback


class FirstStep(TrainerCallback):
    def on_step_end(self, args, state, control, **_):
        if not getattr(self, "said", False):
            self.said = True
            print(f"first step at {state.global_step} on {args.world_size} ranks", flush=True)

"""


def lightning() -> str:
    script = page("# train.py: a regression on generated data, trained by PyTorch Lightning")
    script = script.replace("\n\nclass Regression", LIGHTNING_MARK + "\nclass Regression")
    return script.replace("callbacks=[GoodputCallback()]", "callbacks=[GoodputCallback(), FirstStep()]")


def huggingface() -> str:
    script = page("# train.py: a tiny BERT classifier on generated tokens")
    script = script.replace("\n\nclass Tokens", HF_MARK + "\nclass Tokens")
    return script.replace(
        "trainer.add_callback(GoodputCallback(trainer))",
        "trainer.add_callback(GoodputCallback(trainer))\ntrainer.add_callback(FirstStep())",
    )


def kinds() -> dict[str, tuple[str, str, dict[str, str], bool]]:
    """kind -> (its script, its job file's fields, other files of its code, whether it is resized)."""
    rigid = torchrun_script("# train.py: a plain DDP script", "    optimizer.step()", "step + 1")
    elastic = torchrun_script("# train.py: a DDP script that resumes", "    step += 1", "step")
    packages = torchrun_script("# train.py: a DDP script that needs a package", "    optimizer.step()", "step + 1")
    torchrun = "launcher: torchrun\n"
    return {
        "adaptive (goodput_train)": (adaptive(), "", {}, True),
        "torchrun, rigid": (rigid, torchrun + "requested_gpus: 2\n", {}, False),
        "torchrun, elastic": (
            elastic,
            torchrun + "requested_batch: 32\nelastic: {min_gpus: 1, max_gpus: 4}\n",
            {},
            True,
        ),
        "Lightning": (lightning(), "requirements: [lightning]\n", {}, True),
        "Hugging Face": (huggingface(), "requirements: [transformers]\n", {}, True),
        "packages": (
            packages,
            torchrun + "requested_gpus: 2\nrequirements: requirements.txt\n",
            {"requirements.txt": "einops>=0.8\n"},
            False,
        ),
        "packages (built)": (
            packages,
            torchrun + "requested_gpus: 2\nrequirements: requirements.txt\n",
            {"requirements.txt": "einops>=0.8\n"},
            False,
        ),
    }


class Stack:
    """The stack, a user's connection to its API, and the times of a job's states and marked lines."""

    def __init__(self, base: Path):
        self.base = base
        self.up = Up(base / "data", "--nodes", "2", "--slots", "2", "--workload", "none")
        self.up.server = f"nats://127.0.0.1:{self.up.port}"
        self.up.line(r"serving:")
        environment = credentials.user_environment({}, data=self.up.folder, role="user")
        self.options = credentials.connect_options(credentials.from_env(environment), environment)
        self.bus: Bus | None = None

    async def status(self, job: str) -> JobStatus:
        if self.bus is None:
            self.bus = await Bus.connect_once(self.up.server, "bench-job-kinds", **self.options)
        return await self.bus.request(API_JOB, JobRequest(job), JobStatus, timeout=10)

    async def until(self, job: str, done, timeout_s: float = 300.0) -> tuple[float, JobStatus]:
        deadline = time.time() + timeout_s
        while True:
            shown = await self.status(job)
            if done(shown):
                return time.time(), shown
            if shown.state in ("failed", "rejected", "cancelled") or time.time() > deadline:
                raise RuntimeError(f"{job}: {shown.state} {shown.reason}")
            await asyncio.sleep(0.1)

    def marks(self, job: str) -> list[tuple[float, int, int]]:
        """The job's first-step lines: (time its agent read it, step, world)."""
        shown = self.up.command("logs", job, "--json", "--server", self.up.server)
        found = []
        for line in shown.stdout.splitlines():
            entry = json.loads(line)
            if (
                isinstance(entry["rank"], int) and (match := re.search(MARKED, entry["text"])) is not None
            ):  # not profiling's
                found.append((entry["time"], int(match.group(1)), int(match.group(2))))
        return found

    async def mark_after(self, job: str, after: float, timeout_s: float = 300.0) -> tuple[float, int, int]:
        deadline = time.time() + timeout_s
        while not (later := [mark for mark in self.marks(job) if mark[0] > after]):
            if time.time() > deadline:
                raise RuntimeError(f"{job}: no first step after {after}")
            await asyncio.sleep(0.3)
        return later[0]

    def submit(self, job: str, fields: str, script: str, files: dict[str, str]) -> float:
        code = self.base / job
        code.mkdir()
        (code / "train.py").write_text(script)
        for name, text in files.items():
            (code / name).write_text(text)
        (self.base / f"{job}.yaml").write_text(f"id: {job}\nentrypoint: train.py\n{fields}")
        began = time.time()
        done = self.up.command(
            "submit", str(self.base / f"{job}.yaml"), "--code", str(code), "--server", self.up.server
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr)
        return began


async def measure(stack: Stack, number: int, kind: str, script: str, fields: str, files, resized: bool) -> dict:
    job = f"kind-{number}"
    submitted = stack.submit(job, fields, script, files)
    running_at, _ = await stack.until(job, lambda s: s.state in ("running", "finished"))
    first = await stack.mark_after(job, 0)
    row = {
        "kind": kind,
        "queued_s": running_at - submitted,
        "starting_s": first[0] - running_at,
        "first_step_s": first[0] - submitted,
    }
    installer = stack.up.command("logs", job, "--rank", "env", "--server", stack.up.server).stdout
    row["environments"] = re.findall(r"environment \w+: (built in [\d.]+ s)", installer)  # its nodes', for it
    if resized:
        await asyncio.sleep(max(0.0, first[0] + 3 - time.time()))
        shown = await stack.status(job)
        if shown.state != "running":
            raise RuntimeError(f"{job} ended before its resize: {shown.state}")
        node, before = shown.nodes[0], shown.nodes
        drained = time.time()
        stack.up.command("drain", node, "--server", stack.up.server, role="operator")
        stopping, _ = await stack.until(job, lambda s: "stopping" in s.reason)
        started, _ = await stack.until(job, lambda s: "stopping" not in s.reason)
        running, after = await stack.until(job, lambda s: s.state == "running" and not s.reason and node not in s.nodes)
        resumed = await stack.mark_after(job, stopping)
        stack.up.command("drain", node, "--undo", "--server", stack.up.server, role="operator")
        row |= {
            "decision_s": stopping - drained,
            "stop_s": started - stopping,
            "start_s": running - started,
            "resume_s": resumed[0] - running,
            "resize_s": resumed[0] - drained,
            "resumed_at_step": resumed[1],
            "from": f"{first[2]} on {', '.join(before)}",
            "to": f"{resumed[2]} on {', '.join(after.nodes)}",
        }
    await stack.until(job, lambda s: s.state == "finished", timeout_s=600)
    return row


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="these kinds only (by the start of their names)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="goodput-kinds-"))
    base.chmod(0o711)  # a job's user must pass through to its folder
    stack = Stack(base)
    rows = []
    try:
        for number, (kind, (script, fields, files, resized)) in enumerate(kinds().items()):
            if args.only and not any(kind.startswith(name) for name in args.only):
                continue
            rows.append(await measure(stack, number, kind, script, fields, files, resized))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if stack.bus is not None:
            await stack.bus.close()
        stack.up.stop()
    print("\n| kind | submission to first step (queued + starting) | resize: decision + stop + start + resume |")
    print("|---|---|---|")
    for row in rows:
        resize = (
            f"{row['resize_s']:.1f} s ({row['decision_s']:.1f} + {row['stop_s']:.1f} + {row['start_s']:.1f} + {row['resume_s']:.1f})"
            if "resize_s" in row
            else "restarts (rigid)"
        )
        print(
            f"| {row['kind']} | {row['first_step_s']:.1f} s ({row['queued_s']:.1f} + {row['starting_s']:.1f}) | {resize} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
