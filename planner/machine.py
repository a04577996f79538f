"""This machine as measured (``planner.calibrate=true``, ``cluster=local``): matmul throughput,
what a transformer block leaves of it, AdamW's step per parameter, the process group's
bandwidth and latency per collective, and the engines' own work (ZeRO-2, ZeRO-3, FSDP2),
measured once by ``python -m backends.common.calibrate`` (observers/machine.py and the engines)
in a subprocess (plan.py imports no torch) and cached under ``$XDG_CACHE_HOME/stratagem/machine``
(``~/.cache/stratagem/machine`` where XDG_CACHE_HOME is unset), one file
per host, device, world size and precision. The planner prices ``cluster=local`` with these
numbers instead of ``cluster.peak_tflops`` x ``planner.mfu``, ``cluster.intra_node_GBps`` and
``planner.intra_latency_us``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.conf import cache_dir

CACHE: Path | None = None
"""Where the calibrations are; None: ``core.conf.cache_dir("machine")``, read when used."""
ROOT = Path(__file__).resolve().parents[1]
FORMAT = 7
"""The calibration's format: a cache written by an older one (without the engines' own work:
1; without FSDP2's: 2; without the host's optimizer and copies and the step's floor: 3; with
several processes' compute timed out of lockstep, so optimistic where they slow each other: 4;
with the engines on CPU timed at the reference batch, several times noisier, the offloaded ones
over one process only, and the block's rate from one 4-second moment of a drifting machine: 5;
under glibc's default allocator, whose give-back of every large step -- faulted in again on the
next -- inflated ZeRO-3's figure where a run no longer pays it (observers/memory.py): 6) is
measured again."""
# planner's collective kinds -> the measured operation
OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
       "send_recv": "send"}


@dataclass(frozen=True)
class Machine:
    """What the calibration measured (``backends.common.calibrate``'s JSON)."""

    matmul_tflops: float
    """Dense matmul throughput per process in the run's dtype, TFLOP/s (all processes busy)."""
    efficiency: float
    """A reference transformer block's model FLOP/s over ``matmul_tflops``: this machine's MFU."""
    optimizer_ns_per_param: float
    """AdamW's step with gradient clipping, nanoseconds per fp32 parameter."""
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)
    """op -> {"GBps": bytes on the wire per rank per second / 1e9, "latency_us": per step}."""
    block_tflops: float = 0.0
    tp_speedup: float = 0.0
    """A rank's forward and backward time, whole model over tensor-parallel over every process
    (its all-reduces included; ideal: world); 0: not measured (one process, an older cache)."""
    engine_ns_per_param_zero2: float = 0.0
    """What DeepSpeed's ZeRO-2 engine adds per parameter and micro-batch beyond the priced
    collectives and optimizer step (its hooks, bucket and flattening copies); 0: not measured."""
    engine_ns_per_param_zero3: float = 0.0
    """The same for ZeRO-3 (its per-module fetch and release hooks)."""
    engine_ns_per_param_fsdp2: float = 0.0
    """The same for torch FSDP2 (its per-block hooks, all-gather and reduce-scatter copies)."""
    engine_ns_per_param_zero2_offload: float = 0.0
    engine_ns_per_param_zero3_offload: float = 0.0
    """The same for ZeRO-2 and ZeRO-3 with the optimizer (and ZeRO-3's parameters) on the host,
    their host optimizer step and copies taken out; measured over one process too."""
    host_optimizer_ns_per_param: float = 0.0
    """torch AdamW stepping fp32 partitions on the host as an offloaded optimizer does (fused on
    a CUDA run, foreach on a CPU one), clipping included, ns per parameter at a rank's threads."""
    host_copy_GBps: float = 0.0
    """A host<->device copy, GB/s (pinned host memory on CUDA; on CPU a memcpy)."""
    floor_seconds: float = 0.0
    """A whole step of a GPT too small to compute anything, less its blocks: launch and Python
    overhead per step, under which no step goes."""
    layer_floor_seconds: float = 0.0
    """The same per block and micro-batch."""
    threads: int = 1
    world: int = 1
    precision: str = "32"
    device: str = ""
    host: str = ""
    measured: str = ""
    path: str = ""

    def link(self, op: str) -> tuple[float, float] | None:
        """(GB/s, latency in seconds per step) of a collective kind; None: not measured."""
        got = self.collectives.get(OPS.get(op, ""))
        return (got["GBps"], got["latency_us"] * 1e-6) if got else None

    def optimizer_seconds(self, moments: float, host: bool) -> float:
        """The optimizer's step over ``moments`` parameters: on the host (``host``: an offloaded
        optimizer) at the host's measured rate, else on the device."""
        ns = self.host_optimizer_ns_per_param if host and self.host_optimizer_ns_per_param else \
            self.optimizer_ns_per_param
        return moments * ns * 1e-9

    def floor(self, layers: float, micro_batches: int) -> float:
        """The least a step takes: its launch and Python overhead, ``layers`` blocks per rank
        run ``micro_batches`` times."""
        return self.floor_seconds + self.layer_floor_seconds * layers * micro_batches

    def describe(self) -> str:
        names = {"zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp2": "FSDP2", "zero2_offload": "ZeRO-2 offload",
                 "zero3_offload": "ZeRO-3 offload"}
        ns = {name: getattr(self, f"engine_ns_per_param_{k}") for k, name in names.items()}
        engines = " / ".join(f"{name} {v:.3g}" for name, v in ns.items() if v)
        links = ", ".join(f"{op} {v['GBps']:.2g} GB/s + {v['latency_us']:.3g} us" for op, v in self.collectives.items())
        return (f"measured on {self.host} ({self.device}, {self.world} process(es) x {self.threads} "
                f"thread(s), precision {self.precision}, {self.measured}): matmul "
                f"{self.matmul_tflops:.3g} TFLOP/s per process, a transformer block reaches "
                f"{self.efficiency:.0%} of it, AdamW {self.optimizer_ns_per_param:.3g} ns/param"
                + (f", the engines' own work {engines} ns/param" if engines else "")
                + (f", the host's AdamW {self.host_optimizer_ns_per_param:.3g} ns/param and copies "
                   f"{self.host_copy_GBps:.3g} GB/s (offload), a step's floor {self.floor_seconds:.3g} s + "
                   f"{self.layer_floor_seconds:.3g} s per block" if self.host_copy_GBps else "")
                + (f"; {links}" if links else "") + f" ({self.path})")


