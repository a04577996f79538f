"""Issue 23, "a planner you can trust": DeepSpeed "auto" sizes are planned as Accelerate fills
them and invalid ones are one clear error; a layout that cannot run never gets a 'fits' verdict;
the table says what the JSON says (tight, incomplete, cannot run here); strategy=auto picks what
plan.py shows, never lossy compression on a tie."""

from __future__ import annotations

import subprocess
from pathlib import Path
import sys

import pytest

from tests.conftest import ROOT, typed
from tests.test_planner import BF16_1B, _compose, _plans, describe


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "plan.py", *args, "callbacks=none"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


# ----------------------------------------------------------------------------- 1. DeepSpeed sizes
@pytest.mark.unit
def test_deepspeed_auto_bucket_sizes_are_planned_from_the_hidden_size():
    """accelerate's Accelerator._prepare_deepspeed: reduce_bucket_size = h^2,
    stage3_prefetch_bucket_size = 0.9 h^2 (llama_1b: h = 2048)."""
    raw = "+strategy.deepspeed_config.zero_optimization"
    cfg = _compose(BF16_1B)
    h = describe(cfg.model).dim
    z2 = _plans(*BF16_1B, "strategy=zero2")["zero2"]
    auto = _plans(*BF16_1B, "strategy=zero2", f"{raw}.reduce_bucket_size=auto")["zero2"]
    # two buffers (overlap_comm) and the reduction's flat copy of one, h^2 bf16 elements instead of 200M
    assert z2.memory.buffers - auto.memory.buffers == (200_000_000 - h * h) * 2 * 3
    assert any("reduce_bucket_size=auto: h^2" in n for n in auto.notes)
    z3 = _plans(*BF16_1B, "strategy=zero3", f"{raw}.stage3_prefetch_bucket_size=auto")["zero3"]
    explicit = _plans(*BF16_1B, "strategy=zero3",
                      f"{raw}.stage3_prefetch_bucket_size={int(0.9 * h * h)}")["zero3"]
    assert z3.memory.buffers == explicit.memory.buffers
    ok = _plans(*BF16_1B, "strategy=zero3", f"{raw}.stage3_param_persistence_threshold=auto")
    assert ok["zero3"].memory.total > 0


@pytest.mark.unit
@pytest.mark.parametrize("key, value", [("reduce_bucket_size", "-1"),
                                        ("stage3_prefetch_bucket_size", "-5"),
                                        ("reduce_bucket_size", "lots")])
def test_invalid_deepspeed_sizes_are_one_clear_error(key, value):
    from recipes.job import CONFIG, RUN, validate
    from core.errors import ConfigError

    for depth in (CONFIG, RUN):  # plan.py and train.py
        cfg = _compose((*BF16_1B, "strategy=zero3", f"+strategy.deepspeed_config.zero_optimization.{key}={value}"))
        with pytest.raises(ConfigError) as e:
            validate(cfg, depth=depth)
        text = str(e.value)
        assert f"strategy.deepspeed_config.zero_optimization.{key}=" in text
        assert '"auto"' in text and ">= " in text and "set it to" in text


