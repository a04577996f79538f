"""The one table of training cases every matrix reads: the equivalence tests (each family's
module), the Accelerate backend's, the observers' and the resume tests'. A case is a preset on
a world, with the overrides that make it one run (on top of ``conftest.EQUIV`` and an optimizer),
so the session cache (``conftest.cached``) trains each run once whichever test asks first.

Each case says what must hold of it: how many ranks, the accumulation, the tolerances against
the single-process reference, what each rank holds (a fraction of the full fp32 model ``P`` with
AdamW), and what Accelerate must build for it (None: Accelerate does not run it).
"""

from __future__ import annotations

from dataclasses import dataclass

P = 34976 * 4  # gpt_nano's parameters, fp32 bytes
TWO = ("cluster.devices=2",)
FOUR = ("cluster.devices=4", "cluster.oversubscribe=true")
# ZeRO-3 with DeepSpeed's default (1e5 elements) would keep every gpt_nano parameter whole.
SHARD_ALL = "strategy.param_persistence_threshold=0"
CKPT3 = "trainer.checkpoint_every=3"
# (distributed type, wrapped model) Accelerate must build
DDP, FSDP, FSDP2, DS = (("MULTI_CPU", "DistributedDataParallel"), ("FSDP", "FullyShardedDataParallel"),
                        ("FSDP", "FSDPGPT"), ("DEEPSPEED", "DeepSpeedEngine"))
EXACT, FP16 = (1e-5, 1e-5), (1e-4, 1e-3)  # (losses, parameters), relative to the reference


@dataclass(frozen=True)
class Case:
    overrides: tuple[str, ...]
    world: int
    micro: int
    accelerate: tuple[str, str] | None = None
    tolerance: tuple[float, float] = EXACT
    held: dict[str, float] | None = None
    """params / grads / optimizer each rank holds after a step, as a fraction of P (AdamW)."""
    shard: int = 1
    """Ranks a sharded state is split over (plain SGD holds 2 x P / shard less: no moments)."""
    seq: int = 1
    """Ranks that read the same samples, each a sequence shard (Ulysses' sp)."""

    @property
    def accumulation(self) -> int:
        return 8 // (self.world // self.seq * self.micro)

    def held_with(self, optimizer: str) -> dict[str, float]:
        held = dict(self.held or {})
        if optimizer == "sgd" and "optimizer" in held:
            held["optimizer"] -= 2 / self.shard
        return held


def _ddp(preset: str, micro: int = 4, **kw) -> Case:
    return Case((f"strategy={preset}", *TWO, f"trainer.micro_batch_size={micro}"), 2, micro, DDP, **kw)


def _zero(preset: str, micro: int, held: dict[str, float], *extra: str) -> Case:
    return Case((f"strategy={preset}", *TWO, f"trainer.micro_batch_size={micro}", *extra), 2, micro, DS,
                held=held, shard=2)


_FSDP_HELD = {"params": 0.5, "grads": 0.5, "optimizer": 1.0}  # 1/2 each; Adam's 2 moments
_ZERO12 = {"params": 1.0, "grads": 0.5, "optimizer": 1.5}  # + the fp32 master partition
_ZERO3 = {"params": 0.5, "grads": 0.5, "optimizer": 1.5}

