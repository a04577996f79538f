"""What the planner reads: the model through one torch-free description the model recipe
provides, the cluster, trainer and planner config groups as they are (no second copy of their
fields), and each strategy through its ``Footprint`` (strategies/footprint.py).

The planner imports nothing from recipes/: the description is duck-typed (``ModelDescription``);
recipes.config.ModelConfig is the one that exists today.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from planner.machine import Machine
from planner.states import GB, gb
from strategies.base import StrategyConfig
from strategies.footprint import Footprint
from core.mesh import Mesh
from core.run import Run, derive_from


class ModelDescription(Protocol):
    """The model as the planner needs it: shape and exact parameter counts, one source."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    dropout: float

    @property
    def hidden(self) -> int:
        """The MLP's inner size."""

    def num_params(self) -> int: ...

    def buffer_bytes(self) -> int:
        """Bytes of the model's buffers (DDP broadcasts them each step); a description without
        it: 0, nothing priced."""

    def block_params(self) -> int:
        """Parameters of one repeated block (a MoE model's: a MoE block)."""

    def stack_params(self) -> int:
        """Parameters of all the blocks together (a MoE model's dense first blocks at their size)."""

    def largest_block_params(self) -> int:
        """Parameters of the largest block."""

    def embedding_params(self) -> int:
        """Parameters of one vocab x dim matrix."""


class Inputs(Protocol):
    """What the planner reads of a run: a validated ``recipes.job.Job`` (the planner imports
    nothing from recipes/), its groups as typed objects -- never a composed config."""

    model: ModelDescription
    cluster: Any
    """recipes.config.ClusterConfig: ``planned()``, ``hardware()``, the shape and the links."""
    trainer: Any
    """recipes.config.TrainerConfig: the batch and precision."""
    planner: Any
    """recipes.config.PlannerConfig: the planner's options (``enforce`` among them)."""
    preset: StrategyConfig
    """The preset as composed (or as strategy=auto chose it)."""


def unit_params(model: ModelDescription) -> int:
    """The largest FSDP/ZeRO-3 unit: a transformer block (the largest, where they differ) or an
    embedding matrix."""
    return max(model.largest_block_params(), model.embedding_params())


def rows_per_sample(job: Any) -> int:
    """Sequences the model reads per sample: 2 under objective=dpo (a preference pair), else 1;
    the planner prices rows (activations, compute, tokens per step)."""
    objective = getattr(job, "objective", None)
    return 2 if getattr(objective, "name", "lm") == "dpo" else 1


