"""``cluster.launcher=torchrun``: one command per node (``python train.py cluster=torchrun
cluster.rdzv_endpoint=<node 0>:29500 ...`` on every node); each node's ranks start through
launchers/local.py, whose agents meet at ``cluster.rdzv_endpoint`` (c10d) and number the nodes
themselves. Its rendezvous is checked whoever started this process; its id is the job's run
directory (``run_id``), and where this machine serves it, a port something else holds is refused
(``port_problem``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

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
    if port:
        return [port]
    from launchers.local import launched

    busy = c.rdzv_endpoint and not launched() and port_problem(c.rdzv_endpoint, run_id(given_run_dir(job)))
    return [busy] if busy else []


def run_id(directory: str) -> str:
    """The rendezvous id of the ``cluster=torchrun`` job writing into ``directory``: one per run
    directory, so two jobs on one endpoint never join each other's rendezvous (as torchrun's
    ``--rdzv-id``), and the same on every node of a job, which shares its directory."""
    import hashlib

    return "stratagem-" + hashlib.sha1(str(directory).encode()).hexdigest()[:12]


def given_run_dir(job: Any) -> str:
    """The job's run directory as the command gives it (``hydra.run.dir``, or a sweep's directory
    and job number; relative when given relative: the same string on every node, whatever its
    working directory or mount point); outside a Hydra run, the resolved one, else the endpoint."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized():
        h = HydraConfig.get()
        return f"{h.sweep.dir}/{h.sweep.subdir}" if h.mode == RunMode.MULTIRUN else str(h.run.dir)
    return job.paths.output_dir if job.paths is not None else str(job.cluster.rdzv_endpoint)


def port_problem(endpoint: str, rdzv_id: str, wait_s: float = 5.0) -> str | None:
    """Where this machine serves the rendezvous at ``endpoint`` (its host is one of this
    machine's addresses): the port in use by anything but this job's rendezvous store (another
    node of the job on this machine started it: ``rdzv_id``'s state is in it, within
    ``wait_s``), as the sentence refusing it; None otherwise. A second job there would join the
    first one's rendezvous, and a program that is not a store would leave every node waiting."""
    import errno
    import socket

    host, port = endpoint.rsplit(":", 1)
    host = host.strip("[]")
    try:
        family, *_, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a port in TIME_WAIT is free)
            probe.bind(address)
        return None  # free: the agent serves it
    except OSError as e:
        if getattr(e, "errno", None) != errno.EADDRINUSE:
            return None  # (another machine's address, or unresolvable here: torch says so)
    if _holds(host, int(port), rdzv_id, wait_s):
        return None
    with socket.socket(family, socket.SOCK_STREAM) as free:
        free.bind((address[0], 0))
        other = free.getsockname()[1]
    return (f"cluster.rdzv_endpoint={endpoint}: port {port} is in use on this machine, which serves "
            "this job's rendezvous, by another job's rendezvous or another program (this job would "
            "join that one, or wait on it): give this job a port no one uses, the same on every "
            f"node, e.g. cluster.rdzv_endpoint={host}:{other}")


def _holds(host: str, port: int, rdzv_id: str, wait_s: float) -> bool:
    """Whether the torch store at host:port holds rendezvous ``rdzv_id``'s state within
    ``wait_s``. Asked in a thread given up after that: torch's client waits on a listener that
    is not a store for its own minute, whatever timeout it is given."""
    import datetime
    import threading
    import time

    from torch.distributed import TCPStore

    found: list[bool] = []

    def ask() -> None:
        try:
            store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=wait_s))
            deadline = time.monotonic() + wait_s
            while not found and time.monotonic() < deadline:
                if store.check([f"torch.rendezvous.{rdzv_id}"]):
                    found.append(True)
                time.sleep(0.1)
        except Exception:  # noqa: BLE001  (not a store, or it went away: not this job's)
            return

    thread = threading.Thread(target=ask, name="rendezvous-port", daemon=True)
    thread.start()
    thread.join(wait_s + 1.0)
    return bool(found)
