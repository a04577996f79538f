"""Communication-efficient data parallelism (issue 25): ddp_topk, ddp_int8, local_sgd, diloco.

Exactness where it must hold (2 gloo ranks against the single-process reference, plain SGD: its
update is lr x gradient, so any gradient or averaging error shows): top-k with ratio 1.0, local
SGD with sync_every=1, DiLoCo with outer lr 1 and no momentum; int8 within a tolerance derived
from its quantization step. Error feedback is checked in a real DDP run, step by step. The
communication observer's bytes equal the planner's for every new preset."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import EQUIV, OPTIMIZERS, assert_losses_close, assert_params_close

TWO = ("cluster.devices=2", "trainer.micro_batch_size=4", "callbacks.communication=true")
SGD = (*EQUIV, *OPTIMIZERS["sgd"])
LR = 0.5  # OPTIMIZERS["sgd"]


def _max_rel(ref: list[float], other: list[float]) -> float:
    return max(abs(a - b) / abs(a) for a, b in zip(ref, other))


def _bytes(run, buffers: bool = True) -> tuple[float, float]:
    """(measured data-parallel wire bytes per step, the planner's), DDP's buffer broadcast (the
    rope table, 1 KB a step) included on both sides; ``buffers=False``: the gradient (or
    parameter) traffic alone, to compare presets with each other."""
    measured = sum(v["wire_bytes"] for k, v in run.report["communication"]["per_step"].items()
                   if buffers or k != "broadcast")
    planned = sum(v["bytes"] for k, v in run.report["plan"]["communication"]["by_collective"].items()
                  if buffers or k != "buffer_broadcast")
    return measured, planned


# ----------------------------------------------------------------------------- unit
@pytest.mark.unit
def test_topk_split_sends_the_largest_and_keeps_the_rest_exactly():
    import torch

    from backends.common.ddp_comm import topk_split

    acc = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    values, idx, retained = topk_split(acc, 100)
    sent = torch.zeros_like(acc)
    sent[idx] = values
    assert torch.equal(sent + retained, acc)  # bit for bit
    assert retained.abs().max() <= values.abs().min()
    assert int((retained == 0).sum()) == 100


@pytest.mark.unit
def test_int8_quantization_error_is_at_most_half_a_step():
    import torch

    from backends.common.ddp_comm import int8_dequantize, int8_quantize

    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    codes, sz = int8_quantize(x)
    scale = float(sz[0])
    assert codes.dtype == torch.uint8
    assert scale == pytest.approx((float(x.max()) - float(x.min())) / 255, rel=1e-6)
    assert float((int8_dequantize(codes, sz) - x).abs().max()) <= scale / 2 * (1 + 1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("override, key", [("strategy.topk_ratio=0", "strategy.topk_ratio"),
                                           ("strategy.topk_ratio=1.5", "strategy.topk_ratio"),
                                           ("strategy.sync_every=0", "strategy.sync_every")])
def test_bad_values_are_one_clear_error(override, key):
    from recipes.config import compose
    from recipes.job import validate
    from strategies import ConfigError

    preset = "ddp_topk" if "topk" in key else "local_sgd"
    with pytest.raises(ConfigError) as e:
        validate(compose([f"strategy={preset}", "cluster.devices=2", override]))
    assert len(e.value.problems) == 1 and key in e.value.problems[0], e.value.problems


@pytest.mark.unit
def test_compression_with_relaxed_sync_is_refused():
    from recipes.config import compose
    from recipes.job import validate
    from strategies import ConfigError

    with pytest.raises(ConfigError, match="has nothing to compress"):
        validate(compose(["strategy=local_sgd", "strategy.comm_hook=int8", "cluster.devices=2"]))


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["ddp_topk", "ddp_int8", "ddp_powersgd", "local_sgd", "diloco"])
def test_resume_is_refused_by_name(preset):
    from recipes.config import compose
    from recipes.job import validate

    job = validate(compose([f"strategy={preset}", "cluster.devices=2"]))
    assert preset in job.strategy.resume_problem() and "cannot resume" in job.strategy.resume_problem()
    assert validate(compose(["strategy=ddp", "cluster.devices=2"])).strategy.resume_problem() is None


def _feed(profile, sent: list) -> None:
    """``sent[i]``: the all-reduce bytes of step i, None for no collective, or a list of its
    (kind, bytes, seconds) records, through the observer's own hooks (its recorder stands in for
    torch's collectives: what the aggregation does with them is tested)."""
    records: list = []
    profile._rec = type("Rec", (), {"start": lambda self: records.clear(), "stop": lambda self: list(records),
                                    "unobserved": []})()
    for step, b in enumerate(sent):
        profile.on_step_start(None, step)
        for kind, nbytes, seconds in ([] if b is None else b if isinstance(b, list) else [("all_reduce", b, None)]):
            records.append({"kind": kind, "group": "data-replicate", "bytes": nbytes, "wire_bytes": nbytes,
                            "seconds": seconds})
        profile.on_step_work_end(None, step)


@pytest.mark.unit
def test_the_comparison_leaves_out_the_warm_up_steps():
    """ddp_powersgd, 16 steps on gpt_nano at 2 ranks (the audit's run): 10 warm-up steps of plain
    all-reduce (139,904 B) then 6 compressed (7,040 B). The row read 12.47 ("the planner
    under-predicts PowerSGD 12x"): its average held 9 warm-up steps. It is now the steady state the
    plan prices; a run that never leaves its warm-up gives no ratio and says why; the sweep
    reads the same figure (report.json ``communication.per_step``)."""
    import dataclasses

    from launchers.sweep_report import markdown
    from observers.comm import _selected
    from observers.base import Selection
    from observers.compare import Comparison, summary_lines, sweep_facts
    from recipes.config import compose
    from recipes.job import validate

    psgd, ddp = (validate(compose(["cluster.devices=2", "model=gpt_nano", f"strategy={p}"]))
                 for p in ("ddp_powersgd", "ddp"))
    assert psgd.strategy.traffic_warmup() == (10, "strategy.powersgd_warmup_steps")
    for over in ({"comm_hook": "topk"}, {"comm_hook": "int8"}, {"sync": "local_sgd"}, {"sync": "diloco"}):
        preset = dataclasses.replace(ddp.strategy, **over, start_step=3)
        assert preset.traffic_warmup() == (3, "strategy.start_step"), over
    assert ddp.strategy.traffic_warmup() == (0, "")  # (its start_step starts nothing)
    plan = {"memory": {}, "communication": {"by_collective": {"grad": {"bytes": 7039, "group": "data"}}}}
    for steps, measured, ratio in ((16, 7040, 7040 / 7039), (4, 139904, None)):
        profile = _selected(Selection(psgd, Path("."), plan))
        _feed(profile, [139904] * 10 + [7040] * (steps - 10) if steps > 10 else [139904] * steps)
        comm = profile.report()["communication"]
        assert comm["per_step"]["all_reduce"]["wire_bytes"] == pytest.approx(measured), comm
        assert (comm["warmup_steps"], comm["steady_state"]) == (10, ratio is not None), comm
        assert comm["averaged_steps"] == (6 if steps == 16 else 3), comm  # (4 steps: the first is left out)
        row = Comparison(plan, communication=profile).report()["predicted_vs_measured"]["communication"]
        assert row["measured"] == pytest.approx(measured) and row["ratio"] == (ratio and pytest.approx(ratio)), row
        table = summary_lines({"communication": row})
        facts = sweep_facts({"communication": comm})  # (the sweep's comm MiB/step column)
        assert facts["comm_bytes_per_step"] == pytest.approx(measured), facts
        cell = markdown([{"job": "0", "overrides": [], "status": "ok", **facts}], Path(".")).split("| 0 |")[1]
        if ratio is None:
            assert table[1].endswith("warm-up") and "strategy.powersgd_warmup_steps=10" in row["of"], table
            assert any("strategy.powersgd_warmup_steps=10" in x for x in table[2:]), table
            assert "0.13 (warm-up)" in cell, cell
        else:
            assert "after strategy.powersgd_warmup_steps=10" in row["of"], row
            assert "0.01 |" in cell and "warm-up" not in cell, cell
    # without a warm-up: every step but the first, as before
    plain = _selected(Selection(ddp, Path("."), plan))
    _feed(plain, [5.0, 1.0, 2.0, 3.0])
    assert plain.report()["communication"]["per_step"]["all_reduce"]["wire_bytes"] == pytest.approx(2.0)


@pytest.mark.unit
@pytest.mark.parametrize("preset, first", [("local_sgd", 10), ("diloco", 17)])
def test_local_sgd_and_diloco_are_measured_over_whole_sync_periods(preset, first):
    """gpt_nano at 2 ranks, start_step 10, sync_every 8 (the audit's runs): 10 steps of plain
    all-reduce, then one parameter all-reduce every 8 steps -- local SGD's first on step index 10
    (torch's PeriodicModelAverager: (step - warmup) % period == 0), DiLoCo's on index 17 (its
    counter is past the step) -- which the plan spreads over the 8. A run of 14 steps averaged
    indices 10-13 and read 1.945 ("steady state"), DiLoCo's 0.055, 11 steps 7.6. Now the window is
    the last whole periods after the warm-up; under one period: no ratio, and why."""
    from launchers.sweep_report import markdown
    from observers.base import Selection
    from observers.comm import _selected
    from observers.compare import Comparison, summary_lines, sweep_facts
    from recipes.config import compose
    from recipes.job import validate

    job = validate(compose(["cluster.devices=2", "model=gpt_nano", f"strategy={preset}"]))
    assert job.strategy.traffic_period() == (8, "strategy.sync_every")
    assert validate(compose(["cluster.devices=2", "strategy=ddp_topk"])).strategy.traffic_period() == (1, "")
    full = 139904
    plan = {"memory": {}, "communication": {"by_collective": {
        "param_average_all_reduce": {"bytes": full / 8, "group": "intra"}}}}
    for steps, ratio in ((11, None), (14, None), (17, None), (18, 1.0), (20, 1.0), (25, 1.0), (26, 1.0), (30, 1.0)):
        profile = _selected(Selection(job, Path("."), plan))
        _feed(profile, [full if i < 10 or (i >= first and (i - first) % 8 == 0) else None for i in range(steps)])
        comm = profile.report()["communication"]
        row = Comparison(plan, communication=profile).report()["predicted_vs_measured"]["communication"]
        assert comm["sync_every"] == 8 and comm["steady_state"] is (ratio is not None), (steps, comm)
        assert row["ratio"] == (ratio and pytest.approx(ratio)), (steps, row)
        table, facts = summary_lines({"communication": row}), sweep_facts({"communication": comm})
        cell = markdown([{"job": "0", "overrides": [], "status": "ok", **facts}], Path(".")).split("| 0 |")[1]
        if ratio is None:
            assert comm["averaged_of"] == facts["comm_of"] == "part of a sync period", comm
            assert comm["averaged_steps"] == steps - 10 and table[1].endswith("partial"), (comm, table)
            assert "under one strategy.sync_every=8 period" in row["of"] and "trainer.max_steps=18" in row["of"], row
            assert any(x.strip().startswith("partial: the") for x in table[2:]), table
            assert "(part of a sync period)" in cell, cell
        else:
            assert comm["averaged_of"] == "steady state" and comm["averaged_steps"] % 8 == 0, comm
            assert "whole strategy.sync_every=8 period(s) ending at the last step" in row["of"], row
            assert "(" not in cell.split("|")[9], cell
    # from the first step (start_step=0): the first step aside, whole periods after it
    job0 = validate(compose(["cluster.devices=2", "model=gpt_nano", f"strategy={preset}", "strategy.start_step=0"]))
    at = first - 10
    for steps, ratio in ((8, None), (9, 1.0)):
        profile = _selected(Selection(job0, Path("."), plan))
        _feed(profile, [full if i >= at and (i - at) % 8 == 0 else None for i in range(steps)])
        row = Comparison(plan, communication=profile).report()["predicted_vs_measured"]["communication"]
        assert row["ratio"] == (ratio and pytest.approx(ratio)), (steps, row)
        if ratio is None:
            assert "after the first step" in row["of"] and "trainer.max_steps=9" in row["of"], row


@pytest.mark.unit
def test_every_kind_carries_seconds_null_where_untimed():
    """README: ``per_step[kind] -> {count, bytes, wire_bytes, seconds}``. gloo times some
    collectives only (its futures): a reduce-scatter's row had no ``seconds`` key, and a reader
    indexing it met a KeyError. Untimed kinds carry null; timed ones their mean."""
    from observers.comm import CommunicationProfile

    profile = CommunicationProfile("data-shard")
    _feed(profile, [[("reduce_scatter", 10.0, None), ("all_reduce", 4.0, 0.5)]] * 3)
    comm = profile.report()["communication"]
    for kinds in (comm["per_step"], *comm["by_group"].values()):
        assert kinds["reduce_scatter"]["seconds"] is None, kinds
        assert kinds["all_reduce"]["seconds"] == pytest.approx(0.5), kinds
        assert all(set(v) == {"count", "bytes", "wire_bytes", "seconds"} for v in kinds.values()), kinds


@pytest.mark.unit
def test_the_profile_keeps_no_list_of_steps():
    """The profile kept every step's summary to average at the end: ~1 KB a step a rank (a 3000-step
    ddp run grew 0.135 MB/100 steps with it, 0.035 without). Sums as the steps come give the
    averages the list gave -- every step but the first, from the warm-up's end on, the last whole
    sync periods -- for any length, warm-up and period, and hold at most a period of steps."""
    import random
    from collections import defaultdict

    from observers.comm_steps import Recorded

    def listed(recorded, warmup, period):  # (the old profile: the list, then the averages)
        later = recorded[1:] or recorded
        after = [s for i, s in later if i >= warmup]
        steps = (after[len(after) - len(after) // period * period:] or after) if after else [s for _, s in later]
        acc = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, None]))
        for s in steps:
            for g, kinds in s.items():
                for k, v in kinds.items():
                    d = acc[g][k]
                    d[0] += v["count"] / len(steps)
                    d[1] += v["bytes"] / len(steps)
                    if v["timed"]:
                        d[2] = (d[2] or 0.0) + v["seconds"] / len(steps)
        return len(steps), {g: {k: tuple(v) for k, v in kinds.items()} for g, kinds in acc.items()}

    rng = random.Random(0)
    for _ in range(300):
        warmup, period, n, start = rng.randrange(0, 6), rng.randrange(1, 5), rng.randrange(1, 20), rng.randrange(0, 4)
        recorded = []
        for i in range(start, start + n):
            kinds = {k: {"count": c, "bytes": 8 * c * (i + 1), "wire_bytes": 8.0 * c, "timed": c % 2,
                         "seconds": 0.25 * c if c % 2 else 0.0}
                     for k in rng.sample(["all_reduce", "broadcast", "all_gather"], rng.randrange(0, 3))
                     if (c := rng.randrange(1, 4))}
            recorded.append((i, {"data-replicate": kinds} if kinds else {}))
        window = Recorded(warmup, period)
        for i, s in recorded:
            window.add(i, s)
        sums, _ = window.covered()
        got = {g: {k: (v["count"], v["bytes"], v["seconds"]) for k, v in kinds.items()}
               for g, kinds in sums.average().items()}
        count, want = listed(recorded, warmup, period)
        assert (sums.n or 0) == (count if sums.n else 0) and got.keys() == want.keys(), (recorded, warmup, period)
        for g in want:
            assert got[g].keys() == want[g].keys(), (g, got, want)
            for k in want[g]:
                assert got[g][k] == pytest.approx(want[g][k]), (k, got, want, warmup, period)
        assert len(window._head) < period


