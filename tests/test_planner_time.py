"""Issue 23, the planner's step time, traffic, pipelines and activations: each pipeline schedule
simulated in the order torch runs it (bubble, chunks alive, sends), FSDP2 inside the TP/PP
presets reducing in fp32, the traffic of the step's real micro-batches, activations calibrated
under TP, pipelines and dropout, attention FLOPs, and a machine calibrated for ``cluster=local``;
measured against real gloo runs where it is cheap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.render import plan_dict
from tests.conftest import ROOT, TINY, run_cli, typed
from tests.test_planner import _compose, _plans, describe

BF16_70B = ("model=llama_70b", "cluster=slurm_8x8_h100", "trainer.precision=bf16-mixed")
PARALLEL = ("tp", "fsdp_tp", "3d", "pipeline", "pp_dp")


# ----------------------------------------------------------------------------- 1. FSDP2 in fp32
@pytest.mark.unit
@pytest.mark.parametrize("preset", PARALLEL)
def test_fsdp2_inside_parallel_presets_reduces_in_fp32(preset):
    """parallel/parallelize.py builds FSDP2 with reduce_dtype fp32 for these presets: the
    reduce-scatter moves as many bytes at bf16-mixed as at fp32 (it was half)."""
    key = "grad_reduce_scatter"
    bf16 = _plans(*BF16_70B, f"strategy={preset}")[preset].communication.by_collective[key]
    fp32 = _plans(*BF16_70B, f"strategy={preset}", "trainer.precision=32")[preset].communication.by_collective[key]
    assert bf16.bytes == fp32.bytes > 0


# ----------------------------------------------------------------------------- 2-4. schedules
@pytest.mark.unit
def test_schedule_orders_are_torchs():
    """The chunk order of every multi-stage schedule equals torch's own ``pipeline_order`` (its
    idle slots aside), and GPipe's its ``_get_pipeline_order``; 1F1B's runtime order is the
    warm-up forwards then backward/forward pairs (torch's display order numbers the last
    rank's forwards from 1, the runtime from 0)."""
    import torch.distributed.pipelining.schedules as S

    from parallel.pipeline import actions

    classes = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B, "looped_bfs": S.ScheduleLoopedBFS,
               "interleaved_1f1b": S.ScheduleInterleaved1F1B,
               "interleaved_zb": S.ScheduleInterleavedZeroBubble, "zbv": S.ScheduleZBVZeroBubble}
    kinds = ("F", "B", "I", "W")
    checked = 0
    for schedule, vs in (("gpipe", [1]), ("1f1b", [1]), ("looped_bfs", [2, 3]), ("interleaved_1f1b", [2, 3]),
                         ("interleaved_zb", [2, 3]), ("zbv", [2])):
        for pp in (2, 3, 4):
            for m in range(1, 13):
                for v in vs:
                    if schedule != "gpipe" and m < pp:
                        continue
                    x = object.__new__(classes[schedule])
                    x._n_microbatches, x._num_stages, x.pp_group_size = m, pp, pp
                    x._stages, x.n_local_stages, x.num_stages = [None] * v, v, pp * v
                    x.number_of_rounds = max(1, m // pp)
                    x.microbatches_per_round = m // x.number_of_rounds
                    if schedule.startswith("interleaved") and m % x.number_of_rounds:
                        continue
                    orders = (x._get_pipeline_order() if schedule in ("gpipe", "1f1b") else
                              {r: x._calculate_single_rank_operations(r) for r in range(pp)})
                    torch_order = [[(a.stage_index, a.computation_type.value, a.microbatch_index)
                                    for a in orders[r] if a is not None and a.computation_type.value in kinds]
                                   for r in range(pp)]
                    ours = actions(schedule, pp, v, m)
                    if schedule == "1f1b":
                        torch_order, ours = torch_order[:-1], ours[:-1]
                    assert ours == torch_order, (schedule, pp, v, m)
                    checked += 1
    assert checked > 150


@pytest.mark.unit
def test_each_schedule_has_its_bubble():
    from parallel.pipeline import bubble

    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            gpipe = (p - 1) / (m + p - 1)
            assert bubble("gpipe", p, 1, m) == pytest.approx(gpipe)
            assert bubble("1f1b", p, 1, m) == pytest.approx(gpipe)
            for v in (2, 4):  # Narayanan et al.: the bubble shrinks by the virtual stages
                assert bubble("interleaved_1f1b", p, v, m) == pytest.approx((p - 1) / (v * m + p - 1))
                assert bubble("looped_bfs", p, v, m) == pytest.approx((p - 1) / (v * m + p - 1))
            # zero bubble: backward split into input and weight gradients fills the ramps
            assert bubble("interleaved_zb", p, 2, m) < bubble("interleaved_1f1b", p, 2, m)
            assert bubble("zbv", p, 2, m) < bubble("interleaved_1f1b", p, 2, m)
    # the plan and the run's report say the schedule's own
    plan = _plans("model=gpt_nano", "model.n_layers=4", "strategy=pipeline", "cluster.devices=2",
                  "strategy.schedule=interleaved_1f1b", "trainer.global_batch_size=8",
                  "trainer.micro_batch_size=2")["pipeline"]
    assert plan.microbatches == 8 and plan.bubble_fraction == pytest.approx(1 / (2 * 8 + 1))


@pytest.mark.unit
def test_virtual_stages_send_at_every_boundary():
    """Each boundary between two ranks carries the activation forward and its gradient back per
    micro-batch: 2v - 1 tensors from an end rank of a loop, 2v from a middle one; a V keeps its
    turn on one rank."""
    from parallel.pipeline import sends_per_microbatch

    assert sends_per_microbatch("1f1b", 2, 1) == [1, 1]
    assert sends_per_microbatch("1f1b", 4, 1) == [1, 2, 2, 1]
    assert sends_per_microbatch("interleaved_1f1b", 2, 2) == [3, 3]
    assert sends_per_microbatch("looped_bfs", 4, 2) == [3, 4, 4, 3]
    assert sends_per_microbatch("zbv", 2, 2) == [2, 2]
    base = ("model=gpt_nano", "model.n_layers=4", "strategy=pipeline", "cluster.devices=2",
            "trainer.global_batch_size=8", "trainer.micro_batch_size=2")
    one = _plans(*base)["pipeline"].communication.by_collective["pp_send_recv"].bytes
    for schedule, sends in (("interleaved_1f1b", 3), ("looped_bfs", 3), ("interleaved_zb", 3), ("zbv", 2)):
        got = _plans(*base, f"strategy.schedule={schedule}")["pipeline"].communication.by_collective
        assert got["pp_send_recv"].bytes == sends * one, schedule


@pytest.mark.unit
def test_pipeline_traffic_follows_the_real_micro_batches():
    """planner.microbatches is a what-if for the schedule (its bubble), not the step's traffic."""
    base = ("model=llama_7b", "cluster=node_8x_h100", "trainer.global_batch_size=64")
    a, b = _plans(*base), _plans(*base, "planner.microbatches=4")
    for name in ("pipeline", "megatron_pp"):
        if name not in a:
            continue
        assert (a[name].communication.by_collective["pp_send_recv"].bytes
                == b[name].communication.by_collective["pp_send_recv"].bytes), name
    assert a["pipeline"].bubble_fraction != b["pipeline"].bubble_fraction
    # and a larger micro batch halves the micro-batches, not the bytes
    c = _plans(*base, "trainer.micro_batch_size=2")["pipeline"].communication.by_collective["pp_send_recv"]
    assert c.bytes == a["pipeline"].communication.by_collective["pp_send_recv"].bytes


@pytest.mark.unit
def test_fsdp2_under_a_pipeline_gathers_per_schedule():
    """torch's stage keeps a backward's gather to the end of the schedule and reduce-scatters
    once there: 1F1B gathers m + 1 times per stage, reduces once."""
    from parallel.pipeline import fsdp_gathers

    assert [sum(g) for g in fsdp_gathers("1f1b", 2, 1, 4)] == [5, 5]
    assert [sum(g) for g in fsdp_gathers("gpipe", 2, 1, 4)] == [5, 5]
    assert [sum(g) for g in fsdp_gathers("1f1b", 2, 1, 4, reshard_after_forward=False)] == [1, 1]
    base = ("model=gpt_nano", "strategy=pp_dp", "cluster.devices=4", "cluster.oversubscribe=true",
            "trainer.global_batch_size=8", "trainer.micro_batch_size=1")
    one = _plans(*base, "strategy.microbatches=4")["pp_dp"].communication.by_collective
    two = _plans(*base, "strategy.microbatches=2")["pp_dp"].communication.by_collective
    assert two["grad_reduce_scatter"].bytes == 2 * one["grad_reduce_scatter"].bytes  # per schedule run


@pytest.mark.unit
@pytest.mark.parametrize("tp, pp, names", [(2, 1, ("tp_all_reduce", "tp_logits_all_gather")),
                                           (1, 2, ("pp_send_recv",))])
def test_context_parallelism_divides_the_tp_and_pp_traffic(tp, pp, names):
    """Under cp each rank holds seq_len / cp tokens: its TP all-reduces, logits all-gather and
    pipeline boundary sends carry half a micro-batch's tokens at cp 2 (measured on 4 gloo ranks,
    fp32, micro 4, the whole step: tensor all_reduce 524,352 B and all_gather 131,072 B at
    cp 2 x tp 2, pipeline send 32,768 B at cp 2 x pp 2, where the plan read twice those)."""
    from planner import plan_all
    from recipes.config import compose

    base = ["model=gpt_nano", "strategy=3d", "cluster.devices=4", "cluster.oversubscribe=true",
            "trainer.global_batch_size=16", "trainer.micro_batch_size=4", f"strategy.tp={tp}",
            f"strategy.pp={pp}", "callbacks=none"]
    cp1, cp2 = ({q.strategy: q for q in plan_all(typed(compose([*base, f"strategy.cp={cp}"]))).plans}["3d"]
                for cp in (1, 2))
    assert (cp1.microbatches, cp2.microbatches) == (2, 4)  # (cp 2: one replica, twice the micro-batches)
    for name in names:
        one, two = cp1.communication.by_collective[name], cp2.communication.by_collective[name]
        assert two.bytes / 4 == one.bytes / 2 / 2, name  # per micro-batch: half the tokens
    measured = {"tp_all_reduce": 524_288, "tp_logits_all_gather": 131_072, "pp_send_recv": 32_768}
    assert {k: cp2.communication.by_collective[k].bytes for k in names} == {k: measured[k] for k in names}


# ----------------------------------------------------------------------------- 5, 6. activations
@pytest.mark.unit
def test_pipeline_activations_hold_what_the_schedule_keeps_alive():
    from planner.activations import activation_bytes, activation_parts

    cfg = _compose(("model=gpt_nano",))
    shape = describe(cfg.model)  # 2 layers: one a stage
    layer, _, head, embed = activation_parts(shape, micro=1, regime="32")
    kw = dict(micro=1, pp=2, regime="32", microbatches=4)
    assert activation_bytes(shape, schedule="gpipe", **kw) == int(4 * (layer + head))  # all m, last stage
    assert activation_bytes(shape, schedule="1f1b", **kw) == int(max(2 * (layer + embed), layer + head))


@pytest.mark.unit
def test_tp_and_dropout_use_their_calibration():
    from planner.activations import activation_parts, calibrated

    cfg = _compose(("model=gpt_small",))
    shape = describe(cfg.model)
    assert calibrated(shape, "32", tp=2) is calibrated(shape, "32")["variants"]["tp"]
    assert calibrated(shape, "32", tp=2, sp=True) is calibrated(shape, "32")["variants"]["tp_sp"]
    closed = activation_parts(shape, micro=1, tp=2)[0]
    ours = activation_parts(shape, micro=1, tp=2, regime="32")[0]
    assert ours > 1.2 * closed  # our model saves more than Korthikanti's layer (fp32 norms, RoPE)
    drop = _compose(("model=gpt_small", "model.dropout=0.1"))
    assert activation_parts(describe(drop.model), micro=1, regime="32")[0] > 1.3 * activation_parts(
        shape, micro=1, regime="32")[0]  # the masks and the attention probabilities dropout keeps


def _measured(tmp_path, *overrides):
    run = run_cli("train.py", *TINY, "data=synthetic", "trainer.max_steps=1", *overrides,
                  out=tmp_path / "run", timeout=300)
    return run.report


ACT_CI = {("gpt_nano", "tp"), ("gpt_nano", "1f1b")}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, layout", [
    (m, x) if (m, x) in ACT_CI else pytest.param(m, x, marks=pytest.mark.slow)
    for m in ("gpt_nano", "gpt_small") for x in ("tp", "1f1b", "gpipe", "dropout")])
