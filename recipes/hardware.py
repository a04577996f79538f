"""Known machines as data, for configs that name one instead of spelling out its numbers.

``${instance:<type>,<field>}`` (a resolver, conf/cluster/sagemaker_*.yaml) reads a SageMaker
training instance's GPUs per node, memory per GPU, dense bf16 peak, links and host memory, so
``cluster.sagemaker.instance_type=...`` moves the planner's numbers with it; a field set
explicitly wins. Sources: the instance pages of AWS and NVIDIA's data sheets (dense peaks, no
sparsity); EFA bandwidth is per node, divided here by its GPUs.

``${launched:<nodes|devices>,<default>}`` (conf/cluster/local.yaml) is the world an outside
launcher (torchrun, ``accelerate launch``, srun) started, read from its environment.

``${local:<device_memory_GB|peak_tflops>,<accelerator>}`` (conf/cluster/local.yaml) is this
machine: its NVIDIA GPUs read without torch (``nvidia-smi``, else /proc/driver/nvidia), each
device's real memory and the model's peak from ``KNOWN_GPUS``; without GPUs, the CPU defaults.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# type -> GPUs per node, GB per GPU, dense bf16 TFLOP/s per GPU, intra-node GB/s per GPU,
# inter-node GB/s per GPU, host memory GB, NVMe GB
INSTANCES: dict[str, dict[str, float]] = {
    "ml.p5.48xlarge": dict(devices=8, device_memory_GB=80, peak_tflops=989, intra_node_GBps=900,
                           inter_node_GBps=50, host_memory_GB=2048, nvme_GB=30720),        # 8 x H100 SXM, 3200 Gb/s EFA
    "ml.p5e.48xlarge": dict(devices=8, device_memory_GB=141, peak_tflops=989, intra_node_GBps=900,
                            inter_node_GBps=50, host_memory_GB=2048, nvme_GB=30720),       # 8 x H200
    "ml.p5en.48xlarge": dict(devices=8, device_memory_GB=141, peak_tflops=989, intra_node_GBps=900,
                             inter_node_GBps=50, host_memory_GB=2048, nvme_GB=30720),      # 8 x H200
    "ml.p4d.24xlarge": dict(devices=8, device_memory_GB=40, peak_tflops=312, intra_node_GBps=600,
                            inter_node_GBps=6.25, host_memory_GB=1152, nvme_GB=8000),      # 8 x A100 40GB, 400 Gb/s EFA
    "ml.p4de.24xlarge": dict(devices=8, device_memory_GB=80, peak_tflops=312, intra_node_GBps=600,
                             inter_node_GBps=6.25, host_memory_GB=1152, nvme_GB=8000),     # 8 x A100 80GB
    "ml.g5.48xlarge": dict(devices=8, device_memory_GB=24, peak_tflops=70, intra_node_GBps=32,
                           inter_node_GBps=1.5625, host_memory_GB=768, nvme_GB=7600),      # 8 x A10G (PCIe), 100 Gb/s
}


def instance(kind: str, field: str) -> Any:
    """One number of a known instance type (the ``instance`` resolver)."""
    known = INSTANCES.get(str(kind))
    if known is None:
        raise ValueError(f"cluster.sagemaker.instance_type={kind!r} is not a known instance type "
                         f"({', '.join(INSTANCES)}): set cluster.devices, cluster.device_memory_GB, "
                         "cluster.peak_tflops, cluster.intra_node_GBps, cluster.inter_node_GBps, "
                         "cluster.host_memory_GB and cluster.nvme_GB for it")
    value = known[field]
    return int(value) if field == "devices" else float(value)


# --------------------------------------------------------------------------- an outside launcher
def outside_world() -> tuple[int, int] | None:
    """(nodes, processes per node) of the launcher that started this process as a rank --
    ``torchrun``, ``accelerate launch`` (torchrun underneath) or a multi-task ``srun`` step -- read
    from its environment; None when no launcher did (plain ``python train.py``, whose own
    launcher starts the ranks)."""
    env = os.environ
    if "SLURM_STEP_ID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        tasks = int(env["SLURM_STEP_NUM_TASKS"])
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        return nodes, max(tasks // nodes, 1)
    if all(k in env for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        world = int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_WORLD_SIZE") or world)
        return max(world // max(local, 1), 1), local
    return None


def launched(field: str, default: Any) -> Any:
    """The ``launched`` resolver (conf/cluster/local.yaml): ``nodes`` or ``devices`` as the outside
    launcher started them, else ``default``; a value set in the config or on the command line
    replaces the interpolation, and launchers.check compares it with the launcher's world."""
    world = outside_world()
    if world is None:
        return default
    return {"nodes": world[0], "devices": world[1]}[str(field)]