@pytest.mark.subprocess
def test_plan_py_auto_and_negative_bucket_sizes():
    raw = "+strategy.deepspeed_config.zero_optimization"
    for arg in (f"{raw}.reduce_bucket_size=auto", f"{raw}.stage3_prefetch_bucket_size=auto"):
        proc = _cli("strategy=zero3", arg)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    proc = _cli("strategy=zero2", f"{raw}.reduce_bucket_size=-1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "reduce_bucket_size=-1: must be an integer >= 1" in proc.stderr


@pytest.mark.unit
def test_zero3_that_shards_nothing_says_so(caplog):
    """Audit hydra #4: a user's preset extending zero3 (or zero3 with a model not named gpt_nano)
    keeps DeepSpeed's 1e5-element persistence threshold, which conf/strategy_model's by-name tweak
    sets to 0 only for zero3 + gpt_nano: every gpt_nano tensor stays whole on every rank, and the
    run said nothing (report: state bytes "as planned"). plan.py notes it; train.py warns of it,
    once (``Plan.say``); the tweaked pair and a model with big tensors say nothing."""
    import logging

    from planner import check

    kept = ("model=gpt_nano", "strategy=zero3", "cluster.devices=2", "strategy.param_persistence_threshold=100000")
    line = ("ZeRO-3 shards nothing here: every parameter tensor is under strategy.param_persistence_threshold="
            "100000 (elements), which DeepSpeed keeps whole on every rank; set strategy.param_persistence_"
            "threshold=0 to shard them")
    assert [n for n in _plans(*kept)["zero3"].notes if n.startswith("ZeRO-3")] == [line]
    # nearly every: 289 of 291 tensors, the two 8192-element embeddings aside
    deep = _plans(*kept, "model.n_layers=32", "strategy.param_persistence_threshold=4096")["zero3"]
    assert [n for n in deep.notes if n.startswith("ZeRO-3")] == [
        "ZeRO-3 shards almost nothing here: 289 of 291 parameter tensors (95% of the parameters) are under "
        "strategy.param_persistence_threshold=4096 (elements), which DeepSpeed keeps whole on every rank; "
        "set strategy.param_persistence_threshold=0 to shard them"]
    for quiet in (("model=gpt_nano", "strategy=zero3", "cluster.devices=2"),  # (the by-name tweak: 0)
                  ("model=gpt_small", "strategy=zero3", "cluster.devices=2"),
                  ("model=gpt_nano", "strategy=zero2", "cluster.devices=2")):
        assert not any(n.startswith("ZeRO-3") for n in _plans(*quiet)[quiet[1].split("=")[1]].notes), quiet
    with caplog.at_level(logging.INFO, logger="train"):
        check(typed(_compose(kept))).say(logging.getLogger("train"), [])
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [line]


# ----------------------------------------------------------------------------- 2. verdicts
def _report(*overrides):
    from planner import plan_all

    cfg = _compose(overrides)
    return plan_all(typed(cfg))


def _table(report) -> str:
    import io

    from planner.render import render

    out = io.StringIO()
    render(report, "table", file=out)
    return " ".join(out.getvalue().split())


@pytest.mark.unit
def test_a_layout_that_cannot_run_never_fits():
    p = _plans("cluster=node_8x_h100", "strategy=tp", "strategy.tp=3")["tp"]
    assert not p.fits and p.verdict == "cannot run"
    assert "cannot run" in p.summary() and "fits with" not in p.summary()
    p = _plans("cluster=node_8x_h100", "strategy=pipeline", "strategy.pp=64")["pipeline"]
    assert not p.fits and "fits with" not in p.message() and "cannot run" in p.message()


@pytest.mark.subprocess
def test_plan_py_exits_2_on_a_named_layout_that_cannot_run():
    for args in (("strategy=tp", "strategy.tp=3"), ("strategy=pipeline", "strategy.pp=64")):
        proc = _cli("cluster=node_8x_h100", *args)
        assert proc.returncode == 2, proc.stdout[-500:]
        assert "cannot run on node_8x_h100" in proc.stderr and "world size 8" in proc.stderr
        assert "fits with" not in proc.stdout


@pytest.mark.unit
def test_a_zero_bandwidth_link_is_a_problem_not_a_recommendation():
    plans = _plans("cluster=node_8x_h100", "cluster.intra_node_GBps=0")
    assert any(p.startswith("cluster.intra_node_GBps=0:") for p in plans["ddp"].stalled)
    assert "set cluster.intra_node_GBps" in plans["ddp"].summary()
    report = _report("cluster=node_8x_h100", "cluster.intra_node_GBps=0")
    rec = report.recommendation
    assert rec.strategy is None and "cluster.intra_node_GBps=0" in rec.reason, rec.reason


@pytest.mark.unit
def test_when_only_the_batch_fails_the_reason_is_the_batch():
    from planner import plan_all
    from recipes.config import compose

    cfg = compose(["cluster=node_8x_h100", "trainer.global_batch_size=4", "trainer.micro_batch_size=8",
                   "callbacks=none"])
    rec = plan_all(typed(cfg)).recommendation
    assert rec.strategy is None and "smallest need" not in rec.reason
    assert "trainer.global_batch_size=4 is not divisible" in rec.reason, rec.reason


# ----------------------------------------------------------------------------- 3. reasons, columns
@pytest.mark.unit
def test_one_device_reason_does_not_claim_sharding():
    rec = _report("model=llama_7b", "cluster=h200_1x").recommendation
    assert rec.strategy and "so the state must be sharded" not in rec.reason, rec.reason
    assert "nothing is sharded" in rec.reason and "sharded data parallel layout" not in rec.reason
    small = _report("model=llama_1b", "cluster=h200_1x").recommendation
    assert small.strategy == "single" and "no sharding needed" in small.reason, small.reason
    # TP on one node of 8 with one data-parallel rank: the model is split, nothing is "sharded"
    tp = _report("model=llama_7b", "cluster=node_8x_h100", "cluster.device_memory_GB=24",
                 "trainer.global_batch_size=64").recommendation
    assert "so the model must be split" in tp.reason and "DeepSpeed" not in tp.reason, tp.reason


_TIGHT = ("model=llama_7b", "cluster=h200_1x", "cluster.device_memory_GB=139")  # fsdp: 2.2 GB free


@pytest.mark.unit
def test_table_separates_tight_incomplete_and_cannot_run():
    report = _report(*_TIGHT)
    plans = {p.strategy: p for p in report.plans}
    assert plans["fsdp"].tight
    text = _table(report)
    assert "│ fsdp │ tight │ yes │" in text
    zi = plans["zero_infinity"]  # nvme_path unset: the config is incomplete, not a memory verdict
    assert zi.missing and not zi.blocking
    assert "│ zero_infinity │ no │ incomplete │" in text  # (its NVMe need, 134.8 GB > 68 GB)
    assert "│ tp │ - │ no │ - │" in text and "cannot run on 1" in text
    assert "inf" not in text.split("recommendation:")[0].replace("zero_infinity", "")
    roomy = _plans("model=llama_1b", "cluster=node_8x_h100", "trainer.global_batch_size=64")
    assert roomy["zero_infinity"].memory_fits and roomy["zero_infinity"].missing
    assert "│ zero_infinity │ yes │ incomplete │" in _table(_report("model=llama_1b", "cluster=node_8x_h100",
                                                                  "trainer.global_batch_size=64"))


@pytest.mark.unit
def test_a_tight_recommendation_says_so():
    from planner import recommend

    fsdp = _plans(*_TIGHT)["fsdp"]
    rec = recommend([fsdp])
    assert rec.strategy == "fsdp" and "tight" in rec.reason


@pytest.mark.unit
def test_lossy_compression_never_wins_a_tie():
    import dataclasses

    from planner import recommend

    plans = _plans("model=llama_1b", "cluster=node_8x_h100", "trainer.global_batch_size=64")
    ddp, bf16 = plans["ddp"], plans["ddp_bf16_compress"]
    assert bf16.lossy and not ddp.lossy and bf16.fits and ddp.fits
    tie = dataclasses.replace(bf16, step_seconds=ddp.step_seconds * 0.97)
    assert recommend([tie, ddp]).strategy == "ddp"
    win = dataclasses.replace(bf16, step_seconds=ddp.step_seconds / 1.5)
    rec = recommend([win, ddp])
    assert rec.strategy == "ddp_bf16_compress" and "lossy" in rec.reason and "1.50x" in rec.reason
    assert _report("model=llama_1b", "cluster=node_8x_h100",
                   "trainer.global_batch_size=64").recommendation.strategy not in {
        "ddp_bf16_compress", "ddp_fp16_compress", "ddp_powersgd"}


# ----------------------------------------------------------------------------- 4, 5. auto, tight
_70B = ("model=llama_70b", "cluster=slurm_8x8_h100")


@pytest.mark.unit
def test_strategy_auto_runs_what_fits_and_plan_py_shows_it():
    from planner import choose

    cfg = _compose((*_70B, "strategy=auto"))
    picked, why = choose(typed(cfg))
    assert picked.name in {"fsdp_tp", "tp", "3d", "pipeline", "pp_dp"}, why
    report = _report(*_70B)
    assert report.recommendation.strategy == picked.name
    assert not next(p for p in report.plans if p.strategy == picked.name).planned_only
    names = [p.strategy for p in report.plans]
    first_planned = min(i for i, p in enumerate(report.plans) if p.planned_only)
    assert all(not p.planned_only for p in report.plans[:first_planned])  # runnable first, apart
    assert names.index(picked.name) == 0


@pytest.mark.unit
@pytest.mark.parametrize("over", [_70B, ("model=llama_70b", "cluster=slurm_64x8_a100"),
                                  ("model=llama_13b", "cluster=node_8x_h100"),
                                  ("model=llama_7b", "cluster=h200_1x", "trainer.micro_batch_size=8",
                                   "trainer.global_batch_size=8"),
                                  ("model=mixtral_8x7b", "cluster=slurm_8x8_h100"),
                                  ("model=deepseek_moe_16b", "cluster=node_8x_h100"),
                                  ("model=llama_70b", "cluster=node_8x_h100"),
                                  ("model=llama_70b", "cluster=sagemaker_p5_2node")])
def test_the_run_it_command_plans_to_the_recommendations_numbers(over):
    """plan.py's ``run it`` line (``run_overrides``) and ``strategy=auto``: both give the
    recommendation's degrees, memory and step time when planned again (the 70B line used to
    print ``strategy=3d``, whose preset runs tp=2, 109 GB of 80; the MoE lines left out the
    expert degree the plan chose: fsdp_ep at ep=2, 30.5 s a step where ep=8 was planned at
    8.8 s). The 70B on one node fits only with activation checkpointing; on two, where with
    it the degrees that fit change, the line used to keep the ones chosen without it
    (zero3_ulysses at sp=8, 499 s a step, where sp=2 fits at 125 s)."""
    from planner import choose, run_overrides

    report = _report(*over)
    rec = report.recommendation
    planned = _report(*over, "planner.activation_checkpointing=true") if rec.activation_checkpointing else report
    want = next(p for p in planned.plans if p.strategy == rec.strategy)
    picked = report.recommendation.config
    again = _report(*over, *run_overrides(picked)).plans[0]
    auto = choose(typed(_compose((*over, "strategy=auto"))))[0]
    assert run_overrides(auto) == run_overrides(picked)
    for key in ("tp", "pp", "dp", "sp", "cp", "ep"):
        assert getattr(again, key, None) == getattr(want, key, None), (key, run_overrides(picked))
    assert again.strategy == want.strategy and again.fits == want.fits
    assert again.memory.total == want.memory.total and again.step_seconds == pytest.approx(want.step_seconds)
    if rec.activation_checkpointing:
        assert "strategy.activation_checkpointing=true" in run_overrides(picked)


@pytest.mark.unit
def test_the_hint_names_a_preset_that_fits_with_checkpointing_when_only_that_fits():
    """llama_70b on 8 H100s fits only with activation checkpointing: the refusal of
    ``strategy=fsdp`` said "no preset fits: use more devices ..." while the ranking recommended
    zero3_offload with checkpointing. The hint's command carries it and fits when planned."""
    from planner import preflight

    over = ("model=llama_70b", "cluster=node_8x_h100")
    plan = preflight(typed(_compose((*over, "strategy=fsdp"))))
    assert not plan.fits and plan.hint.startswith("cheapest preset that fits: "), plan.hint
    command = plan.hint.split("(", 1)[1].rstrip(")").split()
    assert "strategy.activation_checkpointing=true" in command, command
    assert preflight(typed(_compose((*over, *command)))).fits
    ranked = _report(*over, "strategy=fsdp")
    own = next(p for p in ranked.plans if p.strategy == "fsdp")
    assert own.hint == plan.hint or "activation_checkpointing=true" in own.hint, own.hint


@pytest.mark.unit
def test_a_need_and_what_the_device_has_read_apart():
    """"the smallest need is fsdp_cp's 0.2 GB per device, has 0.2 GB" (215.9 MB against 200 MB):
    a need and what is there are printed with the digits that tell them apart, in one unit."""
    from planner.states import gb_apart

    assert gb_apart(215_903_808, 200_000_000) == ("0.22 GB", "0.20 GB")
    assert gb_apart(80e9, 80e9) == ("80.0 GB", "80.0 GB")
    assert gb_apart(80.04e9, 80e9) == ("80.04 GB", "80.00 GB")
    assert gb_apart(30 * 2**20, 31 * 2**20) == ("30.0 MiB", "31.0 MiB")
    from planner import preflight

    over = ("model=llama_1b", "cluster=node_8x_h100", "strategy=ddp")
    total = preflight(typed(_compose(over))).memory.total
    short = preflight(typed(_compose((*over, f"cluster.device_memory_GB={total * 0.996 / 1e9}"))))
    need, has = short.message().split("needs ", 1)[1].split(" per device")[0], short.message().split("has ", 1)[1]
    assert not short.fits and need != has.split(";")[0], short.message()
    one = _report("model=gpt_nano", "cluster.accelerator=cpu", "cluster.devices=1", "strategy=single").plans[0]
    assert "(1 device)" in one.summary(), one.summary()


@pytest.mark.unit
def test_one_device_is_recommended_single():
    """On one device ddp and single tie (no gradient to reduce): the tie went to ddp by name."""
    rec = _report("model=gpt_nano", "cluster.accelerator=cpu", "cluster.devices=1").recommendation
    assert rec.strategy == "single", rec.reason


@pytest.mark.unit
def test_on_one_node_the_ranking_plans_tp_and_pp_presets_at_degrees_that_divide_it():
    """One node of 8: TP took the whole node and the preset's PP came on top (tp=8 x pp=2 = 16
    ranks), so the ranking said 3d "cannot run on 8 devices: set cluster.devices=16" while
    ``strategy=3d`` (tp=2 pp=2 dp=2) fits there. Now each is planned at a mesh of this world,
    the one that fits with the shortest step, and its command plans the same."""
    over = ("model=llama_7b", "cluster=node_8x_h100")
    report = _report(*over)
    for p in report.plans:
        if p.strategy in ("3d", "tp", "fsdp_tp", "pipeline", "pp_dp"):
            assert p.mesh_fits and not p.blocking, (p.strategy, p.problems)
    three = next(p for p in report.plans if p.strategy == "3d")
    assert three.fits and 8 % (three.tp * three.pp) == 0, (three.tp, three.pp)
    from planner import preflight

    again = preflight(typed(_compose((*over, "strategy=3d", f"strategy.tp={three.tp}", f"strategy.pp={three.pp}"))))
    assert (again.tp, again.pp, again.dp) == (three.tp, three.pp, three.dp)
    assert again.memory.total == three.memory.total and again.step_seconds == pytest.approx(three.step_seconds)
    assert preflight(typed(_compose((*over, "strategy=3d")))).fits  # (what the audit compared it with)


@pytest.mark.unit
@pytest.mark.parametrize("model, best", [("llama_70b", "3d"), ("mixtral_8x7b", "fsdp_ep")])
def test_the_hint_of_a_preset_that_does_not_fit_is_a_command_that_fits(model, best):
    """train.py's refusal and plan.py's verdict name what to run instead; the command said
    ``strategy=3d`` (tp=2: 109 GB of 80) and ``strategy=fsdp_ep`` (ep=2: 3.5x slower), not the
    degrees the hint's plan was made at."""
    from planner import preflight

    over = (f"model={model}", "cluster=slurm_8x8_h100")
    plan = preflight(typed(_compose((*over, "strategy=ddp"))))
    assert not plan.fits and plan.hint.startswith(f"cheapest preset that fits: {best} (strategy={best} ")
    command = plan.hint.split("(", 1)[1].rstrip(")").split()
    again = preflight(typed(_compose((*over, *command))))
    assert again.fits and again.strategy == best
    ranked = next(p for p in _report(*over).plans if p.strategy == best)
    assert again.step_seconds == pytest.approx(ranked.step_seconds)


@pytest.mark.unit
@pytest.mark.parametrize("asked", ["strategy=auto strategy.activation_checkpointing=true",
                                   "strategy=auto trainer.gradient_checkpointing=true",
                                   "strategy=zero3 planner.activation_checkpointing=true",
                                   "planner.activation_checkpointing=true strategy=auto"])
def test_checkpointing_asked_for_is_planned_and_run(asked):
    """strategy=auto dropped the placeholder's checkpointing (the user's key, or the
    fine-tuner's alias): fsdp was chosen and run without it. planner.activation_checkpointing
    planned the job's preset with it while the run, reading the preset's key, went without:
    train.py's check passed a run that was not the one planned. What is planned now runs."""
    from planner import choose, preflight
    from recipes.config import compose
    from recipes.job import CONFIG, validate

    over = ["model=llama_13b", "cluster=node_8x_h100", *asked.split()]
    job = validate(compose(over), depth=CONFIG, auto=choose)
    assert job.strategy.activation_checkpointing is True, job.strategy.name
    plan = preflight(job)
    assert plan.activation_checkpointing is True and plan.memory.total < 40e9, plan.summary()


@pytest.mark.unit
def test_strategy_auto_refuses_an_every_nth_block_it_would_drop():
    from recipes.config import compose
    from recipes.job import CONFIG, validate
    from strategies import ConfigError

    with pytest.raises(ConfigError, match="strategy.ac_every=2 with strategy=auto"):
        validate(compose(["model=llama_13b", "cluster=node_8x_h100", "strategy=auto",
                          "strategy.activation_checkpointing=true", "strategy.ac_every=2"]), depth=CONFIG)


@pytest.mark.unit
def test_pipeline_micro_batches_planned_are_run():
    """planner.microbatches planned every pipeline with its micro-batches while the run (and
    the run it line) kept the preset's: the job's preset and the recommendation take it."""
    from planner import run_overrides
    from recipes.config import compose
    from recipes.job import CONFIG, validate

    over = ("model=llama_70b", "cluster=slurm_8x8_h100", "planner.microbatches=16")
    assert validate(compose([*over, "strategy=pipeline"]), depth=CONFIG).strategy.microbatches == 16
    picked = _report(*over).recommendation.config
    assert picked.pipeline_microbatches() == 16 and "strategy.microbatches=16" in run_overrides(picked)


@pytest.mark.subprocess
def test_plan_py_strategy_auto_plans_the_choice():
    proc = _cli(*_70B, "strategy=auto")
    assert proc.returncode == 0, proc.stderr
    assert "plan: single" not in proc.stdout and "strategy=auto chose " in proc.stdout
    chosen = proc.stdout.split("strategy=auto chose ")[1].split(":")[0]
    assert f"plan: {chosen} on slurm_8x8_h100" in proc.stdout


@pytest.mark.unit
def test_nothing_runnable_names_the_smallest_need_and_planned_layouts():
    import dataclasses

    from planner import _recommend

    report = _report(*_70B)
    plans = [p if p.planned_only else dataclasses.replace(p, fits=False, memory_fits=False)
             for p in report.plans]
    rec = _recommend(plans)
    assert rec.strategy is None and "the smallest need is" in rec.reason
    assert "planned-only" in rec.reason and "megatron_3d" in rec.reason, rec.reason


@pytest.mark.unit
def test_when_only_the_host_overflows_the_verdicts_say_so():
    """deepseek_moe_16b on one H200: fsdp_offload's 35.8 GB fits the device, its host memory
    does not; nothing fits, and neither the recommendation nor the hint blames the device
    (they read "has 141.0 GB" and "use ... activation checkpointing")."""
    report = _report("model=deepseek_moe_16b", "cluster=h200_1x")
    rec = report.recommendation
    assert rec.strategy is None
    assert "which the device has, but host memory: needs" in rec.reason, rec.reason
    offload = next(p for p in report.plans if p.strategy == "fsdp_offload")
    assert offload.memory.total <= offload.device_bytes and offload.overflows
    assert "overflow the host or NVMe" in offload.hint and "more nodes" in offload.hint, offload.hint


@pytest.mark.unit
def test_slurms_memory_limit_is_the_hosts():
    """sbatch --mem (cluster.slurm.mem_gb) caps what a node's processes may hold: the planner
    plans host memory against it, names the key, and without it the node's own."""
    over = ("model=llama_13b", "cluster=slurm_8x8_h100", "strategy=zero3_offload")
    plan = next(p for p in _report(*over, "cluster.slurm.mem_gb=20").plans if p.strategy == "zero3_offload")
    assert not plan.fits and plan.memory.total <= plan.device_bytes
    assert any(n.endswith("has 20.0 GB (cluster.slurm.mem_gb: sbatch --mem)") for n in plan.overflows), plan.notes
    plan = next(p for p in _report(*over).plans if p.strategy == "zero3_offload")
    assert plan.fits and not plan.overflows


@pytest.mark.unit
def test_a_tight_layout_is_not_recommended_over_an_as_fast_roomy_one():
    from planner import recommend

    report = _report(*_70B)
    planned = [p for p in report.plans if p.planned_only]
    tp = next(p for p in planned if p.strategy == "megatron_tp")
    assert tp.tight  # 78.4 of 80 GB, under the 3 GB reserve
    rec = recommend(planned)
    assert rec.strategy == "megatron_3d", rec.reason


# ----------------------------------------------------------------------------- 6. the peak, phase by phase
@pytest.mark.unit
def test_the_loss_backward_is_in_the_peak_where_it_lives():
    """Measured peak minus saved tensors is 8 x s x b x V bytes (the fp32 log-softmax and logits
    gradients) at the start of backward: beside every activation, before any gradient exists
    when a step is one micro-batch (zero_grad frees them)."""
    from planner import plan_all
    from recipes.config import compose

    cfg = compose(["model=llama_1b", "cluster=h200_1x", "trainer.precision=bf16-mixed",
                   "trainer.micro_batch_size=2", "trainer.global_batch_size=2", "callbacks=none"])
    m = describe(cfg.model)
    plans = {p.strategy: p for p in plan_all(typed(cfg), m).plans}
    single = plans["single"].memory
    assert single.loss == 8 * m.seq_len * 2 * m.vocab_size  # 4.2 GB at llama_1b's 128k vocabulary
    states = single.params + single.grads + single.master + single.optimizer
    # one micro-batch: the gradients are freed between steps, none at backward's start
    assert single.total == states - single.grads + single.activations + single.buffers + single.loss
    assert single.growth == single.total - states
    # with accumulation the gradients of earlier micro-batches are there
    acc = _plans("model=llama_1b", "cluster=h200_1x", "trainer.global_batch_size=4",
                 "strategy=single")["single"].memory
    acc_states = acc.params + acc.grads + acc.master + acc.optimizer
    assert acc.total == acc_states + acc.activations + acc.buffers + acc.loss
    # DeepSpeed keeps its gradient partitions in its own buffers: always counted
    z = plans["zero2"].memory
    assert z.total == z.params + z.grads + z.master + z.optimizer + z.activations + z.buffers + z.loss
    # the documents' view has no engine transients
    doc = _plans("model=llama_1b", "cluster=h200_1x", "planner.accounting=mixed16")["single"].memory
    assert doc.loss == 0 and doc.buffers == 0


@pytest.mark.unit
def test_the_loss_backward_is_on_the_last_stage_and_split_only_by_vocabulary_parallel_tp():
    plans = _plans(*_70B)
    m = describe(_compose(_70B).model)
    whole = 8 * m.seq_len * 1 * m.vocab_size
    assert plans["megatron_tp"].memory.loss == whole // 8  # vocabulary-parallel cross entropy
    assert plans["fsdp_tp"].memory.loss == whole  # the runnable TP presets replicate the logits
    pipe = plans["pipeline"]  # stage 0 holds pp micro-batches in flight, the last one the loss
    assert pipe.memory.loss == whole
    states = sum(getattr(pipe.memory, k) for k in ("params", "grads", "master", "optimizer"))
    assert pipe.memory.total < states + pipe.memory.activations + pipe.memory.buffers + whole


@pytest.mark.unit
def test_fsdp_is_planned_with_the_bf16_calibration_it_runs():
    """FSDP1/FSDP2 gather bf16 weights (MixedPrecision param_dtype): the calibration's bf16
    regime, as DeepSpeed, not autocast's over fp32 weights (measured 1.000 on CPU, autocast's
    was 1.09x here and 1.21x at Llama shapes)."""
    plans = _plans("model=llama_7b", "cluster=node_8x_h100", "trainer.global_batch_size=64")
    for name in ("fsdp", "fsdp2", "hsdp2", "fsdp_grad_op"):
        assert plans[name].memory.activations == plans["zero3"].memory.activations, name
    assert plans["ddp"].memory.activations > 1.15 * plans["fsdp"].memory.activations  # autocast
    from strategies import derive_from, load

    cfg = _compose(("model=llama_7b", "cluster=node_8x_h100", "trainer.global_batch_size=64"))
    from omegaconf import OmegaConf

    cl, t = OmegaConf.to_object(cfg.cluster), OmegaConf.to_object(cfg.trainer)
    assert derive_from(load("fsdp"), cl, t).regime == "bf16"
    assert derive_from(load("ddp"), cl, t).regime == "autocast"
    # the TP/PP presets shard with FSDP2 only over dp > 1 (plan): dp 1 keeps fp32 weights
    assert derive_from(load("tp").with_degrees(tp=8), cl, t).regime == "autocast"
    assert derive_from(load("tp").with_degrees(tp=4), cl, t).regime == "bf16"


@pytest.mark.unit
def test_zero3_steps_one_sub_group_at_a_time():
    """stage3's _prepare_fp32_grad_for_sub_group flattens and casts one sub_group_size (1e9
    elements) at a time: llama_13b on 3 GPUs with checkpointing fits (it was 87.2 GB)."""
    base = ("model=llama_13b", "cluster=node_8x_h100", "cluster.devices=3", "strategy=zero3",
            "strategy.activation_checkpointing=true", "trainer.global_batch_size=3")
    p = _plans(*base)["zero3"]
    assert p.fits and 74e9 < p.memory.total < 78e9, p.memory.total
    states = p.memory.params + p.memory.grads + p.memory.master + p.memory.optimizer
    bucket = 200_000_000 * 2  # one reduce bucket (ZeRO-3), bf16
    assert p.memory.step - states - bucket == 1_000_000_000 * (2 + 4)  # bf16 flatten + fp32 cast
    small = _plans(*base, "strategy.sub_group_size=100000000")["zero3"]
    assert p.memory.step - small.memory.step == 900_000_000 * 6
    raw = _plans(*base, "+strategy.deepspeed_config.zero_optimization.sub_group_size=100000000")["zero3"]
    assert raw.memory.step == small.memory.step


@pytest.mark.unit
def test_fsdp_plans_its_root_unit():
    """Embeddings, final norm and head live in FSDP's root unit: gathered whole from forward to
    the end of backward (not resharded after forward), beside the current and the next block;
    reduced last, once the activations are gone (gathered parameters + unsharded gradients +
    the flat copy reduce-scattered); no DDP buckets."""
    from planner.inputs import unit_params

    m = describe(_compose(BF16_1B).model)
    p = _plans(*BF16_1B, "strategy=fsdp2", "strategy.reduce_fp32=false")["fsdp2"]
    root = m.num_params() - m.n_layers * m.block_params()
    assert root >= m.embedding_params() and unit_params(m) == m.embedding_params()
    block = m.block_params()
    assert p.memory.buffers == int((root + 2 * block) * 2 + block * 2)  # bf16 gathers and grads
    states = p.memory.params + p.memory.grads + p.memory.master + p.memory.optimizer
    root_grads = root * 4 / p.shard  # its sharded fp32 gradient, not made yet
    assert p.memory.step - states == int(root * (2 + 2 + 2) - root_grads)


# ----------------------------------------------------------------------------- 7. the documents' view
def _doc(params: float, devices: int, nodes: int = 1, accounting: str = "mixed16"):
    from planner import plan_all
    from recipes.config import compose

    cfg = compose([f"planner.params={params}", f"planner.accounting={accounting}",
                   "cluster=node_8x_h100", f"cluster.nodes={nodes}", f"cluster.devices={devices}",
                   f"trainer.global_batch_size={nodes * devices}", "trainer.micro_batch_size=1",
                   "trainer.precision=bf16-mixed", "callbacks=none"])
    report = plan_all(typed(cfg))
    return report, {p.strategy: p.memory for p in report.plans}


def _states(m) -> float:
    return m.params + m.grads + m.master + m.optimizer


@pytest.mark.unit
def test_mixed16_is_the_documents_model_through_the_real_presets():
    """distributed-training-math.txt, 10B on 8 workers: replicated 160 GB (20 + 20 + 40 + 80),
    ZeRO-1 55 GB (20 + 20 + 15), ZeRO-2 37.5 GB, ZeRO-3 / FSDP 20 GB; the engine view's
    buffers and step-time copies are not in it (ZeRO-1 was 37.5 with its full gradients moved
    into buffers)."""
    report, m = _doc(1e10, 8)
    GB = 10**9
    assert (m["ddp"].params, m["ddp"].grads, m["ddp"].master, m["ddp"].optimizer) == (
        20 * GB, 20 * GB, 40 * GB, 80 * GB)
    assert (m["zero1"].params, m["zero1"].grads, m["zero1"].master + m["zero1"].optimizer) == (
        20 * GB, 20 * GB, 15 * GB)
    assert (m["zero2"].params, m["zero2"].grads) == (20 * GB, 2.5 * GB)
    for name, total in (("ddp", 160), ("single", 160), ("zero1", 55), ("zero2", 37.5), ("zero3", 20),
                        ("fsdp", 20), ("fsdp2", 20)):
        if name == "single":
            continue  # (one process on 8 devices cannot run; its 160 GB is ddp's)
        assert m[name].total == _states(m[name]) == total * GB, name
        assert m[name].buffers == m[name].loss == 0 and m[name].step == m[name].total
    assert "the reference documents' model" in _table(report)


@pytest.mark.unit
def test_every_worked_memory_number_of_the_reference_documents():
    GB = 10**9
    # ZeRO paper, Figure 1 (the overview's figure): 7.5B parameters on 64 GPUs, K = 12
    _, m = _doc(7.5e9, 8, nodes=8)
    assert m["ddp"].total == 120 * GB
    assert m["zero1"].total == 31_406_250_000  # 2 + 2 + 12/64 bytes: "31.4GB"
    assert m["zero2"].total == 16_640_625_000  # 2 + 14/64: "16.6GB"
    assert m["zero3"].total == 1_875_000_000   # 16/64: "1.9GB"
    # math: the 12B exercise on 8 workers; 7B at 16 B/param "about 112 GB", 14 GB of bf16 weights
    _, m = _doc(12e9, 8)
    assert m["ddp"].total == 192 * GB and m["zero3"].total == 24 * GB
    _, m = _doc(7e9, 1)
    assert m["single"].total == 112 * GB and m["single"].params == 14 * GB
    # deep-dive: 20 B/param, "~140 GB" for 7B (mixed20)
    _, m = _doc(7e9, 1, accounting="mixed20")
    assert m["single"].total == 140 * GB
    # overview: 10B, 20 + 20 + 80 + 40 = 160 GB of states; + ~20 activations + ~10 buffers
    # (its estimates, given) = 190 GB, "~176 GiB"
    _, m = _doc(1e10, 1)
    assert (m["single"].params, m["single"].grads, m["single"].optimizer, m["single"].master) == (
        20 * GB, 20 * GB, 80 * GB, 40 * GB)
    assert int((m["single"].total + 20 * GB + 10 * GB) / 2**30) == 176
    # notes: a 70B model is ~140 GB in bf16; ZeRO-3 over 80 GPUs takes its 280 GB of bf16
    # parameters and gradients (the notes' "full model", 4 B/param) to ~3.5 GB per GPU
    _, m = _doc(70e9, 8, nodes=10)
    assert m["single"].params == 140 * GB if "single" in m else True
    z3 = m["zero3"]
    assert (z3.params + z3.grads) * 80 == 280 * GB and z3.params + z3.grads == 3.5 * GB


# ----------------------------------------------------------------------------- 8. what users see at the end
@pytest.mark.unit
def test_lora_under_zero2_gathers_only_the_trainable_partitions():
    """DeepSpeed's post-step all-gather sends the updated partitions: the trainable parameters
    (measured 0.05 MiB where the frozen weights made it 0.30)."""
    from planner import all_gather_bytes

    trainable = 20_000_000
    p = _plans(*BF16_1B, "strategy=zero2", f"planner.trainable={trainable}")["zero2"]
    gather = p.communication.by_collective["param_all_gather"]
    assert gather.bytes == int(all_gather_bytes(trainable * 2, p.shard))
    full = _plans(*BF16_1B, "strategy=zero2")["zero2"].communication.by_collective["param_all_gather"]
    assert full.bytes > 50 * gather.bytes


@pytest.mark.unit
def test_a_lora_fine_tune_is_recommended_a_preset_that_runs_lora(tmp_path):
    """A Llama 3 70B config.json with model.lora.rank=8 on 8 H100s: the planner recommended
    fsdp_tp at tp=8 (and strategy=auto chose it), which validation refuses ("LoRA runs with
    ddp, ..., fsdp2, ..."). What the job's groups ask of a preset (``Job.layout_problems``:
    LoRA, packing, DPO, samples) is now every plan's problem."""
    import json

    from planner import choose, run_overrides
    from recipes.config import compose
    from recipes.job import RUN, validate

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
        "num_hidden_layers": 80, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}))
    over = ["model=hf", f"model.path={tmp_path}", "model.lora.rank=8", "cluster=node_8x_h100",
            "data.tokenizer=null", "model.pretrained=false"]
    report = _report(*over)
    plans = {p.strategy: p for p in report.plans}
    assert not plans["fsdp_tp"].runnable and "LoRA runs with" in plans["fsdp_tp"].problems[0]
    picked = report.recommendation.config
    assert picked is not None and picked.capabilities.lora, report.recommendation.reason
    assert choose(typed(_compose((*over, "strategy=auto"))))[0].name == picked.name
    validate(compose([*over, *run_overrides(picked)]), depth=RUN)  # what run it prints: valid


