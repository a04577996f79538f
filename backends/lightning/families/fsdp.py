"""FSDP1 on Lightning: its FSDPStrategy built from a preset, runnable on CPU (gloo) too.

Lightning's ``FSDPStrategy`` assumes CUDA in four places; ``CPUCapableFSDPStrategy`` is the one
place that works around them (no torch or Lightning globals are patched):
1. the accelerator connector refuses CPU with ``type(s) is FSDPStrategy``: a subclass passes;
2. the model is wrapped with ``device_id=root_device`` (Lightning passes ``.index``, None on CPU,
   and FSDP1 then tries CUDA);
3. the hybrid (replicate, shard) mesh is built on the root device's type (Lightning hard-codes
   "cuda");
4. gradient clipping by norm goes through the root unit's ``clip_grad_norm_`` (``clip_grad_norm``),
   also for ``Trainer(gradient_clip_val=...)`` on a user's module, which Lightning's FSDPPrecision
   refuses (our precision plugin's ``clip_grad_by_norm``).
A later trainer call on the same module (validate/test/predict/fit after fit) reuses the first
call's FSDP root: Lightning wraps the LightningModule again, whose parameters are then flat shards.
What the preset leaves to the run: the hybrid mesh shape comes from the world Lightning sets up
(``setup_environment``), the wrap and checkpointing policies from the model's declared block
class (``_setup_model``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_warn

from backends.common import torch as torch_common
from backends.lightning.families import builds, warn_cast
from backends.lightning.preset import PresetStrategy
from core.mesh import Axis
from core.precision import low_dtype
from strategies.families.fsdp import FSDPConfig
from parallel.parallelize import find_model

# HYBRID_SHARD's device mesh before the world is known: Lightning requires one at construction;
# ``setup_environment`` replaces it with the real mesh.
_DEFERRED_MESH = (Axis.REPLICATE, Axis.SHARD)


class _DeviceAutocastFSDPPrecision(FSDPPrecision):
    """FSDPPrecision that autocasts on the device type actually in use, and clips by norm
    through the strategy's ``clip_grad_norm`` (the root unit's) where Lightning's refuses
    (``Trainer(gradient_clip_val=...)`` on a user's module)."""

    root: Any = None
    clip: Any = None

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        if self.clip is None:  # not set up by our strategy: Lightning's refusal
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.clip(optimizer, clip_val)

    def forward_context(self):
        if "mixed" in self.precision and self.root is not None:
            device = self.root.compute_device.type
            dtype = low_dtype(self.precision)
            return torch.autocast(device, dtype=dtype)
        return super().forward_context()


@builds(FSDPConfig)
class CPUCapableFSDPStrategy(PresetStrategy, FSDPStrategy):
    """Lightning's FSDPStrategy built from a preset (the workarounds: the module docstring)."""

    def __init__(self, preset: FSDPConfig):
        from torch.distributed.fsdp import BackwardPrefetch, CPUOffload

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
            **({"device_mesh": _DEFERRED_MESH} if preset.hybrid else {}),
        )
        self.preset = preset

    @property
    def precision_plugin(self) -> FSDPPrecision:
        return FSDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        if isinstance(plugin, FSDPPrecision) and not isinstance(plugin, _DeviceAutocastFSDPPrecision):
            name, scaler = plugin.precision, plugin.scaler
            if name == "16-mixed" and isinstance(self.accelerator, CPUAccelerator):
                # Lightning's rule for its other strategies on CPU (its accelerator connector);
                # fp16 would run unscaled: ShardedGradScaler disables itself without CUDA
                rank_zero_warn("Trainer(accelerator='cpu', precision='16-mixed'): AMP with fp16 is "
                               "not supported on CPU; FSDP trains precision='bf16-mixed' instead.")
                name, scaler = "bf16-mixed", None
            # (the scaler set after: Lightning 2.6's FSDPPrecision checks a given scaler against
            # the class's default precision, before it sets its own, so refuses 16-mixed's)
            plugin = _DeviceAutocastFSDPPrecision(name)
            plugin.scaler = scaler
        FSDPStrategy.precision_plugin.fset(self, plugin)

    def setup(self, trainer: Any) -> None:
        warn_cast(self)  # (Lightning's precision plugin casts the module first: convert_module)
        super().setup(trainer)

    def mesh_shape(self) -> tuple[int, int] | None:
        """HYBRID_SHARD's (replicate, shard) device mesh on the world Lightning runs."""
        mesh = self.run().mesh
        return (mesh.dp_replicate, mesh.dp_shard) if self.preset.hybrid else None

    def engine_settings(self) -> dict[str, Any]:
        kwargs = {k: v for k, v in self.kwargs.items() if k != "device_mesh"}
        return {"sharding_strategy": str(self.sharding_strategy), "kwargs": kwargs,
                "cpu_offload": repr(self.cpu_offload), "state_dict_type": self._state_dict_type,
                "mesh_shape": self.mesh_shape()}

    def setup_environment(self) -> None:
        self.kwargs.pop("device_mesh", None)
        super().setup_environment()
        shape = self.mesh_shape()
        if shape is not None:
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh(
                self.root_device.type, shape, mesh_dim_names=(Axis.REPLICATE, Axis.SHARD))

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        root = getattr(self, "_root", None)
        if root is not None and root.module is model:
            return self._attach(root)  # a later trainer call: the first call's units, sharded
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
        return self._attach(model)

    def _attach(self, root: Any) -> Any:
        """``root`` as this strategy's FSDP root, kept for later trainer calls; the precision
        plugin autocasts on its device and clips through it."""
        self._root = self.precision_plugin.root = root
        self.precision_plugin.clip = self.clip_grad_norm
        return root

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Gradients reduce-scatter on every micro-batch, as FSDP2 and ZeRO-2/3 do and the
        planner books: Lightning's default (FSDP's ``no_sync`` through accumulation) would keep
        the whole model's unsharded gradients on every rank until the last micro-batch
        (gpt_small, 4 micro-batches: the step's memory 1.15x the plan)."""
        yield

    def clip_grad_norm(self, optimizer: Any, max_norm: float) -> None:
        """Through the root unit, which sums the shards' squares (inf: measure only)."""
        self._grad_norm = self.model.clip_grad_norm_(max_norm if max_norm > 0 else math.inf)

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if not self.kwargs.get("use_orig_params"):
            _check_optimizer_covers(self.model, self.optimizers)

    def full_state_dict(self, prefix: str = "") -> dict[str, Any]:
        return torch_common.gathered_state_dict(self.model, prefix)


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