# --------------------------------------------------------------------------- this machine's GPUs
# GPU model -> dense 16-bit tensor peak per GPU, TFLOP/s (bf16; fp16 where the part has no bf16:
# V100, T4), and its memory in GB where nvidia-smi cannot say (the /proc fallback). Matched
# against the name nvidia-smi reports, first match wins: the more specific names come first.
# Sources: NVIDIA's data sheets, dense (no sparsity).
KNOWN_GPUS: tuple[tuple[str, float, float], ...] = (
    ("B200", 2250, 180), ("GH200", 989, 96), ("H200", 989, 141), ("H20", 148, 96),
    ("H100 NVL", 835, 94), ("H100 PCIe", 756, 80), ("H100", 989, 80),   # H100 SXM: "H100 80GB HBM3"
    ("A100", 312, 80), ("A800", 312, 80), ("L40S", 362, 48), ("L40", 181, 48), ("L4", 121, 24),
    ("A10G", 70, 24), ("A10", 125, 24), ("A30", 165, 24), ("A40", 150, 48),
    ("RTX 6000 Ada", 364, 48), ("RTX A6000", 155, 48), ("V100", 125, 32), ("T4", 65, 16),
    ("RTX 4090", 165, 24), ("RTX 3090", 71, 24),
)
UNKNOWN_GPU_TFLOPS = 100.0
"""The peak assumed for a GPU not in ``KNOWN_GPUS`` (the plan says so; set cluster.peak_tflops)."""
CPU_DEFAULTS = {"peak_tflops": 0.2}
"""cluster=local on a machine without GPUs (or cluster.accelerator=cpu): 2 cores' fp32 order of
magnitude (its device memory is the host's, ``host_bytes``, shared by the processes)."""


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int
    """Bytes, as nvidia-smi's memory.total reports them (MiB x 2^20)."""
    peak_tflops: float
    known: bool
    """The name is in ``KNOWN_GPUS`` (else ``peak_tflops`` is ``UNKNOWN_GPU_TFLOPS``)."""


def known_gpu(name: str) -> tuple[float, float] | None:
    """(peak TFLOP/s, nominal GB) of a GPU model by the name nvidia-smi reports, or None."""
    upper = name.upper()
    for key, tflops, gb in KNOWN_GPUS:
        if key.upper() in upper:
            return tflops, gb
    return None


def _gpu(name: str, memory: int | None) -> Gpu:
    known = known_gpu(name)
    if memory is None:  # (the /proc fallback: the size in the name, else the model's nominal)
        m = re.search(r"(\d+)\s*GB", name, re.IGNORECASE)
        memory = int(m.group(1)) * 2**30 if m else int((known[1] if known else 0) * 1e9)
    return Gpu(name, memory, known[0] if known else UNKNOWN_GPU_TFLOPS, known is not None)


def parse_nvidia_smi(text: str, visible: str | None = None) -> tuple[Gpu, ...]:
    """The GPUs in ``nvidia-smi --query-gpu=name,memory.total --format=csv,noheader`` output
    (one ``<name>, <N> MiB`` line each); ``visible``: CUDA_VISIBLE_DEVICES, when it lists
    indices, keeps those (an empty one keeps none)."""
    gpus = []
    for line in text.splitlines():
        if "," not in line:
            continue
        name, memory = (part.strip() for part in line.rsplit(",", 1))
        m = re.match(r"(\d+(?:\.\d+)?)\s*(MiB|GiB)?", memory)
        size = int(float(m.group(1)) * (2**30 if m.group(2) == "GiB" else 2**20)) if m else None
        gpus.append(_gpu(name, size))
    if visible is not None and re.fullmatch(r"[\d,\s]*", visible):
        keep = [int(i) for i in visible.replace(" ", "").split(",") if i]
        gpus = [gpus[i] for i in keep if 0 <= i < len(gpus)]
    return tuple(gpus)