# ----------------------------------------------------------------------------- 9. machine checks at launch
@pytest.mark.unit
def test_plan_py_plans_an_nvme_path_absent_on_this_machine(tmp_path):
    """strategy.nvme_path is on the machine that runs the job: train.py checks it (LAUNCH),
    plan.py (CONFIG) plans it from anywhere."""
    from recipes.job import CONFIG, LAUNCH, validate
    from core.errors import ConfigError

    over = ("model=llama_7b", "cluster=node_8x_h100", "strategy=zero_infinity",
            f"strategy.nvme_path={tmp_path / 'on-the-cluster'}", "trainer.global_batch_size=64")
    cfg = _compose(over)
    validate(cfg, depth=CONFIG)
    p = _plans(*over)["zero_infinity"]
    assert not p.problems and p.fits, p.problems
    with pytest.raises(ConfigError) as e:
        validate(_compose((*over, "cluster.accelerator=cpu", "cluster.devices=2",
                           "trainer.global_batch_size=2")), depth=LAUNCH)
    assert "does not exist or is not a directory" in str(e.value)


@pytest.mark.unit
def test_zero_infinity_without_nvme_path_is_incomplete_not_out_of_memory():
    report = _report("model=llama_1b", "cluster=node_8x_h100", "trainer.global_batch_size=64")
    zi = next(p for p in report.plans if p.strategy == "zero_infinity")
    assert zi.missing and not zi.blocking and zi.memory_fits
    assert "does not fit" not in zi.message() and "config is incomplete" in zi.message()
    assert "│ zero_infinity │ yes │ incomplete │" in _table(report)