@pytest.mark.unit
def test_planner_prices_each_method():
    """Per rank and step at 2 ranks, fp32, 124M parameters: DDP's ring all-reduce sends
    2(N-1)/N x 4P; top-k 0.01 sends (N-1) x k x 8 = 2% of it; int8 one byte per element plus 8
    per bucket (a quarter); local SGD and DiLoCo one parameter all-reduce per sync_every steps.
    Memory: one fp32 residual per parameter (top-k, int8), DiLoCo's outer copy and momentum."""
    from planner.communication import all_gather_bytes, ring_all_reduce_bytes
    from recipes.config import compose
    from recipes.job import validate
    from strategies.footprint import Sizes, StateBytes

    P = 124e6
    sizes = Sizes(params=P, trainable=P, bytes=StateBytes(4, 4, 0, 8, 4, 4, 4), dp=2, shard=1)

    def sent(*o: str) -> float:
        fp = validate(compose(["cluster.devices=2", *o])).strategy.footprint()
        per = {"all_reduce": ring_all_reduce_bytes, "all_gather": all_gather_bytes}
        return sum(per[t.op](t.bytes, t.ranks) for t in fp.traffic(sizes))

    def held(*o: str) -> float:
        return validate(compose(["cluster.devices=2", *o])).strategy.footprint().bucket_buffer(sizes)

    full = sent("strategy=ddp")
    assert full == 4 * P
    assert sent("strategy=ddp_topk") / full == pytest.approx(0.02, rel=1e-3)
    assert sent("strategy=ddp_topk", "strategy.topk_ratio=1") / full == pytest.approx(2, rel=1e-6)
    assert sent("strategy=ddp_int8") / full == pytest.approx(0.25, rel=1e-4)
    assert sent("strategy=local_sgd", "strategy.sync_every=8") == pytest.approx(full / 8)
    assert sent("strategy=diloco", "strategy.sync_every=4") == pytest.approx(full / 4)
    base = held("strategy=ddp")
    assert held("strategy=ddp_topk") - base == held("strategy=ddp_int8") - base == 4 * P
    assert held("strategy=diloco") - base == 8 * P and held("strategy=local_sgd") == base