def test_measured_activations_match_tp_pipelines_and_dropout(tmp_path, model, layout):
    """The most saved tensors any rank held in its first micro-batch (a pipeline: its first
    schedule) against the planner's busiest device, within 10%."""
    extra = {"tp": ("strategy=tp", "trainer.global_batch_size=2", "trainer.micro_batch_size=2"),
             "1f1b": ("strategy=pipeline", "trainer.global_batch_size=8", "trainer.micro_batch_size=2"),
             "gpipe": ("strategy=pipeline", "strategy.schedule=gpipe", "trainer.global_batch_size=8",
                       "trainer.micro_batch_size=2"),
             "dropout": ("strategy=tp", "model.dropout=0.1", "trainer.global_batch_size=2",
                         "trainer.micro_batch_size=2")}[layout]
    r = _measured(tmp_path, f"model={model}", "cluster.devices=2", "callbacks.communication=false", *extra)
    row = r["predicted_vs_measured"]["activations"]
    assert 0.9 <= row["ratio"] <= 1.1, row


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", pytest.param("zbv", marks=pytest.mark.slow),
                                      pytest.param("looped_bfs", marks=pytest.mark.slow)])
def test_virtual_stage_traffic_is_measured(tmp_path, schedule):
    """Measured send bytes of the pipeline group equal the plan within 2% (2 ranks, 4 stages)."""
    r = _measured(tmp_path, "model.n_layers=4", "strategy=pipeline", f"strategy.schedule={schedule}",
                  "cluster.devices=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=1",
                  "trainer.max_steps=2")
    sent = r["communication"]["by_group"]["pipeline"]["send"]["wire_bytes"]
    planned = r["plan"]["communication"]["by_collective"]["pp_send_recv"]["bytes"]
    assert sent == pytest.approx(planned, rel=0.02)
    assert r["pipeline"]["bubble_predicted"] > 0 and r["pipeline"]["idle_vs_predicted"] > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_fsdp_tp_reduce_scatter_is_fp32_as_planned(tmp_path):
    """fsdp_tp (tp 2 x dp 2) at bf16-mixed: the data group's reduce-scatter carries 4-byte
    gradients, as many bytes as the plan says (within 1%, shard padding)."""
    r = _measured(tmp_path, "strategy=fsdp_tp", "cluster.devices=4", "cluster.oversubscribe=true",
                  "trainer.precision=bf16-mixed", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
                  "trainer.max_steps=2")
    rs = r["communication"]["by_group"]["data"]["reduce_scatter"]
    assert rs["wire_bytes"] == pytest.approx(
        r["plan"]["communication"]["by_collective"]["grad_reduce_scatter"]["bytes"], rel=0.01)


