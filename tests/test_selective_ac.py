"""strategy.activation_checkpointing=selective (per-op SAC: each block keeps its matmul and
attention outputs and recomputes the rest, parallel/checkpointing.py) and strategy.ac_every
(checkpoint every n-th block): the same losses and final parameters as the run without
checkpointing, fewer saved bytes than it (more than full checkpointing), priced by the planner,
and bad values refused at validate.

Tolerance: checkpointing re-runs the same ops on the same inputs with the same RNG state, so the
recomputed tensors are bitwise the ones a plain forward makes: measured 0.0 on gpt_nano (losses
and parameters, SGD and AdamW, one process). Asserted: the equivalence tests' EXACT (1e-5).
"""

from __future__ import annotations

import pytest

from recipes.config import compose
from recipes.job import validate
from strategies import ConfigError
from tests.cases import CASES, EXACT
from tests.conftest import OPTIMIZERS, EQUIV, assert_losses_close, assert_params_close

pytestmark = pytest.mark.timeout(900)
CPU = ("cluster.accelerator=cpu",)
SELECTIVE = ("strategy.activation_checkpointing=selective",)
EVERY2 = ("strategy.activation_checkpointing=true", "strategy.ac_every=2")


def _shape(layers: int = 2, dim: int = 32, seq: int = 32, dropout: float = 0.0):
    from recipes.config import ModelConfig

    return ModelConfig(name="gpt", dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2,
                       vocab_size=256, seq_len=seq, dropout=dropout, ffn_dim=4 * dim)


def _saved(mode, every: int = 1, *, layers: int = 2, dropout: float = 0.0):
    """(bytes saved for backward by one forward, bytes still counted after backward, grads) of a
    small GPT checkpointed as ``mode`` (the memory observer's counter: autograd's saved-tensor
    hooks, plus what the selective policy caches)."""
    import torch

    from parallel.memory import SavedTensors
    from parallel.parallelize import checkpoint_blocks
    from recipes.training import build_model

    model = build_model(_shape(layers, dropout=dropout), 0)
    if mode:
        checkpoint_blocks(model, mode, every=every)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)  # (the dropout masks)
    with SavedTensors(buffers=model.buffers()) as saved:
        out = model(tokens)
        out.float().pow(2).mean().backward()
    return saved.bytes, saved.live, [p.grad for p in model.parameters()]


# ----------------------------------------------------------------------------- in one process
@pytest.mark.unit
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_selective_saves_less_than_none_more_than_full_same_gradients(dropout):
    """none > selective > full in bytes saved by one forward; the gradients are bitwise equal
    (dropout too: the RNG state is restored for the recomputation); every count is released by
    the backward (the selective cache's too)."""
    none, selective, full = (_saved(m, dropout=dropout) for m in (False, "selective", True))
    every2 = _saved(True, 2, dropout=dropout)
    assert none[0] > every2[0] > full[0]
    assert none[0] > selective[0] > full[0], (none[0], selective[0], full[0])
    for run in (selective, full, every2):
        assert run[1] == 0
        assert all(bool((a == b).all()) for a, b in zip(none[2], run[2]))


@pytest.mark.unit
def test_planner_selective_block_equals_the_measured_block():
    """The planner's per-op count of a selectively checkpointed block (its input, Q, K, V, the
    attention output and log-sum-exp, both projections, gate, up and down) is what a block
    really keeps: measured as the difference between a 2- and a 1-block model, fp32."""
    from planner.activations import activation_parts, selective_block_bytes

    per_block = {m: _saved(m, layers=2)[0] - _saved(m, layers=1)[0] for m in (False, "selective")}
    shape = _shape(2)
    assert selective_block_bytes(shape, micro=2, elem=4) == per_block["selective"]
    assert activation_parts(shape, micro=2, elem=4, regime="32")[0] == per_block[False]


@pytest.mark.unit
def test_planner_selective_between_none_and_full_every_n_interpolates():
    from planner.activations import activation_bytes, recomputed_share

    shape = _shape(8)
    for regime in ("32", None):  # calibrated, and the closed forms
        kw = dict(micro=2, elem=4, regime=regime)
        none, full = activation_bytes(shape, ckpt=False, **kw), activation_bytes(shape, ckpt=True, **kw)
        sel = activation_bytes(shape, ckpt="selective", **kw)
        assert none > sel > full
        every = [activation_bytes(shape, ckpt=True, every=n, **kw) for n in (1, 2, 4)]
        assert full == every[0] < every[1] < every[2] < none
        assert none > activation_bytes(shape, ckpt="selective", every=2, **kw) > sel
    assert recomputed_share(True, 1, 8) == 1 and recomputed_share(True, 4, 8) == 0.25
    assert recomputed_share("selective", 1, 8) == 0 == recomputed_share(False, 1, 8)


