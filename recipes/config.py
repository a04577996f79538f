"""Typed schemas behind ``conf/``: stored in Hydra's ConfigStore so an unknown key or a wrong type
fails at compose time. Strategy schemas live with their families in ``strategies/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelConfig:
    """A decoder-only transformer's shape (recipes/gpt.py)."""

    name: str = MISSING
    dim: int = MISSING
    """Hidden size."""
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: int = MISSING
    """Key/value heads; fewer than n_heads is grouped-query attention."""
    vocab_size: int = MISSING
    seq_len: int = MISSING
    """Tokens per sample (and the RoPE table length)."""
    dropout: float = 0.0
    ffn_dim: int | None = None
    """SwiGLU hidden size; None: 8/3 x dim rounded up to a multiple of 64."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


@dataclass
class ClusterConfig:
    """Hardware as data: the launcher reads the first three, the planner all of them."""

    name: str = "local"
    nodes: int = 1
    devices: int = 1
    """Processes per node (one per GPU; on CPU, per core at most unless oversubscribe)."""
    accelerator: str = "auto"
    """auto | cpu | gpu."""
    device_memory_GB: float = 0.0
    """Memory per device, GB = 1e9 bytes (for CPU: the host memory shared by its processes)."""
    peak_tflops: float = 0.0
    """Dense bf16 peak per device, TFLOP/s."""
    intra_node_GBps: float = 0.0
    """Per-device bandwidth to devices on the same node, GB/s."""
    inter_node_GBps: float = 0.0
    """Per-device bandwidth to other nodes, GB/s."""
    host_memory_GB: float = 0.0
    nvme_GB: float = 0.0
    oversubscribe: bool = False
    """Allow more CPU processes than cores (tests of 4-rank meshes on a 2-core machine)."""


@dataclass
class TrainerConfig:
    max_steps: int = 50
    """Optimizer steps."""
    global_batch_size: int = 16
    """Samples per optimizer step across all ranks (= micro x dp x accumulation)."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank."""
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps (then constant)."""
    precision: str = "32"
    """32 | bf16-mixed | 16-mixed."""
    seed: int = 1234
    grad_clip: float = 0.0
    """Clip the global gradient norm to this value; 0 disables."""
    log_every: int = 1
    """Log the loss every N optimizer steps."""
    export_params: bool = False
    """Write the final full parameters to params.pt (rank 0), for comparison and export."""
    checkpoint_every: int = 0
    """Save a checkpoint every N optimizer steps into <output>/checkpoints; 0 disables."""
    resume_from: str | None = None
    """A checkpoint path written by checkpoint_every, to continue training from."""


@dataclass
class DataConfig:
    name: str = "text"
    """text (the bundled corpus, byte tokens) | synthetic (random tokens, for benchmarks)."""
    path: str | None = None
    """A UTF-8 text file for name=text; None: the bundled corpus."""
    num_samples: int = 4096
    """Samples in the synthetic dataset."""
    num_workers: int = 0


@dataclass
class BackendConfig:
    name: str = "lightning"
    """lightning (Lightning Trainer)."""


@dataclass
class CallbacksConfig:
    progress_bar: bool = True
    """Lightning's progress bar, with loss and tokens/s."""
    report: bool = True
    """Write report.json at the end of the run."""
    memory: bool = True
    """Measure the bytes each rank holds (params, grads, optimizer) into the report."""


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    output_dir: str = MISSING


@dataclass
class PlannerConfig:
    """plan.py and the pre-launch check of train.py."""

    format: str = "table"
    """table | json."""
    accounting: str = "actual"
    """actual (what the preset allocates) | mixed16 (16 B/param) | mixed20 (20 B/param)."""
    params: float | None = None
    """Plan model states of this many parameters, without a model shape (no activations);
    a float so that ``planner.params=1e10`` works."""
    trainable: float | None = None
    """Parameters that train (LoRA-style adapters); the rest are frozen and hold no gradient or
    optimizer state. None: all parameters train."""
    tp: int = 1
    """Tensor-parallel degree for planned-only layouts."""
    pp: int = 1
    """Pipeline-parallel degree for planned-only layouts."""
    microbatches: int | None = None
    """Pipeline micro-batches per step; None: the accumulation steps (at least pp)."""
    mfu: float = 0.4
    """Assumed model-FLOPs utilisation for compute time."""
    enforce: bool = True
    """train.py refuses to launch a run predicted not to fit."""
    activation_checkpointing: bool | None = None
    """Plan with (true) or without (false) activation checkpointing; None: each preset's own."""
    sequence_parallel: bool = True
    """Planned-only TP layouts shard the non-TP activations too (Megatron sequence parallel)."""
    flash_attention: bool = True
    """Attention kernels that store no (seq x seq) scores (SDPA flash / memory-efficient)."""
    host_link_GBps: float = 25.0
    """Per-device host<->device bandwidth for CPU offload, GB/s (PCIe 4 x16)."""
    nvme_GBps: float = 3.0
    """Per-device NVMe bandwidth share for NVMe offload, GB/s."""


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    strategy: Any = MISSING
    cluster: ClusterConfig = MISSING
    backend: BackendConfig = MISSING
    data: DataConfig = MISSING
    trainer: TrainerConfig = MISSING
    callbacks: CallbacksConfig = MISSING
    logger: Any = None
    experiment: Any = None
    paths: PathsConfig = MISSING
    planner: PlannerConfig = field(default_factory=PlannerConfig)


def _store() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, node in [("model", ModelConfig), ("cluster", ClusterConfig),
                        ("trainer", TrainerConfig), ("data", DataConfig),
                        ("backend", BackendConfig), ("callbacks", CallbacksConfig),
                        ("paths", PathsConfig), ("planner", PlannerConfig)]:
        cs.store(group=group, name=f"{group}_schema", node=node)


_store()


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Compose ``conf/train.yaml`` with CLI-style overrides, as train.py would, without running."""
    import hydra

    import strategies  # noqa: F401  (family schemas)
    from strategies.presets import hydra_context

    with hydra_context():
        return hydra.compose(config_name="train", overrides=list(overrides))
