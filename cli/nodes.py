"""`goodput nodes` — the operator's: the nodes of a running goodput, their GPUs, whether each is
alive, lost or drained, and every login's jobs on them."""

from __future__ import annotations

import argparse

from cli.output import tally
from cli.submit import add_connection_arguments
from shared.schema.nodes import NODE_STATES


def register(sub: argparse._SubParsersAction) -> None:
    nodes = sub.add_parser(
        "nodes",
        help="the operator's: the nodes of a running goodput (GPUs, alive, lost or drained, and every "
        "login's jobs on them; a simulated cluster's are all alive)",
    )
    nodes.add_argument("--json", action="store_true", help='one JSON document: {"nodes": [...]}')
    add_connection_arguments(nodes, role="operator")
    nodes.set_defaults(func=_nodes)


def _nodes(args: argparse.Namespace) -> int:
    import json

    import msgspec

    from cli.submit import _call
    from shared import subjects
    from shared.hardware import hardware_name
    from shared.schema.base import Ack
    from shared.schema.nodes import NodeStatuses
    from shared.text import printable

    try:
        answer = _call(
            args,
            subjects.EXECUTOR_NODES,
            Ack(),
            NodeStatuses,
            "no executor at {server} lists nodes: is the stack up?",
        )
    except ValueError as error:
        if "refused this login" in str(error):  # a login sees only its own jobs: not the nodes'
            raise ValueError(
                f"{error}: listing nodes takes the operator's login (--nats-user operator, its "
                "password file under the data folder's secrets)"
            ) from None
        raise
    if args.json:
        print(json.dumps({"nodes": msgspec.to_builtins(answer.nodes)}, indent=2))
        return 0
    print(tally("node", NODE_STATES, [n.state for n in answer.nodes]))
    for node in answer.nodes:
        jobs = f"  jobs: {', '.join(node.jobs)}" if node.jobs else ""
        line = f"  {node.name:<16} {node.gpus:>3} x {hardware_name(node.gpu_type):<12} {node.state:<8}{jobs}"
        print(printable(line.rstrip()))
    return 0
