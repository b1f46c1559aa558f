"""A job that leaves processes behind: a child in its own process group, and one that leaves its
session (setsid), both holding its stdout open and sleeping long. It writes their process ids to
`children` in its HOME, then sleeps itself, or exits at once when profiled (GOODPUT_PROFILE) or told
to (LEAVES_EXIT). Standard library only: the isolation tests may run it on another interpreter."""

import os
import subprocess
import sys
import time
from pathlib import Path

GOODPUT_JOB = True
SLEEP = [sys.executable, "-S", "-c", "import time; time.sleep(600)"]

in_group = subprocess.Popen(SLEEP)
left = subprocess.Popen(SLEEP, start_new_session=True)
children = Path(os.environ["HOME"]) / "children"
children.with_suffix(".partial").write_text(f"{in_group.pid} {left.pid}")
children.with_suffix(".partial").rename(children)
print("children started", flush=True)
if not (os.environ.get("GOODPUT_PROFILE") or os.environ.get("LEAVES_EXIT")):
    time.sleep(600)
