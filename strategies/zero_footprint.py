"""What DeepSpeed ZeRO allocates and sends, as the planner prices it (``ZeroFootprint``), and the
ZeRO sizes DeepSpeed's integrations fill from the model's hidden size when a config says "auto".
The typed config that builds it is ``strategies.families.deepspeed.ZeroConfig``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from strategies.footprint import (
    CPU,
    DEVICE,
    SHARDED,
    Footprint,
    Sizes,
    States,
    Traffic,
    final_flush,
    reduction_copies,
)

AUTO = "auto"
UNSHARDED = 0.9
"""ZeRO-3 with this share of the parameters under the persistence threshold is said to shard
(almost) nothing (``ZeroFootprint.notes``)."""
# zero_optimization keys DeepSpeed's integrations fill from the model's hidden size when "auto"
# (accelerate's Accelerator._prepare_deepspeed, transformers' integrations/deepspeed.py):
# key -> (elements for hidden size h, the least value, the typed key it overrides, the rule)
HIDDEN_AUTO = {
    "reduce_bucket_size": (lambda h: h * h, 1, "reduce_bucket_size", "h^2"),
    "stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), 0, "prefetch_bucket_size", "0.9 x h^2"),
    "stage3_param_persistence_threshold": (lambda h: 10 * h, 0, "param_persistence_threshold", "10 x h"),
}


@dataclass(frozen=True)
class ZeroFootprint(Footprint):
    """What DeepSpeed 0.19 allocates, measured: an fp32 master partition beside the working
    parameters (even in fp32 runs), ZeRO-1/2 gradient buckets all-reduced (not reduce-scattered)
    into fixed-size contiguous buffers, ZeRO-1's full gradients until the accumulation boundary,
    ZeRO-3 keeping up to ``stage3_max_live_parameters`` gathered, the step's fp32 copy of the
    gradient partition."""

    master_weights: bool = True
    stage: int = 2
    live_params: int = 0
    """ZeRO-3: parameters kept gathered (stage3_max_live_parameters); only what exceeds it is
    released after forward and gathered again for backward."""
    offload_grad_buffer: bool = False
    """With the optimizer offloaded, ZeRO-3 keeps the reduced gradient partition in a host buffer
    in the gradient dtype beside the fp32 gradient the host optimizer steps."""
    reduce_bucket: int = 0
    """Elements of each gradient-reduction buffer (reduce_bucket_size, contiguous_gradients)."""
    reduce_buckets: int = 2
    """How many such buffers exist (ZeRO-1/2: 2 with overlap_comm, else 1; ZeRO-3: 1)."""
    prefetch: int = 0
    """ZeRO-3: parameter elements gathered ahead of use (stage3_prefetch_bucket_size)."""
    auto: frozenset = frozenset()
    """zero_optimization keys set to "auto": sized from the model's hidden size as Accelerate
    fills them (reduce_bucket_size h^2, stage3_prefetch_bucket_size 0.9 h^2)."""
    sub_group: int = 1_000_000_000
    """ZeRO-3: partition elements the optimizer steps at once (sub_group_size): its fp32
    gradient copy exists for one sub-group at a time."""
    persistence: int = 0  # (ZeRO-3's stage3_param_persistence_threshold: ``persistent``)

    def persistent(self, n: Sizes) -> tuple[float, int]:
        """ZeRO-3: (elements, tensors) of this rank's tensors at most the persistence threshold,
        which DeepSpeed keeps whole beside their partition, never releases nor gathers for
        compute, and all-gathers once after each step (parameter_offload.py
        ``mark_persistent_parameters``, stage3.py ``persistent_parameters``): a model's norms and
        biases, a small model's every tensor; none when only the parameter count is known."""
        if self.stage < 3 or n.model is None or not hasattr(n.model, "tensor_sizes"):
            return 0.0, 0
        limit = self._sized("stage3_param_persistence_threshold", n, self.persistence)
        small = {k: c for k, c in n.model.tensor_sizes().items() if k <= limit}
        return float(sum(k * c for k, c in small.items())) / n.mp, sum(small.values())

    def traffic(self, n: Sizes) -> list[Traffic]:
        out, (persist, tensors) = super().traffic(n), self.persistent(n)
        if persist:  # (after the step: nothing to hide under)
            out.append(Traffic("param_all_gather_persistent", "all_gather", n.shard, n.tp,
                               persist * n.bytes.gather, "none", calls=tensors))
        return out

    def states(self, n: Sizes) -> States:  # (the whole copies stay on the device under offload)
        out, extra = super().states(n), math.ceil(self.persistent(n)[0] * n.bytes.params)
        return dataclasses.replace(out, params=out.params + extra) if extra else out

    def gathered_params(self, n: Sizes) -> float:
        return n.params - self.persistent(n)[0]

    def _sized(self, key: str, n: Sizes, configured: int) -> int:
        return HIDDEN_AUTO[key][0](hidden_size(n)) if key in self.auto else configured

    def _reduce_bucket(self, n: Sizes) -> int:
        return self._sized("reduce_bucket_size", n, self.reduce_bucket)

    def _prefetch(self, n: Sizes) -> int:
        return self._sized("stage3_prefetch_bucket_size", n, self.prefetch)

    def notes(self, n: Sizes) -> list[str]:
        h = hidden_size(n)
        return [f"zero_optimization.{k}=auto: {HIDDEN_AUTO[k][3]} = {HIDDEN_AUTO[k][0](h):,} elements "
                f"(h={h:,}{'' if n.model is not None else ', estimated from the parameter count'}; "
                "as Accelerate fills it)" for k in HIDDEN_AUTO if k in self.auto] + self._unsharded(n)

    def _unsharded(self, n: Sizes) -> list[str]:
        """ZeRO-3 with every (or nearly every) parameter in tensors under the persistence threshold,
        which DeepSpeed keeps whole on every rank: the run is ZeRO-3 by name and shards (almost)
        nothing. A small model under a preset made for large ones (zero3's 1e5 elements), said
        since a user's preset or model misses conf/strategy_model's by-name tweak."""
        persist, tensors = self.persistent(n)
        if not tensors or n.shard < 2:
            return []
        sizes = n.model.tensor_sizes()
        total = sum(sizes.values())
        share = persist * n.mp / max(1, sum(k * c for k, c in sizes.items()))
        if share < UNSHARDED:
            return []
        limit = self._sized("stage3_param_persistence_threshold", n, self.persistence)
        key = ("strategy.param_persistence_threshold" if "stage3_param_persistence_threshold" not in self.auto
               else "zero_optimization.stage3_param_persistence_threshold=auto, 10 x h, so")
        what = ("nothing here: every parameter tensor is" if tensors == total else
                f"almost nothing here: {tensors} of {total} parameter tensors ({share:.0%} of the parameters) are")
        return [f"ZeRO-3 shards {what} under {key}={limit} (elements), which DeepSpeed keeps whole "
                f"on every rank; set strategy.param_persistence_threshold=0 to shard them"]

    def full_grads_at_step(self, n: Sizes) -> bool:
        """ZeRO-1 with accumulation: stage_1_and_2 reduces only at the accumulation boundary
        (``reduce_ready_partitions_and_remove_grads``), so every rank's full ``.grad`` lives
        across the micro-batches and still exists at the step (measured: ratio 1.25 at 2 ranks,
        1.5 at 4 when planned as the partition); the step's ``zero_grad`` frees it."""
        return self.stage == 1 and n.accumulation > 1 and n.shard > 1 and self.optimizer_offload == DEVICE

    def held_grads(self, n: Sizes, split: int) -> int:
        sb = n.bytes
        if self.stage == 1:  # reduced at the accumulation boundary into this rank's partition
            split = math.ceil(n.trainable * sb.grads / (1 if self.full_grads_at_step(n) else n.shard))
        if self.optimizer_offload != DEVICE:
            # the host optimizer steps an fp32 gradient partition (4 B/param whatever the
            # precision); ZeRO-3 also keeps the reduced partition there in the gradient dtype
            split = math.ceil(n.trainable * (4 + (sb.grads if self.offload_grad_buffer else 0)) / n.shard)
        return split

    def grads_released(self, n: Sizes) -> bool:
        return False  # reduced into flat partition buffers the engine keeps

    def freed_at_step(self, n: Sizes) -> float:
        return self.held_grads(n, 0) if self.full_grads_at_step(n) else 0.0

    def bucket_buffer(self, n: Sizes) -> float:
        if not self.reduce_bucket:
            return super().bucket_buffer(n)
        used = n.dp > 1 or self.optimizer_offload != DEVICE
        if not used:
            return 0.0
        bucket = self._reduce_bucket(n)
        if not n.resident:  # (torch.empty of reduce_bucket_size elements each)
            return bucket * self.reduce_buckets * n.bytes.grads
        # on a host only the written pages: each bucket fills with at most the gradients
        # reduced, and the second (overlap_comm) only once they overflow the first
        reduced = n.trainable if self.stage < 3 else n.params  # ZeRO-3 reduces full gradients
        written = min(bucket, reduced) + (min(bucket, max(0.0, reduced - bucket))
                                          if self.reduce_buckets > 1 else 0.0)
        return written * n.bytes.grads

    def backward_extra(self, n: Sizes) -> float:
        # ZeRO-1: full gradients until the boundary's reduction; ZeRO-2/3: the reduction's
        # copies, beside the activations where a bucket is flushed before backward's end
        if self.stage == 1:  # (with accumulation they are the held gradients: states)
            return n.trainable * n.bytes.grads * (n.dp > 1 and not self.full_grads_at_step(n))
        return 0.0 if final_flush(self, n) else reduction_copies(self, n)

    def final_extra(self, n: Sizes) -> float:
        # one flush, at backward's end: the copies after every activation is freed (measured:
        # zero3's growth 342.2 MB against 451.2 planned with them beside the activations)
        return reduction_copies(self, n) if self.stage >= 2 and final_flush(self, n) else 0.0

    def prefetched(self, n: Sizes) -> float:
        return min(self._prefetch(n) / n.mp, n.params) if self._prefetch(n) else n.unit

    def kept_gathered(self, n: Sizes, gathered: float) -> float:
        # what is reused soon stays gathered, up to stage3_max_live_parameters
        if not self.reshard_after_forward:
            return gathered
        # (never more than the model's gathered part: the persistent tensors are states)
        return min(self.gathered_params(n), max(gathered, self.live_params / n.mp))

    def step_extra(self, n: Sizes) -> float:
        # the step's .to(fp32) of the gradient partition (on the host when offloaded)
        if self.optimizer_offload != DEVICE:
            return 0.0
        if self.stage >= 3:
            # stage3's _prepare_fp32_grad_for_sub_group: flatten the sub-group's gradients (a
            # copy in their dtype) and cast it to fp32, one sub_group_size at a time
            part = min(n.trainable / n.shard, self.sub_group)
            return part * (4 + (n.bytes.grads if n.bytes.grads < 4 else 0))
        return n.trainable * 4 / n.shard if n.bytes.grads < 4 else 0.0

    def bucket_size(self, n: Sizes) -> float:
        return (self._reduce_bucket(n) * min(n.bytes.grads, 4) if self.reduce_bucket
                else self.bucket_bytes)

    @property
    def engine(self) -> str:
        """ZeRO-1 and 2 share stage_1_and_2: one measured overhead; offloaded, its own (``*_offload``)."""
        return ("zero3" if self.stage == 3 else "zero2") + ("_offload" if self.optimizer_offload == CPU else "")

    def regathered(self, n: Sizes) -> float:
        return max(0.0, self.gathered_params(n) - self.live_params / n.mp)

    def grad_reduction(self, n: Sizes, grad: float, bucket: float) -> list[Traffic]:
        if self.stage < 3:  # measured: DeepSpeed 0.19 all-reduces ZeRO-1/2 buckets, each rank keeps its part
            return [Traffic("grad_all_reduce", "all_reduce", n.shard, n.tp, grad, "backward",
                            per_micro=self.grads == SHARDED, calls=grad / bucket)]
        calls = grad / bucket if self.reduce_bucket else n.units
        return [Traffic("grad_reduce_scatter", "reduce_scatter", n.shard, n.tp, grad, "backward",
                        per_micro=True, calls=calls)]


def hidden_size(n: Sizes) -> int:
    """The model's hidden size (what Accelerate reads from ``model.config.hidden_size``); with
    planner.params alone, estimated as 128 x layers, L = (P / (12 x 128^2))^(1/3)."""
    if n.model is not None and getattr(n.model, "dim", None):
        return int(n.model.dim)
    return int(128 * max(1.0, (n.total_params / (12 * 128**2)) ** (1 / 3)))