# ----------------------------------------------------------------------------- 7. attention FLOPs
@pytest.mark.unit
def test_compute_counts_attention():
    """llama_7b at seq 4096: 12 x layers x seq x dim FLOPs per token beside 6 per matmul parameter
    (PaLM's MFU convention): ~16% more than 6 x params, and exactly the model's own count."""
    cfg = _compose(("model=llama_7b", "cluster=node_8x_h100", "strategy=fsdp"))
    shape = describe(cfg.model)
    p = _plans("model=llama_7b", "cluster=node_8x_h100", "strategy=fsdp")["fsdp"]
    t = cfg.trainer
    expected = (shape.flops_per_token() * t.global_batch_size * shape.seq_len
                / (8 * cfg.cluster.peak_tflops * 1e12 * cfg.planner.mfu))
    assert p.compute_seconds == pytest.approx(expected, rel=1e-9)
    six_n = 6 * shape.num_params() * t.global_batch_size * shape.seq_len / (8 * cfg.cluster.peak_tflops * 1e12
                                                                            * cfg.planner.mfu)
    assert 1.12 < p.compute_seconds / six_n < 1.2


# ----------------------------------------------------------------------------- 8. calibration
MACHINE = {"matmul_tflops": 0.2, "efficiency": 0.5, "optimizer_ns_per_param": 10.0, "block_tflops": 0.1,
           "threads": 1, "collectives": {"all_reduce": {"GBps": 1.0, "latency_us": 100.0},
                                         "all_gather": {"GBps": 0.5, "latency_us": 50.0},
                                         "reduce_scatter": {"GBps": 0.25, "latency_us": 50.0},
                                         "send": {"GBps": 2.0, "latency_us": 20.0}}}