@pytest.mark.unit
def test_the_plan_prices_ddp_s_buffer_broadcast():
    """DDP broadcasts the model's buffers from rank 0 before each step's first forward: gpt_nano's
    rope table, seq_len 32 x head_dim 8 x 4 bytes = 1024, on every rank (the observer's count),
    exposed; none on one rank, for a model with no description (planner.params only), or with
    broadcast_buffers off; model=hf: transformers' inv_freq and original_inv_freq, head_dim / 2
    fp32 each."""
    import dataclasses

    from recipes.config import compose
    from recipes.job import validate
    from strategies.footprint import Sizes, StateBytes

    job = validate(compose(["cluster.devices=2", "model=gpt_nano", "strategy=ddp"]))
    fp, shape = job.strategy.footprint(), job.model
    sizes = Sizes(params=1e4, trainable=1e4, bytes=StateBytes(4, 4, 0, 8, 4, 4, 4), dp=2, shard=1, model=shape)
    sent = {t.name: t for t in fp.traffic(sizes)}
    assert set(sent) == {"grad_all_reduce", "buffer_broadcast"}
    b = sent["buffer_broadcast"]
    assert (b.op, b.ranks, b.bytes, b.overlap, b.calls) == ("broadcast", 2, 32 * 8 * 4, "none", 1.0)
    assert [t.name for t in fp.traffic(dataclasses.replace(sizes, model=None))] == ["grad_all_reduce"]
    assert [t.name for t in fp.traffic(dataclasses.replace(sizes, dp=1))] == ["grad_all_reduce"]
    assert [t.name for t in dataclasses.replace(fp, broadcast_buffers=False).traffic(sizes)] == ["grad_all_reduce"]
    hf = dataclasses.replace(shape, architecture="llama", dim=64, n_heads=4)
    assert {t.name: t.bytes for t in fp.traffic(dataclasses.replace(sizes, model=hf))}["buffer_broadcast"] == 16 * 4


