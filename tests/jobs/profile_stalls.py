"""A job whose first profiling run stalls until its node agent dies (the profiler has to notice the
node is lost and run it again on another); every other run is the quick job's. The stall says so on
stderr (the agent's profiling log), and a marker in /tmp, named after the job, says it happened (not
under its TMPDIR: that is in its folder on one node, and the run it stalls is measured again on another)."""

import os
import sys
import time
from pathlib import Path

from examples.jobs.mlp_blobs import main
from goodput_train.protocol import JOB_ENV, PROFILE_ENV

GOODPUT_JOB = True
STALLING = "stalling until the agent dies"


def marker(job_id: str) -> Path:
    return Path("/tmp") / f"goodput-stalled-{job_id}"


if __name__ == "__main__":
    if os.environ.get(PROFILE_ENV) and not marker(os.environ[JOB_ENV]).exists():
        marker(os.environ[JOB_ENV]).touch()
        print(STALLING, file=sys.stderr, flush=True)
        agent = os.getppid()
        while os.getppid() == agent:
            time.sleep(0.2)
        sys.exit(1)
    main(["--epochs", "2", *sys.argv[1:]])
