"""Expert parallelism for mixture-of-experts models: the routed experts of every MoE layer split
over ``strategy.ep`` ranks, tokens traded by all-to-all (parallel/experts.py), composed with a
data-parallel engine over everything else. This module: the family ``fsdp2_ep`` (preset
``fsdp_ep``: FSDP2 over the non-expert parameters; the experts, sharded over the ep group, are
FSDP2-sharded over the dp / ep ranks that hold the same experts -- torchtitan's layout), and what
every expert-parallel family shares (the model's problems, the experts' footprint: ``ExpertSplit``;
``deepspeed_ep.py`` is the other). ``ep`` takes no ranks of its own: it folds into the
data-parallel ranks (``Mesh``), which must be a multiple of it; the model's experts must divide by it
(``Mesh.model_problems``, which names the degrees dividing both).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from strategies.base import Capabilities, StrategyConfig, family
from core.knobs import knob
from strategies.families.fsdp2 import FSDP2Config
from strategies.footprint import FSDPFootprint, Sizes, States, Traffic
from core.mesh import Mesh
from core.run import Run


def moe_problems(preset: StrategyConfig, model: Any) -> list[str]:
    n = getattr(model, "n_experts", 0) or 0
    if n == 0:
        return [f"strategy={preset.name} shards the experts of a mixture-of-experts model, and "
                f"model={getattr(model, 'name', '?')} has none (model.n_experts=0): use a MoE model "
                "(model=gpt_moe_nano, mixtral_8x7b, deepseek_moe_16b) or a dense preset (fsdp2, zero2)"]
    layers, dense = getattr(model, "n_layers", 0), getattr(model, "first_dense_layers", 0)
    if getattr(model, "moe_layers", 1) == 0 and dense == layers:  # (> n_layers: the model's own problem)
        return [f"strategy={preset.name} shards the experts of a mixture-of-experts model, and "
                f"model.first_dense_layers={dense} = model.n_layers={layers} leaves none (every layer "
                f"dense): allowed 0..{layers - 1}; set model.first_dense_layers<={layers - 1}, or use a "
                "dense preset (fsdp2, zero2)"]
    # (n_experts divisible by ep: core.mesh.Mesh.model_problems, which knows the ranks ep folds into)
    return []


@dataclass(frozen=True)
class ExpertSplit:
    """What changes in a footprint under expert parallelism: the routed experts' parameters are
    split over ``ep`` ranks, their gradients and optimizer state reduced and sharded over the
    ``dp / ep`` ranks that hold the same experts (``ep`` apart); the rest as the engine does;
    and every MoE layer trades its capacity slots by all-to-all, dispatch and combine in
    forward, the same two in backward."""

    ep: int = 1

    def _parts(self, n: Sizes) -> tuple[Sizes, Sizes | None]:
        model = n.model
        experts = float(model.expert_params()) / n.mp if getattr(model, "is_moe", False) else 0.0
        if experts <= 0:
            return n, None
        ratio = n.trainable / n.params if n.params else 1.0
        layers = max(1, model.moe_layers)
        per_layer = experts / layers
        # the largest unit beside the experts: a MoE block with its share of the experts, or one
        # that ep leaves whole (a dense first block, an embedding)
        whole = max(model.embedding_params(), model.block_params(moe=False) if model.n_layers > layers else 0)
        unit = max(model.block_params() / n.mp - per_layer + per_layer / self.ep, whole / n.mp)
        dense = dataclasses.replace(n, params=n.params - experts, trainable=n.trainable - experts * ratio,
                                    unit=unit, blocks=None if n.blocks is None else n.blocks - experts)
        ex = dataclasses.replace(n, params=experts / self.ep, trainable=experts * ratio / self.ep,
                                 dp=max(1, n.dp // self.ep), shard=max(1, n.shard // self.ep),
                                 tp=n.tp * self.ep, unit=per_layer / self.ep, units=layers,
                                 blocks=experts / self.ep)
        return dense, ex

    def states(self, n: Sizes) -> States:
        dense, ex = self._parts(n)
        mine = super().states(dense)
        if ex is None:
            return mine
        other = super().states(ex)
        return States(**{f.name: getattr(mine, f.name) + getattr(other, f.name)
                         for f in dataclasses.fields(States)})

    def buffers(self, n: Sizes) -> tuple[int, int]:
        return super().buffers(self._parts(n)[0])

    def traffic(self, n: Sizes) -> list[Traffic]:
        dense, ex = self._parts(n)
        out = super().traffic(dense)
        if ex is None:
            return out
        out += [dataclasses.replace(t, name=f"expert_{t.name}") for t in super().traffic(ex)
                if t.op != "copy"]
        model, elem = n.model, n.bytes.activation
        if self.ep > 1:
            # one (n_experts, micro x capacity, dim) buffer per all-to-all; 4 per MoE layer and
            # micro-batch (dispatch and combine, forward and backward)
            payload = model.n_experts * n.micro * model.capacity() * model.dim * elem
            calls = 4 * max(1, model.moe_layers)
            out.append(Traffic("moe_all_to_all", "all_to_all", self.ep, 1, payload * calls, "none",
                               per_micro=True, calls=calls))
        return out

    def notes(self, n: Sizes) -> list[str]:
        model = n.model
        if not getattr(model, "is_moe", False) or not model.moe_layers:  # (no MoE layer: refused)
            return super().notes(n)
        if self.ep == 1:  # (no expert groups: the experts are sharded like the rest, nothing traded)
            return [*super().notes(n), f"expert parallel ep=1: the {model.expert_params():,} expert parameters "
                    "are FSDP-sharded over every rank like the rest; no token all-to-all"]
        return [*super().notes(n),
                f"expert parallel ep={self.ep}: {model.expert_params():,} expert parameters split "
                f"{self.ep} ways; token all-to-all of n_experts x micro x capacity({model.capacity()}) "
                f"x dim per dispatch/combine (capacity_factor {model.capacity_factor:g}); activation "
                "checkpointing's recompute repeats the forward pair (not priced)"]


@dataclass(frozen=True)
class FSDPEPFootprint(ExpertSplit, FSDPFootprint):
    pass


# torch 2.13 on gloo: the token all-to-all's record_function ops recur a different number of
# times in the recomputation than in the forward, which the selective policy's cache refuses
# (tests/test_selective_ac.py keeps the case, refused)
EP_SELECTIVE = ("the experts' token all-to-all is not replayed op for op when the block is "
                "recomputed, which selective checkpointing's cache requires")


@family("fsdp2_ep")
@dataclass
class FSDP2EPConfig(FSDP2Config):
    """FSDP2 over the non-expert parameters, the experts split over ``ep`` ranks."""

    SELECTIVE_REFUSED = EP_SELECTIVE

    ep: int = knob(2, min=1)
    """Expert-parallel degree: ranks each holding n_experts / ep experts of every MoE layer (it
    divides the data-parallel size and model.n_experts)."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(lora=False, degrees=("ep",), backends=("lightning",),
                            sharded_build=("lightning",))

    def mesh(self, nodes: int, devices: int) -> Mesh:
        return Mesh(nodes, devices, ep=self.ep)

    def problems(self, run: Run) -> list[str]:
        out = super().problems(run)
        if self.hybrid:
            out.append(f"strategy.hybrid=true with strategy={self.name}: HSDP with expert "
                       "parallelism is not built; set strategy.hybrid=false")
        if getattr(run, "compile", False):
            out.append(f"trainer.compile=true with strategy={self.name}: compiling blocks whose "
                       "routing is data-dependent (capacity, dropped tokens) around the experts' "
                       "all-to-all hooks is not built; set trainer.compile=false")
        return out

    def model_problems(self, model: Any) -> list[str]:
        return super().model_problems(model) + moe_problems(self, model)

    def footprint(self) -> FSDPEPFootprint:
        return FSDPEPFootprint(ep=self.ep, reshard_after_forward=self.reshard_after_forward,
                               reduce_fp32=self.reduce_fp32)


__all__ = ["ExpertSplit", "FSDP2EPConfig", "FSDPEPFootprint", "moe_problems"]
