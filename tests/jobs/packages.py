"""A job that asks for a package the node has not (its order's requirements): it tells, as JSON on
stderr (its log), where its interpreter, that package and the node's torch come from, and what it
got trying to change its environment (shared with every job that asks the same)."""

import json
import os
import sys
from pathlib import Path

from goodput_train.protocol import OUTCOME_PREFIX

GOODPUT_JOB = True


def attempt(action) -> str:
    try:
        return f"ALLOWED: {action()}"
    except OSError as error:
        return f"denied: {type(error).__name__}: {error}"


if __name__ == "__main__":
    import six
    import torch

    site = Path(six.__file__).parent
    told = {
        "prefix": sys.prefix,
        "six": six.__file__,
        "torch": torch.__file__,
        "virtual_env": os.environ.get("VIRTUAL_ENV", ""),
        "plant a module": attempt(lambda: (site / "planted.py").write_text("print('planted')")),
        "change a module": attempt(lambda: open(six.__file__, "a").write("# changed")),
    }
    print(json.dumps(told), file=sys.stderr, flush=True)
    print(OUTCOME_PREFIX + json.dumps({"stopped": False}), flush=True)
