"""A job that writes: a checkpoint through the library, then a folder and a file of its own code's
beside it, then its outcome (the file-modes test: all it writes must be its owner's only)."""

import json
import os
from pathlib import Path

from goodput_train import checkpoint
from goodput_train.protocol import CHECKPOINT_PATH_ENV, OUTCOME_PREFIX

GOODPUT_JOB = True

if __name__ == "__main__":
    path = Path(os.environ[CHECKPOINT_PATH_ENV])  # the agent's choice
    checkpoint.save({"steps": 1}, path)
    notes = path.parent / f"{path.stem}.notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("what a job's own code writes\n")
    print(OUTCOME_PREFIX + json.dumps({"stopped": False}), flush=True)
