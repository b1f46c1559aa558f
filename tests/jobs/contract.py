"""A job that keeps the job contract (docs/jobs.md) without the library, as its id says:
`quiet-*` reports metrics and exits 0, with no outcome line; `stopped-*` prints the stopped mark
and exits 0 the first time (it leaves its checkpoint), then ends as the quiet one does; `crash-*`
writes 12 lines to stderr and exits 3; `unasked-*` prints the stopped mark and exits 0 every time;
`sigterm-*` exits 0 on SIGTERM without the mark, its rank 0 reporting `runs` (counted in its
checkpoint), and ends when a file `end` is beside its checkpoint; `deep-*` prints an outcome and a
metrics line nested 1000 deep, then ends as the quiet one does."""

import json
import os
import signal
import sys
import time
from pathlib import Path

from goodput_train.protocol import CHECKPOINT_PATH_ENV, JOB_ENV, METRICS_PREFIX, OUTCOME_PREFIX, STOPPED_MARK

GOODPUT_JOB = True

if __name__ == "__main__":
    job, checkpoint = os.environ[JOB_ENV], Path(os.environ[CHECKPOINT_PATH_ENV])
    print(METRICS_PREFIX + json.dumps({"test_mse": 0.25, "phase": "first", "curve": [1, 2]}), flush=True)
    if job.startswith("crash"):
        for n in range(12):
            print(f"stderr line {n}", file=sys.stderr)
        sys.exit(3)
    if job.startswith("unasked"):
        print(STOPPED_MARK, flush=True)
        sys.exit(0)
    if job.startswith("sigterm"):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        if os.environ["RANK"] == "0":
            runs = 1 + (int(checkpoint.read_text()) if checkpoint.exists() else 0)
            checkpoint.write_text(str(runs))
            print(METRICS_PREFIX + json.dumps({"runs": runs}), flush=True)
        while not (checkpoint.parent / "end").exists():
            time.sleep(0.05)
        sys.exit(0)
    if job.startswith("deep"):
        print(OUTCOME_PREFIX + "[" * 1000, flush=True)
        print(METRICS_PREFIX + "[" * 1000, flush=True)
    if job.startswith("stopped") and not checkpoint.exists():
        checkpoint.write_text("stopped once")
        print(STOPPED_MARK, flush=True)
        sys.exit(0)
    print(METRICS_PREFIX + json.dumps({"test_mse": 0.125, "runs": 1 + checkpoint.exists()}), flush=True)
