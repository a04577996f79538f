"""FSDP1: torch ``FullyShardedDataParallel`` (flat parameters).

Presets: ``fsdp`` (FULL_SHARD), ``fsdp_grad_op`` (SHARD_GRAD_OP), ``fsdp_hybrid`` (HYBRID_SHARD:
shard inside a group, replicate across groups), ``fsdp_offload`` (CPUOffload; GPU only).
Each transformer block (the model's declared ``block_cls``) is its own FSDP unit; the module
holding the model is the root unit (embeddings, final norm, output). Mixed precision follows
``trainer.precision``. FSDP1 checkpoints activations inside its own wrapping (the engine's
policy, from the same block class), so its parallelize plan is empty.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from strategies.base import Capabilities, StrategyConfig, family
from core.knobs import knob
from strategies.footprint import CPU, DEVICE, FSDPFootprint
from core.mesh import Mesh
from parallel.parallelize import ParallelPlan
from core.run import Run

SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "none")
STATE_DICT_TYPES = ("sharded", "full")


@family("fsdp")
@dataclass
class FSDPConfig(StrategyConfig):
    """torch FSDP1 (FullyShardedDataParallel)."""

    # FSDP1 with use_orig_params mixes frozen and trainable parameters in one flat parameter only
    # at a cost and with caveats; LoRA runs on FSDP2 (per-parameter sharding).
    CAPABILITIES = Capabilities(lora=False, selective_checkpointing=False)

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

    @property
    def capabilities(self) -> Capabilities:
        # use_orig_params=false hands the optimizer flat parameters: one per unit, mixing norms,
        # biases and weights
        # (Accelerate builds FSDP1 without a device mesh: HYBRID_SHARD is Lightning's alone)
        return dataclasses.replace(self.CAPABILITIES, param_groups=self.use_orig_params,
                                   backends=("lightning",) if self.hybrid else self.CAPABILITIES.backends)

    @property
    def hybrid(self) -> bool:
        return self.sharding_strategy == "HYBRID_SHARD"

    def mesh(self, nodes: int, devices: int) -> Mesh:
        return Mesh(nodes, devices, shard=(self.shard_group_size or devices) if self.hybrid else None)

    def problems(self, run: Run) -> list[str]:
        out = []
        if run.compile:
            out.append(f"trainer.compile=true with strategy={self.name} (FSDP1): FSDP1 wraps blocks "
                       "by its auto-wrap policy and flattens their parameters into FlatParameters, "
                       "so there is no point between checkpointing and sharding to compile a block "
                       "(torch supports compiling FSDP2's per-parameter shards); use strategy=fsdp2, "
                       "or set trainer.compile=false")
        if self.state_dict_type == "full" and run.accelerator == "cpu":
            out.append("strategy.state_dict_type=full: gathering a full FSDP1 state dict crashes rank 0 "
                       "on CPU (gloo); allowed on CPU: sharded. Set strategy.state_dict_type=sharded")
        if self.hybrid:
            out += hybrid_problems(self.shard_group_size, run.mesh)
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
        return out

    def notes(self, run: Run) -> list[str]:
        return one_replica(self.name, self.shard_group_size, run.mesh) if self.hybrid else []

    def footprint(self) -> FSDPFootprint:
        # CPUOffload moves parameter shards AND gradients to the host; the step runs there.
        offload = CPU if self.offload_params else DEVICE
        return FSDPFootprint(params_offload=offload, optimizer_offload=offload,
                             reshard_after_forward=self.sharding_strategy != "SHARD_GRAD_OP")

    def plan(self, mesh: Mesh) -> ParallelPlan:
        return ParallelPlan()  # FSDP1's wrapper checkpoints the blocks it wraps (the engine's policy)


def one_replica(name: str, shard_group_size: int | None, mesh: Mesh) -> list[str]:
    """A hybrid preset whose shard group is every data-parallel rank has one replica: it runs as
    plain full sharding (shared with strategies/families/fsdp2.py)."""
    if mesh.dp_replicate > 1 or mesh.dp_shard < 2:
        return []
    key = f"strategy.shard_group_size={shard_group_size}" if shard_group_size else \
        f"strategy.shard_group_size unset (cluster.devices={mesh.devices})"
    divisors = [d for d in range(2, mesh.dp_shard) if mesh.dp_shard % d == 0]
    fix = (f"set strategy.shard_group_size to {' or '.join(map(str, divisors))} for replicas"
           if divisors else "more ranks (nodes) make replicas")
    return [f"strategy={name} with {key}: one shard group of all {mesh.dp_shard} data-parallel ranks, "
            f"one replica: this is plain full sharding, no hybrid; {fix}"]


def hybrid_problems(shard_group_size: int | None, mesh: Mesh) -> list[str]:
    """HYBRID/HSDP shard group checks (shared with strategies/families/fsdp2.py)."""
    shard = shard_group_size or mesh.devices
    key = "strategy.shard_group_size" if shard_group_size else "cluster.devices (the default shard group)"
    size = mesh.size
    if shard < 2:
        return [f"{key}={shard}: a hybrid shard group of 1 rank does not shard (and FSDP1 "
                "HYBRID_SHARD trains silently wrong with it); allowed: 2 .. world size "
                f"{size}, dividing it. Set strategy.shard_group_size=2 or more, or use strategy=ddp"]
    if size % shard:
        divisors = [d for d in range(2, size + 1) if size % d == 0]
        return [f"{key}={shard} does not divide the world size {size} (nodes {mesh.nodes} x "
                f"devices {mesh.devices}): replicate x shard must equal the world; allowed shard "
                f"group sizes: {', '.join(map(str, divisors)) or 'none (world size 1)'}"]
    return []
