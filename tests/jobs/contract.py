"""A job that keeps the job contract (docs/jobs.md) without the library, as its id says:
`quiet-*` reports metrics and exits 0, with no outcome line; `stopped-*` prints the stopped mark
and exits 0 the first time (it leaves its checkpoint), then ends as the quiet one does; `crash-*`
writes 12 lines to stderr and exits 3."""

import json
import os
import sys
from pathlib import Path

from goodput_train.protocol import CHECKPOINT_PATH_ENV, JOB_ENV, METRICS_PREFIX, STOPPED_MARK

GOODPUT_JOB = True

if __name__ == "__main__":
    job, checkpoint = os.environ[JOB_ENV], Path(os.environ[CHECKPOINT_PATH_ENV])
    print(METRICS_PREFIX + json.dumps({"test_mse": 0.25, "phase": "first", "curve": [1, 2]}), flush=True)
    if job.startswith("crash"):
        for n in range(12):
            print(f"stderr line {n}", file=sys.stderr)
        sys.exit(3)
    if job.startswith("stopped") and not checkpoint.exists():
        checkpoint.write_text("stopped once")
        print(STOPPED_MARK, flush=True)
        sys.exit(0)
    print(METRICS_PREFIX + json.dumps({"test_mse": 0.125, "runs": 1 + checkpoint.exists()}), flush=True)
