"""The plugin contract: a strategy family is a typed config with builders.

A family is a dataclass subclassing ``StrategyConfig`` and decorated with ``@family("name")``.
It is stored in Hydra's ConfigStore as ``strategy/<name>_schema`` so each preset YAML in
``conf/strategy/`` starts with ``defaults: [<name>_schema, _self_]`` and a typo in a key fails at
compose time. The family answers four questions, each in one method:

- ``problems(world, run)``: every config problem, collected, before any process starts;
- ``layout(world)``: what each rank holds (the planner and the profile callbacks read it);
- ``lightning(world, run)``: the Lightning ``Strategy`` object (or a registry name);
- ``full_state_dict(trainer)``: full, unsharded parameters for export and comparison.

The Accelerate builder is a later seam (``accelerate``).
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
    master_weights: bool = False
    """The engine keeps its own fp32 copy of the parameters for the optimizer (DeepSpeed), sharded
    like the optimizer state, beside the working parameters (even in fp32 runs)."""


@dataclass(frozen=True)
class Run:
    """What builders need to know about the run besides the world (resolved, plain values)."""

    accelerator: str = "cpu"
    """cpu | gpu, after resolving ``auto``."""
    precision: str = "32"
    """Lightning precision flag: 32 | bf16-mixed | 16-mixed."""
    block_cls: type | None = None
    """The model's repeated block (wrap policies, activation checkpointing)."""
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

    def __post_init__(self) -> None:
        if self.family == "?":
            self.family = self.FAMILY

    def problems(self, world: World, run: Run) -> list[str]:
        """Every problem with this preset on this world, as sentences naming key, value and fix."""
        return []

    def layout(self, world: World) -> Layout:
        return Layout()

    def lightning(self, world: World, run: Run) -> Any:
        """The Lightning ``Strategy`` (object or registry name) for ``trainer.strategy``."""
        raise NotImplementedError(f"strategy family {self.family!r} has no Lightning builder")

    def accelerate(self, world: World, run: Run) -> Any:
        """Accelerate plugins/kwargs: the seam for the Accelerate backend."""
        raise NotImplementedError(f"strategy family {self.family!r} has no Accelerate builder yet")

    def parallelize(self, model: torch.nn.Module, device_mesh: Any, *, world: World | None = None,
                    run: Run | None = None) -> torch.nn.Module:
        """Applied to the freshly built model inside ``configure_model``, in the fixed order
        TP -> activation checkpointing -> compile -> FSDP. The default does only checkpointing."""
        if self.activation_checkpointing:
            checkpoint_blocks(model)
        return model

    def optimizer(self, params: Any, *, lr: float, betas: tuple[float, float], eps: float,
                  weight_decay: float) -> Any:
        """The AdamW the run trains with; a family whose engine needs its own AdamW overrides."""
        import torch

        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def held_bytes(self, trainer: Any, what: str) -> int:
        """Bytes of ``what`` (params | grads | optimizer) this rank really holds right now,
        counted from the live objects (local shards only). Families whose engine keeps state
        outside ``parameters()``/``optimizer.state`` (DeepSpeed) override this."""
        from strategies.memory import held_bytes

        return held_bytes(trainer, what)

    def full_state_dict(self, trainer: Any) -> dict[str, torch.Tensor]:
        """The model's full (unsharded) parameters, fp32 on CPU, keyed as in the plain model.
        Called on every rank after fit (gathering may be collective)."""
        model = trainer.lightning_module.model
        return {plain_key(k): v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Recompute each of the model's blocks (``model.block_cls``) in backward (torch's wrapper)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, model.block_cls))


def plain_key(key: str) -> str:
    """A state-dict key as the plain model names it (wrappers' prefixes removed)."""
    return key.replace(CHECKPOINT_PREFIX, "")


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

        ConfigStore.instance().store(group="strategy", name=f"{name}_schema", node=cls(family=name))
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