# ----------------------------------------------------------------------------- real processes
def _feedback_worker(rank: int, world: int, init: str, kind: str, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from backends.common import ddp_comm

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = ddp_comm.TopKState(0.01, 0) if kind == "topk" else ddp_comm.Int8State(0)
    hook = ddp_comm.topk_hook if kind == "topk" else ddp_comm.int8_hook
    state.record = True  # top-k: checks its real (values, indices) + retained against its input
    log: list[dict] = []

    def recording(st, bucket):
        grad = bucket.buffer().clone()
        old = st.residual(bucket).clone()
        fut = hook(st, bucket)
        new = st.residual(bucket).clone()
        sent = grad + old - new  # what this rank put on the wire this step

        def check(f):
            # no collective here: a callback runs on gloo's worker thread (one would deadlock)
            log.append({"grad": grad, "old": old, "new": new, "sent": sent, "avg": f.value().clone()})
            return f.value()

        return fut.then(check)

    ddp.register_comm_hook(state, recording)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x = torch.randn(16, 64, generator=g)
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for e in log:  # the mean of what the ranks sent, on the main thread after training
        e["mean_sent"] = e["sent"].clone()
        dist.all_reduce(e["mean_sent"])
        e["mean_sent"] /= world
    # DDP rebuilds its bucket (another parameter order) after the first step: sum from the second
    later = log[1:]
    total_grad = sum(e["grad"] for e in later) + later[0]["old"]
    total_sent = sum(e["sent"] for e in later)
    out[rank] = {
        # sent + retained == gradient + old residual, each step (top-k: bit for bit)
        "step_identity": max(float((e["sent"] + e["new"] - e["grad"] - e["old"]).abs().max()) for e in log),
        # over steps 1-4: everything sent + what is still retained == every gradient computed
        # (+ what step 0 left)
        "run_identity": float((total_sent + log[-1]["new"] - total_grad).abs().max()),
        "scale": float(total_grad.abs().max()),
        # what DDP hands the optimizer == the mean of what the ranks sent
        "average": max(float((e["avg"] - e["mean_sent"]).abs().max()) for e in log),
        "nonzero_sent": [int((e["sent"] != 0).sum()) for e in log],
        "numel": log[0]["grad"].numel(),
        "max_scale": getattr(state, "max_scale", 0.0),
        "residual": max(float(e["new"].abs().max()) for e in log),
        "recorded": list(getattr(state, "check", [])),
    }
    del ddp, model, opt  # (then torn down as a run is: the DDP, which holds the group, collected first)
    from backends import teardown

    teardown(True)


def _spawn(kind: str, tmp_path) -> dict:
    import torch.multiprocessing as mp

    # spawn, not fork: this pytest process may have run torch ops already (a forked child can
    # then hang in torch's thread pools)
    manager = mp.get_context("spawn").Manager()
    out = manager.dict()
    mp.start_processes(_feedback_worker, args=(2, f"file://{tmp_path}/rdzv", kind, out), nprocs=2,
                       start_method="spawn")
    return dict(out)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_topk_error_feedback_loses_nothing(tmp_path):
    """Ratio 0.01, 5 steps, a real 2-rank DDP: each step sent + retained equals the gradient
    plus the previous residual exactly, over the run sent + retained equals every gradient, only
    k = 1% entries go out, and DDP applies the mean of what the ranks sent."""
    for r in _spawn("topk", tmp_path).values():
        assert len(r["recorded"]) == 5 and set(r["recorded"]) == {0.0}  # bit for bit, each step
        assert r["step_identity"] <= 1e-6 * max(r["scale"], 1.0)  # (recomputed here: rounding)
        assert r["run_identity"] <= 1e-6 * max(r["scale"], 1.0)
        k = max(1, int(0.01 * r["numel"]))
        assert all(n <= k for n in r["nonzero_sent"]) and max(r["nonzero_sent"]) == k
        assert r["average"] <= 1e-7


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_int8_error_feedback_keeps_at_most_half_a_step(tmp_path):
    """int8: what rounding drops is retained (never more than half a quantization step per
    element), sent + retained equals gradient + old residual, and DDP applies the mean."""
    for r in _spawn("int8", tmp_path).values():
        assert r["step_identity"] <= 1e-6 * max(r["scale"], 1.0)
        assert r["run_identity"] <= 1e-5 * max(r["scale"], 1.0)
        assert 0 < r["residual"] <= r["max_scale"] / 2 * (1 + 1e-4)
        assert r["average"] <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, overrides", [
    ("ddp_topk ratio 1.0", ("strategy=ddp_topk", "strategy.topk_ratio=1.0", "strategy.start_step=0")),
    ("local_sgd sync_every=1", ("strategy=local_sgd", "strategy.sync_every=1", "strategy.start_step=0")),
    ("diloco outer lr 1, no momentum, H=1", ("strategy=diloco", "strategy.sync_every=1", "strategy.start_step=0",
                                            "strategy.outer_lr=1", "strategy.outer_momentum=0")),
])
def test_exact_settings_equal_ddp(cached, reference, name, overrides):
    """Equal to the single-process reference (and so to DDP, tests/test_ddp.py) within 1e-5; the
    measured bytes equal the planner's (top-k at ratio 1 sends twice DDP's: value + index)."""
    run = cached(*SGD, *TWO, *overrides)
    ref = reference("sgd")
    assert_losses_close(ref.losses, run.losses, rtol=1e-5)
    assert_params_close(ref.params(), run.params(), rtol=1e-5)
    measured, planned = _bytes(run)
    assert measured == pytest.approx(planned, rel=0.02)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_int8_within_its_quantization_tolerance(cached, reference):
    """Each bucket is quantized with step s = (max - min) / 255 <= 2 max|g| / 255; with error
    feedback the updates applied so far differ from the true ones by the retained residual,
    at most s/2 per element, so SGD's parameters differ from DDP's by about lr x s/2 <=
    lr x max|g| / 255 (plus the drift of gradients taken at slightly different parameters). The
    stated tolerance: 2 lr x max(global grad norm) / 255 per element (~4e-3 here; measured
    ~5e-4), losses within 1e-3 relative (measured ~1e-4). Bytes: a quarter of DDP's."""
    run = cached(*SGD, *TWO, "strategy=ddp_int8", "strategy.start_step=0")
    ref = reference("sgd")
    tol = 2 * LR * max(run.report["grad_norms"]) / 255
    worst = max(float((ref.params()[k] - run.params()[k]).abs().max()) for k in ref.params())
    assert 0 < worst <= tol, (worst, tol)
    assert _max_rel(ref.losses, run.losses) <= 1e-3
    measured, planned = _bytes(run)
    assert measured == pytest.approx(planned, rel=0.02)
    ddp = cached(*SGD, *TWO, "strategy=ddp")
    assert _bytes(run, buffers=False)[0] / _bytes(ddp, buffers=False)[0] == pytest.approx(0.25, rel=0.02)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_topk_sends_two_percent_and_still_learns(cached, reference):
    """Ratio 0.01 from the first step: ~2% of DDP's bytes (k values + k indices, 8 bytes per
    entry vs 4 bytes per element all-reduced), measured equal to the planner's. Error feedback
    keeps it descending: the loss falls every step, and after 6 steps it is within 20% of DDP's
    (measured ~15%: with 1% of the entries per step it lags, it does not diverge)."""
    run = cached(*SGD, *TWO, "strategy=ddp_topk", "strategy.start_step=0")
    ddp = cached(*SGD, *TWO, "strategy=ddp")
    measured, planned = _bytes(run)
    assert measured == pytest.approx(planned, rel=0.02)
    assert _bytes(run, buffers=False)[0] / _bytes(ddp, buffers=False)[0] == pytest.approx(0.02, rel=0.05)
    assert all(b < a for a, b in zip(run.losses, run.losses[1:]))
    assert abs(run.losses[-1] - ddp.losses[-1]) / ddp.losses[-1] <= 0.2


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", [  # (CI: DiLoCo's averaging by its exact settings, above)
    "local_sgd", pytest.param("diloco", marks=pytest.mark.slow)])