# ----------------------------------------------------------------------------- 10. checkpointing, micro batch
@pytest.mark.unit
def test_activation_checkpointing_is_suggested_when_it_changes_the_answer():
    """llama_7b at micro batch 8 on one H200: nothing runs without checkpointing (210 GB of
    activations); with it, a preset fits: the recommendation says so, the JSON and strategy=auto
    turn it on."""
    from planner import choose, plan_all, report_dict
    from recipes.config import compose

    over = ("model=llama_7b", "cluster=h200_1x", "trainer.precision=bf16-mixed",
            "trainer.micro_batch_size=8", "trainer.global_batch_size=8", "callbacks=none")
    report = plan_all(typed(compose(list(over))))
    rec = report.recommendation
    assert rec.strategy and rec.activation_checkpointing, rec.reason
    assert "strategy.activation_checkpointing=true" in rec.reason
    plan = next(p for p in report.plans if p.strategy == rec.strategy)
    assert not plan.fits and plan.checkpointed_total <= plan.device_bytes
    assert "fits with checkpointing" in _table(report)
    out = report_dict(report)
    assert out["recommendation"]["activation_checkpointing"] is True
    assert next(p for p in out["plans"] if p["strategy"] == rec.strategy)["total_checkpointed"] > 0
    cfg = compose([*over, "strategy=auto"])
    picked, _ = choose(typed(cfg))
    assert picked.name == rec.strategy and picked.activation_checkpointing
    # ... and never when the answer does not change
    plain = _report("model=llama_7b", "cluster=node_8x_h100", "trainer.global_batch_size=64").recommendation
    assert not plain.activation_checkpointing and plain.with_checkpointing is None
    assert "activation checkpointing" not in plain.reason


