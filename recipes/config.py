"""Typed schemas behind ``conf/``: stored in Hydra's ConfigStore so an unknown key or a wrong type
fails at compose time, each field with its allowed values declared (``knob``) so a bad value
fails validation with one sentence. Torch-free: plan.py and ``train.py --cfg job`` import this and
nothing heavy.

This module holds the root schema (``TrainConfig``), the small groups (backend, logger, export,
paths, planner; callbacks: the keys each observer declares in its own module, gathered by
``observers.callbacks_schema``) and ``GROUP_SCHEMAS``; the large groups have
modules of their own: ``recipes/model_config.py`` (model), ``recipes/cluster_config.py`` (cluster
and each launcher's keys), ``recipes/trainer_config.py`` (trainer and data). Strategy schemas
live with their families in ``strategies/``. ``recipes/compose.py`` stores the schemas and
registers the resolvers (``register``) and composes; its names are importable from here too.

Schemas are stored at the ConfigStore's root (``train_schema``, ``logger_schema``; strategy
families as ``<family>_schema``), not inside the groups, so ``--help`` lists only real options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING

from recipes.cluster_config import (LAUNCHERS, ClusterConfig, ClusterTrainer, K8sConfig, RayConfig,
                                    SageMakerConfig, SlurmConfig)
from recipes.model_config import ARCHITECTURES, LORA_TARGETS, LoraConfig, ModelConfig
from recipes.trainer_config import (DATASETS, OPTIMIZERS, PRECISIONS, SCHEDULERS, TOKEN_DTYPES, TRAIN_ON,
                                    DataConfig, ObjectiveConfig, TrainerConfig)
from core.knobs import free, knob
from strategies.base import AC_CHOICES
from core.conf import CONF_DIR
from observers import callbacks_schema

__all__ = [
    "ARCHITECTURES", "BACKENDS", "DATASETS", "GROUP_SCHEMAS", "LAUNCHERS", "LOGGERS", "LORA_TARGETS",
    "OPTIMIZERS", "PRECISIONS", "SCHEDULERS", "TOKEN_DTYPES", "TRAIN_ON", "BackendConfig",
    "CallbacksConfig", "ClusterConfig", "ClusterTrainer", "DataConfig", "ExportConfig", "K8sConfig",
    "LoggerConfig", "LoraConfig", "ModelConfig", "PathsConfig", "PlannerConfig", "RayConfig",
    "SageMakerConfig", "SlurmConfig", "TrainConfig", "TrainerConfig", "compose", "compose_chosen",  # noqa: F822
    "describe", "register", "run_name", "unreadable",  # noqa: F822  (these: _COMPOSE, PEP 562)
]

# A backend is a file of conf/backend/ (and a module of backends/): the files are the choices.
BACKENDS = tuple(sorted(p.stem for p in (CONF_DIR / "backend").glob("*.yaml")))
# A logger is a file of conf/logger/ (and an ``@logger`` of observers/loggers.py): the choices.
LOGGERS = tuple(sorted(p.stem for p in (CONF_DIR / "logger").glob("*.yaml")))


@dataclass
class BackendConfig:
    name: str = knob("lightning", choices=BACKENDS)
    """The engine that runs the loop: a file of conf/backend/ and a module of backends/."""


# The callbacks group: each observer declares its own keys beside its factory (``@observer(name,
# order, knobs=...)`` in observers/<observer>.py); its schema is all of them, in the observers' order.
CallbacksConfig = callbacks_schema(__name__)


@dataclass
class LoggerConfig:
    name: str = knob("csv", choices=LOGGERS)
    """Where the metrics go besides report.json: csv | tensorboard | wandb (a file of conf/logger/)."""
    project: str = free("stratagem", "any wandb project name")
    """wandb: the project."""
    mode: str = knob("offline", choices=("online", "offline", "disabled"))
    """wandb: online | offline | disabled."""

    READ_BY: ClassVar[dict[str, str]] = {"project": "wandb", "mode": "wandb"}
    """The keys one logger alone reads -> that logger: set away from its default under another
    logger, refused at validate (every logger file composes this one schema)."""


@dataclass
class ExportConfig:
    """export.py: which native config to write for the preset and cluster."""

    name: str = knob("accelerate", choices=("accelerate", "deepspeed"))
    """accelerate (an `accelerate launch` config YAML) | deepspeed (the DeepSpeed JSON)."""
    out: str | None = free(None, "a file to create")
    """Where to write it; None: <strategy>-<cluster>.<name>.(yaml|json) in the current directory."""
    wrap: str | None = free(None, "a class name of the model your script trains")
    """export=accelerate, FSDP presets: the class of your model's repeated block (one FSDP unit
    each, e.g. wrap=LlamaDecoderLayer; wrap=Block: our built-in models); None: by size (a unit
    per 1e8 parameters, the root always), which fits any model."""


@dataclass
class PathsConfig:
    # (None: no run yet -- ``train.py --cfg job --resolve`` composes before Hydra names the run's
    # directory, and prints these as null)
    root_dir: str | None = MISSING
    """The directory the command was started in (Hydra's runtime.cwd)."""
    output_dir: str | None = MISSING
    """The run's directory (hydra.run.dir, outputs/<date>/<time> by default): its report.json,
    logs and checkpoints."""


@dataclass
class PlannerConfig:
    """plan.py and the pre-launch check of train.py."""

    format: str = knob("table", choices=("table", "json"))
    """plan.py's output: table (for reading) | json (for scripts)."""
    accounting: str = knob("actual", choices=("actual", "mixed16", "mixed20"))
    """actual (what the preset allocates) | mixed16 (16 B/param) | mixed20 (20 B/param)."""
    params: float | None = knob(None, above=0.0)
    """Plan model states of this many parameters, without a model shape (no activations);
    a float so that ``planner.params=1e10`` works."""
    trainable: float | None = knob(None, above=0.0)
    """Parameters that train (LoRA-style adapters); the rest are frozen and hold no gradient or
    optimizer state. None: all parameters train."""
    tp: int = knob(1, min=1)
    """Tensor-parallel degree for planned-only layouts."""
    pp: int = knob(1, min=1)
    """Pipeline-parallel degree for planned-only layouts."""
    microbatches: int | None = knob(None, min=1)
    """Pipeline micro-batches per step; None: the accumulation steps (at least pp)."""
    mfu: float = knob(0.4, above=0.0, max=1.0)
    """Assumed model-FLOPs utilisation for compute time, in (0, 1]."""
    enforce: bool = True
    """train.py refuses to launch a run predicted not to fit."""
    activation_checkpointing: Any = knob(None, choices=AC_CHOICES)
    """Plan with (true, selective) or without (false) activation checkpointing; None: each
    preset's own (strategy.activation_checkpointing). ``Any``: a bool or the word selective."""
    sequence_parallel: bool = True
    """Planned-only TP layouts shard the non-TP activations too (Megatron sequence parallel)."""
    flash_attention: bool = True
    """Attention kernels that store no (seq x seq) scores (SDPA flash / memory-efficient)."""
    host_link_GBps: float = knob(25.0, above=0.0)
    """Per-device host<->device bandwidth for CPU offload, GB/s (PCIe 4 x16)."""
    nvme_GBps: float = knob(3.0, above=0.0)
    """Per-device NVMe bandwidth share for NVMe offload, GB/s."""
    reserve_GB: float = knob(3.0, min=0.0)
    """GPU memory the plan's states do not see: CUDA context, NCCL buffers, allocator
    fragmentation. A GPU plan that fits with less than this free is called tight."""
    intra_latency_us: float = knob(2.0, min=0.0)
    """Latency of one step of a collective inside a node, microseconds (NVLink / PCIe; the
    alpha of the alpha-beta cost: measure it with nccl-tests at small sizes)."""
    inter_latency_us: float = knob(8.0, min=0.0)
    """Latency of one step of a collective across nodes, microseconds (InfiniBand / RoCE)."""
    calibrate: bool = False
    """cluster=local: measure this machine once (matmul throughput, a transformer block's share
    of it, AdamW's step, the process group's bandwidth and latency; a subprocess, cached in
    ~/.cache/stratagem/machine per host, device, world and precision) and plan step time with it."""


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    strategy: Any = MISSING
    cluster: ClusterConfig = MISSING
    backend: BackendConfig = MISSING
    data: DataConfig = MISSING
    trainer: TrainerConfig = MISSING
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    callbacks: CallbacksConfig = MISSING
    logger: Any = None
    export: Any = None
    experiment: Any = None
    paths: PathsConfig = MISSING
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    preflight: bool = True
    """A multirun composes, validates and plans every point before it starts or queues any job,
    and starts none when one cannot run (launchers/sweep.py); ``+preflight=false`` skips that."""


# cfg group -> its schema: what validation checks field by field.
GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig, "cluster": ClusterConfig, "trainer": TrainerConfig, "data": DataConfig,
    "backend": BackendConfig, "callbacks": CallbacksConfig, "logger": LoggerConfig,
    "planner": PlannerConfig, "export": ExportConfig, "objective": ObjectiveConfig,
}


# recipes/compose.py's names, importable from here as before; resolved on first use, since
# compose.py reads the schemas above (PEP 562).
_COMPOSE = ("compose", "compose_chosen", "describe", "register", "run_name", "unreadable", "_default_choices")


def __getattr__(name: str) -> Any:
    if name in _COMPOSE:
        from recipes import compose

        return getattr(compose, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