def test_relaxed_sync_sends_parameters_every_h_steps(cached, preset):
    """sync_every=2 from the first step, 9 steps: the steps the observer averages (all but the
    first) hold 4 parameter all-reduces in 8 steps -- half of DDP's bytes -- as planned; no
    gradient traffic between. The loss still falls."""
    run = cached(*SGD, *TWO, f"strategy={preset}", "strategy.sync_every=2", "strategy.start_step=0",
                 "trainer.max_steps=9")
    measured, planned = _bytes(run)
    assert measured == pytest.approx(planned, rel=0.02)
    assert set(run.report["communication"]["per_step"]) <= {"all_reduce", "broadcast"}
    assert run.losses[-1] < run.losses[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, overrides", [
    pytest.param("ddp_topk ratio 1.0", ("strategy=ddp_topk", "strategy.topk_ratio=1.0", "strategy.start_step=0"),
                 marks=pytest.mark.slow),
    ("local_sgd sync_every=1", ("strategy=local_sgd", "strategy.sync_every=1", "strategy.start_step=0")),
    pytest.param("diloco outer lr 1, no momentum, H=1",
                 ("strategy=diloco", "strategy.sync_every=1", "strategy.start_step=0", "strategy.outer_lr=1",
                  "strategy.outer_momentum=0"), marks=pytest.mark.slow),
])
def test_exact_settings_equal_ddp_on_accelerate(cached, reference, name, overrides):
    """The same exact settings on backend=accelerate (the hook registered on the prepared model,
    the synchronizer called by its loop at the accumulation boundary)."""
    run = cached(*SGD, *TWO, *overrides, "backend=accelerate")
    ref = reference("sgd")
    assert_losses_close(ref.losses, run.losses, rtol=1e-5)
    assert_params_close(ref.params(), run.params(), rtol=1e-5)


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_bad_input_exits_2(train):
    run = train("strategy=ddp_topk", "strategy.topk_ratio=0", "cluster.devices=2", check=False)
    assert run.proc.returncode == 2
    assert "strategy.topk_ratio" in run.log