@pytest.mark.subprocess
def test_plan_py_run_it_line_turns_checkpointing_on():
    proc = _cli("model=llama_7b", "cluster=h200_1x", "trainer.micro_batch_size=8",
                "trainer.global_batch_size=8")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("run it:"))
    assert "strategy.activation_checkpointing=true" in line


# ----------------------------------------------------------------------------- 11. this machine
SMI_8xH100 = "NVIDIA H100 80GB HBM3, 81559 MiB\n" * 8


@pytest.mark.unit
def test_nvidia_smi_output_is_parsed_into_known_gpus():
    from recipes.hardware import UNKNOWN_GPU_TFLOPS, describe_gpus, host_bytes, local, parse_nvidia_smi

    gpus = parse_nvidia_smi(SMI_8xH100)
    assert len(gpus) == 8 and all(g.known and g.peak_tflops == 989 for g in gpus)
    assert gpus[0].memory == 81559 * 2**20
    assert local("device_memory_GB", "auto", gpus) == pytest.approx(85.521)
    assert local("peak_tflops", "auto", gpus) == 989
    assert local("device_memory_GB", "cpu", gpus) == round(host_bytes()[0] / 1e9, 3)  # cpu: the host's
    assert local("device_memory_GB", "auto", ()) == round(host_bytes()[0] / 1e9, 3)
    assert local("peak_tflops", "auto", ()) == 0.2
    names = {"NVIDIA A100-SXM4-40GB": 312, "NVIDIA A100 80GB PCIe": 312, "NVIDIA H100 PCIe": 756,
             "NVIDIA H100 NVL": 835, "NVIDIA H200": 989, "NVIDIA L4": 121, "NVIDIA L40S": 362,
             "NVIDIA A10G": 70, "Tesla V100-SXM2-16GB": 125, "NVIDIA GeForce RTX 4090": 165}
    for name, peak in names.items():
        assert parse_nvidia_smi(f"{name}, 1024 MiB")[0].peak_tflops == peak, name
    odd = parse_nvidia_smi("NVIDIA Quantum Q1, 24576 MiB")
    assert not odd[0].known and odd[0].peak_tflops == UNKNOWN_GPU_TFLOPS
    assert "not in the table of known GPUs" in describe_gpus(odd)
    assert len(parse_nvidia_smi(SMI_8xH100, visible="0,3")) == 2
    assert parse_nvidia_smi(SMI_8xH100, visible="") == ()


