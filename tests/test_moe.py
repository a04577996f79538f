"""Mixture of experts and expert parallelism: the MoE GPT (routing, capacity, the balancing loss),
its shapes and their problems, the planner's expert split and token all-to-all, and fsdp_ep on
2 gloo ranks (ep=2) against the same MoE model on one process (zero2_ep: tests/test_zero2_ep.py).

Equivalence: routing, capacity and the balancing loss are computed per sequence (each sequence
is a routing group), so a data-parallel split of the batch decides exactly what one process
decides, dropping included; the equivalence runs use gpt_moe_nano's capacity_factor 2.0 (no
drops: every slot of a sequence fits) and a separate test shows drops are counted. Tolerance:
losses 1e-5 relative; parameters 1e-5 with SGD, 1e-3 with AdamW (as tests/test_parallel.py).
"""

from __future__ import annotations

import pytest

from recipes.config import compose, describe
from recipes.job import validate
from strategies import ConfigError
from tests.conftest import (EQUIV, OPTIMIZERS, assert_losses_close, assert_moe_close, assert_params_close,
                            run_cli, typed)

MOE = ("model=gpt_moe_nano",)
CPU = ("cluster.accelerator=cpu",)
TWO = ("cluster.devices=2",)
PARAMS_RTOL = {"sgd": 1e-5, "adamw": 1e-3}


# ----------------------------------------------------------------------------- the model
@pytest.mark.unit
@pytest.mark.parametrize("name, total, experts", [
    ("gpt_moe_nano", 72_096, 49_152),
    ("mixtral_8x7b", 46_702_792_704, 45_097_156_608),  # 46.7B (Mixtral's paper)
    ("deepseek_moe_16b", 16_375_728_128, 14_948_499_456),  # 16.4B (DeepSeek-MoE's paper)
])
def test_moe_shapes_count_their_parameters(name, total, experts):
    shape = describe(compose([f"model={name}"]).model)
    assert shape.num_params() == total and shape.expert_params() == experts


@pytest.mark.unit
def test_moe_model_matches_its_count_and_a_token_by_token_reference():
    import torch

    from recipes.training import build_model

    shape = describe(compose([*MOE]).model)
    model = build_model(shape, 1)
    assert sum(p.numel() for p in model.parameters()) == shape.num_params()
    moe = model.layers["0"].mlp
    x = torch.randn(2, 32, 32)
    y = moe(x)
    probs = torch.softmax(moe.router(x), -1)
    top_p, top_i = probs.topk(2, -1)
    w = top_p / top_p.sum(-1, keepdim=True)
    e = moe.experts
    ref = torch.zeros_like(x)
    for b in range(2):
        for t in range(32):
            for j in range(2):
                i = top_i[b, t, j]
                h = torch.nn.functional.silu(x[b, t] @ e.w1[i]) * (x[b, t] @ e.w3[i])
                ref[b, t] += w[b, t, j] * (h @ e.w2[i])
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert int(moe.stats["dropped"]) == 0 and int(moe.stats["tokens"].sum()) == 2 * 32 * 2
    # the balancing loss: n_experts x sum_e f_e P_e, 1 when perfectly balanced
    assert float(moe.aux_loss.detach()) >= 1.0 - 1e-6


@pytest.mark.unit
def test_tokens_over_capacity_are_dropped_and_counted():
    """capacity_factor 0.5: ceil(0.5 x 32 x 2 / 4) = 8 slots per expert and sequence, 32 of a
    sequence's 64 assignments kept, the rest dropped (they keep their residual)."""
    import torch

    from recipes.training import build_model

    shape = describe(compose([*MOE, "model.capacity_factor=0.5"]).model)
    assert shape.capacity() == 8
    model = build_model(shape, 1)
    model(torch.randint(0, 256, (3, 32)))
    stats = model.layers["0"].mlp.stats
    assert stats["tokens"].tolist() == [24, 24, 24, 24]
    assert int(stats["dropped"]) == 3 * 64 - 96