def _cache(tmp_path, monkeypatch, *overrides):
    from planner import machine

    monkeypatch.setattr(machine, "CACHE", tmp_path / "machine")
    cfg = _compose(overrides)
    p = machine.path(machine.key(typed(cfg).cluster, cfg.trainer.precision))
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({**MACHINE, "format": machine.FORMAT}))
    return p


@pytest.mark.unit
def test_a_calibrated_machine_prices_cluster_local(tmp_path, monkeypatch):
    base = ("model=gpt_small", "cluster=local", "cluster.devices=2", "cluster.accelerator=cpu", "strategy=ddp")
    _cache(tmp_path, monkeypatch, *base)
    plain = _plans(*base)["ddp"]
    p = _plans(*base, "planner.calibrate=true")["ddp"]
    shape = describe(_compose(base).model)
    flops = shape.flops_per_token() * 16 * shape.seq_len
    assert p.compute_seconds == pytest.approx(flops / (2 * 0.2e12 * 0.5))
    assert p.optimizer_seconds == pytest.approx(shape.num_params() * 10e-9)
    ar = p.communication.by_collective["grad_all_reduce"]
    assert ar.latency_seconds == pytest.approx(ar.calls * 2 * 100e-6)  # 2 log2(2) steps of 100 us
    assert ar.seconds == pytest.approx(ar.bytes / 1e9 + ar.latency_seconds)
    assert p.step_seconds != plain.step_seconds and p.peak_tflops == 0.2 and p.mfu == 0.5
    from planner import plan_all

    report = plan_all(typed(_compose((*base, "planner.calibrate=true"))), shape)
    text = " ".join(report.assumptions)
    assert "measured on this machine" in text and "(6 x matmul params + 12 x layers x seq x dim)" in text
    # other clusters are never calibrated
    assert _plans("model=gpt_small", "cluster=node_8x_h100", "planner.calibrate=true")["ddp"].optimizer_seconds == 0


