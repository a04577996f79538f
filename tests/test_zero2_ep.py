"""zero2_ep (family deepspeed_ep): DeepSpeed ZeRO-2 with the MoE model's experts split over ep
ranks (backends/common/deepspeed.py's ``apply_ep_deepspeed``), against the same model on one process.

How it reaches DeepSpeed without patching it: each MoE layer becomes an instance of a subclass of
its class and ``deepspeed.moe.layer.MoE`` (the engine then creates its expert groups), the expert
parameters carry DeepSpeed's own tags (``allreduce=False``, ``group_name``) and the optimizer
gets DeepSpeed's moe parameter groups. ZeRO-2 then reduces each expert gradient over the ranks
holding the same experts, divided by dp (the mean over every rank's loss, as for the rest).

Clipping: DeepSpeed's expert group norm is the square root of a sum over the whole data-parallel
group of each rank's partition (= every expert once), then "averaged" over the expert-data-parallel
group -- of equal values, so the norm, and clipping, equal one process's (measured: the logged
norms agree to 3e-7, and SGD clipped at 0.3 below every step's norm lands on the same parameters).

Checkpoints: payload ``zero_ep`` (checkpoints/state.py): each rank's module and ZeRO-2 state
through the engine's ``state_dict`` / ``load_state_dict``, and the full model (experts gathered).

Tolerances (measured, this 2-core CPU, torch 2.13, DeepSpeed 0.19.8): losses within 2e-7 and
parameters 2e-7 (SGD, 2 and 4 ranks) and 6e-6 (AdamW, 4 ranks); asserted at 1e-5.
"""

from __future__ import annotations

import pytest

from recipes.config import compose
from recipes.job import validate
from strategies import ConfigError
from tests.conftest import (EQUIV, OPTIMIZERS, assert_losses_close, assert_moe_close, assert_params_close,
                            bf16_valued)

MOE = ("model=gpt_moe_nano",)
CPU = ("cluster.accelerator=cpu",)
TWO = ("cluster.devices=2",)
WORLD = {2: (*TWO, "trainer.micro_batch_size=4"),
         4: ("cluster.devices=4", "cluster.oversubscribe=true", "trainer.micro_batch_size=2")}
CLIP = ("trainer.grad_clip=0.3",)  # below every step's gradient norm (0.67-0.80): clips each step


# ----------------------------------------------------------------------------- validation
@pytest.mark.unit
def test_zero2_ep_trains_and_checkpoints_as_zero_ep():
    import strategies

    caps = strategies.load("zero2_ep").capabilities
    assert not caps.planned_only and caps.checkpoint == "zero_ep"
    validate(compose(["strategy=zero2_ep", *TWO, *CPU, *MOE]))  # every other setting at its default


@pytest.mark.unit
@pytest.mark.parametrize("overrides, needle", [
    (("strategy.stage=3",), "strategy.stage=3 with strategy=zero2_ep"),
    (("strategy.sp=2", "cluster.devices=4", "cluster.oversubscribe=true", "trainer.micro_batch_size=2"),
     "strategy.sp=2 with strategy=zero2_ep"),
    (("strategy.offload_optimizer=cpu",), "offloading the expert groups is not built"),
])
def test_what_zero2_ep_does_not_build_is_one_error_each(overrides, needle):
    with pytest.raises(ConfigError) as e:
        validate(compose(["strategy=zero2_ep", *TWO, *CPU, *MOE, *overrides]))
    assert len(e.value.problems) == 1 and needle in e.value.problems[0], e.value.problems


# ----------------------------------------------------------------------------- equivalence
@pytest.fixture(scope="module")
def runs(cached):
    def get(*overrides: str, optimizer: str = "sgd") -> object:
        return cached(*EQUIV, *MOE, *OPTIMIZERS[optimizer], *overrides, timeout=300)

    return get


