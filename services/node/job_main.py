"""How a node agent runs a job's code: `python -m services.node.job_main [--checkpoint PATH]
[--code] TARGET ARGS...` runs TARGET as `__main__` with ARGS. TARGET is a module of the operator's
jobs package, as `python -m MODULE ARGS...` would run it; with `--code`, the job's own code in the
working directory: a script (`train.py`, as `python train.py ARGS...`: its folder first on
sys.path) or a module (`python -m trainer ARGS...`: the working directory first on sys.path).
`--checkpoint PATH` is the agent's mark of a training worker (`processes.stop_leftovers` knows its
own by it); it is not passed on: the job reads its checkpoint from GOODPUT_CHECKPOINT.

Once the agent reading its stdout is gone (killed: the pipe is broken), the worker exits quietly
(exit code 1) instead of leaving a BrokenPipeError traceback in its log for a line no one could
read. What it writes (checkpoints, files of the job's own) is its owner's only, whatever the umask
it was started with; its limits are its box's (`box.Rules`)."""

import os
import runpy
import sys

from shared.files import PRIVATE_UMASK


def main() -> None:
    os.umask(PRIVATE_UMASK)
    _, code, target, arguments = parse(sys.argv[1:])
    sys.argv = [target, *arguments]
    try:
        try:
            if not code:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            elif target.endswith(".py"):
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                runpy.run_path(target, run_name="__main__")
            else:
                sys.path.insert(0, os.getcwd())
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        sys.exit(1)


def parse(argv: list[str]) -> tuple[str | None, bool, str, list[str]]:
    """(the checkpoint mark, whether TARGET is the job's own code, TARGET, its ARGS) of job_main's
    arguments; what follows TARGET is the job's, whatever it looks like."""
    checkpoint, code = None, False
    while argv and argv[0] in ("--checkpoint", "--code"):
        if argv[0] == "--code":
            code, argv = True, argv[1:]
        else:
            checkpoint, argv = argv[1], argv[2:]
    return checkpoint, code, argv[0], argv[1:]


if __name__ == "__main__":
    main()