@pytest.mark.subprocess
def test_plan_py_plans_this_machines_gpus(tmp_path):
    """cluster=local (accelerator auto) on a box whose nvidia-smi reports 8 x H100: each device's
    own 85.5 GB (81,559 MiB) and 989 TFLOP/s, not the host's memory shared by 8 processes;
    plan.py imports no torch to find out."""
    from recipes.hardware import host_bytes

    import os

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in SMI_8xH100.splitlines()))
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    # (fsdp2: FSDP1's 8 whole builds of llama_1b, 63.5 GB, would overflow this host's memory)
    args = ("model=llama_1b", "cluster.devices=8", "strategy=fsdp2", "trainer.global_batch_size=64")
    proc = subprocess.run([sys.executable, "plan.py", *args, "callbacks=none"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    share = f"{host_bytes()[0] / 1e9 / 8:.1f} GB"
    assert "of 85.5 GB per device" in text and f"of {share}" not in text
    assert "this machine's 8 x NVIDIA H100 80GB HBM3 (81,559 MiB, 989 TFLOP/s each)" in text
    # without GPUs: the CPU view, as before
    bare = subprocess.run([sys.executable, "plan.py", *args, "callbacks=none"], cwd=ROOT,
                          env={**os.environ, "PATH": str(tmp_path / "none")}, capture_output=True,
                          text=True, timeout=120)
    assert f"has {share}" in " ".join(bare.stdout.split()), bare.stderr[-2000:]


@pytest.mark.subprocess
def test_a_gpu_machines_calibration_is_cached_under_the_gpu_planning_found(tmp_path, monkeypatch):
    """One probe of this machine's GPUs (recipes/hardware.py) decides both what the plan runs on
    and the name the calibration is cached under (planner/machine.py had a probe of its own)."""
    from planner import machine
    from recipes import hardware

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in SMI_8xH100.splitlines()))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    hardware.local_gpus.cache_clear()
    try:
        cfg = _compose(("cluster.devices=8",))  # cluster=local, accelerator auto
        k = machine.key(typed(cfg).cluster, "bf16-mixed")
        assert (k["accelerator"], k["device"], k["world"], k["threads"]) == ("gpu", "NVIDIA H100 80GB HBM3", 8, 0)
        monkeypatch.setenv("PATH", str(tmp_path / "none"))
        hardware.local_gpus.cache_clear()
        k = machine.key(typed(_compose(("cluster.devices=8",))).cluster, "bf16-mixed")
        assert k["accelerator"] == "cpu" and k["device"] == machine.cpu_name()
    finally:
        hardware.local_gpus.cache_clear()


