"""GPU types by the names people know. A cluster's GPU types are keyed as the reference data keys
them (`aws`, `dgx-ext`, `rtx`: the machines they were measured on); what users read and may write
is the hardware (T4, A100, RTX 2080 Ti). The keys stay accepted everywhere, as aliases."""

from __future__ import annotations

from typing import Iterable

# Reference key -> hardware (../shared/reference/sia/README.md names the machines; Gavel's are the GPUs').
HARDWARE = {
    "aws": "T4",
    "azure": "V100",
    "dgx": "A100",
    "dgx-ext": "A100",
    "quad": "RTX 6000",
    "rtx": "RTX 2080 Ti",
    "k80": "K80",
    "p100": "P100",
    "v100": "V100",
    "cpu": "CPU slot",
}


def hardware_name(gpu_type: str) -> str:
    """What people call a GPU type (the type itself when it is not a known key)."""
    return HARDWARE.get(gpu_type, gpu_type)


def _squashed(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def types_named(name: str, gpu_types: Iterable[str]) -> list[str]:
    """The types among `gpu_types` that `name` names: by key, or by hardware name, whatever the case,
    spaces and dashes ("A100", "rtx-2080-ti", "RTX2080Ti")."""
    gpu_types = list(gpu_types)
    if name in gpu_types:
        return [name]
    return [t for t in gpu_types if _squashed(hardware_name(t)) == _squashed(name) or _squashed(t) == _squashed(name)]


def described(gpu_types: Iterable[str]) -> str:
    """ "T4 (aws), A100 (dgx-ext)": types for a message, hardware first."""
    return ", ".join(f"{hardware_name(t)} ({t})" if hardware_name(t) != t else t for t in gpu_types)
