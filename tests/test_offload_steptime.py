"""Issue #38, offload step time: the calibration times what an offloading run does on the host --
the optimizer it really runs there (torch AdamW over DeepSpeed's fp32 host partitions: our
presets hand DeepSpeed the recipe's torch optimizer, ``zero_force_ds_cpu_optimizer: false``, so
DeepSpeedCPUAdam never runs), the host<->device copy rate and DeepSpeed's own offload work -- and
a step's floor (launch and Python overhead); the planner adds them. On CPU, zero2_offload and
zero3_offload runs through train.py step within 25% of the calibrated plan (slow tier)."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run_cli, typed

MACHINE = {"matmul_tflops": 0.02, "efficiency": 0.8, "optimizer_ns_per_param": 10.0, "block_tflops": 0.016,
           "threads": 1, "collectives": {}}
HOST = {"host_optimizer_ns_per_param": 30.0, "host_copy_GBps": 2.0, "floor_seconds": 0.01,
        "layer_floor_seconds": 0.002, "engine_ns_per_param_zero2_offload": 20.0,
        "engine_ns_per_param_zero3_offload": 50.0}
BASE = ("cluster=local", "cluster.accelerator=cpu", "cluster.devices=1", "trainer.precision=32",
        "trainer.global_batch_size=2", "trainer.micro_batch_size=2", "callbacks=none",
        "planner.calibrate=true")


def _cache(tmp_path, monkeypatch, data: dict, *overrides: str):
    """This machine's calibration cache (under tmp_path) holding ``data``."""
    from planner import machine
    from recipes.config import compose

    monkeypatch.setattr(machine, "CACHE", tmp_path / "machine")
    cfg = compose([*BASE, *overrides])
    p = machine.path(machine.key(typed(cfg).cluster, cfg.trainer.precision))
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data))
    return p


def _plan(*overrides: str):
    from planner import preflight
    from recipes.config import compose

    return preflight(typed(compose([*BASE, *overrides])))


@pytest.mark.unit
@pytest.mark.parametrize("strategy", ["zero2_offload", "zero3_offload"])
def test_an_offload_plan_adds_the_host_optimizer_copies_and_engine(tmp_path, monkeypatch, strategy):
    """With a calibrated machine an offloaded optimizer steps at the host's measured rate (not the
    device's), its copies move at the measured host<->device rate (not planner.host_link_GBps),
    and DeepSpeed's offload work is added over one process too; the same model under zero2/zero3
    (not offloaded, one rank) keeps the device's optimizer rate and no engine term."""
    from planner import machine

    model = ("model=gpt_nano", "model.dim=384", "model.n_layers=4", "model.ffn_dim=1024",
             "model.n_heads=6", "model.n_kv_heads=6")
    _cache(tmp_path, monkeypatch, {**MACHINE, **HOST, "format": machine.FORMAT}, *model)
    p = _plan(*model, f"strategy={strategy}")
    params = p.memory.host_items["fp32_master"] / 4
    assert p.optimizer_seconds == pytest.approx(params * 30e-9, rel=1e-6)
    assert p.engine_seconds == pytest.approx(params * HOST[f"engine_ns_per_param_{strategy}"] * 1e-9, rel=1e-6)
    copies = [x for n, x in p.communication.by_collective.items() if x.group == "host"]
    assert copies and all(x.seconds == pytest.approx(x.bytes / 2e9) for x in copies)
    assert p.step_seconds == pytest.approx(p.compute_seconds + p.exposed_seconds + p.optimizer_seconds
                                           + p.engine_seconds)
    assert p.step_seconds > p.floor_seconds > 0
    on_device = _plan(*model, f"strategy={strategy.removesuffix('_offload')}")
    assert on_device.optimizer_seconds == pytest.approx(params * 10e-9, rel=1e-6)
    assert on_device.engine_seconds == 0
    # an older calibration (no host measurements) prices the host step as the device's
    _cache(tmp_path, monkeypatch, {**MACHINE, "format": machine.FORMAT}, *model)
    assert _plan(*model, f"strategy={strategy}").optimizer_seconds == pytest.approx(params * 10e-9, rel=1e-6)


