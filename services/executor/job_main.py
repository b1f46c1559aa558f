"""How a node agent runs a job's module: `python -m services.executor.job_main MODULE ARGS...` runs
MODULE as `__main__` with ARGS, as `python -m MODULE ARGS...` would. Once the agent reading its
stdout is gone (killed: the pipe is broken), the worker exits quietly (exit code 1) instead of
leaving a BrokenPipeError traceback in its log for a line no one could read."""

import os
import runpy
import sys


def main() -> None:
    module = sys.argv.pop(1)
    try:
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        sys.exit(1)


if __name__ == "__main__":
    main()
