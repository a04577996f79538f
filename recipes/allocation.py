"""What a launcher's allocation lets one node of a job use, as the scheduler says it (torch-free,
read by ``ClusterConfig.host_limit`` for the planner and by launchers/slurm.py's checks).

Slurm: the partition's nodes (sinfo) and, where Slurm counts memory (a consumable resource), what
a job that asks for none gets -- the partition's (else the cluster's) DefMemPerNode, or
DefMemPerCPU x its CPUs on a node (scontrol); inside a job, its own allocation
(SLURM_MEM_PER_NODE, or SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE) and the node's MemTotal or cgroup
limit, never the controller (every rank of a large job would ask it).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
from typing import Any

log = logging.getLogger(__name__)


def in_job() -> bool:
    """This process runs inside a Slurm job."""
    return "SLURM_JOB_ID" in os.environ


def partitions() -> dict[str, dict[str, Any]] | None:
    """The controller's partitions: name -> CPUs per node, nodes, GPUs per node, the smallest
    node's memory in MB (None: no sinfo)."""
    if not shutil.which("sinfo"):
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P|%c|%D|%G|%m"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    parts: dict[str, dict[str, Any]] = {}
    for line in out.splitlines():
        name, cpus, nodes, gres, memory = line.split("|")
        gpus = sum(int(g.split(":")[-1].split("(")[0]) for g in gres.split(",")
                   if g.startswith("gpu") and g.split(":")[-1].split("(")[0].isdigit())
        p = parts.setdefault(name, {"cpus": 0, "nodes": 0, "gpus": 0, "memory": None})
        p["cpus"] = max(p["cpus"], int(cpus.rstrip("+")))
        if memory.rstrip("+").isdigit():  # (MB; the smallest node's)
            p["memory"] = min(p["memory"] or int(memory.rstrip("+")), int(memory.rstrip("+")))
        p["nodes"] += int(nodes)
        p["gpus"] = max(p["gpus"], gpus)
    return parts


def slurm_memory(partition: str | None, cpus_per_node: int, mem_gb: int | None) -> list[tuple[float, str]]:
    """What bounds the memory of one node of a job, GB, each with where it was read. In a job:
    the node's own (MemTotal, or the job's cgroup) and, asking for no memory (``mem_gb`` None),
    the job's allocation (SLURM_MEM_PER_NODE, or SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE). Before
    submission: the partition's smallest node (sinfo) and, asking for none, the default a job
    gets where Slurm counts memory (scontrol: the partition's DefMemPerNode or DefMemPerCPU x
    ``cpus_per_node``, else the cluster's). Empty where Slurm cannot be asked. (A job never asks
    the controller: every rank of a large job would.)"""
    if in_job():
        from recipes.hardware import host_bytes

        node, source = host_bytes()
        out = [(node / 1e9, f"this node's {source}")]
        per_node, per_cpu = os.environ.get("SLURM_MEM_PER_NODE", ""), os.environ.get("SLURM_MEM_PER_CPU", "")
        cpus = os.environ.get("SLURM_CPUS_ON_NODE", "")
        if mem_gb is None and per_node.isdigit() and int(per_node):
            out.append((int(per_node) * MB, f"this job's allocation, SLURM_MEM_PER_NODE{UNSET}"))
        elif mem_gb is None and per_cpu.isdigit() and cpus.isdigit():
            out.append((int(per_cpu) * int(cpus) * MB,
                        f"this job's allocation, SLURM_MEM_PER_CPU {per_cpu} MB x {cpus} CPUs{UNSET}"))
        return out
    found = _memory(partition)
    if found is None:
        return []
    name, node_mb, default = found
    out = [(node_mb * MB, f"the nodes of partition {name}, sinfo")] if node_mb else []
    if mem_gb is None and default is not None:
        kind, mb, where = default
        out.append((mb * MB, f"{where} DefMemPerNode{UNSET}") if kind == "DefMemPerNode" else
                   (mb * cpus_per_node * MB, f"{where} DefMemPerCPU {mb} MB x {cpus_per_node} CPUs{UNSET}"))
    return out


MB = 2**20 / 1e9
"""GB (1e9 bytes) in one of Slurm's MB (MiB)."""
UNSET = ": Slurm's default for a job without cluster.slurm.mem_gb (set it; 0: all of each node's)"


def _confs() -> tuple[str, ...]:
    """Where a Slurm client finds its configuration: SLURM_CONF, or the packages' and a
    configless login node's (sackd) places."""
    if os.environ.get("SLURM_CONF"):
        return (os.environ["SLURM_CONF"],)
    return ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf", "/run/slurm/conf/slurm.conf")


@functools.lru_cache(maxsize=8)
def _memory(partition: str | None) -> tuple[str, int | None, tuple[str, int, str] | None] | None:
    """For jobs of ``partition`` (None: the default one): its name, its smallest node's memory
    (MB, sinfo) and the default memory of a job that asks for none -- (DefMemPerNode or
    DefMemPerCPU, MB, whose) where Slurm counts memory, else None (scontrol). None: no Slurm."""
    if not shutil.which("scontrol") or not any(map(os.path.exists, _confs())):
        return None  # no Slurm here (and scontrol retries a SLURM_CONF that is not there for a minute)

    def ask(*args: str) -> str:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout
    try:
        config = dict(line.split("=", 1) for line in ask("show", "config").splitlines() if " = " in line)
        config = {k.strip(): v.strip() for k, v in config.items()}
        parts = [dict(f.split("=", 1) for f in line.split() if "=" in f)
                 for line in ask("show", "partition", "-o").splitlines()]
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log.warning("scontrol did not answer (%s): the memory Slurm grants a job is not known here, "
                    "so the plan takes cluster.host_memory_GB (set cluster.slurm.mem_gb to be sure)",
                    ((getattr(e, "stderr", None) or str(e) or type(e).__name__).strip().splitlines() or ["?"])[0][:160])
        return None
    part = next((p for p in parts if p.get("PartitionName") == partition
                 or (partition is None and p.get("Default") == "YES")), None)
    if part is None:
        return None
    name = part["PartitionName"]
    node_mb = (partitions() or {}).get(name, {}).get("memory")
    select = part.get("SelectTypeParameters", "NONE")
    if "MEMORY" not in (config.get("SelectTypeParameters", "") if select == "NONE" else select).upper():
        return name, node_mb, None
    for source, where in ((part, f"partition {name}'s"), (config, "the cluster's")):
        for kind in ("DefMemPerNode", "DefMemPerCPU"):
            if source.get(kind, "").isdigit() and int(source[kind]):
                return name, node_mb, (kind, int(source[kind]), where)
    return name, node_mb, None