@pytest.mark.unit
def test_over_several_ranks_an_offloaded_zero_takes_its_own_engine_figure(tmp_path, monkeypatch):
    """Format 6 measures the offloaded engines over every world (format 5 measured them over one
    process and priced a sharded zero2_offload at ZeRO-2's figure): sharded, zero2_offload's
    engine term is its own figure, and zero2's stays ZeRO-2's."""
    from planner import machine

    two = ("model=gpt_nano", "cluster.devices=2", "trainer.global_batch_size=4")
    _cache(tmp_path, monkeypatch, {**MACHINE, **HOST, "engine_ns_per_param_zero2": 7.0,
                                   "format": machine.FORMAT}, *two)
    p = _plan(*two, "strategy=zero2_offload")
    params = p.memory.host_items["fp32_master"] / 4 * 2  # (each rank's fp32 partition: half)
    own = HOST["engine_ns_per_param_zero2_offload"]
    assert p.engine_seconds == pytest.approx(params * own * 1e-9, rel=1e-3)
    assert _plan(*two, "strategy=zero2").engine_seconds == pytest.approx(params * 7e-9, rel=1e-3)


@pytest.mark.unit
def test_the_communication_row_compares_collectives_only():
    """report.json's predicted_vs_measured.communication compares what the communication observer
    can see -- the collectives -- so the plan's offload copies (host<->device memory copies no
    process group carries) are left out of its prediction: zero3_offload read 0.33 with them."""
    from observers.compare import predicted_wire_bytes
    from planner.render import plan_dict

    comm = plan_dict(_plan("model=gpt_nano", "cluster.devices=2", "trainer.global_batch_size=4",
                           "strategy=zero3_offload", "planner.calibrate=false"))["communication"]
    host = {n: x["bytes"] for n, x in comm["by_collective"].items() if x["group"] == "host"}
    assert set(host) == {"optimizer_offload", "param_offload_fetch"}
    assert predicted_wire_bytes(comm) == comm["bytes_per_step"] - sum(host.values()) > 0


@pytest.mark.unit
def test_a_small_model_is_planned_at_the_measured_floor(tmp_path, monkeypatch):
    """gpt_nano's computed step is microseconds; the plan is the measured floor: per step plus
    per block and micro-batch (2 blocks, 2 micro-batches per step here). No calibration: no floor."""
    from planner import machine

    slow = {**MACHINE, **HOST, "floor_seconds": 0.05, "layer_floor_seconds": 0.01, "format": machine.FORMAT}
    _cache(tmp_path, monkeypatch, slow, "model=gpt_nano", "trainer.global_batch_size=4")
    p = _plan("model=gpt_nano", "trainer.global_batch_size=4", "strategy=zero2_offload")
    assert p.floor_seconds == pytest.approx(0.05 + 0.01 * 2 * 2)
    assert p.step_seconds == p.floor_seconds
    assert p.compute_seconds + p.optimizer_seconds + p.engine_seconds + p.exposed_seconds < p.floor_seconds
    from planner.render import plan_dict

    assert plan_dict(p)["floor_seconds"] == p.floor_seconds
    plain = _plan("model=gpt_nano", "trainer.global_batch_size=4", "strategy=zero2_offload",
                  "planner.calibrate=false")
    assert plain.floor_seconds == 0


@pytest.mark.unit
def test_a_cache_of_an_older_format_is_measured_again(tmp_path, monkeypatch):
    """FORMAT 4 added the host's optimizer, copies, offload engines and floor: a format-3 cache
    is not read (``ensure`` measures again); a current one is, with every new field."""
    from planner import machine
    from recipes.config import compose

    assert machine.FORMAT >= 4
    p = _cache(tmp_path, monkeypatch, {**MACHINE, "format": 3})
    cfg = compose(list(BASE))
    assert machine.load(typed(cfg).cluster, "32") is None
    p.write_text(json.dumps({**MACHINE, **HOST, "format": machine.FORMAT}))
    got = machine.load(typed(cfg).cluster, "32")
    assert got is not None and all(getattr(got, k) == v for k, v in HOST.items())
    assert "host's AdamW 30 ns/param" in got.describe()
    # (a one-process calibration measures the offloaded engines only: they are named)
    assert "own work ZeRO-2 offload 20 / ZeRO-3 offload 50 ns/param" in got.describe()


# ------------------------------------------------------------------ the CPU proof (train.py)
# The calibration's reference block (observers/machine.py REFERENCE["cpu"]): dim 384, ffn 1024,
# 6 heads, seq 128; 4 blocks, vocab 256: 7.3M parameters (29 MB fp32; a few hundred MB of
# states, grads and moments with offload is slower than this machine allows in CI).
SHAPE = ("model=gpt_nano", "model.dim=384", "model.n_layers=4", "model.ffn_dim=1024", "model.n_heads=6",
         "model.n_kv_heads=6", "model.seq_len=128", "model.dropout=0")
