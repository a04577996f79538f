"""The run's facts, derived in one place from the validated config: the mesh (world and degrees,
data-parallel size), the batch (accumulation), the precision and its regime, the checkpoint
format. Validation (recipes/job.py), the planner (each preset it prices) and a strategy reached
through Lightning's registry (from the world Lightning sets up) all call ``derive``; everything
else reads the ``Run`` it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.mesh import Batch, Mesh
from core.precision import regime

Preset = Any
"""A strategy config (``strategies.base.StrategyConfig``): core imports no strategy, it asks the
preset (``mesh``, ``for_batch``, ``capabilities``)."""


@dataclass(frozen=True)
class Run:
    """What builders, the planner and the checkpoint code know about a run besides the config."""

    mesh: Mesh
    batch: Batch
    accelerator: str = "cpu"
    """cpu | gpu, after resolving ``auto``."""
    precision: str = "32"
    """32 | bf16-mixed | 16-mixed."""
    regime: str = "32"
    """32 | autocast | bf16 (``regime``): what the planner's activation calibration is keyed by."""
    grad_clip: float = 0.0
    checkpoint: str = "dcp"
    """dcp | deepspeed: the format the family's engine writes (``Capabilities.checkpoint``)."""
    compile: bool = False
    """trainer.compile: torch.compile each block (the plan's compile step)."""
    float8: str = "none"
    """trainer.float8: none | tensorwise | rowwise (the plan's first step, parallel/float8.py)."""

    @property
    def micro_batch_size(self) -> int:
        return self.batch.micro_size

    @property
    def accumulation(self) -> int:
        return self.batch.accumulation

    def problems(self) -> list[str]:
        """The mesh arithmetic, then (when it holds) the batch arithmetic; fp16 mixed precision
        on CPU; trainer.compile on CPU without a C++ compiler (inductor compiles its kernels with
        one)."""
        out = self.mesh.problems() or self.batch.problems()
        if self.precision == "16-mixed" and self.accelerator == "cpu":
            out = [*out, "trainer.precision=16-mixed on CPU: fp16 mixed precision needs a GPU (Lightning "
                         "trains bf16-mixed in its place, Accelerate and DeepSpeed have no fp16 autocast "
                         "or loss scaling on CPU): use trainer.precision=bf16-mixed or 32, or "
                         "cluster.accelerator=gpu"]
        if self.compile and self.accelerator == "cpu" and not cxx():
            out = [*out, "trainer.compile=true on CPU needs a C++ compiler for inductor's kernels, "
                         "and none was found (CXX, g++, c++): install one (apt-get install g++) "
                         "or set trainer.compile=false"]
        return out


def cxx() -> str | None:
    """The C++ compiler torch's inductor would use on CPU ($CXX, else g++ or c++), or None."""
    import os
    import shutil

    return next((p for c in (os.environ.get("CXX"), "g++", "c++") if c and (p := shutil.which(c))), None)


COMPILE_PROVEN = ("single", "ddp", "fsdp2", "zero2")
"""The presets whose compiled blocks are proven equal to eager (tests/test_compile.py's
``COMPILED``): ``trainer.compile=auto`` turns compile on for them on CUDA."""


def compile_on(value: Any, preset: str, accelerator: str) -> bool:
    """``trainer.compile`` resolved: true / false as given (a bool, or the strings the schema
    keeps), ``auto``: on for the ``COMPILE_PROVEN`` presets on a GPU (``accelerator`` resolved:
    cpu | gpu), off elsewhere and on CPU (inductor's CPU kernels are not what is measured, and a
    CPU run's numerics stay eager's)."""
    if isinstance(value, str):
        if value.lower() == "auto":
            return accelerator == "gpu" and preset in COMPILE_PROVEN
        return value.lower() == "true"
    return bool(value)


def derive(strategy: Preset, *, nodes: int, devices: int, accelerator: str = "cpu",
           precision: str = "32", global_batch: int | None = None, micro_batch: int = 1,
           grad_clip: float = 0.0, compile: bool = False, float8: str = "none") -> Run:
    """The one derivation of a run's facts from a strategy, the cluster's shape and the trainer's
    batch, precision and clipping (``accelerator`` already resolved: cpu or gpu). Without
    ``global_batch`` (a Lightning Trainer given the preset by name): one micro-batch per step,
    and nothing derived from the batch."""
    return _settle(strategy, nodes=nodes, devices=devices, accelerator=accelerator, precision=precision,
                   global_batch=global_batch, micro_batch=micro_batch, grad_clip=grad_clip,
                   compile=compile, float8=float8)[1]


def _settle(strategy: Preset, *, nodes: int, devices: int, accelerator: str, precision: str,
            global_batch: int | None, micro_batch: int, grad_clip: float, compile: Any,
            hidden: int | None = None, float8: str = "none") -> tuple[Preset, Run]:
    mesh = strategy.mesh(nodes, devices)
    if global_batch is not None and mesh.dp >= 1:
        strategy = strategy.for_batch(global_batch, micro_batch, mesh.dp)
    if hidden is not None:  # ... and from the model (DeepSpeed's "auto" sizes)
        strategy = strategy.for_model(hidden)
    # (a count the batch could not give is the preset's problem to explain, not the batch's)
    chunks = 1 if global_batch is not None and strategy.underived() else strategy.chunks()
    batch = Batch(global_batch or micro_batch * mesh.dp * chunks, micro_batch, mesh.dp, chunks)
    caps = strategy.capabilities
    return strategy, Run(mesh=mesh, batch=batch, accelerator="gpu" if accelerator == "gpu" else "cpu",
                         precision=str(precision),
                         regime=regime(str(precision), strategy.low_precision_weights(mesh)),
                         grad_clip=float(grad_clip or 0.0), checkpoint=caps.checkpoint,
                         compile=compile_on(compile, strategy.name, accelerator), float8=str(float8 or "none"))


def derive_from(strategy: Preset, cluster: Any, trainer: Any, accelerator: str | None = None) -> Run:
    """``derive`` from the cluster and trainer groups as typed objects (``accelerator``: resolved,
    else the cluster's own when it names one)."""
    return settle(strategy, cluster, trainer, accelerator=accelerator)[1]


def settle(strategy: Preset, cluster: Any, trainer: Any, *, accelerator: str | None = None,
           hidden: int | None = None) -> tuple[Preset, Run]:
    """The preset as it runs and its ``Run``, in one derivation (validation's): the mesh once,
    what the preset derives from the batch (a pipeline's micro-batch count) and, given the
    model's ``hidden`` size, from the model (DeepSpeed's "auto" sizes) filled in, then the
    run's facts of that preset."""
    return _settle(strategy, nodes=cluster.nodes, devices=cluster.devices,
                   accelerator=accelerator or cluster.accelerator, precision=trainer.precision,
                   global_batch=trainer.global_batch_size, micro_batch=trainer.micro_batch_size,
                   grad_clip=trainer.grad_clip, compile=getattr(trainer, "compile", False),
                   float8=str(getattr(trainer, "float8", "none")),
                   hidden=hidden)


def cpu_threads(local_ranks: int) -> int:
    """Intra-op threads each CPU rank of a node computes with: ``OMP_NUM_THREADS`` when set,
    else the cores this process may use shared evenly by the node's ranks (at least one; torchrun
    gives every rank 1). Ranks that oversubscribe the cores spin against each other: a 2-stage
    pipeline on 2 cores ran 7x slower with 2 threads a rank than with 1 (measured)."""
    import os

    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))


__all__ = ["COMPILE_PROVEN", "Run", "compile_on", "cpu_threads", "derive", "derive_from", "settle"]