# (PowerSGD is bitwise on gpt_nano, whose matrices sit at the same offsets in DDP's first-iteration
# bucket and its rebuilt one; elsewhere its first resumed step rounds 1 ULP apart --
# tests/test_lightning_user.py's ckpt_path case; README, "Checkpoints".)
# Each preset past its warm-up before the step-3 checkpoint, its own state alive across it:
# residuals, PowerSGD's factors, local SGD's diverged replicas and AdamW moments (average every 4
# steps from step 1), DiLoCo's outer copy and momentum (synchronized after steps 2, 4, 6).
RESUMES = {
    "ddp_topk": ("strategy=ddp_topk", "strategy.start_step=1"),
    "ddp_int8": ("strategy=ddp_int8", "strategy.start_step=1"),
    "ddp_powersgd": ("strategy=ddp_powersgd", "strategy.powersgd_warmup_steps=2"),
    "local_sgd": ("strategy=local_sgd", "strategy.start_step=1", "strategy.sync_every=4"),
    "diloco": ("strategy=diloco", "strategy.start_step=0", "strategy.sync_every=2"),
    # gpt_small's gradients fill three rebuilt DDP buckets, where the first resumed step runs in
    # one: top-k and int8 pick and scale per bucket of the run they continue (ddp_comm.py groups)
    "ddp_topk, gpt_small": ("strategy=ddp_topk", "strategy.start_step=1", "model=gpt_small"),
    "ddp_int8, gpt_small": ("strategy=ddp_int8", "strategy.start_step=1", "model=gpt_small"),
}
RESUME_CI = {("ddp_powersgd", "lightning"), ("diloco", "lightning"), ("ddp_topk", "accelerate")}
# (gpt_small's three buckets: test_powersgd_with_several_buckets_keeps_the_collective_order in CI)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("preset, backend", [
    c if c in RESUME_CI else pytest.param(*c, marks=pytest.mark.slow)
    for c in [(p, b) for p in RESUMES for b in ("lightning", "accelerate")]])
