"""Tensor parallel, pipeline parallel and their compositions with FSDP2 data parallelism.

Presets: ``tp`` (Megatron column/row through DTensor ``parallelize_module``), ``fsdp_tp``
(2-D: TP inside, FSDP2 across), ``pipeline`` (``torch.distributed.pipelining`` schedules),
``pp_dp`` (pipeline x data parallel) and ``3d`` (DP x TP x PP). One family, one mesh:
``(data_parallel, pipeline_parallel, tensor_parallel)`` with the tensor dimension innermost
(neighbouring ranks), its arithmetic owned by ``core.mesh.Mesh``.

Parallelism is applied from outside the recipe, in the fixed order TP -> activation
checkpointing -> compile -> FSDP2 (``plan``; parallel/parallelize.py), from what the model
declares: ``tp_plan`` (which linear layer is column- or row-parallel, relative to a block) and
``pp_plan`` (the ModuleDict of blocks, and the modules only the first or last stage runs;
parallel/pipeline.py cuts it). Data parallelism over ``dp`` ranks is FSDP2 on the data-parallel
sub-mesh (torchtitan's layout); a replica's ``pp x tp`` ranks read the same batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from strategies.base import Capabilities, StrategyConfig, family
from core.knobs import knob
from strategies.footprint import FSDPFootprint
from core.mesh import Axis, Mesh
from parallel.parallelize import FSDP2Plan, ParallelPlan
from parallel.pipeline import SCHEDULES
from core.run import Run


@family("parallel")
@dataclass
class ParallelConfig(StrategyConfig):
    """DP x TP x PP on one device mesh: TP through DTensor, PP through torch.distributed.pipelining,
    DP through FSDP2."""

    dp: int | None = knob(None, min=1)
    """Data-parallel replicas (FSDP2 over them); None: what the world leaves, size / (tp x pp)."""
    tp: int = knob(1, min=1)
    """Tensor-parallel degree: ranks splitting each layer's heads and hidden features."""
    pp: int = knob(1, min=1)
    """Pipeline-parallel degree: ranks holding consecutive blocks of the model."""
    sequence_parallel: bool = False
    """With tp > 1: shard the norm and dropout regions along the sequence (all-gather before
    attention and the MLP, reduce-scatter after) instead of replicating them."""
    schedule: str = knob("1f1b", choices=tuple(SCHEDULES))
    """Pipeline schedule (torch's): gpipe, 1f1b, or with virtual stages interleaved_1f1b,
    looped_bfs, interleaved_zb, zbv."""
    microbatches: int | None = knob(None, min=1)
    """Pipeline micro-batches per engine step (each of trainer.micro_batch_size samples); None:
    derived from the batch -- every sample of the step in one schedule (global / (micro x dp))
    when the schedule allows that many, else the most that divide it (``for_batch``)."""
    virtual_stages: int | None = knob(None, min=1)
    """Model stages per pipeline rank; None: 1, or 2 for the schedules that need several."""
    stages: int | None = knob(None, min=1)
    """Model stages in all (pp x virtual_stages); None: derived. Setting it derives virtual_stages."""
    split: list[int] | None = None
    """Blocks per stage (sums to model.n_layers); None: balanced by parameter count (the first
    stage also holds the embedding, the last the head)."""
    reshard_after_forward: bool = True
    """FSDP2 over data parallel: free gathered block parameters after forward."""
    cp: int = knob(1, min=1)
    """Context-parallel degree (torch's context_parallel: ring attention over sequence shards,
    causal chunks load-balanced): cp ranks read the same samples, each 2 of 2 x cp chunks of the
    sequence; FSDP2 shards over dp x cp. model.seq_len must be divisible by 2 x cp, and
    model.dropout 0 (ring attention runs no attention dropout)."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(lora=False, degrees=("tp", "pp"), backends=("lightning",),
                            sharded_build=("lightning",),
                            cuts_model=self.pp > 1 or self.sequence_parallel or self.cp > 1)

    def with_degrees(self, **degrees: int) -> ParallelConfig:
        return dataclasses.replace(super().with_degrees(**degrees), dp=None)

    # ---------------------------------------------------------------- shape
    def mesh(self, nodes: int, devices: int) -> Mesh:
        return Mesh(nodes, devices, tp=self.tp, pp=self.pp, cp=self.cp)

    def mesh_dims(self, mesh: Mesh) -> dict[Axis, int]:
        """The DeviceMesh's dimensions, outermost first: (data, [context,] pipeline, tensor),
        the tensor dimension innermost (neighbouring ranks), context (when cp > 1) next to data:
        data x context is FSDP2's shard group."""
        sizes = {Axis.DATA: mesh.dp, Axis.CONTEXT: mesh.cp, Axis.PIPELINE: mesh.pp, Axis.TENSOR: mesh.tp}
        return {k: v for k, v in sizes.items() if k != Axis.CONTEXT or mesh.cp > 1}

    def virtual(self) -> int:
        need = SCHEDULES[self.schedule][1] if self.schedule in SCHEDULES else 1
        if self.virtual_stages is not None:
            return self.virtual_stages
        if self.stages is not None and self.pp >= 1 and self.stages % self.pp == 0:
            return self.stages // self.pp
        return need

    def n_stages(self) -> int:
        return self.pp * self.virtual()

    def pipeline_schedule(self) -> tuple[str, int, list[int] | None]:
        return self.schedule, self.virtual(), list(self.split) if self.split else None

    def pipeline_microbatches(self) -> int | None:
        # (None left: no batch to derive it from -- a Lightning Trainer given the preset by
        # name: one micro-batch per stage, the fewest every schedule runs)
        return (self.microbatches or self.pp) if self.pp > 1 else None

    def for_batch(self, global_batch: int, micro_batch: int, dp: int) -> ParallelConfig:
        if self.pp == 1 or self.microbatches is not None or micro_batch < 1 or dp < 1:
            return self
        n = global_batch // (micro_batch * dp) if global_batch % (micro_batch * dp) == 0 else 0
        fits = [d for d in range(n, 0, -1) if n % d == 0 and self._runs(d)]
        return dataclasses.replace(self, microbatches=fits[0]) if fits else self

    def underived(self) -> bool:
        return self.pp > 1 and self.microbatches is None

    def _runs(self, microbatches: int) -> bool:
        """The schedule runs this many micro-batches per step."""
        if self.schedule in ("interleaved_1f1b", "interleaved_zb") and microbatches % self.pp:
            return False
        return self.schedule == "gpipe" or microbatches >= self.pp

    def problems(self, run: Run) -> list[str]:
        out = []
        size = run.mesh.size
        if self.dp is not None and self.dp * self.cp * self.tp * self.pp != size:
            cp = f" * cp({self.cp})" if self.cp > 1 else ""
            out.append(f"strategy.dp({self.dp}){cp} * tp({self.tp}) * pp({self.pp}) = "
                       f"{self.dp * self.cp * self.tp * self.pp} != world size {size} (cluster.nodes "
                       f"{run.mesh.nodes} x cluster.devices {run.mesh.devices}): set strategy.dp=null to "
                       "derive it, or change the degrees")
        if run.compile and self.tp > 1:
            # measured on torch 2.13 (CPU, gloo, strategy=tp): the compiled block's backward hands
            # DTensor's redistribute a plain Tensor (AttributeError: no attribute '_local_tensor')
            out.append(f"trainer.compile=true with strategy={self.name} (tensor parallel, tp={self.tp}): "
                       "torch 2.13's compiled blocks fail in backward at the DTensor layer boundaries "
                       "that tensor parallelism inserts (DTensor's redistribute gets a plain Tensor); "
                       "compile runs with pipelines (tp=1), ddp, fsdp2, zero1/2 and ulysses; set "
                       "trainer.compile=false")
        if self.sequence_parallel and self.tp == 1:
            out.append("strategy.sequence_parallel=true needs strategy.tp > 1 (it shards the norm "
                       "regions over the tensor-parallel group): set strategy.tp or turn it off")
        if run.precision == "16-mixed":
            out.append("trainer.precision=16-mixed with DTensor/pipeline parallelism: no gradient "
                       "scaler for DTensor gradients; allowed: 32, bf16-mixed")
        if self.pp > 1:
            out += self._pipeline_problems(run)
        return out

    def _pipeline_problems(self, run: Run) -> list[str]:
        if self.schedule not in SCHEDULES:  # (the knob's own check names it)
            return []
        out, need = [], SCHEDULES[self.schedule][1]
        b = run.batch
        if (self.microbatches is None and not b.problems()
                and self.for_batch(b.global_size, b.micro_size, b.dp).underived()):
            # null found no count the schedule runs: say why, in the batch's terms
            n = b.global_size // (b.micro_size * b.dp)
            least = self.pp if self.schedule != "gpipe" else 1
            out.append(f"strategy.microbatches=null derives the pipeline's micro-batches from the batch: "
                       f"global_batch_size({b.global_size}) / (micro_batch_size({b.micro_size}) x "
                       f"data-parallel size({b.dp})) = {n} per step, and strategy.schedule={self.schedule} "
                       f"with pp={self.pp} needs {least} or more"
                       + (f" (a multiple of {self.pp})" if self.schedule.startswith("interleaved") else "")
                       + f": set {self._batch_change(b)}")
            return out
        if self.stages is not None and self.stages % self.pp:
            out.append(f"strategy.stages={self.stages} is not a multiple of strategy.pp={self.pp}: "
                       "each pipeline rank holds the same number of stages")
        v = self.virtual()
        if need == 1 and v != 1:
            out.append(f"strategy.schedule={self.schedule} runs one stage per rank, but "
                       f"virtual_stages={v}: use interleaved_1f1b (or looped_bfs, interleaved_zb, "
                       "zbv) for several, or set strategy.virtual_stages=1")
        if need > 1 and v < 2:
            out.append(f"strategy.schedule={self.schedule} needs >= 2 virtual stages per rank, "
                       f"got {v}: set strategy.virtual_stages=2 or use schedule=1f1b")
        if self.schedule == "zbv" and v != 2:
            out.append(f"strategy.schedule=zbv places exactly 2 stages per rank (a V): "
                       f"virtual_stages={v}; set it to 2")
        if self.microbatches is None:
            return out
        if self.schedule != "gpipe" and self.microbatches < self.pp:
            out.append(f"strategy.microbatches={self.microbatches} < strategy.pp={self.pp}: "
                       f"{self.schedule} needs at least one micro-batch per stage in flight; "
                       f"{self._count_fix(b)} (or schedule=gpipe)")
        elif self.schedule in ("interleaved_1f1b", "interleaved_zb") and self.microbatches % self.pp:
            out.append(f"strategy.microbatches={self.microbatches} must be a multiple of "
                       f"strategy.pp={self.pp} for {self.schedule}: {self._count_fix(b)}")
        return out

    def _count_fix(self, b: Any) -> str:
        """The micro-batch counts this schedule runs that the batch divides into (global =
        micro x microbatches x dp x accumulation), else the batch changes that make one."""
        g, m, dp = b.global_size, b.micro_size, b.dp
        n = g // (m * dp) if m >= 1 and dp >= 1 and g % (m * dp) == 0 else 0
        counts = [c for c in range(1, n + 1) if n % c == 0 and self._runs(c)]
        if counts:
            return f"set strategy.microbatches={_either(counts)}"
        least = self.pp if self.schedule != "gpipe" else 1
        what = f"multiple of {self.pp}" if self.schedule.startswith("interleaved") else \
            f"count of {least} or more"
        per = f" per data-parallel replica (of {dp})" if dp > 1 else ""
        holds = (f"the {n} micro-batches of {m} a step holds{per}" if n else
                 f"global_batch_size({g}) / (micro_batch_size({m}) x data-parallel size({dp}))")
        return f"no {what} divides {holds}; set strategy.microbatches={least} with {self._batch_change(b)}"

    def _batch_change(self, b: Any) -> str:
        """trainer.global_batch_size / micro_batch_size values whose micro-batches per step
        (global / (micro x dp)) the schedule runs: a multiple of pp (1 for gpipe)."""
        g, m, dp = b.global_size, b.micro_size, b.dp
        least = self.pp if self.schedule != "gpipe" else 1
        unit = max(1, m) * dp * least
        lo = g // unit * unit
        sizes = [v for v in (lo, lo + unit) if v >= unit]
        fix = f"trainer.global_batch_size={_either(sizes)}"
        per = g // (dp * least) if g % (dp * least) == 0 else 0
        micros = [d for d in range(1, per + 1) if per % d == 0]
        return fix + (f", or trainer.micro_batch_size={_either(micros)}" if micros else "")

    def model_problems(self, model: Any) -> list[str]:
        """Problems of this preset with the model's shape (``recipes.config.ModelConfig``)."""
        cut = super().model_problems(model)
        if cut:
            return cut
        out = []
        seq_len = getattr(model, "seq_len", None)
        if self.cp > 1 and isinstance(seq_len, int) and seq_len % (2 * self.cp):
            out.append(f"model.seq_len={seq_len} is not divisible by 2 x strategy.cp={self.cp} = "
                       f"{2 * self.cp}: torch's load balancing cuts the causal sequence into 2 x cp "
                       f"chunks (each rank one early and one late); choose seq_len a multiple of "
                       f"{2 * self.cp} or another cp")
        dropout = getattr(model, "dropout", 0.0)
        if self.cp > 1 and isinstance(dropout, (int, float)) and dropout > 0:
            # measured (CPU, torch 2.13): the ranks fail inside scaled_dot_product_attention
            # (aten.add.Tensor mixing a Tensor and a DTensor); the residual dropout alone runs
            out.append(f"model.dropout={dropout} with strategy.cp={self.cp}: context parallelism "
                       "(torch's ring attention) does not run attention dropout -- on CPU the ranks "
                       "fail inside scaled_dot_product_attention, and torch's CUDA ring backward "
                       "reuses one chunk's dropout seed for every chunk; set model.dropout=0, or "
                       "shard the sequence with a preset without context parallelism "
                       "(strategy=ulysses or zero3_ulysses)")
        if self.sequence_parallel and self.tp > 1 and isinstance(seq_len, int) and \
                (seq_len // self.cp) % self.tp and not seq_len % self.cp:
            per = f" / strategy.cp={self.cp} = {seq_len // self.cp}" if self.cp > 1 else ""
            out.append(f"model.seq_len={seq_len}{per} is not divisible by strategy.tp={self.tp}: "
                       "sequence parallelism shards the sequence between the tensor-parallel "
                       f"regions over the tp ranks; choose seq_len a multiple of {self.tp * self.cp}"
                       " or set strategy.sequence_parallel=false")
        if self.tp > 1:
            for key, attr in (("n_heads",) * 2, ("n_kv_heads",) * 2, ("ffn_dim", "hidden"), ("vocab_size",) * 2):
                value = getattr(model, attr, None)  # (the MLP's width: ffn_dim, or the one it implies)
                if isinstance(value, int) and value % self.tp:
                    out.append(f"model.{key}={value} is not divisible by strategy.tp={self.tp}: "
                               f"tensor parallelism splits it over the tp ranks; choose tp "
                               f"dividing {key} (or another model)")
        if self.pp > 1:
            n, stages = model.n_layers, self.n_stages()
            if stages > n:
                out.append(f"strategy.pp={self.pp} x virtual_stages={self.virtual()} = {stages} "
                           f"stages > model.n_layers={n}: every stage needs a block; lower pp or "
                           "virtual_stages")
            if self.split is not None and (len(self.split) != stages or sum(self.split) != n
                                           or min(self.split) < 1):
                out.append(f"strategy.split={list(self.split)} must list {stages} stage sizes "
                           f">= 1 summing to model.n_layers={n}")
            if getattr(model, "tie_embeddings", False):
                out.append("model.tie_embeddings=true with strategy.pp > 1: the embedding (first "
                           "stage) and the head (last stage) would share one weight across ranks; "
                           "set model.tie_embeddings=false")
        return out

    def footprint(self) -> FSDPFootprint:
        # FSDP2 over the data-parallel ranks; TP and PP split what each replica holds (the
        # planner divides by tp x pp). Gradients are reduce-scattered in fp32 whatever the
        # precision, as ``plan`` builds FSDP2 (reduce_fp32=True).
        return FSDPFootprint(reshard_after_forward=self.reshard_after_forward, reduce_fp32=True, fsdp2=True)

    def low_precision_weights(self, mesh: Mesh) -> bool:
        # FSDP2's MixedPrecisionPolicy casts the weights only where it shards: dp > 1 (``plan``)
        return mesh.dp > 1

    def plan(self, mesh: Mesh) -> ParallelPlan:
        # FSDP2 over dp x cp (torchtitan folds cp into the shard group)
        fsdp = FSDP2Plan(self.reshard_after_forward, reduce_fp32=True) if mesh.dp_seq > 1 else None
        return ParallelPlan(tp=self.tp, sequence_parallel=self.sequence_parallel, cp=self.cp,
                            activation_checkpointing=self.activation_checkpointing,
                            ac_every=self.ac_every, fsdp=fsdp)

    def world_role(self, mesh: Mesh) -> str:
        # A mesh dimension spanning every rank is the world group itself (torch reuses it).
        for axis, degree in ((Axis.TENSOR, self.tp), (Axis.CONTEXT, self.cp), (Axis.PIPELINE, self.pp)):
            if degree == mesh.size:
                return axis.role
        return Axis.SHARD.role


def _either(values: list[int], most: int = 6) -> str:
    """1, 2 or 4 (the first ``most``)."""
    shown = [str(v) for v in values[:most]]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


__all__ = ["ParallelConfig"]