@dataclass(frozen=True)
class Setup:
    """Everything but the layout: the cluster, trainer and planner groups and the model."""

    cluster: Any
    """recipes.config.ClusterConfig: nodes, devices, device_bytes(), bandwidths, memory."""
    trainer: Any
    """recipes.config.TrainerConfig: global/micro batch and precision."""
    options: Any
    """recipes.config.PlannerConfig."""
    model: ModelDescription
    machine: Machine | None = None
    """This machine as measured (``planner.calibrate=true`` on ``cluster=local``), else None."""
    hardware: str | None = None
    """What ``cluster.accelerator=auto`` found on this machine (its GPUs), for the assumptions."""
    reference: bool = False
    """objective=dpo: each rank first runs the training pairs through the whole fp32 reference
    model (recipes/dpo.py ``reference_logps``)."""
    backend: str = "lightning"
    """The job's backend: whether a preset builds the model whole on every rank first
    (``Capabilities.sharded_build``)."""
    layout_problems: Any = None
    """What the job's other groups ask of a preset, ``(preset, run) -> problems`` (LoRA,
    packing, DPO, callbacks.samples: ``recipes.job.Job.layout_problems``); None: nothing."""

    @classmethod
    def of(cls, job: Inputs, model: ModelDescription | None = None) -> Setup:
        """From a validated job's typed groups (``recipes.job.Job``) and the model's description
        (``model``: another description than the job's own, else ``job.model``)."""
        from planner import machine

        cluster, trainer, pairs = job.cluster, job.trainer, rows_per_sample(job) > 1
        if pairs:  # objective=dpo: a sample is a (chosen, rejected) pair of rows
            import dataclasses

            trainer = dataclasses.replace(trainer, micro_batch_size=2 * trainer.micro_batch_size,
                                          global_batch_size=2 * trainer.global_batch_size)
        hardware = cluster.hardware()  # accelerator=auto: this machine's GPUs (nvidia-smi, no torch)
        cluster = cluster.planned()
        measured = machine.load(cluster, trainer.precision) if machine.applies(job) else None
        su = cls(cluster, trainer, job.planner, job.model if model is None else model, measured, hardware,
                 pairs, getattr(job, "backend", "lightning"), getattr(job, "layout_problems", None))
        if problems := su.problems():
            from core.errors import ConfigError

            raise ConfigError(problems)
        return su

    def problems(self) -> list[str]:
        """What the planner's inputs contradict (each field's own range is checked at compose)."""
        out, o = [], self.options
        if o.trainable is not None and int(o.trainable) > self.params:
            out.append(f"planner.trainable={int(o.trainable):,} exceeds the model's {self.params:,} "
                       "parameters: set it to at most the parameter count (LoRA adapters: their "
                       "own count), or null for all")
        shape = self.model
        for key, value in (("planner.tp", o.tp), ("planner.pp", o.pp)):
            if value is None or value <= 1 or shape is None:
                continue
            if key == "planner.tp" and (shape.n_heads % value or shape.n_kv_heads % value):
                out.append(f"planner.tp={value} must divide model.n_heads={shape.n_heads} and "
                           f"model.n_kv_heads={shape.n_kv_heads} (tensor parallelism splits heads): "
                           "choose a divisor of both")
            if key == "planner.pp" and value > shape.n_layers:
                out.append(f"planner.pp={value} exceeds model.n_layers={shape.n_layers}: every "
                           "pipeline stage needs a block")
        return out

    @property
    def shape(self) -> ModelDescription | None:
        """The model's shape, or None when ``planner.params`` plans model states alone."""
        return None if self.options.params is not None else self.model

    @property
    def params(self) -> int:
        if self.options.params is not None:
            return int(self.options.params)
        lora = getattr(self.model, "lora_params", None)  # adapters are parameters too
        return self.model.num_params() + (lora() if lora else 0)

    @property
    def trainable(self) -> int | None:
        """``planner.trainable``, else the model's LoRA adapters (model.lora.rank), else None:
        every parameter trains."""
        t = self.options.trainable
        if t is None and self.options.params is None and getattr(self.model, "lora", None) is not None:
            return self.model.lora_params() or None
        return None if t is None else int(t)

    @property
    def seq_len(self) -> int:
        return self.model.seq_len

    @property
    def world_size(self) -> int:
        return self.cluster.nodes * self.cluster.devices

    def link_GBps(self, group: str, op: str | None = None) -> float:
        """Per-device bandwidth of a link: intra | inter (node), host (PCIe) or nvme; inside a
        calibrated machine, what ``op`` measured."""
        c, o = self.cluster, self.options
        if group == "intra" and self.machine is not None and (got := self.machine.link(op or "all_reduce")):
            return got[0]
        if group == "host" and self.machine is not None and self.machine.host_copy_GBps:
            return self.machine.host_copy_GBps  # (the measured host<->device copy)
        return {"intra": c.intra_node_GBps, "inter": c.inter_node_GBps,
                "host": o.host_link_GBps, "nvme": o.nvme_GBps}[group]

    def latency_seconds(self, group: str, op: str) -> float:
        """One step of a collective of kind ``op`` over ``group`` (the alpha of alpha-beta)."""
        if group == "intra" and self.machine is not None and (got := self.machine.link(op)):
            return got[1]
        o = self.options
        return {"intra": getattr(o, "intra_latency_us", 0.0),
                "inter": getattr(o, "inter_latency_us", 0.0)}.get(group, 0.0) * 1e-6

    @property
    def host_bytes(self) -> int:
        """Host memory per node: host_memory_GB, or the launcher's limit when lower."""
        return int(self.cluster.host_limit()[0] * GB)

    def host_has(self, shown: str | None = None) -> str:
        """What a host-memory note says the node has (``shown``: those bytes as formatted
        beside a need), and the key behind a launcher's limit."""
        key = self.cluster.host_limit()[1]
        return (shown or gb(self.host_bytes)) + ("" if key == "cluster.host_memory_GB" else f" ({key})")

    @property
    def nvme_bytes(self) -> int:
        return int(self.cluster.nvme_GB * GB)


@dataclass(frozen=True)
class Candidate:
    """A layout to plan: a preset of conf/strategy/ (at the degrees the planner chose for it), or a
    planned-only layout (``capabilities.planned_only``)."""

    name: str
    config: StrategyConfig
    description: str = ""

    @property
    def planned_only(self) -> bool:
        return self.config.capabilities.planned_only

    @property
    def footprint(self) -> Footprint:
        return self.config.footprint()

    def run(self, su: Setup) -> Run:
        """The run's facts on this setup (the one derivation train.py uses too)."""
        return derive_from(self.config, su.cluster, su.trainer)

    def rung(self, mesh: Mesh) -> int:
        """The deep-dive's ladder: replicate, shard, TP or a sequence degree inside a node, PP
        across, offload."""
        fp = self.footprint
        if fp.offloaded:
            return 4
        if mesh.pp > 1:
            return 3
        if mesh.tp > 1 or mesh.seq > 1:  # a sequence degree (cp, Ulysses) is model parallelism
            return 2                    # too: taken when sharding alone does not fit (long sequences)
        return int(fp.sharded)


def candidate(preset: StrategyConfig) -> Candidate:
    """A preset's typed config (``strategies.load(name)``) as a planner candidate."""
    return Candidate(name=preset.name, config=preset, description=f"{preset.family} preset")