def test_each_rank_s_own_state_resumes_exactly(cached, train, tmp_path, preset, backend):
    """6 steps straight against its step-3 checkpoint resumed to 6 (trainer.resume_from=auto, as a
    Slurm requeue does): the same losses and bitwise-equal parameters. Each rank's residuals,
    factors, replica and averager are written beside the checkpoint (rank_state/rank<r>.pt) and
    taken back, PowerSGD's through DDP's bucket rebuild after the first resumed step."""
    import shutil

    import torch

    from checkpoints import read, refusal
    from recipes.compose import compose
    from recipes.job import validate

    over = (*EQUIV, *TWO, *RESUMES[preset], "trainer.checkpoint_every=3", f"backend={backend}")
    straight = cached(*over)
    step3 = straight.out / "checkpoints" / "step3"
    assert sorted(f.name for f in (step3 / "rank_state").iterdir()) == ["rank0.pt", "rank1.pt"]
    shutil.copytree(step3, tmp_path / "resumed" / "checkpoints" / "step3")
    resumed = train(*over, "callbacks=none", name="resumed")
    assert "and this rank's own state" in resumed.log, resumed.log[-3000:]
    assert resumed.losses == straight.losses  # the same floats, the whole run
    a, b = straight.params(), resumed.params()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # ... and only from its own checkpoint on as many ranks: another world is refused by name
    other = validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *RESUMES[preset], "cluster.devices=1",
                              "trainer.micro_batch_size=8"]))  # (the world differs: refused before the model)
    assert "keeps state of its own on each rank" in refusal(read(step3), other)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend, runs", [
    pytest.param("lightning", 1, id="lightning-x1"),
    # (Accelerate registers the same ordered hook; CI runs its compression hooks in test_accelerate)
    pytest.param("accelerate", 1, id="accelerate-x1", marks=pytest.mark.slow),
    pytest.param("lightning", 6, id="lightning-x6", marks=pytest.mark.slow),
])
def test_powersgd_with_several_buckets_keeps_the_collective_order(tmp_path, backend, runs):
    """gpt_small's gradients fill 2 DDP buckets; PowerSGD issues a bucket's later all-reduces from
    its futures' callbacks, which gloo ran in a different order on each rank: a collective
    mismatch and SIGABRT at its first compressed step in 1 of 3 runs (2 of 2 once) before its
    buckets went one at a time (backends/common/ddp_comm.py, one_bucket_at_a_time; 0 of 6 after)."""
    from tests.conftest import run_cli

    for i in range(runs):
        run = run_cli("train.py", "strategy=ddp_powersgd", "cluster.devices=2", "model=gpt_small",
                      "trainer.max_steps=12", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                      f"backend={backend}", "cluster.accelerator=cpu", out=tmp_path / f"run{i}", timeout=300)
        assert len(run.losses) == 12
    # ... and its all-reduce after the 10 warm-up steps is the plan's (averaged over steps 2-12: 5x)
    measured, planned = _bytes(run)
    assert run.report["communication"]["averaged_steps"] == 2 and measured == pytest.approx(planned, rel=0.02)
    assert "after strategy.powersgd_warmup_steps=10" in run.report["predicted_vs_measured"]["communication"]["of"]