def _reference(runs, optimizer: str, *extra: str):
    return runs("strategy=single", "trainer.micro_batch_size=8", *extra, optimizer=optimizer)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_zero2_ep_matches_one_process_and_the_plan(runs):
    """2 ranks, ep=2, SGD without clipping (a wrong expert-gradient scale moves the losses by
    percents): losses and gathered final parameters equal one process's; the state bytes and the
    communication are the planner's (within 1%), the token all-to-all on the ep group."""
    run = runs("strategy=zero2_ep", *WORLD[2])
    ref = _reference(runs, "sgd")
    assert_losses_close(ref.losses, run.losses, rtol=1e-5)
    assert_params_close(ref.params(), run.params(), rtol=1e-5)
    pvm = run.report["predicted_vs_measured"]
    assert pvm["state_bytes"]["ratio"] == pytest.approx(1.0, abs=0.01), pvm["state_bytes"]
    assert pvm["communication"]["ratio"] == pytest.approx(1.0, abs=0.01), pvm["communication"]
    assert run.report["communication"]["by_group"]["ep"]["all_to_all"]["count"] == 2 * 4


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world, optimizer, clip", [
    (4, "sgd", ()), (2, "sgd", CLIP), (4, "sgd", CLIP), (4, "adamw", ()),
])
def test_zero2_ep_matches_one_process_on_more_ranks_and_with_clipping(runs, world, optimizer, clip):
    """4 ranks (two replicas of each expert: ZeRO-2 partitions their gradients and optimizer
    state between them), AdamW (EQUIV's grad_clip=1.0), and SGD clipped at 0.3 on every step:
    losses, gradient norms and final parameters equal one process's."""
    run = runs("strategy=zero2_ep", *WORLD[world], *clip, optimizer=optimizer)
    ref = _reference(runs, optimizer, *clip)
    assert_losses_close(ref.losses, run.losses, rtol=1e-5)
    assert run.report["grad_norms"] == pytest.approx(ref.report["grad_norms"], rel=1e-5)
    assert_params_close(ref.params(), run.params(), rtol=1e-5)
    # every group by its role: DeepSpeed's expert-data-parallel group (the two replicas of each
    # expert) found in DeepSpeed's registry, not "group<N>" (observers/comm.py)
    groups = run.report["communication"]["by_group"]
    assert not [g for g in groups if g.startswith("group")], sorted(groups)
    # (on 2 ranks that group is one rank, yet clipping's norm still all-reduces over it: labeled too)
    assert world == 2 or "ep_replicate" in groups, sorted(groups)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero2_ep_checkpoint_resumes_exactly(runs):
    """AdamW, 2 ranks, a checkpoint at step 3: resuming from it continues exactly (each rank's
    experts and their moments come back to it); the checkpoint's full model is the run's, and
    the report's routing covers the whole run."""
    import torch

    full = runs("strategy=zero2_ep", *WORLD[2], "trainer.checkpoint_every=3", optimizer="adamw")
    ckpt = full.out / "checkpoints" / "step3"
    assert (ckpt / "COMPLETE").is_file() and (ckpt / "zero_ep" / "model.pt").is_file()
    resumed = runs("strategy=zero2_ep", *WORLD[2], f"trainer.resume_from={ckpt}", optimizer="adamw")
    assert resumed.losses[:3] == full.losses[:3]
    assert_losses_close(full.losses[3:], resumed.losses[3:], rtol=1e-5)
    assert_params_close(full.params(), resumed.params(), rtol=1e-5)
    last = torch.load(full.out / "checkpoints" / "step6" / "zero_ep" / "model.pt")
    assert_params_close(full.params(), last, rtol=0)
    assert_moe_close(full.report["moe"], resumed.report["moe"])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_zero2_ep_under_bf16_exports_the_fp32_masters(runs):
    """Under bf16-mixed each rank's module holds bf16 copies (its own experts) and ZeRO steps fp32
    masters: params.pt and the checkpoint's model.pt (what convert.py reads) are the masters --
    no tensor bf16-valued, each rounding to the ranks' bf16 weights, experts in rank order (the
    export was those bf16 weights themselves). The dense presets: tests/test_zero.py."""
    import torch

    run = runs("strategy=zero2_ep", *WORLD[2], "trainer.precision=bf16-mixed", "trainer.max_steps=2")
    params = run.params()
    d = run.out / "checkpoints" / "step2" / "zero_ep"
    assert not bf16_valued(params), bf16_valued(params)
    full = torch.load(d / "model.pt")
    assert set(full) == set(params) and all(torch.equal(full[k], params[k]) for k in params)
    ranks = [torch.load(d / f"rank{r}.pt", weights_only=False)["module"] for r in range(2)]
    for k, v in params.items():
        held = ranks[0][k] if ranks[0][k].shape == v.shape else torch.cat([m[k] for m in ranks])
        assert held.dtype == torch.bfloat16 and torch.equal(v.bfloat16(), held), k
