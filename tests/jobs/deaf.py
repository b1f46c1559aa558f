"""A job that ignores SIGTERM: it sleeps until it is killed (a stop's SIGKILL, once the grace is
over), so every stop of it takes the whole grace. With `--hears` it keeps SIGTERM's default (it ends
at once). It says `asleep` on its stderr (its log) once it is; standard library only: it starts in a
blink."""

import signal
import sys
import time

GOODPUT_JOB = True

if __name__ == "__main__":
    if "--hears" not in sys.argv[1:]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("asleep", file=sys.stderr, flush=True)
    while True:
        time.sleep(60)