def planned(cluster: Any) -> Any:
    """The cluster as recipes' ClusterConfig resolves it (``accelerator=auto``: this machine's GPUs,
    found without torch by recipes/hardware.py -- the one probe)."""
    return cluster.planned()


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
        name = m.group(1).strip() if m else ""
    except OSError:
        name = ""
    return f"{name or 'cpu'} x {os.cpu_count() or 1}"


def key(cluster: Any, precision: str) -> dict[str, Any]:
    from core.run import cpu_threads

    cluster = planned(cluster)
    acc, world = ("gpu" if cluster.accelerator == "gpu" else "cpu"), int(cluster.nodes) * int(cluster.devices)
    gpu = cluster.device_name() if acc == "gpu" else None
    return {"host": socket.gethostname(), "device": gpu or cpu_name(),
            "world": world, "precision": str(precision), "accelerator": acc,
            "threads": cpu_threads(int(cluster.devices)) if acc == "cpu" else 0}


def path(k: dict[str, Any]) -> Path:
    name = f"{k['host']}-{k['device']}-w{k['world']}-t{k['threads']}-{k['precision']}"
    return (CACHE or cache_dir("machine")).expanduser() / (re.sub(r"[^\w.-]+", "_", name) + ".json")


def applies(job: Any) -> bool:
    """``planner.calibrate=true`` on ``cluster=local`` (``job``: a validated Job, its groups typed)."""
    return bool(job.planner.calibrate) and job.cluster.name == "local"


def load(cluster: Any, precision: str) -> Machine | None:
    """The cached measurement for this machine, world and precision, or None."""
    k = key(cluster, precision)
    p = path(k)
    if not p.is_file():
        return None
    data = json.loads(p.read_text())
    if data.get("format", 1) < FORMAT:
        return None
    fields = Machine.__dataclass_fields__
    return Machine(**{f: v for f, v in data.items() if f in fields},
                   **{f: k[f] for f in ("world", "precision", "device") if f not in data}, path=str(p))


def ensure(job: Any, *, measure: bool | None = None, force: bool = False) -> Machine | None:
    """``planner.calibrate=true`` on ``cluster=local``: the cached measurement, measured now (in a
    subprocess, ~20-40 s) when there is none and ``measure`` (None: unless this process is a rank
    torchrun or srun started -- its peers would measure at the same time: it reads the cache);
    None otherwise."""
    if not applies(job):
        return None
    if measure is None:
        measure = not all(v in os.environ for v in ("LOCAL_RANK", "RANK", "WORLD_SIZE"))
    cluster, precision = job.cluster, str(job.trainer.precision)
    k = key(cluster, precision)
    p = path(k)
    cached = None if force else load(cluster, precision)
    if cached is not None or not measure:
        return cached
    p.parent.mkdir(parents=True, exist_ok=True)
    print(f"planner.calibrate=true: measuring this machine once ({k['world']} process(es), "
          f"{k['accelerator']}, precision {precision}; about a minute) into {p}", file=sys.stderr,
          flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")  # (two runs measuring at once: one file each)
    cmd = [sys.executable, "-m", "backends.common.calibrate", f"--world={k['world']}",
           f"--precision={precision}", f"--accelerator={k['accelerator']}", f"--out={tmp}"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                              check=False)
    except subprocess.TimeoutExpired as e:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"planner.calibrate=true: measuring this machine took over {e.timeout:.0f} s "
                           f"and was stopped ({' '.join(cmd)}); run with planner.calibrate=false to plan "
                           f"step time from the cluster config's peak_tflops and link rates") from None
    if done.returncode != 0 or not tmp.is_file():
        raise RuntimeError(f"planner.calibrate=true: measuring this machine failed ({' '.join(cmd)}):\n"
                           + (done.stderr or done.stdout)[-2000:])
    data = (json.loads(tmp.read_text()) | {f: k[f] for f in ("world", "precision", "device")}
            | {"format": FORMAT})
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, p)  # (atomic: a run reading the cache meanwhile sees the old file or the new)
    return load(cluster, precision)