@pytest.mark.unit
def test_the_moe_report_of_a_resumed_run_covers_the_whole_run():
    """observers/moe.py: the router's record rides in the checkpoint's history (JSON, the run's
    totals so far), so a run resumed at step 3 of 6 reports what the uninterrupted run does, not
    its last three steps (capacity 1.0: some drops, counted too)."""
    import json
    from types import SimpleNamespace

    import torch

    from observers.moe import MoEStats
    from recipes.training import build_model

    shape = describe(compose([*MOE, "model.capacity_factor=1.0"]).model)
    engine = SimpleNamespace(model=build_model(shape, 1))
    batches = [torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def steps(stats, first, last):
        for step in range(first, last):
            with torch.no_grad():
                engine.model(batches[step])
            stats.on_forward_end(engine, step)
            stats.on_step_end(engine, step + 1, 0.0)

    whole, first, resumed = MoEStats(), MoEStats(), MoEStats()
    steps(whole, 0, 6)
    steps(first, 0, 3)
    saved = json.loads(json.dumps(first.history()))  # (history.json)
    resumed.on_resume(engine, 3, saved)
    steps(resumed, 3, 6)
    for stats in (whole, resumed):
        stats.on_train_end(engine)
    want = whole.report()["moe"]
    assert want["dropped_tokens"] > 0
    assert_moe_close(want, resumed.report()["moe"])
    last_three = MoEStats()
    steps(last_three, 3, 6)
    last_three.on_train_end(engine)
    assert last_three.report()["moe"]["tokens_per_expert"] != want["tokens_per_expert"]


@pytest.mark.unit
@pytest.mark.parametrize("overrides, needle", [
    (("model.top_k=5",), "model.top_k=5 > model.n_experts=4"),
    (("model.capacity_factor=0",), "model.capacity_factor=0.0: must be > 0"),
    (("strategy=fsdp_ep", *TWO, "model.n_experts=3", "model.top_k=1"),
     "model.n_experts=3 is not divisible by strategy.ep=2"),
    (("strategy=fsdp_ep", "cluster.devices=3", "cluster.oversubscribe=true"),
     "strategy.ep=2 must divide dp_shard(3) * cp(1) = 3"),
    (("strategy=tp", *TWO), "strategy=tp with a mixture-of-experts model"),
])
def test_bad_moe_shapes_one_clear_error_each(overrides, needle):
    with pytest.raises(ConfigError) as e:
        validate(compose([*MOE, *CPU, *overrides]))
    assert len(e.value.problems) == 1 and needle in e.value.problems[0], e.value.problems


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["fsdp_ep", "zero2_ep"])
@pytest.mark.parametrize("overrides, needle, fixes", [
    # 3 experts on 2 data-parallel ranks: only ep=1 divides both (ep=3 was once suggested)
    ((*TWO, "model.n_experts=3", "model.top_k=1"),
     "no ep > 1 divides both: set model.n_experts=4 (a multiple of strategy.ep=2), or strategy.ep=1",
     [("model.n_experts=4",), ("strategy.ep=1",)]),
    # 6 experts on 4 ranks: ep 2 divides both, 3 and 6 only the experts
    (("cluster.devices=4", "cluster.oversubscribe=true", "trainer.micro_batch_size=4", "model.n_experts=6",
      "model.top_k=1", "strategy.ep=4"), "choose ep among 1, 2 (dividing both)", [("strategy.ep=2",)]),
])
def test_expert_degree_refusal_names_only_degrees_that_fit(preset, overrides, needle, fixes):
    """ep must divide model.n_experts and the data-parallel ranks it folds into: the refusal
    lists only degrees dividing both, or names the n_experts change; each fix validates."""
    with pytest.raises(ConfigError) as e:
        validate(compose([*MOE, *CPU, f"strategy={preset}", *overrides]))
    assert len(e.value.problems) == 1 and needle in e.value.problems[0], e.value.problems
    for fix in fixes:
        validate(compose([*MOE, *CPU, f"strategy={preset}", *overrides, *fix]))


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["fsdp_ep", "zero2_ep"])
def test_ep_presets_refuse_a_dense_model_by_name(preset):
    with pytest.raises(ConfigError) as e:
        validate(compose([f"strategy={preset}", *TWO, *CPU, "model=gpt_nano"]))
    assert f"strategy={preset} shards the experts" in str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["fsdp_ep", "zero2_ep"])