@pytest.mark.unit
def test_tensor_parallel_over_the_measured_world_uses_its_measured_speedup(tmp_path, monkeypatch):
    """tp over every calibrated process: a rank's compute is the whole model's divided by the
    measured ``tp_speedup`` (not by tp), and TP's collectives, inside that measurement, are not
    added again; at other tp degrees the ideal division and the priced collectives stay."""
    from planner import machine

    base = ("model=gpt_small", "cluster=local", "cluster.devices=2", "cluster.accelerator=cpu",
            "strategy=tp", "planner.calibrate=true")
    p = _cache(tmp_path, monkeypatch, *base)
    ideal = _plans(*base)["tp"]
    p.write_text(json.dumps({**MACHINE, "format": machine.FORMAT, "tp_speedup": 1.25}))
    measured = _plans(*base)["tp"]
    cfg = _compose(base)
    assert machine.load(typed(cfg).cluster, cfg.trainer.precision).tp_speedup == 1.25
    assert measured.compute_seconds == pytest.approx(ideal.compute_seconds * 2 / 1.25)
    tp_comm = sum(x.seconds for n, x in ideal.communication.by_collective.items() if n.startswith("tp_"))
    assert tp_comm > 0
    assert measured.exposed_seconds == pytest.approx(ideal.exposed_seconds - tp_comm)
    assert _plans(*base, "strategy=ddp")["ddp"].compute_seconds == pytest.approx(
        _plans(*base[:-2], "strategy=ddp", "planner.calibrate=true")["ddp"].compute_seconds)