CASES: dict[str, Case] = {
    "single": Case(("strategy=single", "trainer.micro_batch_size=8"), 1, 8, ("NO", "GPT")),
    "ddp": _ddp("ddp", held={"params": 1.0, "grads": 1.0, "optimizer": 2.0}),
    "ddp-accumulation": _ddp("ddp", micro=2),
    "ddp_fp16_compress": _ddp("ddp_fp16_compress", tolerance=FP16),
    "fsdp": Case(("strategy=fsdp", *TWO, "trainer.micro_batch_size=4", CKPT3), 2, 4, FSDP,
                 held=_FSDP_HELD, shard=2),
    "fsdp-accumulation": Case(("strategy=fsdp", *TWO, "trainer.micro_batch_size=2"), 2, 2, FSDP,
                              held=_FSDP_HELD, shard=2),
    "fsdp_grad_op": Case(("strategy=fsdp_grad_op", *TWO, "trainer.micro_batch_size=4"), 2, 4, FSDP,
                         held=_FSDP_HELD, shard=2),
    "fsdp_grad_op-ac": Case(("strategy=fsdp_grad_op", *TWO, "trainer.micro_batch_size=4",
                             "strategy.activation_checkpointing=true"), 2, 4, held=_FSDP_HELD, shard=2),
    "fsdp_hybrid": Case(("strategy=fsdp_hybrid", *FOUR, "strategy.shard_group_size=2",
                         "trainer.micro_batch_size=2"), 4, 2, held=_FSDP_HELD, shard=2),
    "fsdp2": Case(("strategy=fsdp2", *TWO, "trainer.micro_batch_size=4", CKPT3), 2, 4, FSDP2,
                  held=_FSDP_HELD, shard=2),
    "hsdp2-ac": Case(("strategy=hsdp2", *FOUR, "strategy.shard_group_size=2", "trainer.micro_batch_size=2",
                      "strategy.activation_checkpointing=true"), 4, 2, held=_FSDP_HELD, shard=2),
    "zero1": _zero("zero1", 4, _ZERO12),
    "zero2": _zero("zero2", 4, _ZERO12),
    "zero2_offload": _zero("zero2_offload", 4, _ZERO12),
    "zero3": _zero("zero3", 4, _ZERO3, SHARD_ALL),
    # offload: the reduced gradient partition is also copied into the CPU fp32 master's .grad,
    # where the CPU optimizer steps it; ZeRO-3 keeps its device partition too (2 x P/N)
    "zero3_offload": _zero("zero3_offload", 4, {**_ZERO3, "grads": 1.0}, SHARD_ALL),
    "zero2-accumulation": _zero("zero2", 2, _ZERO12),
    "zero3-accumulation": _zero("zero3", 2, _ZERO3, SHARD_ALL),
    # tensor and pipeline parallel (Lightning only): global 8 = micro 8 for TP (one replica),
    # micro 1-2 x 4 micro-batches x accumulation for a 2-stage pipeline, micro 2 x 2 on 2 replicas
    "tp": Case(("strategy=tp", *TWO, "trainer.micro_batch_size=8"), 2, 8),
    "tp-sp": Case(("strategy=tp", *TWO, "trainer.micro_batch_size=4", "strategy.sequence_parallel=true"), 2, 4),
    "gpipe": Case(("strategy=pipeline", *TWO, "strategy.schedule=gpipe", "trainer.micro_batch_size=1",
                   "strategy.microbatches=4"), 2, 1),
    "1f1b": Case(("strategy=pipeline", *TWO, "strategy.schedule=1f1b", "trainer.micro_batch_size=2"), 2, 2),
    "fsdp_tp": Case(("strategy=fsdp_tp", *FOUR, "trainer.micro_batch_size=4"), 4, 4),
    # sequence parallel (Ulysses, tests/test_sequence.py): sp 2 on 2 ranks is one data-parallel
    # replica; ZeRO shards over every rank (dp x sp)
    # (ZeRO-1 with accumulation 2: the full gradients at the step, tests/test_sequence.py)
    "ulysses": Case(("strategy=ulysses", *TWO, "trainer.micro_batch_size=4"), 2, 4,
                    held={**_ZERO12, "grads": 1.0}, shard=2, seq=2),
    "zero3_ulysses": Case(("strategy=zero3_ulysses", *FOUR, "trainer.micro_batch_size=2", SHARD_ALL), 4, 2,
                          shard=4, seq=2),
    # context parallel (torch's ring attention, tests/test_sequence.py): cp 2 on 2 ranks is one
    # replica, FSDP2 over dp x cp; on 4: dp 2 x cp 2, and cp 2 x tp 2 (3d's cp knob)
    "fsdp_cp": Case(("strategy=fsdp_cp", *TWO, "trainer.micro_batch_size=4"), 2, 4, held=_FSDP_HELD,
                    shard=2, seq=2),
    "fsdp_cp-dp": Case(("strategy=fsdp_cp", *FOUR, "trainer.micro_batch_size=2"), 4, 2, seq=2),
    "3d-cp-pp": Case(("strategy=3d", *FOUR, "strategy.cp=2", "strategy.tp=1", "strategy.pp=2",
                      "trainer.micro_batch_size=2"), 4, 2, seq=4),
    "3d-cp-tp": Case(("strategy=3d", *FOUR, "strategy.cp=2", "strategy.tp=2", "strategy.pp=1",
                      "trainer.micro_batch_size=4"), 4, 4, seq=4),
    "pp_dp": Case(("strategy=pp_dp", *FOUR, "trainer.micro_batch_size=2", "strategy.microbatches=2"), 4, 2),
}


def case(name: str) -> tuple[str, ...]:
    """A case's overrides (on top of EQUIV and an optimizer)."""
    return CASES[name].overrides


def on_accelerate() -> list[str]:
    return [name for name, c in CASES.items() if c.accelerate is not None]
