"""DeepSpeed ZeRO (stages 1-3, CPU and NVMe offload): the config and what each rank holds.

ZeRO-1 shards the optimizer state (fp32 master weights and Adam moments) over the data-parallel
ranks, ZeRO-2 also the gradients, ZeRO-3 also the parameters (gathered per layer for forward and
backward). Offload keeps the optimizer state (ZeRO-Offload) or the parameter shards too
(ZeRO-Infinity) in CPU memory or on NVMe.

The DeepSpeed config is generated from the typed keys below (``deepspeed_json``, plain data; with
a ``Run``, for an engine that does not fill them itself -- Accelerate's plugin, an exported JSON --
also the micro batch, accumulation, clipping and precision). ``strategy.deepspeed_config`` is raw
DeepSpeed JSON deep-merged over it (mappings key by key, any other value replaces), except that a
key with a typed owner (``_OWNED``) is refused by ``problems()`` instead of silently winning; an
engine then fills what is still missing itself (Lightning: accumulation, micro batch, clipping and
precision from the Trainer).

The engine code (the DeepSpeed engine under each backend, ``zero.Init``, its CPU accelerator,
counting what it holds) lives in backends/.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.conf import has, merge, plain
from core.precision import find
from strategies.base import DEEPSPEED, Capabilities, StrategyConfig, family
from core.knobs import knob
from strategies.footprint import CPU, DEVICE, NVME, REPLICATED, SHARDED
from strategies.zero_footprint import AUTO, HIDDEN_AUTO, ZeroFootprint
from core.mesh import Mesh
from core.run import Run

STAGES = (1, 2, 3)
OFFLOAD = ("none", "cpu", "nvme")
_WHERE = {"none": DEVICE, "cpu": CPU, "nvme": NVME}
# deepspeed_config keys a typed key owns (dotted key -> what to set instead): merged, they would
# win in the engine while report.json's config and the footprint say the typed value. (The ZeRO
# sizes the footprint reads from the merged JSON -- reduce_bucket_size, sub_group_size, overlap_comm,
# contiguous_gradients, stage3_prefetch_bucket_size, stage3_param_persistence_threshold -- may be raw.)
_OWNED = {
    "train_batch_size": "trainer.global_batch_size", "gradient_clipping": "trainer.grad_clip",
    "train_micro_batch_size_per_gpu": "trainer.micro_batch_size", "scheduler": "trainer.scheduler / warmup_steps",
    "gradient_accumulation_steps": "trainer.global_batch_size / trainer.micro_batch_size (it is derived)",
    **dict.fromkeys(("fp16", "bf16", "amp", "torch_autocast"), "trainer.precision"),
    "optimizer": "trainer.optimizer / lr / betas / weight_decay (the recipe's torch optimizer steps)",
    "zero_optimization.stage": "strategy.stage", "zero_optimization.offload_param": "strategy.offload_params",
    "zero_optimization.offload_optimizer": "strategy.offload_optimizer",
    "zero_optimization.allgather_bucket_size": "strategy.allgather_bucket_size",
    "zero_optimization.stage3_max_live_parameters": "strategy.max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance": "strategy.max_reuse_distance",
    "aio.block_size": "strategy.aio_block_size", "aio.queue_depth": "strategy.aio_queue_depth",
}



@family("deepspeed")
@dataclass
class ZeroConfig(StrategyConfig):
    """DeepSpeed ZeRO data parallelism."""

    stage: int = knob(2, choices=STAGES,
                      fix="use 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters)")
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    offload_optimizer: str = knob("none", choices=OFFLOAD)
    """none | cpu | nvme: where optimizer state (fp32 master + moments) and its step live."""
    offload_params: str = knob("none", choices=OFFLOAD)
    """none | cpu | nvme: where parameter shards live between uses (stage 3 only)."""
    nvme_path: str | None = knob(None, exists="dir", at_launch=True,
                                 fix="create it (mkdir -p) or point strategy.nvme_path at an NVMe mount")
    """Directory for NVMe swap files (needed when an offload is nvme; must be writable on the
    machine that runs the job: checked by train.py, not plan.py)."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward (DeepSpeed's overlap_comm)."""
    contiguous_gradients: bool = True
    """Copy reduced gradients into one contiguous buffer (less fragmentation)."""
    reduce_bucket_size: int = knob(200_000_000, min=1)
    """Elements reduced per gradient bucket (all stages)."""
    allgather_bucket_size: int = knob(200_000_000, min=1)
    """Elements all-gathered per bucket after the step (stages 1 and 2)."""
    prefetch_bucket_size: int = knob(50_000_000, min=1)
    """Stage 3: elements of parameters fetched ahead of use (stage3_prefetch_bucket_size)."""
    param_persistence_threshold: int = knob(100_000, min=0)
    """Stage 3: parameters with fewer elements stay unsharded (stage3_param_persistence_threshold)."""
    max_live_parameters: int = knob(1_000_000_000, min=1)
    """Stage 3: most gathered parameter elements held at once (stage3_max_live_parameters)."""
    max_reuse_distance: int = knob(1_000_000_000, min=0)
    """Stage 3: keep a gathered parameter if reused within this many elements' worth of work."""
    sub_group_size: int = knob(1_000_000_000, min=1)
    """Elements per optimizer sub-group stepped at once (bounds offload/NVMe buffers)."""
    pin_memory: bool | None = None
    """Page-locked CPU buffers for offload (faster host<->GPU copies; needs CUDA); None: on a GPU
    run yes, on CPU no."""
    param_buffer_count: int = knob(5, min=1)
    """NVMe parameter offload: swap buffers per rank."""
    param_buffer_size: int = knob(100_000_000, min=1)
    """NVMe parameter offload: elements per swap buffer (>= the largest parameter)."""
    optimizer_buffer_count: int = knob(4, min=1)
    """NVMe optimizer offload: swap buffers per rank."""
    aio_block_size: int = knob(1_048_576, min=1)
    """NVMe async I/O block size in bytes (DeepSpeed aio.block_size)."""
    aio_queue_depth: int = knob(8, min=1)
    """NVMe async I/O queue depth (DeepSpeed aio.queue_depth)."""
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    """Raw DeepSpeed JSON deep-merged over the generated config (see the module docstring)."""
    sp: int = knob(1, min=1)
    """DeepSpeed Ulysses degree: sp ranks read the same samples, each a 1/sp shard of the
    sequence; an all-to-all turns sequence shards into head shards around attention
    (DistributedAttention). model.n_heads and seq_len must be divisible by it (KV heads it does
    not divide are replicated to the query heads, as DeepSpeed does)."""

    @property
    def capabilities(self) -> Capabilities:
        # the engine's save_checkpoint (one optimizer shard per rank); LoRA while parameters are
        # whole on every rank (ZeRO-3's partitioned parameters lose per-parameter requires_grad);
        # Ulysses replaces the attention core the built-in GPT declares (cuts_model), which a
        # DeepSpeed JSON alone does not say (no native config)
        return Capabilities(checkpoint=DEEPSPEED, lora=self.stage <= 2, degrees=("sp",),
                            native_config="deepspeed" if self.sp == 1 else None, cuts_model=self.sp > 1,
                            sharded_build=("lightning", "accelerate") if self.stage == 3 else ())

    def mesh(self, nodes: int, devices: int) -> Mesh:
        return Mesh(nodes, devices, sp=self.sp)

    def model_problems(self, model: Any) -> list[str]:
        """Ulysses splits heads (after the all-to-all) and the sequence (before it) over sp."""
        out = super().model_problems(model)
        if self.sp > 1 and not out:
            for key in ("n_heads", "seq_len"):  # (KV heads sp does not divide are replicated)
                value = getattr(model, key, None)
                if isinstance(value, int) and value % self.sp:
                    what = "sequence" if key == "seq_len" else "heads"
                    out.append(f"model.{key}={value} is not divisible by strategy.sp={self.sp}: "
                               f"Ulysses splits the {what} over the sp ranks; choose sp dividing "
                               f"model.n_heads and model.seq_len (or another model)")
        return out

    # ---------------------------------------------------------------- validation
    def problems(self, run: Run) -> list[str]:
        out: list[str] = []
        if run.compile and self.stage == 3:
            own = self.preset_value("stage")  # (strategy.stage=3 over a ZeRO-1/2 preset: its own fixes it)
            fix = f"set strategy.stage={own}, or use" if own in (1, 2) else "use strategy=zero2 or"
            out.append(f"trainer.compile=true with strategy={self.name} (ZeRO-3): DeepSpeed gathers "
                       "each partitioned parameter in hooks around every module's forward, which a "
                       "compiled block would have to trace (DeepSpeed compiles only through its own "
                       f"engine.compile); {fix} strategy=fsdp2, or set trainer.compile=false")
        if self.offload_params != "none" and self.stage != 3:
            out.append(f"strategy.offload_params={self.offload_params} needs strategy.stage=3 "
                       f"(got {self.stage}): only ZeRO-3 shards parameters; use strategy=zero3_offload "
                       "or set strategy.offload_params=none")
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            why = " and ".join(f"strategy.{k}=nvme" for k in ("offload_optimizer", "offload_params")
                               if getattr(self, k) == "nvme")
            out.append(f"strategy.nvme_path={self.nvme_path!r} but {why} needs a directory for swap "
                       "files: set strategy.nvme_path=/path/on/nvme (it must exist and be writable)")
        if self.pin_memory and run.accelerator == "cpu":
            out.append("strategy.pin_memory=true needs CUDA (page-locked memory for host<->GPU "
                       "copies): set strategy.pin_memory=false on cluster.accelerator=cpu")
        raw = plain(self.deepspeed_config)
        at = lambda k: json.dumps(functools.reduce(dict.get, k.split("."), raw))  # noqa: E731
        return out + [f"strategy.deepspeed_config.{k}={at(k)}: a typed key owns that knob, and the raw "
                      "value would silently win over it; remove it from strategy.deepspeed_config and "
                      f"set {owner} instead"
                      for k, owner in _OWNED.items() if has(raw, k)]

    def value_problems(self) -> list[str]:
        """Raw ``deepspeed_config.zero_optimization`` sizes: an integer in range or "auto"."""
        zero = plain(self.deepspeed_config).get("zero_optimization", {})
        out = []
        for key, (_, least, typed, rule) in HIDDEN_AUTO.items():
            if (not isinstance(zero, dict) or key not in zero or zero[key] == AUTO
                    or _count(zero[key], least) is not None):
                continue
            out.append(f"strategy.deepspeed_config.zero_optimization.{key}={zero[key]!r}: must be "
                       f"an integer >= {least} (elements) or \"auto\" (filled from the model's "
                       f"hidden size h, as Accelerate does: {rule}); set it to e.g. "
                       f"{_default(typed)} or \"auto\", or remove it and set strategy.{typed}")
        return out

    def launch_problems(self, run: Run) -> list[str]:
        """NVMe offload on the machine that runs it: a writable swap directory, Linux libaio."""
        where = [k for k in ("offload_optimizer", "offload_params") if getattr(self, k) == "nvme"]
        if not where or not self.nvme_path:
            return []
        why = " and ".join(f"strategy.{k}=nvme" for k in where)
        path = Path(self.nvme_path)
        out = []  # (that the directory exists is the field's own check, at launch too)
        if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
            out.append(f"strategy.nvme_path={self.nvme_path!r} is not writable by this user "
                       f"({why}): fix its permissions or choose another directory")
        if not libaio_available():
            out.append(f"{why} needs Linux libaio to build DeepSpeed's async_io op, and it is not "
                       "installed: apt-get install -y libaio-dev, or set the offload to cpu")
        return out

    # ---------------------------------------------------------------- footprint
    def footprint(self) -> ZeroFootprint:
        s, zero = self.stage, self.deepspeed_json().get("zero_optimization", {})
        contiguous = zero.get("contiguous_gradients", self.contiguous_gradients)
        return ZeroFootprint(
            stage=s,
            optimizer=SHARDED,
            grads=SHARDED if s >= 2 else REPLICATED,
            params=SHARDED if s >= 3 else REPLICATED,
            optimizer_offload=_WHERE.get(self.offload_optimizer, DEVICE),
            params_offload=_WHERE.get(self.offload_params, DEVICE),
            reshard_after_forward=s >= 3,
            live_params=self.max_live_parameters,
            offload_grad_buffer=s >= 3 and self.offload_optimizer != "none",
            # contiguous_gradients buffers, allocated at the configured size (stage_1_and_2's
            # setup_buckets: a second one with overlap_comm; stage3: one), raw JSON merged in
            reduce_bucket=_or(_count(zero.get("reduce_bucket_size"), 1), self.reduce_bucket_size),
            reduce_buckets=(0 if not contiguous
                            else 1 if s >= 3 or not zero.get("overlap_comm", self.overlap_comm) else 2),
            prefetch=(_or(_count(zero.get("stage3_prefetch_bucket_size"), 0), self.prefetch_bucket_size)
                      if s >= 3 else 0),
            # "auto" sizes: filled from the model's hidden size when planned (value_problems
            # reports any other unusable value, and the typed key stands in meanwhile)
            auto=frozenset(k for k in HIDDEN_AUTO if zero.get(k) == AUTO
                           and (s >= 3 or not k.startswith("stage3"))),
            sub_group=_or(_count(zero.get("sub_group_size"), 1), self.sub_group_size),
            persistence=_or(_count(zero.get("stage3_param_persistence_threshold"), 0),
                            self.param_persistence_threshold),
            pin_memory=self.pin_memory,
            swap_buffers=(self.param_buffer_count * self.param_buffer_size, self.optimizer_buffer_count),
        )

    def for_model(self, hidden: int) -> ZeroConfig:
        """``"auto"`` sizes in deepspeed_config.zero_optimization filled as Accelerate fills them
        (DeepSpeed itself takes no "auto"): the engine of either backend gets numbers."""
        raw = plain(self.deepspeed_config)
        zero = raw.get("zero_optimization")
        if not isinstance(zero, dict) or not any(zero.get(k) == AUTO for k in HIDDEN_AUTO):
            return self
        zero = {k: (HIDDEN_AUTO[k][0](hidden) if k in HIDDEN_AUTO and v == AUTO else v)
                for k, v in zero.items()}
        return dataclasses.replace(self, deepspeed_config={**raw, "zero_optimization": zero})

    # ---------------------------------------------------------------- the engine's config
    def pins(self, run: Run | None) -> bool:
        """Whether offload buffers are page-locked: ``pin_memory``, or by default on a GPU run."""
        return self.pin_memory if self.pin_memory is not None else run is not None and run.accelerator == "gpu"

    def deepspeed_json(self, run: Run | None = None) -> dict[str, Any]:
        """The DeepSpeed config of this preset (plain dicts, lists, scalars); with ``run``, also the micro
        batch, accumulation, clipping and precision (engines that do not fill them; Lightning does)."""
        zero: dict[str, Any] = {
            "stage": self.stage,
            "overlap_comm": self.overlap_comm,
            "contiguous_gradients": self.contiguous_gradients,
            "reduce_bucket_size": self.reduce_bucket_size,
            "sub_group_size": self.sub_group_size,
        }
        if self.stage < 3:
            zero |= {"allgather_partitions": True, "allgather_bucket_size": self.allgather_bucket_size,
                     "reduce_scatter": True}
        else:  # (gather_16bit: a script's accelerator.get_state_dict / save_model; it gathers only then)
            zero |= {"stage3_prefetch_bucket_size": self.prefetch_bucket_size,
                     "stage3_param_persistence_threshold": self.param_persistence_threshold,
                     "stage3_max_live_parameters": self.max_live_parameters,
                     "stage3_max_reuse_distance": self.max_reuse_distance,
                     "stage3_gather_16bit_weights_on_model_save": True}
        if self.offload_optimizer != "none":
            zero["offload_optimizer"] = {"device": self.offload_optimizer, "pin_memory": self.pins(run)}
            if self.offload_optimizer == "nvme":
                zero["offload_optimizer"] |= {"nvme_path": self.nvme_path,
                                              "buffer_count": self.optimizer_buffer_count}
        if self.offload_params != "none":
            zero["offload_param"] = {"device": self.offload_params, "pin_memory": self.pins(run)}
            if self.offload_params == "nvme":
                zero["offload_param"] |= {"nvme_path": self.nvme_path,
                                          "buffer_count": self.param_buffer_count,
                                          "buffer_size": self.param_buffer_size}
        cfg: dict[str, Any] = {
            "zero_optimization": zero,
            # The optimizer is the recipe's torch optimizer (recipes/training.py), not DeepSpeed's.
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**31 - 1,  # our report logs the loss; keep DeepSpeed quiet
            "wall_clock_breakdown": False,
        }
        if run is not None:  # an explicit 0: DeepSpeed's default clips at 1.0
            cfg |= {"train_micro_batch_size_per_gpu": run.micro_batch_size,
                    "gradient_accumulation_steps": run.accumulation,
                    "gradient_clipping": float(run.grad_clip)}
            precision = find(run.precision)
            cfg |= precision.deepspeed_config() if precision else {}
        if "nvme" in (self.offload_optimizer, self.offload_params):
            cfg["aio"] = {"block_size": self.aio_block_size, "queue_depth": self.aio_queue_depth,
                          "single_submit": False, "overlap_events": True, "thread_count": 1}
        return merge(cfg, plain(self.deepspeed_config))


# -------------------------------------------------------------------- helpers
def _default(typed: str) -> Any:
    return next(f.default for f in ZeroConfig.__dataclass_fields__.values() if f.name == typed)


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _count(value: Any, least: int) -> int | None:
    """A DeepSpeed element count as an int (integral floats such as 5e8 too); None when absent,
    "auto" (the footprint sizes it from the model) or unusable (``value_problems`` says so)."""
    if value is None or value == AUTO or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if value == int(value) >= least else None  # (integral, and at least ``least``)


def libaio_available() -> bool:
    """Linux libaio and its header, which DeepSpeed's async_io op compiles against (NVMe offload).
    (Loaded by name rather than found with ``ctypes.util.find_library``, which runs ldconfig.)"""
    import ctypes

    if not Path("/usr/include/libaio.h").exists():
        return False
    for name in ("libaio.so.1", "libaio.so.1t64", "libaio.so"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False