# ----------------------------------------------------------------------------- 12. verdicts, verified
@pytest.mark.unit
def test_the_70b_pipeline_derives_its_micro_batches_from_the_batch():
    """pp=8 on 64 GPUs: each replica has 64 micro-batches of accumulation, and the preset's
    micro-batches follow the batch (no 'microbatches=4 < 8')."""
    for name in ("pipeline", "pp_dp"):
        p = _plans(*_70B)[name]
        assert p.pp == 8 and p.microbatches == 64 and not p.problems, (name, p.problems)


@pytest.mark.unit
def test_tp_and_pp_rows_on_one_device_show_no_numbers():
    report = _report("model=llama_7b", "cluster=h200_1x")
    text = _table(report)
    for name in ("tp", "pipeline", "3d"):
        assert f"│ {name} │ - │ no │ - │ - │ - │ - │ - │ - │ cannot run on 1" in text, name
    assert "inf" not in text.split("recommendation:")[0].replace("zero_infinity", "")
    rec = report.recommendation
    assert "sharded" not in rec.reason.split(";")[-1] and "3d" not in rec.reason, rec.reason


@pytest.mark.unit
def test_sgd_is_planned_with_its_own_state():
    """trainer.optimizer=sgd keeps no moments (one buffer with momentum): its plan holds 0 (or
    half) of AdamW's optimizer bytes -- measured equal under fsdp2 and zero2 (state_bytes 1.000)."""
    from planner import plan_all
    from recipes.config import compose

    def optimizer_bytes(*extra):
        cfg = compose(["model=gpt_small", "strategy=fsdp2", "cluster.devices=2", "cluster.accelerator=cpu", *extra])
        return plan_all(typed(cfg), chosen=True).plans[0].memory.optimizer

    adamw = optimizer_bytes()
    assert adamw > 0
    assert optimizer_bytes("trainer.optimizer=sgd") == 0
    assert optimizer_bytes("trainer.optimizer=sgd", "trainer.momentum=0.9") == pytest.approx(adamw / 2, abs=1)