@pytest.mark.unit
def test_deepspeeds_measured_engine_work_prices_zero_steps(tmp_path, monkeypatch):
    """A calibrated machine's ``engine_ns_per_param_zero2``/``_zero3``/``_fsdp2`` (the engine's own
    work per parameter and micro-batch) is added to that engine's step as ``engine_seconds``;
    DDP has none, nor tp's FSDP2 over one data-parallel rank (not applied); a cache from before
    the engines were measured (format 1) is not used."""
    from planner import machine

    base = ("model=gpt_small", "cluster=local", "cluster.devices=2", "cluster.accelerator=cpu",
            "planner.calibrate=true")
    p = _cache(tmp_path, monkeypatch, *base)
    presets = ("ddp", "zero2", "zero3", "fsdp2", "tp")
    before = {s: _plans(*base, f"strategy={s}")[s] for s in presets}
    assert all(x.engine_seconds == 0 for x in before.values())
    p.write_text(json.dumps({**MACHINE, "format": machine.FORMAT, "engine_ns_per_param_zero2": 7.0,
                             "engine_ns_per_param_zero3": 11.0, "engine_ns_per_param_fsdp2": 5.0}))
    after = {s: _plans(*base, f"strategy={s}")[s] for s in presets}
    params = describe(_compose(base).model).num_params()
    for s, ns in (("ddp", 0.0), ("zero2", 7.0), ("zero3", 11.0), ("fsdp2", 5.0), ("tp", 0.0)):
        # each micro-batch the rank runs (global batch 16 at micro batch 1 over 2 ranks: 8)
        assert after[s].engine_seconds == pytest.approx(params * ns * 1e-9 * after[s].microbatches)
        assert after[s].step_seconds == pytest.approx(before[s].step_seconds + after[s].engine_seconds)
    assert after["zero3"].microbatches == 8 and after["zero3"].engine_seconds > 0
    assert plan_dict(after["zero3"])["engine_seconds"] == after["zero3"].engine_seconds
    # twice the micro-batches per step: twice the hooks
    acc = _plans(*base, "strategy=zero3", "trainer.global_batch_size=32")["zero3"]
    assert acc.engine_seconds == pytest.approx(2 * after["zero3"].engine_seconds)
    p.write_text(json.dumps({**MACHINE, "engine_ns_per_param_zero3": 11.0}))  # no format: 1
    cfg = _compose(base)
    assert machine.load(typed(cfg).cluster, cfg.trainer.precision) is None
    assert _plans(*base, "strategy=zero3")["zero3"].optimizer_seconds == 0  # priced uncalibrated


@pytest.mark.unit
def test_the_caches_follow_xdg_cache_home(tmp_path, monkeypatch):
    """The calibrations and the tokenized data live under $XDG_CACHE_HOME/stratagem where it is
    set (a cluster's small home), under ~/.cache/stratagem where it is not."""
    from planner import machine
    from recipes.token_inputs import default_cache_dir

    def where() -> list[Path]:
        k = {"host": "h", "device": "d", "world": 1, "threads": 1, "precision": "32"}
        return [machine.path(k).parent, default_cache_dir()]

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert where() == [tmp_path / "xdg" / "stratagem" / x for x in ("machine", "tokens")]
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert where() == [tmp_path / ".cache" / "stratagem" / x for x in ("machine", "tokens")]


@pytest.mark.unit
def test_the_calibration_times_each_repeat_of_the_compute_in_lockstep():
    """Format 5: every process passes a barrier before each timed repeat (a run's steps are locked
    by their collectives), not once before the loop, where the process done first left the
    machine to the others: 2-process plans measured 1.27-1.57 against 0.91-1.11 in lockstep."""
    from observers import machine as measure

    calls = []
    measure._timed(lambda: calls.append("run"), repeats=3, sync=lambda: None,
                   together=lambda: calls.append("barrier"))
    assert calls == ["run"] + ["barrier", "run"] * 3  # (the warm-up alone, then each repeat)


