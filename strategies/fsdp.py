"""FSDP1: torch ``FullyShardedDataParallel`` (flat parameters) through Lightning's FSDPStrategy.

Presets: ``fsdp`` (FULL_SHARD), ``fsdp_grad_op`` (SHARD_GRAD_OP), ``fsdp_hybrid`` (HYBRID_SHARD:
shard inside a group, replicate across groups), ``fsdp_offload`` (CPUOffload; GPU only).
Each transformer block (``GPT.block_cls``) is its own FSDP unit; the LightningModule is the root
unit (embeddings, final norm, output). Mixed precision follows ``trainer.precision``.

Lightning's ``FSDPStrategy`` assumes CUDA in four places; ``CPUCapableFSDPStrategy`` below is the
one place that works around them (no torch or Lightning globals are patched).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from strategies.base import CPU, SHARDED, Layout, Run, StrategyConfig, family
from strategies.mesh import World

SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "none")
STATE_DICT_TYPES = ("sharded", "full")
# Module-path pieces that wrappers insert; the plain model's state_dict has none of them.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


@family("fsdp")
@dataclass
class FSDPConfig(StrategyConfig):
    """torch FSDP1 (FullyShardedDataParallel) through Lightning's FSDPStrategy."""

    sharding_strategy: str = "FULL_SHARD"
    """FULL_SHARD (ZeRO-3) | SHARD_GRAD_OP (ZeRO-2: params stay gathered from forward to backward)
    | HYBRID_SHARD (FULL_SHARD inside a shard group, replicated across groups)."""
    shard_group_size: int | None = None
    """HYBRID_SHARD only: ranks per shard group (>= 2, divides the world); None: cluster.devices."""
    offload_params: bool = False
    """CPUOffload: parameter shards and gradients live on the host; the optimizer steps there (GPU only)."""
    use_orig_params: bool = True
    """Expose the original parameters (views into the flat parameters) to the optimizer."""
    auto_wrap: bool = True
    """Make each transformer block (the model's block_cls) its own FSDP unit; false: one unit."""
    backward_prefetch: str = "BACKWARD_PRE"
    """All-gather the next unit's params during backward: BACKWARD_PRE | BACKWARD_POST | none."""
    forward_prefetch: bool = False
    """Issue the next unit's all-gather before the current forward finishes."""
    limit_all_gathers: bool = True
    """Rate-limit all-gathers so at most two units are unsharded at once (bounds peak memory)."""
    state_dict_type: str = "sharded"
    """Checkpoint format: sharded (a directory, one DCP shard per rank) | full (one file; GPU only)."""

    # ------------------------------------------------------------------ validation
    def problems(self, world: World, run: Run) -> list[str]:
        out = []
        if self.sharding_strategy not in SHARDING:
            out.append(f"strategy.sharding_strategy={self.sharding_strategy!r} is not one of "
                       f"{', '.join(SHARDING)} (NO_SHARD is strategy=ddp)")
        if self.backward_prefetch not in PREFETCH:
            out.append(f"strategy.backward_prefetch={self.backward_prefetch!r} is not one of "
                       f"{', '.join(PREFETCH)}")
        if self.state_dict_type not in STATE_DICT_TYPES:
            out.append(f"strategy.state_dict_type={self.state_dict_type!r} is not one of "
                       f"{', '.join(STATE_DICT_TYPES)}")
        elif self.state_dict_type == "full" and run.accelerator == "cpu":
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
        )

    # ------------------------------------------------------------------ builders
    def lightning(self, world: World, run: Run) -> Any:
        from torch.distributed.fsdp import BackwardPrefetch, CPUOffload

        kwargs: dict[str, Any] = {}
        if self.sharding_strategy == "HYBRID_SHARD":
            shard = self.shard_size(world)
            kwargs["device_mesh"] = (world.size // shard, shard)  # (replicate, shard)
        blocks = {run.block_cls} if run.block_cls is not None else None
        return strategy_class()(
            sharding_strategy=self.sharding_strategy,
            cpu_offload=CPUOffload(offload_params=self.offload_params),
            auto_wrap_policy=blocks if self.auto_wrap else None,
            activation_checkpointing_policy=blocks if self.activation_checkpointing else None,
            state_dict_type=self.state_dict_type,
            use_orig_params=self.use_orig_params,
            backward_prefetch=(None if self.backward_prefetch == "none"
                               else BackwardPrefetch[self.backward_prefetch]),
            forward_prefetch=self.forward_prefetch,
            limit_all_gathers=self.limit_all_gathers,
            **kwargs,
        )

    def full_state_dict(self, trainer: Any) -> dict[str, Any]:
        # The root FSDP unit wraps the LightningModule, whose ``model`` is the GPT.
        return gather_full_state_dict(trainer.strategy.model, prefix="model.")


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
    out = {}
    for k, v in sd.items():
        for piece in WRAPPER_PREFIXES:
            k = k.replace(piece, "")
        if k.startswith(prefix):
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k[len(prefix):]] = full.detach().float().cpu().clone()
    return out


# ---------------------------------------------------------------------- the CPU workaround
@functools.cache
def strategy_class() -> type:
    """``CPUCapableFSDPStrategy``, built on first use so importing this module stays light."""
    import torch
    from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
    from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
    from lightning.pytorch.strategies import FSDPStrategy

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

    class CPUCapableFSDPStrategy(FSDPStrategy):
        """Lightning's FSDPStrategy, runnable on CPU (gloo) too. The workarounds, all here:

        1. the accelerator connector refuses CPU with ``type(s) is FSDPStrategy``: a subclass passes;
        2. the model is wrapped with ``device_id=root_device`` (Lightning passes ``.index``, None on
           CPU, and FSDP1 then tries CUDA);
        3. a tuple ``device_mesh`` (replicate, shard) is built on the root device's type (Lightning
           hard-codes "cuda");
        4. gradient clipping by norm goes through the root unit's ``clip_grad_norm_``.
        """

        @property
        def precision_plugin(self) -> FSDPPrecision:
            return FSDPStrategy.precision_plugin.fget(self)

        @precision_plugin.setter
        def precision_plugin(self, plugin: Any) -> None:
            if isinstance(plugin, FSDPPrecision) and not isinstance(plugin, _RootClippingFSDPPrecision):
                plugin = _RootClippingFSDPPrecision(plugin.precision, scaler=plugin.scaler)
            FSDPStrategy.precision_plugin.fset(self, plugin)

        def setup_environment(self) -> None:
            mesh = self.kwargs.pop("device_mesh", None)
            super().setup_environment()
            if isinstance(mesh, tuple):
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh(self.root_device.type, mesh, mesh_dim_names=("replicate", "shard"))
            if mesh is not None:
                self.kwargs["device_mesh"] = mesh

        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            from torch.distributed.fsdp import FullyShardedDataParallel

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