@pytest.mark.unit
def test_plan_reports_selective_between_none_and_full():
    """Through the planner on a preset: the activations planned, and no recomputed matmul
    FLOPs under selective."""
    import planner
    from tests.conftest import typed

    def plan(*o):
        return planner.preflight(typed(compose(["model=gpt_nano", "strategy=single", *CPU, *o])))

    none = plan()
    sel = plan("strategy.activation_checkpointing=selective")
    full = plan("strategy.activation_checkpointing=true")
    assert none.memory.activations > sel.memory.activations > full.memory.activations
    assert sel.activation_checkpointing == "selective"
    assert sel.flops_per_step == none.flops_per_step < full.flops_per_step
    whatif = plan("planner.activation_checkpointing=selective")
    assert whatif.memory.activations == sel.memory.activations


# ----------------------------------------------------------------------------- the values
@pytest.mark.unit
@pytest.mark.parametrize("value, expected", [("true", True), ("false", False), ("selective", "selective")])
def test_values_compose_from_the_command_line(value, expected):
    from parallel.parallelize import plan_for

    job = validate(compose(["strategy=fsdp2", "cluster.devices=2", *CPU,
                            f"strategy.activation_checkpointing={value}"]))
    assert job.strategy.activation_checkpointing is expected or job.strategy.activation_checkpointing == expected
    assert plan_for(job.strategy, job.run).activation_checkpointing == expected
    job = validate(compose(["strategy=fsdp2", "cluster.devices=2", *CPU, "strategy.ac_every=2",
                            "strategy.activation_checkpointing=true"]))
    assert plan_for(job.strategy, job.run).ac_every == 2
    planned = validate(compose(["planner.activation_checkpointing=null", *CPU]))
    assert planned.cfg.planner.activation_checkpointing is None


