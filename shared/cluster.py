"""Cluster specifications and Sia's configuration set.

A cluster is a list of nodes, each with a GPU type and a GPU count. The policy never reasons about
arbitrary placements: per GPU type with R GPUs a node and N nodes, the only allocations are

    (1 node, 1, 2, 4, ..., R GPUs)  and  (n nodes, n*R GPUs) for n = 2 .. N

(Sia §3.2), which keeps the configuration set at N + log2(R) entries per type. A node whose GPU
count is not a power of two is split into virtual nodes that are (6 GPUs -> 4 + 2), so the set stays
exact for every node.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable

import yaml

from shared.schema.base import Config, Node, Spots


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: tuple[Node, ...]

    @cached_property
    def node_type(self) -> dict[str, str]:
        """Node name -> GPU type."""
        return {n.name: n.gpu_type for n in self.nodes}

    def placement_type(self, spots: Spots) -> str | None:
        """The one GPU type of a placement; None if it is empty, names unknown nodes or mixes types."""
        types = {self.node_type.get(node) for node, _ in spots}
        return types.pop() if len(types) == 1 and None not in types else None

    def config_of(self, spots: Spots) -> Config | None:
        """The allocation a single-type placement amounts to: (type, nodes used, GPUs)."""
        gpu_type = self.placement_type(spots)
        return None if gpu_type is None else Config(gpu_type, len(spots), sum(g for _, g in spots))

    @cached_property
    def gpu_types(self) -> tuple[str, ...]:
        """GPU types in order of first appearance."""
        return tuple(dict.fromkeys(n.gpu_type for n in self.nodes))

    # The per-type figures and the configuration set are read every round; on a cluster of
    # thousands of nodes each walk over the nodes costs milliseconds, so they are computed once.
    @cached_property
    def _capacity(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for n in self.nodes:
            totals[n.gpu_type] = totals.get(n.gpu_type, 0) + n.gpus
        return totals

    @cached_property
    def _largest_node(self) -> dict[str, int]:
        largest: dict[str, int] = {}
        for n in self.nodes:
            largest[n.gpu_type] = max(largest.get(n.gpu_type, 0), n.gpus)
        return largest

    def capacity(self, gpu_type: str) -> int:
        return self._capacity.get(gpu_type, 0)

    @cached_property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def gpus_per_node(self, gpu_type: str) -> int:
        """R for a type: the size of its largest (virtual) node."""
        if gpu_type not in self._largest_node:
            raise ValueError(f"cluster {self.name!r} has no GPUs of type {gpu_type!r}")
        return self._largest_node[gpu_type]

    def configurations(self) -> list[Config]:
        """Sia's configuration set, type by type in cluster order (a new list each call)."""
        return list(self._configurations)

    @cached_property
    def _configurations(self) -> tuple[Config, ...]:
        configs: list[Config] = []
        for gpu_type in self.gpu_types:
            r = self.gpus_per_node(gpu_type)
            full_nodes = sum(1 for n in self.nodes if n.gpu_type == gpu_type and n.gpus == r)
            k = 1
            while k <= r:
                configs.append(Config(gpu_type, 1, k))
                k *= 2
            configs.extend(Config(gpu_type, n, n * r) for n in range(2, full_nodes + 1))
        return tuple(configs)


def replica_count(gpus_per_node: Iterable[int], group: int) -> int:
    """Model-parallel replicas of `group` GPUs on these nodes, none spanning two nodes; 0 when some
    node's GPUs are not whole groups (a hybrid-parallel job cannot run there)."""
    gpus_per_node = list(gpus_per_node)
    return 0 if any(g % group for g in gpus_per_node) else sum(gpus_per_node) // group


def power_of_two_parts(gpus: int) -> list[int]:
    """6 -> [4, 2]: the binary digits of the GPU count, largest first."""
    return [1 << b for b in range(gpus.bit_length() - 1, -1, -1) if gpus >> b & 1]