# (slow tier: CI proves local SGD's sync on one node, exact at sync_every=1 and every H steps)
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_sgd_on_two_nodes_averages_hierarchically_as_one_node_does(tmp_path, cached):
    """Two torchrun "nodes" of one process each on loopback take torch's
    HierarchicalModelAverager (within a node every step, the world every sync_every steps);
    with one process per node that is the one-node PeriodicModelAverager's schedule, so the run
    equals the local 2-process local_sgd run (SGD: a missed or extra average moves the losses).
    start_step is a multiple of sync_every: torch's hierarchical averager counts its period from
    step 0, the periodic one from the warm-up's end (with start_step=1 they differ from step 3)."""
    import json
    import os

    import torch

    from tests.test_launch import _free_port, _node_command, _nodes

    common = (*SGD, "strategy=local_sgd", "strategy.sync_every=2", "strategy.start_step=2",
              "trainer.micro_batch_size=4")
    local = cached(*common, "cluster.devices=2")
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs, logs = _nodes(_node_command(*common, port=port), (tmp_path, tmp_path), env)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    run = next((tmp_path / "outputs").iterdir())
    report = json.loads((run / "report.json").read_text())
    assert report["config"]["cluster"]["nodes"] == 2
    assert_losses_close(local.losses, report["losses"], rtol=1e-6)
    assert_params_close(local.params(), torch.load(run / "params.pt"), rtol=1e-6)


# gpt_nano at dim 42 (3 heads, 1 key/value head) and SwiGLU width 65: 47,502 parameters, one bucket
# whose element count is not a multiple of 4 (2 mod 4).
ODD = ("model.dim=42", "model.n_heads=3", "model.n_kv_heads=1", "model.ffn_dim=65")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", [  # (the packing both share: int8's three dtypes in CI)
    "ddp_int8", pytest.param("ddp_topk", marks=pytest.mark.slow)])
def test_compression_of_a_bucket_of_any_size_trains_past_its_start_step(cached, preset):
    """The compressed payload packs parts of different dtypes (int8: uint8 codes and the fp32
    scale and zero point; top-k: values and int32 indices) into one all-gather: unpacking must
    not assume a part starts aligned for its dtype (int8 crashed at its first compressed step,
    "storage_offset() must be divisible by 4", on a bucket of 47,502 codes). 20 compressed steps
    after 2 plain ones, and the loss falls."""
    run = cached(*SGD, *TWO, *ODD, f"strategy={preset}", "strategy.start_step=2", "trainer.max_steps=22")
    assert len(run.losses) == 22 and run.losses[-1] < run.losses[0], run.losses
    # the compressed steps' bytes, the plan's (with the second step's plain all-reduce in the average: +14%)
    measured, planned = _bytes(run)
    assert run.report["communication"]["averaged_steps"] == 20 and measured == pytest.approx(planned, rel=0.02)


@pytest.mark.unit
def test_a_lightning_users_refused_resume_names_the_trainers_arguments():
    """A user's fit(ckpt_path=...) of a checkpoint without the preset's per-rank state was told
    train.py's fixes (trainer.resume_from, cluster.devices, strategy=ddp -- in a user's Trainer,
    Lightning's own plain DDP)."""
    from backends.lightning.families.ddp import resume_advice
    from strategies.presets import load

    said = resume_advice(load("ddp_int8"), {"preset": "ddp", "ranks": [None, None]})
    assert "(this checkpoint holds strategy=ddp's on 2 rank(s))" in said
    assert "fit(ckpt_path=...)" in said and "devices x num_nodes" in said and "without ckpt_path" in said
    assert "Trainer(strategy='stratagem_ddp') (not Lightning's 'ddp'" in said
    assert said.endswith("with train.py: resume from a strategy=ddp_int8 checkpoint with the same cluster.devices "
                         "x cluster.nodes, start the run again without trainer.resume_from, or resume with "
                         "strategy=ddp"), said