@pytest.mark.unit
@pytest.mark.parametrize("overrides, message", [
    (("strategy.activation_checkpointing=sometimes",),
     "strategy.activation_checkpointing='sometimes' is not one of False, True, selective"),
    (("strategy.activation_checkpointing=1",), "strategy.activation_checkpointing=1: not one of false, true, selective"),
    (("strategy.ac_every=2",), "strategy.ac_every=2 with strategy.activation_checkpointing=false"),
    (("strategy.ac_every=0", "strategy.activation_checkpointing=true"), "strategy.ac_every=0: must be >= 1"),
    (("strategy.ac_every=3", "strategy.activation_checkpointing=true"), "strategy.ac_every=3 > model.n_layers=2"),
    (("strategy=fsdp", "cluster.devices=2", "strategy.activation_checkpointing=selective"),
     "strategy.activation_checkpointing=selective with strategy=fsdp: FSDP1"),
    (("strategy=fsdp", "cluster.devices=2", "strategy.activation_checkpointing=true", "strategy.ac_every=2"),
     "strategy.ac_every=2 with strategy=fsdp: FSDP1"),
    (("planner.activation_checkpointing=maybe",), "planner.activation_checkpointing='maybe' is not one of"),
    # expert parallelism: measured failing in backward (torch 2.13, gloo): the token all-to-all's
    # record_function ops recur more often in the recomputation than SAC's cache holds
    *[((f"strategy={p}", "cluster.devices=2", "model=gpt_moe_nano", "strategy.activation_checkpointing=selective"),
       f"strategy.activation_checkpointing=selective with strategy={p}: the experts' token all-to-all")
      for p in ("fsdp_ep", "zero2_ep")],
])
def test_bad_values_are_one_config_error(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=gpt_nano", *CPU, *overrides]))
    assert message in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- through train.py
@pytest.mark.subprocess
@pytest.mark.parametrize("ac, optimizer", [
    # (SGD shows any gradient error; AdamW, which divides a constant scale out, in the slow tier)
    pytest.param(SELECTIVE, o, id=f"selective-{o}", marks=[pytest.mark.slow] if o == "adamw" else [])
    for o in OPTIMIZERS] + [
    pytest.param(EVERY2, "sgd", id="every2-sgd"),
    # (every n-th block whole is the old wrapper on fewer blocks: SGD shows any gradient error)
    pytest.param(EVERY2, "adamw", id="every2-adamw", marks=pytest.mark.slow)])
def test_single_equals_no_checkpointing(reference, cached, optimizer, ac):
    """gpt_nano on one process: the losses and final parameters of the run without
    checkpointing; the selective run saves fewer bytes than it (the memory observer)."""
    off = reference(optimizer)
    on = cached(*EQUIV, *OPTIMIZERS[optimizer], "strategy=single", "trainer.micro_batch_size=8", *ac)
    assert_losses_close(off.losses, on.losses, rtol=EXACT[0])
    assert_params_close(off.params(), on.params(), rtol=EXACT[1])
    saved = [r.report["memory"]["ranks"][0]["activations"] for r in (off, on)]
    assert saved[1] < saved[0], saved




@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
@pytest.mark.parametrize("case, extra", [("fsdp2", ()), ("fsdp2", ("strategy.ac_every=2",)),
                                         ("tp", ()), ("1f1b", ()), ("zero2", ()), ("ddp", ())],
                         ids=["fsdp2", "fsdp2-every2", "tp", "pipeline", "zero2", "ddp"])
def test_presets_equal_their_run_without_checkpointing(cached, backend, case, extra):
    """2 ranks, SGD: selective checkpointing under each family that runs through
    parallel/parallelize.py (FSDP2 on Accelerate through its own parallelize before the plugin
    shards), equal to the same preset without checkpointing."""
    if backend == "accelerate" and CASES[case].accelerate is None:
        pytest.skip(f"{case}: not run by backend=accelerate")
    base = (*EQUIV, *OPTIMIZERS["sgd"], *CASES[case].overrides, f"backend={backend}")
    off = cached(*base)
    on = cached(*base, "strategy.activation_checkpointing=selective", *extra)
    assert_losses_close(off.losses, on.losses, rtol=EXACT[0])
    assert_params_close(off.params(), on.params(), rtol=EXACT[1])



# ----------------------------------------------------------------------------- the planner's presets
def _as_named(cfg, name: str):
    """``cfg`` with strategy=<name> (the preset's node, as Hydra composes it: strategies/presets.py)."""
    from strategies.presets import node

    out = cfg.copy()
    out.strategy = node(name)
    return out


@pytest.mark.unit
def test_planner_selective_ranks_only_presets_the_validator_takes():
    """planner.activation_checkpointing=selective: a preset that refuses selective checkpointing
    (FSDP1's, the expert-parallel ones) is "cannot run" with that reason and never the
    recommendation (fsdp was, and its "run it" command was refused); every row that runs, and
    the recommendation as printed, pass the validator a user's explicit strategy= meets."""
    import planner
    from recipes.job import CONFIG

    cfg = compose(["model=llama_7b", "cluster=node_8x_a100_80g", "planner.activation_checkpointing=selective"])
    report = planner.plan_all(validate(cfg, depth=CONFIG))
    rec, runs = report.recommendation, [p for p in report.plans if p.runnable]
    assert runs and rec.config is not None and rec.config.activation_checkpointing == "selective"
    for name in {p.strategy for p in runs} | {rec.strategy}:
        validate(_as_named(cfg, name), depth=CONFIG)  # raises on a refusal
    printed = _as_named(cfg, rec.strategy)  # the "run it" line: the preset and every key it sets
    for key_value in planner.run_overrides(rec.config)[1:]:
        key, value = key_value.removeprefix("strategy.").split("=")
        printed.strategy[key] = {"true": True, "false": False, "null": None}.get(value, value)
    validate(printed, depth=CONFIG)
    refused = {p.strategy: p for p in report.plans if p.strategy in ("fsdp", "fsdp_hybrid", "fsdp_ep", "zero2_ep")}
    assert len(refused) == 4 and all(p.verdict == "cannot run" for p in refused.values())
    assert "selective with strategy=fsdp: FSDP1" in " ".join(refused["fsdp"].problems)


@pytest.mark.unit
def test_strategy_auto_under_planner_selective_picks_a_preset_that_checkpoints_selectively():
    """strategy=auto never chooses what an explicit strategy= would refuse: it ran FSDP1's
    fsdp_grad_op (full checkpointing) under a plan for selective, step time 25% low."""
    import planner
    from recipes.job import CONFIG

    cfg = compose(["model=gpt_nano", *CPU, "cluster.devices=2", "cluster.device_memory_GB=0.0046",
                   "planner.activation_checkpointing=selective", "strategy=auto"])
    auto = validate(cfg, depth=CONFIG, auto=planner.choose)
    assert auto.strategy.activation_checkpointing == "selective"
    assert auto.strategy.capabilities.selective_checkpointing and not auto.strategy.SELECTIVE_REFUSED
    validate(_as_named(cfg, auto.strategy.name), depth=CONFIG)