def test_ep_presets_refuse_a_moe_model_without_a_moe_layer(preset):
    """first_dense_layers = n_layers: no routed expert anywhere (it trained as the dense preset,
    the plan saying "0 expert parameters split 2 ways"); one below it is a MoE layer, accepted."""
    base = [f"strategy={preset}", *TWO, *CPU, *MOE]
    with pytest.raises(ConfigError) as e:
        validate(compose([*base, "model.first_dense_layers=2"]))
    assert e.value.problems == [
        f"strategy={preset} shards the experts of a mixture-of-experts model, and "
        "model.first_dense_layers=2 = model.n_layers=2 leaves none (every layer dense): allowed 0..1; "
        "set model.first_dense_layers<=1, or use a dense preset (fsdp2, zero2)"], e.value.problems
    validate(compose([*base, "model.first_dense_layers=1"]))


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["fsdp_ep", "zero2_ep"])
def test_ep_presets_refused_by_accelerate_by_name(preset):
    from backends import check

    with pytest.raises(ConfigError) as e:
        validate(compose([f"strategy={preset}", *TWO, *CPU, *MOE, "backend=accelerate"]), extra=[check])
    assert f"strategy={preset} (expert parallelism) is not supported by backend=accelerate" in str(e.value)


# ----------------------------------------------------------------------------- the planner
@pytest.mark.unit
def test_planner_splits_experts_by_ep_and_prices_the_token_all_to_all():
    """mixtral_8x7b on 8 GPUs, zero2_ep (replicated non-expert parameters, bf16): each rank holds
    the experts' 45.1B parameters 1/ep; the all-to-all is 4 per MoE layer and micro-batch of
    n_experts x micro x capacity x dim x 2 bytes, (ep-1)/ep of it sent per rank."""
    shape = describe(compose(["model=mixtral_8x7b"]).model)
    p2, p8 = _plan("zero2_ep", 2), _plan("zero2_ep", 8)
    dense = shape.num_params() - shape.expert_params()
    assert p8["memory"]["params"] == pytest.approx(2 * (dense + shape.expert_params() / 8), rel=1e-6)
    assert p2["memory"]["params"] - p8["memory"]["params"] == pytest.approx(
        2 * shape.expert_params() * (1 / 2 - 1 / 8), rel=1e-6)
    a2a = p8["communication"]["by_collective"]["moe_all_to_all"]
    cfg = compose(["model=mixtral_8x7b", "cluster=node_8x_h100"])
    micro, accumulation = cfg.trainer.micro_batch_size, p8["microbatches"]
    one = 8 * micro * shape.capacity() * shape.dim * 2
    assert a2a["ranks"] == 8 and a2a["calls"] == 4 * 32 * accumulation
    assert a2a["bytes"] == pytest.approx(4 * 32 * one * 7 / 8 * accumulation, rel=1e-6)


@pytest.mark.unit
def test_an_ep_of_one_says_no_tokens_are_traded():
    """fsdp_ep at ep=1 (deepseek on 8 H100s recommends it) noted a token all-to-all its
    communication table rightly leaves out."""
    p1, p2 = _plan("fsdp_ep", 1), _plan("fsdp_ep", 2)
    assert "moe_all_to_all" not in p1["communication"]["by_collective"]
    assert any("no token all-to-all" in n for n in p1["notes"]), p1["notes"]
    assert any("token all-to-all of n_experts" in n for n in p2["notes"]), p2["notes"]


