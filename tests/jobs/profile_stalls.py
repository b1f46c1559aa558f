"""A job whose profiling runs stall until their node agent dies (the profiler has to notice the node
is lost and run it again on another) for as long as a marker the test makes, named after the job,
is there: in /var/tmp, which a job's box shows read-only (its own /tmp is its alone); every other
run is the quick job's. The stall says so on stderr (the agent's profiling log)."""

import os
import sys
import time
from pathlib import Path

from examples.jobs.mlp_blobs import main
from goodput_train.protocol import JOB_ENV, PROFILE_ENV

GOODPUT_JOB = True
STALLING = "stalling until the agent dies"


def marker(job_id: str) -> Path:
    return Path("/var/tmp") / f"goodput-stall-{job_id}"


if __name__ == "__main__":
    if os.environ.get(PROFILE_ENV) and marker(os.environ[JOB_ENV]).exists():
        print(STALLING, file=sys.stderr, flush=True)
        agent = os.getppid()  # in a box, 0 for as long as it lives: ended with its box
        while os.getppid() == agent:
            time.sleep(0.2)
        sys.exit(1)
    main(["--epochs", "2", *sys.argv[1:]])
