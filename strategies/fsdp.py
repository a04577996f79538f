"""FSDP1: torch ``FullyShardedDataParallel`` (flat parameters) through Lightning's FSDPStrategy.

Presets: ``fsdp`` (FULL_SHARD), ``fsdp_grad_op`` (SHARD_GRAD_OP), ``fsdp_hybrid`` (HYBRID_SHARD:
shard inside a group, replicate across groups), ``fsdp_offload`` (CPUOffload; GPU only).
Each transformer block (the model's declared ``block_cls``) is its own FSDP unit; the
LightningModule is the root unit (embeddings, final norm, output). Mixed precision follows
``trainer.precision``.

Lightning's ``FSDPStrategy`` assumes CUDA in four places; ``CPUCapableFSDPStrategy`` below is the
one place that works around them (no torch or Lightning globals are patched). It also resolves
what the preset leaves to the run: the hybrid mesh from the world Lightning sets up, and the
wrap and checkpointing policies from the model's block class.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from strategies.base import CPU, SHARDED, Layout, Run, StrategyConfig, family, find_model, plain_state_dict
from strategies.checks import knob
from strategies.mesh import World

SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "none")
STATE_DICT_TYPES = ("sharded", "full")


@family("fsdp")
@dataclass
class FSDPConfig(StrategyConfig):
    """torch FSDP1 (FullyShardedDataParallel) through Lightning's FSDPStrategy."""

    sharding_strategy: str = knob("FULL_SHARD", choices=SHARDING,
                                  fix="set strategy.sharding_strategy to one of FULL_SHARD, "
                                      "SHARD_GRAD_OP, HYBRID_SHARD (NO_SHARD is strategy=ddp)")
    """FULL_SHARD (ZeRO-3) | SHARD_GRAD_OP (ZeRO-2: params stay gathered from forward to backward)
    | HYBRID_SHARD (FULL_SHARD inside a shard group, replicated across groups)."""
    shard_group_size: int | None = knob(None, min=1)
    """HYBRID_SHARD only: ranks per shard group (>= 2, divides the world); None: cluster.devices."""
    offload_params: bool = False
    """CPUOffload: parameter shards and gradients live on the host; the optimizer steps there (GPU only)."""
    use_orig_params: bool = True
    """Expose the original parameters (views into the flat parameters) to the optimizer."""
    auto_wrap: bool = True
    """Make each transformer block (the model's block_cls) its own FSDP unit; false: one unit."""
    backward_prefetch: str = knob("BACKWARD_PRE", choices=PREFETCH)
    """All-gather the next unit's params during backward: BACKWARD_PRE | BACKWARD_POST | none."""
    forward_prefetch: bool = False
    """Issue the next unit's all-gather before the current forward finishes."""
    limit_all_gathers: bool = True
    """Rate-limit all-gathers so at most two units are unsharded at once (bounds peak memory)."""
    state_dict_type: str = knob("sharded", choices=STATE_DICT_TYPES)
    """Checkpoint format: sharded (a directory, one DCP shard per rank) | full (one file; GPU only)."""

    # ------------------------------------------------------------------ validation
    def problems(self, world: World, run: Run) -> list[str]:
        out = []
        if self.state_dict_type == "full" and run.accelerator == "cpu":
            out.append("strategy.state_dict_type=full: gathering a full FSDP1 state dict crashes rank 0 "
                       "on CPU (gloo); allowed on CPU: sharded. Set strategy.state_dict_type=sharded")
        if self.sharding_strategy == "HYBRID_SHARD":
            out += _hybrid_problems(self.shard_group_size, world)
        elif self.shard_group_size is not None:
            out.append(f"strategy.shard_group_size={self.shard_group_size} only applies to "
                       f"sharding_strategy=HYBRID_SHARD, not {self.sharding_strategy}: remove it, "
                       "or use strategy=fsdp_hybrid")
        if self.offload_params:
            if run.accelerator == "cpu":
                out.append("strategy.offload_params=true is GPU only: FSDP1 CPUOffload pins host memory "
                           "and synchronizes device streams, which do not exist without an accelerator "
                           "(and on CPU the parameters already live in host memory). Use strategy=fsdp "
                           "on CPU, or cluster.accelerator=gpu")
            if self.use_orig_params:
                out.append("strategy.offload_params=true with strategy.use_orig_params=true trains "
                           "silently wrong in FSDP1: set strategy.use_orig_params=false")
            if self.state_dict_type == "full":
                out.append("strategy.offload_params=true with strategy.state_dict_type=full fails "
                           "(full state dict with offload_to_cpu): set strategy.state_dict_type=sharded")
        if world.tp * world.pp != 1:
            out.append(f"strategy={self.name} is data parallel only: tp={world.tp}, pp={world.pp}; "
                       "use a tensor/pipeline-parallel strategy")
        return out

    def shard_size(self, world: World) -> int:
        """Ranks one parameter is split over."""
        if self.sharding_strategy == "HYBRID_SHARD":
            return self.shard_group_size or world.devices
        return world.size

    # ------------------------------------------------------------------ layout
    def layout(self, world: World) -> Layout:
        hybrid = self.sharding_strategy == "HYBRID_SHARD"
        offload = CPU if self.offload_params else "device"
        return Layout(
            params=SHARDED, grads=SHARDED, optimizer=SHARDED,
            shard_group=self.shard_size(world) if hybrid else None,
            # CPUOffload moves parameter shards AND gradients to the host; the step runs there.
            params_offload=offload, optimizer_offload=offload,
            reshard_after_forward=self.sharding_strategy != "SHARD_GRAD_OP",
            backward_regather="blocks",  # the root unit is not resharded after forward
        )

    def mesh_shape(self, world: World) -> tuple[int, int] | None:
        """HYBRID_SHARD's (replicate, shard) device mesh on ``world``; None otherwise."""
        if self.sharding_strategy != "HYBRID_SHARD":
            return None
        shard = self.shard_size(world)
        return (world.size // shard, shard)

    # ------------------------------------------------------------------ builders
    def lightning(self, run: Run | None = None) -> Any:
        return strategy_class()(self)

    def accelerate(self, world: World, run: Run, block_cls: type | None = None) -> dict[str, Any]:
        from accelerate.utils import FullyShardedDataParallelPlugin

        return {"fsdp_plugin": FullyShardedDataParallelPlugin(
            fsdp_version=1, sharding_strategy=self.sharding_strategy,
            backward_prefetch=None if self.backward_prefetch == "none" else self.backward_prefetch,
            forward_prefetch=self.forward_prefetch, limit_all_gathers=self.limit_all_gathers,
            use_orig_params=self.use_orig_params, cpu_offload=self.offload_params,
            state_dict_type="SHARDED_STATE_DICT" if self.state_dict_type == "sharded" else "FULL_STATE_DICT",
            activation_checkpointing=self.activation_checkpointing,
            **_accelerate_wrap(self.auto_wrap, block_cls),
            # the module is built identically on every rank (the seed alone decides its weights),
            # so there is nothing to broadcast -- and the broadcast wants a CUDA-like device
            sync_module_states=False, cpu_ram_efficient_loading=False)}

    def accelerate_problems(self, world: World, run: Run) -> list[str]:
        if self.sharding_strategy == "HYBRID_SHARD":
            return [f"strategy={self.name} (HYBRID_SHARD) is not supported by backend=accelerate: "
                    "Accelerate builds FSDP1 without a device mesh, and HYBRID_SHARD then derives its "
                    "shard group from the GPUs per node (on CPU, none: it trains silently wrong); "
                    "backend=lightning runs it"]
        return []

    def full_state_dict(self, root: Any, prefix: str = "") -> dict[str, Any]:
        return gather_full_state_dict(root, prefix=prefix)


def _accelerate_wrap(auto_wrap: bool, block_cls: type | None) -> dict[str, Any]:
    """Accelerate's FSDP plugin wrap policy: one unit per block (shared with FSDP2)."""
    if auto_wrap and block_cls is not None:
        return {"auto_wrap_policy": "transformer_based_wrap",
                "transformer_cls_names_to_wrap": [block_cls.__name__]}
    return {"auto_wrap_policy": "no_wrap"}


def _hybrid_problems(shard_group_size: int | None, world: World) -> list[str]:
    """HYBRID/HSDP shard group checks (shared with strategies/fsdp2.py)."""
    shard = shard_group_size or world.devices
    key = "strategy.shard_group_size" if shard_group_size else "cluster.devices (the default shard group)"
    if shard < 2:
        return [f"{key}={shard}: a hybrid shard group of 1 rank does not shard (and FSDP1 "
                "HYBRID_SHARD trains silently wrong with it); allowed: 2 .. world size "
                f"{world.size}, dividing it. Set strategy.shard_group_size=2 or more, or use strategy=ddp"]
    if world.size % shard:
        divisors = [d for d in range(2, world.size + 1) if world.size % d == 0]
        return [f"{key}={shard} does not divide the world size {world.size} (nodes {world.nodes} x "
                f"devices {world.devices}): replicate x shard must equal the world; allowed shard "
                f"group sizes: {', '.join(map(str, divisors)) or 'none (world size 1)'}"]
    return []


def gather_full_state_dict(root: Any, prefix: str = "") -> dict[str, Any]:
    """Full fp32 CPU tensors of a sharded module, on every rank (collective), keyed as in the plain
    model: ``prefix`` is dropped and wrapper path pieces (FSDP1, activation checkpointing) removed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return plain_state_dict(sd, prefix)


# HYBRID_SHARD's device mesh before the world is known: Lightning requires one at construction;
# ``CPUCapableFSDPStrategy.setup_environment`` replaces it with the real mesh.
_DEFERRED_MESH = ("replicate", "shard")


# ---------------------------------------------------------------------- the CPU workaround
@functools.cache
def strategy_class() -> type:
    """``CPUCapableFSDPStrategy``, built on first use so importing this module stays light."""
    import torch
    from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
    from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
    from lightning.pytorch.strategies import FSDPStrategy

    from strategies.lightning_support import PresetStrategy

    class _RootClippingFSDPPrecision(FSDPPrecision):
        """FSDPPrecision that clips by norm through the root FSDP unit (Lightning refuses, as it has
        no reference to the root) and autocasts on the device type actually in use."""

        root: Any = None

        def clip_grad_by_norm(self, optimizer: Any, clip_val: float | int) -> None:
            if self.root is None:
                return super().clip_grad_by_norm(optimizer, clip_val)
            self.root.clip_grad_norm_(clip_val)  # global norm across all shards

        def forward_context(self):
            if "mixed" in self.precision and self.root is not None:
                device = self.root.compute_device.type
                dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
                return torch.autocast(device, dtype=dtype)
            return super().forward_context()

    class CPUCapableFSDPStrategy(PresetStrategy, FSDPStrategy):
        """Lightning's FSDPStrategy built from a preset, runnable on CPU (gloo) too.

        The CPU workarounds, all here:
        1. the accelerator connector refuses CPU with ``type(s) is FSDPStrategy``: a subclass passes;
        2. the model is wrapped with ``device_id=root_device`` (Lightning passes ``.index``, None on
           CPU, and FSDP1 then tries CUDA);
        3. the hybrid (replicate, shard) mesh is built on the root device's type (Lightning
           hard-codes "cuda");
        4. gradient clipping by norm goes through the root unit's ``clip_grad_norm_``.
        What the preset leaves to the run: the hybrid mesh shape comes from the world Lightning
        sets up (``setup_environment``), the wrap and checkpointing policies from the model's
        declared block class (``_setup_model``).
        """

        def __init__(self, preset: FSDPConfig):
            from torch.distributed.fsdp import BackwardPrefetch, CPUOffload

            hybrid = preset.sharding_strategy == "HYBRID_SHARD"
            super().__init__(
                sharding_strategy=preset.sharding_strategy,
                cpu_offload=CPUOffload(offload_params=preset.offload_params),
                state_dict_type=preset.state_dict_type,
                use_orig_params=preset.use_orig_params,
                backward_prefetch=(None if preset.backward_prefetch == "none"
                                   else BackwardPrefetch[preset.backward_prefetch]),
                forward_prefetch=preset.forward_prefetch,
                limit_all_gathers=preset.limit_all_gathers,
                # HYBRID_SHARD needs a mesh at construction; its shape needs the world: setup.
                **({"device_mesh": _DEFERRED_MESH} if hybrid else {}),
            )
            self.preset = preset

        @property
        def precision_plugin(self) -> FSDPPrecision:
            return FSDPStrategy.precision_plugin.fget(self)

        @precision_plugin.setter
        def precision_plugin(self, plugin: Any) -> None:
            if isinstance(plugin, FSDPPrecision) and not isinstance(plugin, _RootClippingFSDPPrecision):
                plugin = _RootClippingFSDPPrecision(plugin.precision, scaler=plugin.scaler)
            FSDPStrategy.precision_plugin.fset(self, plugin)

        def engine_settings(self) -> dict[str, Any]:
            kwargs = {k: repr(v) for k, v in self.kwargs.items() if k != "device_mesh"}
            return {"sharding_strategy": str(self.sharding_strategy), "kwargs": kwargs,
                    "cpu_offload": repr(self.cpu_offload), "state_dict_type": self._state_dict_type,
                    "mesh_shape": self.preset.mesh_shape(self.world())}

        def setup_environment(self) -> None:
            self.kwargs.pop("device_mesh", None)
            super().setup_environment()
            shape = self.preset.mesh_shape(self.world())
            if shape is not None:
                from torch.distributed.device_mesh import init_device_mesh

                self.kwargs["device_mesh"] = init_device_mesh(
                    self.root_device.type, shape, mesh_dim_names=("replicate", "shard"))

        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            _, block = find_model(model)
            policy = ModuleWrapPolicy({block}) if block is not None else None
            if self.preset.auto_wrap and policy is not None:
                self.kwargs["auto_wrap_policy"] = policy
            if self.preset.activation_checkpointing:
                if policy is None:
                    raise ValueError("strategy.activation_checkpointing=true, but the model "
                                     "declares no block_cls to checkpoint")
                self._activation_checkpointing_kwargs = {"auto_wrap_policy": policy}
            if self.root_device.type != "cpu" or any(
                    isinstance(m, FullyShardedDataParallel) for m in model.modules()):
                model = super()._setup_model(model)
            else:
                model = FullyShardedDataParallel(
                    module=model, cpu_offload=self.cpu_offload,
                    mixed_precision=self.mixed_precision_config,
                    sharding_strategy=self.sharding_strategy,
                    device_id=self.root_device, **self.kwargs)
                _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
            self.precision_plugin.root = model
            return model

        def setup_optimizers(self, trainer: Any) -> None:
            super().setup_optimizers(trainer)
            if not self.kwargs.get("use_orig_params"):
                _check_optimizer_covers(self.model, self.optimizers)

    return CPUCapableFSDPStrategy


def _check_optimizer_covers(model: Any, optimizers: list) -> None:
    """With use_orig_params=False an optimizer built from ``LightningModule.parameters()`` misses
    the root unit's flat parameter (it is registered on the wrapper): refuse instead of training
    those weights never."""
    have = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in have]
    if missing:
        raise RuntimeError(
            f"FSDP use_orig_params=False: the optimizer does not hold {', '.join(missing)}; "
            "configure_optimizers must use self.trainer.model.parameters(), or set "
            "strategy.use_orig_params=true")
