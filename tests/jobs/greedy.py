"""A job that takes more than its box gives: GREEDY_CHILDREN detached children (each in a session
of its own) that spin on the CPU for GREEDY_SECONDS, or GREEDY_MB of memory touched page by page.
It prints `children started` once they run."""

import os
import time

GOODPUT_JOB = True


def spin(until: float) -> None:
    while time.monotonic() < until:
        pass


if __name__ == "__main__":
    until = time.monotonic() + float(os.environ.get("GREEDY_SECONDS", "0"))
    for _ in range(int(os.environ.get("GREEDY_CHILDREN", "0"))):
        if os.fork() == 0:
            os.setsid()  # detached: no longer in the worker's group
            spin(until)
            os._exit(0)
    print("children started", flush=True)
    hoard = [bytearray(b"\1" * (1 << 20)) for _ in range(int(os.environ.get("GREEDY_MB", "0")))]
    spin(until)