RUN = ("cluster=local", "cluster.accelerator=cpu", "trainer.precision=32", "callbacks.progress_bar=false",
       "trainer.warmup_steps=0", "planner.enforce=false", "trainer.max_steps=24", "trainer.micro_batch_size=2",
       "planner.calibrate=true")
CASES = {"zero2-1rank": ("zero2_offload", 1), "zero3-1rank": ("zero3_offload", 1),
         "zero2-2ranks": ("zero2_offload", 2), "zero3-2ranks": ("zero3_offload", 2)}
# 24 steps: the plan is a steady step, and an offloading run's first 3-4 steps are not one (one
# rank, zero2_offload: 0.68, 0.49, 0.37, then 0.29-0.33 s; two ranks 0.80-0.56 then 0.45-0.50):
# with 4 steps the median (of steps 2-4) measured the warm-up, 1.13-1.49 of plans the steady
# steps meet; 24 rather than 12 so that the median spans twice as much of the machine's time.
# Measured 2026-11-28 17:55-19:45 (AMD EPYC host, format-6 calibration), this test seven times
# on an idle machine: zero2-1rank 0.89-1.23, zero3-1rank 0.89-1.10, zero2-2ranks 0.89-1.22,
# zero3-2ranks 1.00-1.34 (a known gap then). Format 5 read zero2-2ranks 0.65-1.53 and
# zero3-2ranks 0.72-1.64: its 2-rank engine figures were the difference of two noisy medians.
# The zero3 gap was glibc handing each ZeRO-3 step's freed heap back to the kernel and faulting
# it in again (~5,000 pages a step per rank; observers/memory.py allocate_exactly). With the
# ranks' heap never trimmed (format 7), 2026-11-28 22:40-22:55, five runs on a fresh VM:
# zero2-1rank 1.11-1.14, zero3-1rank 1.10-1.17, zero2-2ranks 1.05-1.12, zero3-2ranks 1.10-1.16.
DRIFT = ("this VM's speed moves 30-35% for tens of seconds at a time (2026-11-28: six 4-s block "
         "measurements in a row read 0.034-0.045 TFLOP/s; a 2-rank zero3_offload run stepped at "
         "0.67 s for its whole 15 s, against 0.47-0.50 in the runs before and after)")


def _home(path):
    """A home whose calibration cache starts empty: the case's world is calibrated minutes (or
    seconds) before its run. This machine's own cache may be hours old, and a VM's speed drifts
    15-25% between hours (2026-11-28: 03:30 calibrations against 05:35 runs measured 1.27-1.50,
    the same runs 0.97-1.14 against fresh ones). Built extensions stay where they are."""
    path.mkdir(parents=True, exist_ok=True)
    return {"HOME": str(path), "XDG_CACHE_HOME": str(path / ".cache"), "TORCH_EXTENSIONS_DIR": os.environ.get(
        "TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions"))}


@pytest.fixture(scope="module")
def fresh_home(tmp_path_factory):
    """One home for this module's cases: each world size is calibrated once, before its first case."""
    return _home(tmp_path_factory.mktemp("home"))


# a calibration (~40 s for one process, ~60 s for two; one per world size) and a 24-step run each
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_offload_step_time_is_within_25_percent_after_calibration(tmp_path, case, fresh_home):
    """Within 25% of the calibrated plan; a case outside it runs once more on a calibration taken
    just before (DRIFT): a plan that is wrong misses twice, a moment of the machine's once."""
    strategy, ranks = CASES[case]

    def ratio(out, env):
        run = run_cli("train.py", *RUN, *SHAPE, f"strategy={strategy}", f"cluster.devices={ranks}",
                      f"trainer.global_batch_size={2 * ranks}", out=out, timeout=900, env=env)
        pvm = run.report["predicted_vs_measured"]
        return pvm["step_seconds"] | {"communication": pvm.get("communication")}

    rows = [ratio(tmp_path / case, fresh_home)]
    if ranks > 1:  # (the collectives as planned, the offload copies left out: not collectives)
        assert rows[0]["communication"]["ratio"] == pytest.approx(1.0, abs=0.01), rows[0]
    if abs(rows[0]["ratio"] - 1) > 0.25:
        rows.append(ratio(tmp_path / f"{case}-again", _home(tmp_path / "home")))
    assert abs(rows[-1]["ratio"] - 1) <= 0.25, rows
