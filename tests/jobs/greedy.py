"""A job that takes more than its box gives: GREEDY_CHILDREN detached children (each in a session
of its own) that spin on the CPU for GREEDY_SECONDS, or GREEDY_MB of memory touched page by page.
It prints `children started` once they run, and at its end `loops N` a second: how many turns of
its own loop it got (a neighbour's share of the CPU shows there)."""

import os
import time

GOODPUT_JOB = True


def spin(until: float) -> int:
    loops = 0
    while time.monotonic() < until:
        loops += 1
    return loops


if __name__ == "__main__":
    until = time.monotonic() + float(os.environ.get("GREEDY_SECONDS", "0"))
    for _ in range(int(os.environ.get("GREEDY_CHILDREN", "0"))):
        if os.fork() == 0:
            os.setsid()  # detached: no longer in the worker's group
            spin(until)
            os._exit(0)
    print("children started", flush=True)
    hoard = [bytearray(b"\1" * (1 << 20)) for _ in range(int(os.environ.get("GREEDY_MB", "0")))]
    began = time.monotonic()
    loops = spin(until)
    print(f"loops {loops / max(1e-9, time.monotonic() - began):.0f}", flush=True)