def _from_proc(root: Path = Path("/proc/driver/nvidia/gpus")) -> tuple[Gpu, ...]:
    """The driver's view when nvidia-smi is missing: each GPU's model, its memory from the name
    or the table."""
    out = []
    for info in sorted(root.glob("*/information")) if root.is_dir() else ():
        m = re.search(r"^Model:\s*(.+)$", info.read_text(errors="replace"), re.MULTILINE)
        if m:
            out.append(_gpu(m.group(1).strip(), None))
    return tuple(out)


@functools.cache
def local_gpus() -> tuple[Gpu, ...]:
    """This machine's NVIDIA GPUs, without torch: ``nvidia-smi`` (the first on PATH), else
    /proc/driver/nvidia; () on a machine without them. Read once per process."""
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            done = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=20)
            if done.returncode == 0:
                return parse_nvidia_smi(done.stdout, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except (OSError, subprocess.SubprocessError):
            pass
    return _from_proc()


def _cgroup_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """This process's cgroup memory limit in bytes (v2 ``memory.max``, else v1
    ``memory/memory.limit_in_bytes``); None when unlimited or unreadable."""
    for f in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # (v1 says "no limit" with a huge number)
            return int(text)
        return None
    return None


@functools.cache
def host_bytes() -> tuple[int, str]:
    """This machine's host memory a job may use, and where it came from: /proc/meminfo's
    MemTotal, or the cgroup's limit when lower (a container, a Slurm allocation); (24 GB,
    "assumed") where neither can be read."""
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal:"))
        total, source = int(line.split()[1]) * 1024, "MemTotal"
    except (OSError, StopIteration, ValueError, IndexError):
        return 24 * 10**9, "assumed"
    limit = _cgroup_limit()
    return (limit, "cgroup limit") if limit is not None and limit < total else (total, source)


def local(field: str, accelerator: str = "auto", gpus: tuple[Gpu, ...] | None = None) -> float:
    """The ``local`` resolver (conf/cluster/local.yaml): ``device_memory_GB``, ``peak_tflops`` or
    ``host_memory_GB`` of this machine. With GPUs (``accelerator`` auto or gpu): the smallest
    device's memory and peak (a GPU not in ``KNOWN_GPUS``: ``UNKNOWN_GPU_TFLOPS``); without, or on
    ``accelerator=cpu``: the host's memory (``host_bytes``) and ``CPU_DEFAULTS``' peak. The host's
    memory in either case. A value set in the config or on the command line
    replaces the interpolation."""
    if field == "host_memory_GB":
        return round(host_bytes()[0] / 1e9, 3)
    gpus = local_gpus() if gpus is None else gpus
    if str(accelerator) == "cpu" or not gpus:
        return round(host_bytes()[0] / 1e9, 3) if field == "device_memory_GB" else CPU_DEFAULTS[str(field)]
    if field == "device_memory_GB":
        return round(min(g.memory for g in gpus) / 1e9, 3)
    return float(min(g.peak_tflops for g in gpus))


def describe_gpus(gpus: tuple[Gpu, ...]) -> str:
    """``8 x NVIDIA H100 80GB HBM3 (81,559 MiB, 989 TFLOP/s each)``; unknown models say so."""
    groups: dict[tuple[str, int], int] = {}
    for g in gpus:
        groups[(g.name, g.memory)] = groups.get((g.name, g.memory), 0) + 1
    parts = []
    for (name, memory), count in groups.items():
        g = next(x for x in gpus if x.name == name)
        peak = (f"{g.peak_tflops:g} TFLOP/s each" if g.known else
                f"not in the table of known GPUs (recipes/hardware.py): {UNKNOWN_GPU_TFLOPS:g} "
                "TFLOP/s assumed, set cluster.peak_tflops")
        parts.append(f"{count} x {name} ({memory / 2**20:,.0f} MiB, {peak})")
    return ", ".join(parts)