def real_node(name: str) -> str:
    """The machine a (possibly virtual) node is part of: `cpu-0-v1` -> `cpu-0`."""
    return re.sub(r"-v\d+$", "", name)


def real_nodes(cluster: Cluster) -> dict[str, Node]:
    """The cluster's machines: its virtual nodes put back together, by name."""
    machines: dict[str, Node] = {}
    for node in cluster.nodes:
        name = real_node(node.name)
        gpus = machines[name].gpus if name in machines else 0
        machines[name] = Node(name, node.gpu_type, gpus + node.gpus)
    return machines


def build_cluster(name: str, groups: list[dict]) -> Cluster:
    """A cluster from node groups `{gpu_type, count, gpus_per_node}`; odd nodes are split."""
    nodes: list[Node] = []
    per_type: dict[str, int] = {}  # node numbers run on across groups of one type: names stay unique
    for i, group in enumerate(groups):
        try:
            gpu_type = str(group["gpu_type"])
            count = int(group["count"])
            per_node = int(group["gpus_per_node"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"cluster {name!r}: node group {i} needs gpu_type, count and gpus_per_node: {exc}"
            ) from None
        if count < 1 or per_node < 1:
            raise ValueError(f"cluster {name!r}: node group {i} needs count >= 1 and gpus_per_node >= 1")
        first = per_type.get(gpu_type, 0)
        per_type[gpu_type] = first + count
        for n in range(first, first + count):
            parts = power_of_two_parts(per_node)
            for v, gpus in enumerate(parts):
                suffix = f"-v{v}" if len(parts) > 1 else ""
                nodes.append(Node(f"{gpu_type}-{n}{suffix}", gpu_type, gpus))
    if not nodes:
        raise ValueError(f"cluster {name!r} has no nodes")
    return Cluster(name, tuple(nodes))


PRESETS: dict[str, list[dict]] = {
    # Sia's heterogeneous 64-GPU cluster: T4 (g4dn.12xlarge), A100 (DGX), RTX 2080Ti nodes.
    "sia-hetero-64": [
        {"gpu_type": "aws", "count": 6, "gpus_per_node": 4},
        {"gpu_type": "dgx-ext", "count": 2, "gpus_per_node": 8},
        {"gpu_type": "rtx", "count": 3, "gpus_per_node": 8},
    ],
    # Pollux's homogeneous 64-GPU cluster: 16 g4dn.12xlarge nodes of 4 T4.
    "pollux-homo-64": [{"gpu_type": "aws", "count": 16, "gpus_per_node": 4}],
}
# This machine: one node of 4 CPU slots standing in for GPUs (`--executors real`).
PRESETS["local"] = [{"gpu_type": "cpu", "count": 1, "gpus_per_node": 4}]
# Sia's scalability study (its --cluster_scale=32): every node group of sia-hetero-64 times 32, 2,048 GPUs.
PRESETS["sia-hetero-2048"] = [dict(group, count=32 * group["count"]) for group in PRESETS["sia-hetero-64"]]
# The policy's scaling curve (benchmarks/bench_scaling.py): the same groups times 8, 128 and 256.
for _scale in (8, 128, 256):
    PRESETS[f"sia-hetero-{64 * _scale}"] = [
        dict(group, count=_scale * group["count"]) for group in PRESETS["sia-hetero-64"]
    ]
del _scale


def load_cluster(name_or_path: str) -> Cluster:
    """A preset by name, or a YAML/JSON file: `{name: ..., nodes: [{gpu_type, count, gpus_per_node}]}`."""
    if name_or_path in PRESETS:
        return build_cluster(name_or_path, PRESETS[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown cluster {name_or_path!r}: use a preset ({', '.join(PRESETS)}) or a YAML/JSON file")
    text = path.read_text()
    spec = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(spec, dict) or not isinstance(spec.get("nodes"), list):
        raise ValueError(f"{path}: a cluster file needs a 'nodes' list of {{gpu_type, count, gpus_per_node}}")
    return build_cluster(str(spec.get("name", path.stem)), spec["nodes"])
