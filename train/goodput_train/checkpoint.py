"""Atomic checkpoints: a kill at any moment leaves the last complete checkpoint readable.

A checkpoint is written to a temporary file beside the target, flushed and fsynced, then renamed
over the target (atomic on POSIX) and the folder fsynced, so the rename itself survives a crash.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def save(state: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def load(path: str | Path) -> dict[str, Any] | None:
    """The checkpoint at `path`, or None if there is none yet (leftover partial files are ignored)."""
    path = Path(path)
    if not path.exists():
        return None
    # Plain tensors and numbers (no pickled code runs), onto the CPU: a GPU job may resume on another
    # node, or a CPU one; loading into the model puts them on its device.
    return torch.load(path, weights_only=True, map_location="cpu")
