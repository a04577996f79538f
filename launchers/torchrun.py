"""``cluster.launcher=torchrun``: one command per node (``python train.py cluster=torchrun
cluster.rdzv_endpoint=<node 0>:29500 ...`` on every node); each node's ranks start through
launchers/local.py, whose agents meet at ``cluster.rdzv_endpoint`` (c10d) and number the nodes
themselves. Its rendezvous is checked whoever started this process."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from launchers.registry import launcher

if TYPE_CHECKING:
    from recipes.job import Job

ENDPOINT = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:\d{1,5}$")


def bad_port(key: str, address: str, example: str) -> str | None:
    """A host:port whose port is outside 1..65535 (sockets refuse it at start-up), as the
    sentence refusing it; None otherwise."""
    port = int(address.rsplit(":", 1)[1])
    if 1 <= port <= 65535:
        return None
    return (f"{key}={address!r}: port {port} is outside 1..65535: set a port in that range, "
            f"e.g. {key}={example}")


@launcher("torchrun", checked_first=True)
def launch_problems(job: Job) -> list[str]:
    """The rendezvous every node meets at: set with more than one node, host:port, a port in
    1..65535."""
    c = job.cluster
    if c.rdzv_endpoint is None and c.nodes > 1:
        return [f"cluster.rdzv_endpoint=null with cluster.nodes={c.nodes}: the nodes of a torchrun "
                "job meet at one rendezvous; set cluster.rdzv_endpoint=<node 0's address>:29500 "
                "(the same on every node)"]
    if c.rdzv_endpoint is not None and not ENDPOINT.match(c.rdzv_endpoint):
        return [f"cluster.rdzv_endpoint={c.rdzv_endpoint!r} is not host:port: set e.g. "
                "cluster.rdzv_endpoint=10.0.0.1:29500"]
    port = c.rdzv_endpoint and bad_port("cluster.rdzv_endpoint", c.rdzv_endpoint, "10.0.0.1:29500")
    return [port] if port else []
