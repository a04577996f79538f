"""The plugin contract: a strategy family is a typed config with builders.

A family is a dataclass subclassing ``StrategyConfig`` and decorated with ``@family("name")``.
Its schema is stored in Hydra's ConfigStore as ``<name>_schema`` (at the root, so ``--help``
lists only presets), so each preset YAML in ``conf/strategy/`` starts with
``defaults: [/<name>_schema@_here_, _self_]`` and a typo in a key fails at compose time. Fields
declare their allowed values with ``knob`` (strategies/checks.py). The family answers, each in
one method:

- ``problems(world, run)``: every problem that involves more than one field, collected;
- ``layout(world)``: what each rank holds (the planner and the observers read it);
- ``lightning(run)``: the Lightning ``Strategy``; it learns the world from Lightning at setup,
  so ``Trainer(strategy="<preset>")`` builds exactly what train.py builds;
- ``parallelize(module, mesh)``: parallelism applied from outside to the plain model;
- ``accelerate(world, run, block_cls)``: the same preset as ``accelerate.Accelerator`` arguments;
- ``held_bytes(model, optimizers, what)`` and ``full_state_dict(root)``: measurement and export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from strategies.mesh import World

# Where a state lives, and over how many ranks it is split.
REPLICATED, SHARDED = "replicated", "sharded"
DEVICE, CPU, NVME = "device", "cpu", "nvme"


@dataclass(frozen=True)
class Layout:
    """What one rank holds under a preset, as data. Sizes come from the model, not from here."""

    params: str = REPLICATED
    """replicated | sharded (ZeRO-3 / FULL_SHARD / fully_shard)."""
    grads: str = REPLICATED
    """replicated | sharded (ZeRO-2 and up)."""
    optimizer: str = REPLICATED
    """replicated | sharded (ZeRO-1 and up): fp32 master weights and moments."""
    shard_group: int | None = None
    """Ranks a sharded state is split over; None means the whole data-parallel group.
    HYBRID/HSDP shard inside this group and replicate across groups."""
    params_offload: str = DEVICE
    """device | cpu | nvme: where the parameter shards live between uses."""
    optimizer_offload: str = DEVICE
    """device | cpu | nvme: where optimizer state (and the step) lives."""
    grad_bytes_ratio: float = 1.0
    """Communicated gradient bytes relative to the gradient dtype (fp16 hook on fp32: 0.5)."""
    reshard_after_forward: bool = True
    """ZeRO-3/FULL_SHARD free gathered params after forward (False: SHARD_GRAD_OP-like)."""
    backward_regather: str = "all"
    """With reshard_after_forward, what is gathered again for backward: all | blocks (FSDP:
    the root unit -- embeddings, final norm, head -- stays gathered) | over_live (DeepSpeed
    ZeRO-3: only what exceeds ``live_params`` is released and gathered again)."""
    live_params: int = 0
    """over_live: parameters DeepSpeed keeps gathered (stage3_max_live_parameters)."""
    grad_all_reduce: bool = False
    """Sharded gradients come from an all-reduce of full buckets, each rank keeping its part
    (DeepSpeed ZeRO-1/2), not from a reduce-scatter."""
    grad_bucket_copy: bool = False
    """DDP without gradient_as_bucket_view: its buckets hold a second copy of the gradients."""
    grad_error_feedback: bool = False
    """PowerSGD keeps an error-feedback buffer the size of the gradients (fp32)."""
    reduce_fp32: bool | None = None
    """Gradients are reduced in fp32 whatever the precision (FSDP2's reduce_dtype); None: the
    precision's usual reduce dtype."""
    master_weights: bool = False
    """The engine keeps its own fp32 copy of the parameters for the optimizer (DeepSpeed), sharded
    like the optimizer state, beside the working parameters (even in fp32 runs)."""
    grads_partitioned_at_step: bool = False
    """Full gradients accumulate through backward and are reduced at the accumulation boundary
    into this rank's partition, the full ones freed before the step (DeepSpeed ZeRO-1): the
    held gradient state is the partition, the full gradients a backward-phase transient."""
    offload_grad_buffer: bool = False
    """With the optimizer offloaded, the reduced gradient partition stays in a host buffer in the
    gradient dtype beside the fp32 gradient the host optimizer steps (DeepSpeed ZeRO-3)."""
    reduce_bucket: int = 0
    """Elements of each of the engine's own gradient-reduction buffers, allocated at that size
    whatever the model (DeepSpeed reduce_bucket_size with contiguous_gradients); 0: DDP-style
    buckets of ``bucket_cap_mb``."""
    reduce_buckets: int = 2
    """How many such buffers exist (DeepSpeed ZeRO-1/2: 2 with overlap_comm, else 1; ZeRO-3: 1)."""
    prefetch: int = 0
    """Parameter elements gathered ahead of use beside the current unit (DeepSpeed ZeRO-3's
    stage3_prefetch_bucket_size); 0: one unit (FSDP's prefetch)."""
    compression_rank: int = 0
    """PowerSGD: the rank of the factors sent instead of each gradient matrix (0: none)."""
    compression_warmup: int = 0
    """PowerSGD: optimizer steps of plain all-reduce before compression starts."""


@dataclass(frozen=True)
class Run:
    """What builders need to know about the run besides the world (resolved, plain values)."""

    accelerator: str = "cpu"
    """cpu | gpu, after resolving ``auto``."""
    precision: str = "32"
    """32 | bf16-mixed | 16-mixed."""
    micro_batch_size: int = 1
    accumulation: int = 1
    grad_clip: float = 0.0


@dataclass
class StrategyConfig:
    """Keys every strategy preset has. Families subclass this and add their own."""

    name: str = "?"
    """The preset's name: the YAML file's stem under conf/strategy/."""
    family: str = "?"
    """The plugin that builds this preset (set by the family's schema, not by users)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward instead of storing its activations."""

    FAMILY: ClassVar[str] = "?"
    CHECKPOINT: ClassVar[str] = "dcp"
    """How this family's engine writes model and optimizer: dcp (torch distributed checkpoint,
    which reshards to any torch preset and world size) | deepspeed (DeepSpeed's own)."""

    def __post_init__(self) -> None:
        if self.family == "?":
            self.family = self.FAMILY

    def problems(self, world: World, run: Run) -> list[str]:
        """Every problem with this preset on this world, as sentences naming key, value and fix."""
        return []

    def model_problems(self, model: Any) -> list[str]:
        """Problems of this preset with the model's shape (``recipes.config.ModelConfig``)."""
        return []

    def chunks(self) -> int:
        """Micro-batches one engine step's batch is cut into inside the strategy (a pipeline's
        micro-batches); the data loader serves trainer.micro_batch_size x this."""
        return 1

    def layout(self, world: World) -> Layout:
        return Layout()

    def world_role(self, world: World) -> str:
        """What the whole-world process group carries under this preset (the communication
        profile names groups by role): data-shard when it shards, else data-replicate."""
        lay = self.layout(world)
        return "data-shard" if SHARDED in (lay.params, lay.grads, lay.optimizer) else "data-replicate"

    def lightning(self, run: Run | None = None) -> Any:
        """The Lightning ``Strategy`` for this preset. It takes the world (nodes, devices), the
        precision and the model's block class from Lightning and the module at setup, so the
        same call serves train.py and Lightning's registry. ``run``: when the caller knows it
        (train.py), for engines that fix their device when first imported (DeepSpeed)."""
        raise NotImplementedError(f"strategy family {self.family!r} has no Lightning builder")

    def accelerate(self, world: World, run: Run, block_cls: type | None = None) -> dict[str, Any]:
        """Keyword arguments for ``accelerate.Accelerator`` that make it run this preset (plugins,
        kwargs handlers); ``block_cls``: the model's repeated block (wrap policies). Empty: plain
        data parallel (DDP) or one process."""
        return {}

    def model_context(self, accelerate_kwargs: dict[str, Any]) -> Any:
        """The context to build the model in, under the Accelerate backend (DeepSpeed ZeRO-3
        partitions parameters as they are created: ``zero.Init``). Lightning's strategies have
        their own (``model_sharded_context``)."""
        import contextlib

        return contextlib.nullcontext()

    def accelerate_problems(self, world: World, run: Run) -> list[str]:
        """Why this preset cannot run on the Accelerate backend here (empty: it can)."""
        return []

    def repair(self, model: Any, optimizer: Any) -> None:
        """Fix-ups the engine needs once it is built (whichever backend built it)."""

    def parallelize(self, module: torch.nn.Module, mesh: Any = None, *,
                    precision: str = "32") -> torch.nn.Module:
        """Apply this preset's parallelism to the plain model inside ``module``, in the fixed
        order TP -> activation checkpointing -> compile -> FSDP. The default does only
        checkpointing; engines that wrap the model themselves (DDP, FSDP1, DeepSpeed) wrap after."""
        if self.activation_checkpointing:
            checkpoint_blocks(module)
        return module

    def held_bytes(self, model: Any, optimizers: list[Any], what: str) -> int:
        """Bytes of ``what`` (params | grads | optimizer) this rank really holds right now,
        counted from the live objects (local shards only): ``model`` as the engine wrapped it,
        ``optimizers`` as the engine steps them. Families whose engine keeps state outside
        ``parameters()``/``optimizer.state`` (DeepSpeed) override this."""
        from strategies.memory import held_bytes

        return held_bytes(model, optimizers, what)

    def full_state_dict(self, root: Any, prefix: str = "") -> dict[str, torch.Tensor]:
        """The model's full (unsharded) parameters, fp32 on CPU, keyed as in the plain model:
        ``root`` is the module the engine wrapped, ``prefix`` where the plain model sits in it.
        Called on every rank after fit (gathering may be collective)."""
        return plain_state_dict(unwrap(root).state_dict(), prefix)


# Module-path pieces that wrappers insert; the plain model's state_dict has none of them.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def find_model(module: torch.nn.Module) -> tuple[torch.nn.Module, type | None]:
    """The model inside ``module`` that declares its repeated block (``block_cls``, as
    recipes/gpt.py does), and that class; ``(module, None)`` when nothing declares one (a user's
    own module): strategies then treat the module as one unit."""
    for m in module.modules():
        block = getattr(type(m), "block_cls", None)
        if isinstance(block, type):
            return m, block
    return module, None


def checkpoint_blocks(module: torch.nn.Module) -> None:
    """Recompute each block of the model inside ``module`` in backward (torch's wrapper)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    _, block = find_model(module)
    if block is None:
        raise ValueError("strategy.activation_checkpointing=true, but the model declares no "
                         "block_cls to checkpoint: set block_cls on the model class")
    apply_activation_checkpointing(module, check_fn=lambda m: isinstance(m, block))


def materialize(module: torch.nn.Module, device: Any) -> None:
    """After sharding a model built on the meta device: give its meta parameters real (local,
    sharded) storage on ``device``, keep every tensor that was real already (LoRA adapters,
    buffers), then let the model load its weights into the shards (a module with
    ``pending_weights`` set has ``load_pretrained``, as recipes/hf.py's models do)."""
    import torch

    tensors = lambda: [*module.named_parameters(), *module.named_buffers()]  # noqa: E731
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    if not any(t.is_meta for _, t in tensors()):
        return
    with torch.no_grad():
        keep = {n: local(t).detach().clone() for n, t in tensors() if not t.is_meta}
        module.to_empty(device=device)
        for n, t in tensors():
            if n in keep:
                local(t).copy_(keep[n])
    for m in module.modules():
        if getattr(m, "pending_weights", False):
            m.load_pretrained()


def unwrap(root: Any) -> Any:
    """The module inside engine wrappers that only hold it (DDP's and DeepSpeed's ``.module``)."""
    while type(root).__name__ in ("DistributedDataParallel", "DeepSpeedEngine"):
        root = root.module
    return root


def plain_state_dict(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Full fp32 CPU copies keyed as the plain model: wrapper pieces and ``prefix`` removed,
    keys outside ``prefix`` dropped."""
    out = {}
    for k, v in state.items():
        k = plain_key(k)
        if k.startswith(prefix):
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k[len(prefix):]] = full.detach().float().cpu().clone()
    return out


def plain_key(key: str) -> str:
    """A state-dict key as the plain model names it (wrappers' path pieces removed)."""
    for piece in WRAPPER_PREFIXES:
        key = key.replace(piece, "")
    return key


_FAMILIES: dict[str, type[StrategyConfig]] = {}


def family(name: str):
    """Class decorator: register a strategy family under ``name`` and store its schema in Hydra."""

    def register(cls: type[StrategyConfig]) -> type[StrategyConfig]:
        if name in _FAMILIES and _FAMILIES[name] is not cls:
            raise ValueError(f"strategy family {name!r} is registered twice "
                             f"({_FAMILIES[name].__module__} and {cls.__module__}); rename one")
        cls.FAMILY = name
        _FAMILIES[name] = cls
        from hydra.core.config_store import ConfigStore

        ConfigStore.instance().store(name=f"{name}_schema", node=cls(family=name))
        return cls

    return register


def families() -> dict[str, type[StrategyConfig]]:
    return dict(_FAMILIES)


def family_of(name: str) -> type[StrategyConfig]:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"strategy.family={name!r} is unknown; known families: "
                       f"{', '.join(sorted(_FAMILIES))}") from None


def as_config(node: Any) -> StrategyConfig:
    """Turn a composed ``cfg.strategy`` node into its family's dataclass (plain Python values)."""
    from omegaconf import OmegaConf

    if isinstance(node, StrategyConfig):
        return node
    obj = OmegaConf.to_object(node) if OmegaConf.is_config(node) else node
    if isinstance(obj, StrategyConfig):
        return obj
    cls = family_of(obj["family"])
    return cls(**obj)


__all__ = ["Layout", "Run", "StrategyConfig", "family", "families", "family_of", "as_config",
           "REPLICATED", "SHARDED", "DEVICE", "CPU", "NVME"]