# deepseek_moe_16b's kind of stack at CPU size: a dense first block, a MoE block with a shared expert
UNEVEN = ("model.n_shared_experts=1", "model.first_dense_layers=1", "model.moe_ffn_dim=32", "model.top_k=1")


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["fsdp2", "fsdp_ep"])
@pytest.mark.parametrize("shape", [(), UNEVEN], ids=["uniform", "uneven"])
def test_fsdp_regathers_the_blocks_as_built(preset, shape):
    """Backward all-gathers every block again (the root is kept): on 2 ranks a rank sends half
    of the blocks' parameters (fsdp_ep: their non-expert ones; ep=2 leaves each expert one
    holder), counted on the built model. A dense first block was priced as a MoE block (the
    uneven stack planned 1.6x the bytes measured: ``test_an_uneven_stack_sends_what_was_planned``)."""
    from planner import plan_dict, preflight
    from recipes.training import build_model

    cfg = compose([*MOE, *CPU, *TWO, f"strategy={preset}", "trainer.micro_batch_size=4", *shape])
    model = build_model(describe(cfg.model), 1)
    held = sum(p.numel() for name, p in model.layers.named_parameters()
               if preset == "fsdp2" or ".experts." not in f".{name}")
    planned = plan_dict(preflight(typed(cfg)))["communication"]["by_collective"]["param_all_gather_backward"]
    assert planned["bytes"] == held * 4 / 2 * 2  # fp32, half sent, 2 micro-batches a step


def _plan(preset: str, ep: int) -> dict:
    from planner import plan_dict, preflight

    cfg = compose(["model=mixtral_8x7b", "cluster=node_8x_h100", f"strategy={preset}", f"strategy.ep={ep}"])
    return plan_dict(preflight(typed(cfg)))


# ----------------------------------------------------------------------------- equivalence
@pytest.fixture(scope="module")
def runs(cached):
    def get(*overrides: str, optimizer: str = "sgd") -> object:
        return cached(*EQUIV, *MOE, *OPTIMIZERS[optimizer], *overrides, timeout=300)

    return get


def _reference(runs, optimizer: str):
    return runs("strategy=single", "trainer.micro_batch_size=8", optimizer=optimizer)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout, optimizer", [
    ("ep2", "sgd"),
    pytest.param("ep2", "adamw", marks=pytest.mark.slow),
    pytest.param("dp4-ep2", "sgd", marks=pytest.mark.slow),
])
def test_ep_matches_the_moe_model_on_one_process(runs, layout, optimizer):
    """ep=2 on 2 ranks (and on 4: two replicas of each expert, FSDP2-sharded between them):
    losses and gathered final parameters equal one process's. With SGD a wrong expert-gradient
    scale (divided by dp / ep instead of dp, or not at all) moves the losses by percents; the
    report's moe key agrees with the reference's."""
    world = {"ep2": (*TWO, "trainer.micro_batch_size=4"),
             "dp4-ep2": ("cluster.devices=4", "cluster.oversubscribe=true", "trainer.micro_batch_size=2")}
    run = runs("strategy=fsdp_ep", *world[layout], optimizer=optimizer)
    ref = _reference(runs, optimizer)
    assert_losses_close(ref.losses, run.losses, rtol=1e-5)
    assert_params_close(ref.params(), run.params(), rtol=PARAMS_RTOL[optimizer])
    moe, want = run.report["moe"], ref.report["moe"]
    assert moe["dropped_tokens"] == want["dropped_tokens"] == 0
    assert moe["aux_loss"] == pytest.approx(want["aux_loss"], rel=1e-5)
    flat = [x for layer in moe["tokens_per_expert"] for x in layer]
    assert flat == pytest.approx([x for layer in want["tokens_per_expert"] for x in layer], rel=1e-9)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_moe_activations_are_planned_from_their_own_calibration(runs):
    """A MoE block saves its router's probabilities, every assignment's indices and weights and
    the capacity slots through the experts (recipes/calibrate.py's moe_block): the measured saved
    tensors equal the plan on one process (within 1%); under ep 2 the exchanged slot buffers the
    experts save come on top, unplanned (measured +3-5%). The dense calibration alone had them
    2.2x low."""
    one = _reference(runs, "sgd").report["predicted_vs_measured"]["activations"]
    assert one["ratio"] == pytest.approx(1.0, abs=0.01), one
    ep = runs("strategy=fsdp_ep", *TWO, "trainer.micro_batch_size=4").report["predicted_vs_measured"]
    assert 1.0 <= ep["activations"]["ratio"] <= 1.06, ep["activations"]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_all_to_all_on_the_ep_group_as_planned(runs):
    """Per step: 2 MoE layers x (dispatch + combine) x (forward + backward) all-to-alls on the
    ep group, each of the whole capacity buffer (4 experts x 4 sequences x 32 slots x 32 dims x
    4 bytes); what the planner predicted, within 2%."""
    run = runs("strategy=fsdp_ep", *TWO, "trainer.micro_batch_size=4")
    a2a = run.report["communication"]["by_group"]["ep"]["all_to_all"]
    assert a2a["count"] == 2 * 4
    assert a2a["bytes"] == 8 * 4 * 4 * 32 * 32 * 4
    planned = run.report["plan"]["communication"]["by_collective"]["moe_all_to_all"]
    assert planned["bytes"] == pytest.approx(a2a["wire_bytes"], rel=0.02)


