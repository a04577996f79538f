"""Issue 23, "a planner you can trust": DeepSpeed "auto" sizes are planned as Accelerate fills
them and invalid ones are one clear error; a layout that cannot run never gets a 'fits' verdict;
the table says what the JSON says (tight, incomplete, cannot run here); strategy=auto picks what
plan.py shows, never lossy compression on a tie."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
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
    # two buffers (overlap_comm) of h^2 bf16 elements instead of 200M
    assert z2.memory.buffers - auto.memory.buffers == (200_000_000 - h * h) * 2 * 2
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
    from strategies.mesh import ConfigError

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


# ----------------------------------------------------------------------------- 2. verdicts
def _report(*overrides):
    from planner import plan_all

    cfg = _compose(overrides)
    return plan_all(cfg, describe(cfg.model))


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
    rec = plan_all(cfg, describe(cfg.model)).recommendation
    assert rec.strategy is None and "smallest need" not in rec.reason
    assert "trainer.global_batch_size=4 is not divisible" in rec.reason, rec.reason


# ----------------------------------------------------------------------------- 3. reasons, columns
@pytest.mark.unit
def test_one_device_reason_does_not_claim_sharding():
    rec = _report("model=llama_7b", "cluster=h200_1x").recommendation
    assert rec.strategy and "so the state must be sharded" not in rec.reason, rec.reason
    assert "nothing is sharded" in rec.reason


@pytest.mark.unit
def test_table_separates_tight_incomplete_and_cannot_run():
    report = _report("model=llama_7b", "cluster=h200_1x")
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

    fsdp = _plans("model=llama_7b", "cluster=h200_1x")["fsdp"]
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
    picked, why = choose(cfg, describe(cfg.model))
    assert picked.name in {"fsdp_tp", "tp", "3d", "pipeline", "pp_dp"}, why
    report = _report(*_70B)
    assert report.recommendation.strategy == picked.name
    assert not next(p for p in report.plans if p.strategy == picked.name).planned_only
    names = [p.strategy for p in report.plans]
    first_planned = min(i for i, p in enumerate(report.plans) if p.planned_only)
    assert all(not p.planned_only for p in report.plans[:first_planned])  # runnable first, apart
    assert names.index(picked.name) == 0


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
def test_a_tight_layout_is_not_recommended_over_an_as_fast_roomy_one():
    from planner import recommend

    report = _report(*_70B)
    planned = [p for p in report.plans if p.planned_only]
    tp = next(p for p in planned if p.strategy == "megatron_tp")
    assert tp.tight  # 78.4 of 80 GB, under the 3 GB reserve
    rec = recommend(planned)
    assert rec.strategy == "megatron_3d", rec.reason