@pytest.mark.unit
def test_the_block_rate_is_the_median_over_every_burst():
    """Format 6: the block's runs come in bursts spread over the calibration (its start, after the
    collectives, its end), and its rate is the model FLOPs over the median of all of them."""
    import statistics

    import torch

    from observers import machine as measure

    block = measure._Block("cpu", "32", torch.device("cpu"), lambda: None, lambda: None)
    block.step = lambda: None  # (the bursts' bookkeeping, not the block's speed)
    for _ in range(3):
        block.burst()
    assert len(block.times) == 3 * measure._Block.BURST
    block.times = [1.0] * 5 + [2.0] * 5 + [4.0] * 5
    assert block.tflops == pytest.approx(block.flops / statistics.median(block.times) / 1e12)
    assert block.tflops == pytest.approx(block.flops / 2.0 / 1e12)


@pytest.mark.subprocess
@pytest.mark.slow  # a whole calibration: 108 s in CI before format 4 added the host's measurements
def test_plan_py_calibrates_in_a_subprocess_and_imports_no_torch(tmp_path):
    """planner.calibrate=true: plan.py measures this machine once (a subprocess running
    backends.common.calibrate: ~50 s on 2 cores), caches it under the user's cache directory, plans
    with it, and itself imports no torch; the second call reads the cache."""
    from planner import machine
    from tests.conftest import engines_loaded

    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / ".cache")}
    args = ("plan.py", "model=gpt_nano", "cluster.devices=2", "cluster.accelerator=cpu", "strategy=ddp",
            "planner.calibrate=true", "planner.format=json")
    proc, loaded = engines_loaded(*args, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch" not in loaded, loaded
    cached = list((tmp_path / ".cache" / "stratagem" / "machine").glob("*-w2-*-32.json"))
    assert len(cached) == 1
    m = json.loads(cached[0].read_text())
    assert m["matmul_tflops"] > 0 and 0 < m["efficiency"] < 1.5 and m["optimizer_ns_per_param"] > 0
    assert set(m["collectives"]) == {"all_reduce", "all_gather", "reduce_scatter", "send"}
    assert m["tp_speedup"] > 0  # TP over both processes, measured
    assert m["format"] == machine.FORMAT == 7  # the engines on one row, under the ranks' steady allocator
    assert all(m[k] > 0 for k in ("host_optimizer_ns_per_param", "host_copy_GBps", "floor_seconds"))
    assert all(m[f"engine_ns_per_param_{e}"] >= 0 for e in ("zero2", "zero3", "fsdp2", "zero2_offload",
                                                               "zero3_offload"))
    again = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**__import__("os").environ, **env})
    plan = json.loads(again.stdout)["plans"][0]
    assert plan["compute"]["peak_tflops"] == pytest.approx(m["matmul_tflops"])
    assert "measuring this machine" not in again.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_calibration_at_a_world_tp_cannot_split_measures_the_rest(tmp_path):
    """4 processes: the reference block's 6 heads do not split 4 ways, so no tp_speedup (a tp
    plan there keeps the ideal division) -- and the calibration still measures everything else
    (it crashed in apply_tp before)."""
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "observers.machine", "--world", "4", "--threads", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads(out.read_text())
    assert "tp_speedup" not in m and m["block_tflops"] > 0 and set(m["collectives"]) >= {"all_reduce"}


@pytest.mark.slow
@pytest.mark.subprocess
def test_calibration_leaves_out_the_engines_a_precision_refuses(tmp_path):
    """16-mixed on CPU: DeepSpeed has no fp16 loss scaling there and FSDP2 no scaler for DTensor
    gradients (their presets refuse it), so the calibration measures the rest and no engine --
    their plans then carry no engine term (0: not measured)."""
    out = tmp_path / "m.json"
    cmd = [sys.executable, "-m", "backends.common.calibrate", "--world", "2", "--threads", "1",
           "--precision", "16-mixed", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads(out.read_text())
    assert m["block_tflops"] > 0 and not [k for k in m if k.startswith("engine_ns_per_param")]