@pytest.mark.multiprocess
@pytest.mark.slow  # (CI: test_fsdp_regathers_the_blocks_as_built prices it; this measures it)
@pytest.mark.timeout(600)
def test_an_uneven_stack_sends_what_was_planned(runs):
    """fsdp_ep with a dense first block and a shared expert: what the ranks send per step is the
    plan's, within 1% (it was 6% under it, the backward all-gather priced 1.6x high)."""
    run = runs("strategy=fsdp_ep", *TWO, "trainer.micro_batch_size=4", *UNEVEN)
    pvm = run.report["predicted_vs_measured"]["communication"]
    assert pvm["ratio"] == pytest.approx(1.0, abs=0.01), pvm


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_ep_checkpoint_resumes_exactly(runs):
    """The DCP checkpoint holds every expert (the DTensors' full shapes); resuming at step 3
    continues exactly (AdamW: the moments of each rank's experts come back to it), and the
    report's routing covers the whole run (the checkpoint's history carries it)."""
    full = runs("strategy=fsdp_ep", *TWO, "trainer.micro_batch_size=4", "trainer.checkpoint_every=3",
                optimizer="adamw")
    ckpt = full.out / "checkpoints" / "step3"
    assert (ckpt / "COMPLETE").is_file(), sorted(full.out.rglob("*"))
    resumed = runs("strategy=fsdp_ep", *TWO, "trainer.micro_batch_size=4", f"trainer.resume_from={ckpt}",
                   optimizer="adamw")
    assert resumed.losses[:3] == full.losses[:3]
    assert_losses_close(full.losses[3:], resumed.losses[3:], rtol=1e-5)
    assert_params_close(full.params(), resumed.params(), rtol=1e-5)
    assert_moe_close(full.report["moe"], resumed.report["moe"])


@pytest.mark.subprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides, needle", [
    (("model.n_experts=3", "model.top_k=1"), "model.n_experts=3 is not divisible by strategy.ep=2"),
    (("model.top_k=5",), "model.top_k=5 > model.n_experts=4"),
])
def test_invalid_shapes_exit_2_before_launch(tmp_path, overrides, needle):
    run = run_cli("train.py", *MOE, *CPU, "strategy=fsdp_ep", *TWO, *overrides, out=tmp_path / "run",
                  check=False, timeout=120)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert needle in run.log and "Initializing distributed" not in run.log
