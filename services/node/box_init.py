"""A job's box's first process (its PID 1): `python -m services.node.box_init`, started by `box.Box`.

It holds the box open and reaps what the job's processes leave behind (orphans come to PID 1:
unreaped, each would hold one of the box's processes). Its stdin is the agent's lifeline: once it
breaks (the agent is gone, killed -9 included) it gives the job's processes the stop's grace to
checkpoint and stop (they read the same lifeline), then returns, and the kernel ends whatever is
left of the box with it: no box outlives its agent.
"""

import os
import signal
import sys
import threading
import time

from shared.runtime import STOP_TIMEOUT_S

LOOK_EVERY_S = 0.2


def reap() -> None:
    while True:
        try:
            os.wait()
        except ChildProcessError:  # none now: one may come (an orphan)
            time.sleep(1.0)


def others() -> bool:
    """Whether a process of the box other than this one is still running (not a zombie)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and entry != "1":
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                        return True
            except OSError:
                pass
    return False


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a stop is for the job's processes; the agent removes the box
    threading.Thread(target=reap, daemon=True).start()
    while sys.stdin.buffer.read(4096):
        pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while others() and time.monotonic() < deadline:
        time.sleep(LOOK_EVERY_S)


if __name__ == "__main__":
    main()