@pytest.mark.unit
def test_local_host_memory_is_the_machines_or_its_cgroups_limit(tmp_path):
    """cluster=local plans the host memory this machine has (it planned every machine at 24 GB):
    /proc/meminfo's MemTotal, or a cgroup's limit when lower; the plan's assumptions say which."""
    from recipes.config import compose
    from recipes.hardware import _cgroup_limit, host_bytes

    total = int(next(x for x in Path("/proc/meminfo").read_text().splitlines()
                     if x.startswith("MemTotal:")).split()[1]) * 1024
    host, source = host_bytes()
    assert host <= total and source in ("MemTotal", "cgroup limit") and (source == "MemTotal") == (host == total)
    cfg = compose(["cluster=local"])
    assert cfg.cluster.host_memory_GB == pytest.approx(host / 1e9, abs=1e-3)
    assert f"host memory {host / 1e9:.1f} GB ({source})" in typed(cfg).cluster.hardware()
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_limit(tmp_path) is None
    (tmp_path / "memory.max").write_text("8589934592\n")
    assert _cgroup_limit(tmp_path) == 8 * 2**30
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    assert _cgroup_limit(tmp_path / "v1") is None


@pytest.mark.unit
def test_when_only_the_host_overflows_the_summary_says_so():
    """The summary read "9.7 GB of 25.3 GB per device (does NOT fit, short -15.6 GB)" when the
    device had room and the host did not: it now names the host's shortfall."""
    from planner import preflight

    over = ("model=llama_1b", "strategy=zero3_offload", "strategy.activation_checkpointing=true",
            "trainer.micro_batch_size=1", "trainer.global_batch_size=1", "cluster.accelerator=cpu",
            "cluster.device_memory_GB=80", "cluster.host_memory_GB=8")
    plan = preflight(typed(_compose(over)))
    assert not plan.fits and plan.margin > 0
    assert "fits on the device, but does NOT fit: host memory: needs" in plan.summary()
    assert "short -" not in plan.summary()
    device = preflight(typed(_compose((*over[:-2], "cluster.device_memory_GB=1", "cluster.host_memory_GB=500"))))
    assert not device.fits and "does NOT fit on the device, short" in device.summary()


@pytest.mark.unit
def test_one_ranks_recommendation_names_the_picked_engines_saving():
    """llama3_8b on one H200: the reason for torch FSDP credited "DeepSpeed's bf16 parameters +
    fp32 master". Each engine's reason is its own: FSDP makes one unit's 16-bit weights at a
    time where torch AMP keeps a 16-bit copy of every weight; DeepSpeed's 16-bit parameters are
    the working weights."""
    from planner import plan_all, recommend

    plans = plan_all(typed(_compose(("model=llama3_8b", "cluster=h200_1x",
                                     "planner.activation_checkpointing=true")))).plans
    for pick, own, other in (("fsdp", "one unit's 16-bit weights at a time", "DeepSpeed"),
                             ("fsdp2", "one unit's 16-bit weights at a time", "DeepSpeed"),
                             ("zero3", "DeepSpeed's 16-bit parameters are the working weights", "unit")):
        rec = recommend([p for p in plans if p.strategy in (pick, "ddp", "single")])
        assert rec.strategy == pick and "nothing is sharded" in rec.reason, rec.reason
        assert own in rec.reason and other not in rec.reason, rec.reason


@pytest.mark.unit
def test_the_plan_line_says_which_part_of_comm_the_closing_table_compares():
    """zero3_offload on 2 CPU ranks: train.log's plan line read "comm 0.4 MiB/step" and the
    closing table "communication 0.13 MiB": the first counts offload's host copies, the second
    the collectives alone. The plan line names both parts; the collectives are the table's."""
    from observers.compare import predicted_wire_bytes
    from planner import plan_dict, preflight
    from planner.states import gb

    plan = preflight(typed(_compose(("model=gpt_nano", "strategy=zero3_offload", "cluster.accelerator=cpu",
                                     "cluster.devices=2"))))
    wire = predicted_wire_bytes(plan_dict(plan)["communication"])
    copies = plan.communication.bytes_per_step - wire
    assert 0 < wire and 0 < copies, plan.communication
    assert (f"comm {gb(plan.communication.bytes_per_step)}/step (collectives {gb(wire)}, offload "
            f"copies {gb(copies)})") in plan.summary(), plan.summary()


@pytest.mark.unit
def test_a_verdict_names_every_overflow_and_its_hint_only_fixes_that_could_help():
    """llama_70b zero_infinity on one H200 overflows the device by 1 GB and NVMe by 1.3 TB: the
    verdict named the device alone, and the hint advised "a smaller micro batch or activation
    checkpointing" -- at micro batch 1, after checkpointing was planned and fitted nothing, and
    again once checkpointing was on. Every overflow is named; a fix is offered only where it is
    not set and could change the answer."""
    from planner import preflight
    from recipes.config import compose

    over = ("model=llama_70b", "cluster=h200_1x", "strategy=zero_infinity", "strategy.nvme_path=/nvme",
            "trainer.micro_batch_size=1")
    both = preflight(typed(_compose(over)))
    for line in (both.message(), both.summary()):
        assert "142.0 GB" in line and "NVMe: needs 1,379.5 GB per node, has 68.0 GB" in line, line
    on = preflight(typed(_compose((*over, "strategy.activation_checkpointing=true"))))
    assert on.margin > 0 and on.message().startswith("does not fit on h200_1x: NVMe: needs")
    for hint in (both.hint, on.hint):  # (with checkpointing zero_infinity has room on the device)
        assert "overflow the host or NVMe (more nodes split offloaded state" in hint, hint
        assert "use more devices, a smaller micro batch or activation checkpointing" not in hint
    cfg = compose(["model=gpt_nano", "cluster.accelerator=cpu", "cluster.device_memory_GB=0.0001",
                   "trainer.micro_batch_size=2", "planner.activation_checkpointing=false"])
    off = preflight(typed(cfg))  # (checkpointing off and not planned: offered; micro batch 2: offered)
    assert off.hint.endswith("use more devices, a smaller micro batch or activation checkpointing "
                             "(planner.activation_checkpointing=true)"), off.hint
    cfg.planner.activation_checkpointing = "selective"
    assert preflight(typed(cfg)).hint.endswith("or full activation checkpointing (planner.activation_"
                                               "checkpointing=true)")
