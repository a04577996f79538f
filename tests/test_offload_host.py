"""Issue #38, offload truth: host memory of ZeRO-2/ZeRO-3 offload (and FSDP CPUOffload)
planned item by item as DeepSpeed allocates it (planner/host.py), and on CPU the host RSS of
real zero2_offload / zero3_offload runs through train.py within 10% of the plan."""

from __future__ import annotations

import pytest

from planner.host import ENGINE_RUNTIME_BYTES, PROCESS_BYTES, pow2
from recipes.config import compose
from strategies.footprint import HOST_STATES
from tests.conftest import run_cli, typed

GB = 10**9
LLAMA_7B = ("model=llama_7b", "cluster=local", "cluster.accelerator=gpu", "cluster.devices=1",
            "cluster.host_memory_GB=1000", "trainer.precision=bf16-mixed",
            "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "callbacks=none")


def _plan(*overrides: str):
    from planner import preflight

    return preflight(typed(compose(list(overrides))))


@pytest.mark.unit
def test_llama_7b_zero2_offload_books_each_allocation():
    """One GPU, bf16: fp32 master, fp32 gradient, Adam's m and v, the 16-bit staging copy
    (stage_1_and_2.py temp_buffer_bit16), the largest parameter's gradient buffer, each pinned
    block's power-of-two rounding, DeepSpeed's runtime and the process base."""
    p = _plan(*LLAMA_7B, "strategy=zero2_offload")
    items, P = p.memory.host_items, p.memory.host_items["fp32_master"] / 4
    assert items["fp32_grads"] == items["fp32_master"] == pytest.approx(4 * P, abs=8)
    assert items["optimizer_moments"] == pytest.approx(8 * P, abs=8)
    assert items["staging_16bit"] == pytest.approx(2 * P, rel=1e-6)
    assert "accumulation" not in items and "step_temporaries" not in items  # fused AdamW on CUDA
    pinned = (items["fp32_master"], items["fp32_grads"], items["staging_16bit"], items["largest_grad_buffer"])
    assert items["pinned_rounding"] == pytest.approx(sum(pow2(b) - b for b in pinned), rel=1e-6)
    assert pow2(26.95e9) == 2**35  # the "26.95 GB becomes 34.36 GB"
    assert items["process"] == PROCESS_BYTES["gpu"] and items["engine_runtime"] == ENGINE_RUNTIME_BYTES
    assert p.memory.host == sum(v for k, v in items.items() if k != "process")
    assert 135 * GB < p.memory.host + items["process"] < 145 * GB  # the outside reading: ~140 GB


@pytest.mark.unit
def test_llama_7b_zero3_offload_books_init_partitions_and_sub_groups():
    p = _plan(*LLAMA_7B, "strategy=zero3_offload")
    items, P = p.memory.host_items, p.memory.host_items["fp32_master"] / 4
    assert items["params_16bit"] == pytest.approx(2 * P, rel=1e-6)
    assert items["grads_16bit"] == pytest.approx(2 * P, rel=1e-6)  # grad_partitions_flat_buffer
    assert 2 * P < items["init_partitions"] < 4 * P  # zero.Init's pinned ds_tensors, cached
    assert "staging_16bit" not in items
    # the states are what the planner counted before: only the extras are new
    states = sum(items[k] for k in HOST_STATES if k in items)
    assert states == pytest.approx(P * (2 + 4 + 4 + 2 + 8), rel=1e-6)
    assert p.memory.host + items["process"] > 150 * GB  # the old plan: 134.8 GB


@pytest.mark.unit
def test_the_largest_gradient_buffer_is_the_largest_tensor_the_optimizer_steps():
    """stage_1_and_2.py sizes temp_grad_buffer_for_cpu_offload by the largest trainable
    parameter: a MoE block's stacked experts (one tensor each of the three, not all experts of
    the model as one), and with LoRA the largest adapter."""
    moe = ("model=mixtral_8x7b", *LLAMA_7B[1:], "strategy=zero2_offload")
    items = _plan(*moe).memory.host_items
    assert items["largest_grad_buffer"] == 8 * 4096 * 14336 * 2  # w1 of 8 experts, bf16
    pinned = (items["fp32_master"], items["fp32_grads"], items["staging_16bit"], items["largest_grad_buffer"])
    assert items["pinned_rounding"] == pytest.approx(sum(pow2(b) - b for b in pinned), rel=1e-6)
    import dataclasses

    from planner.host import tensors

    llama = typed(compose(["model=llama_7b", "cluster.accelerator=cpu"])).model
    lora = dataclasses.replace(llama, lora=dataclasses.replace(llama.lora, rank=8))  # (model=hf's)
    assert max(tensors(lora, 0)) == 32000 * 4096  # the embedding
    assert max(tensors(lora, 0, trainable=True)) == 8 * 4096  # an attention adapter's A or B
    assert len(tensors(lora, 0, trainable=True)) == 32 * 4 * 2


@pytest.mark.unit
def test_host_overflow_counts_the_process_base():
    p = _plan(*LLAMA_7B[:4], "cluster.host_memory_GB=125", *LLAMA_7B[5:], "strategy=zero2_offload")
    assert not p.memory_fits
    assert any(n.startswith("host memory: needs 143.2 GB") for n in p.notes), p.notes


@pytest.mark.unit
def test_cpu_has_no_pinned_blocks_and_the_optimizer_impl_sets_the_temporaries():
    """On CPU nothing is pinned (no rounding, zero.Init's partitions freed); torch AdamW's
    temporaries follow its implementation (for-loop 2, foreach 1, fused 0 partitions); SGD none."""
    cpu = ("model=gpt_nano", "cluster.accelerator=cpu", "trainer.precision=bf16-mixed",
           "trainer.global_batch_size=2", "trainer.micro_batch_size=2", "callbacks=none")
    for strategy in ("zero2_offload", "zero3_offload"):
        items = _plan(*cpu, f"strategy={strategy}").memory.host_items
        assert "pinned_rounding" not in items and "init_partitions" not in items
        assert items["step_temporaries"] == items["fp32_master"]  # foreach: one fp32 partition
        loop = _plan(*cpu, f"strategy={strategy}", "trainer.optimizer_impl=for-loop").memory.host_items
        assert loop["step_temporaries"] == 2 * loop["fp32_master"]
        sgd = _plan(*cpu, f"strategy={strategy}", "trainer.optimizer=sgd").memory.host_items
        assert "step_temporaries" not in sgd
    unpinned = _plan(*LLAMA_7B, "strategy=zero2_offload", "strategy.pin_memory=false").memory.host_items
    assert "pinned_rounding" not in unpinned


# ------------------------------------------------------------------ the CPU proof (train.py)
SMALL = ("model.dim=384", "model.n_layers=4", "model.ffn_dim=1024", "model.n_heads=6", "model.n_kv_heads=6")
LARGER = ("model.dim=768", "model.n_layers=4", "model.ffn_dim=2048", "model.n_heads=12", "model.n_kv_heads=12")
RUN = ("model=gpt_nano", "model.dropout=0", "cluster.accelerator=cpu", "trainer.precision=bf16-mixed",
       "callbacks.progress_bar=false", "trainer.warmup_steps=0", "planner.enforce=false",
       "trainer.max_steps=2", "trainer.micro_batch_size=2")  # (the first step is not measured)
CASES = {  # name: (strategy, ranks, shape[, accumulation])
    "zero3-1rank": ("zero3_offload", 1, SMALL),
    "zero2-1rank": ("zero2_offload", 1, SMALL),
    "zero2-2ranks": ("zero2_offload", 2, LARGER),
    "zero3-2ranks": ("zero3_offload", 2, LARGER),
    "zero2-1rank-larger": ("zero2_offload", 1, LARGER),
    # ZeRO-2 offload accumulates each parameter's gradient in a host buffer of its own
    # (state_bytes read 1.200 at gpt_small's default accumulation 2: the plan left it out)
    "zero2-1rank-accumulation": ("zero2_offload", 1, SMALL, 2),
}


def _tier(case: str):
    # (one rank too: DeepSpeed starts torch.distributed, gloo, in it.) All in the slow tier (15-60 s
    # each). Deep in a suite the 1-rank cases once measured pytest's own peak (ru_maxrss crosses
    # exec; observers/memory.py reads VmHWM since, tests/test_allocator.py). The 2-rank ZeRO-3
    # case read 1.06-1.12 while the observer allocated exactly only from the first step: buffers
    # the build left in glibc's heap and the step freed stayed resident (docs/PLANNER.md).
    marks = [pytest.mark.multiprocess, pytest.mark.slow]
    return pytest.param(case, marks=marks)


@pytest.mark.parametrize("case", [_tier(c) for c in CASES])
def test_host_rss_of_offload_runs_is_within_10_percent_of_the_plan(tmp_path, case):
    """On CPU the host is the device: the RSS a steady step reaches above the process before
    the model was built against the device plan plus the host plan (predicted_vs_measured.peak)."""
    strategy, ranks, shape, accumulation = (*CASES[case], 1)[:4]
    run = run_cli("train.py", *RUN, *shape, f"strategy={strategy}", f"cluster.devices={ranks}",
                  f"trainer.global_batch_size={2 * ranks * accumulation}", out=tmp_path / case, timeout=400)
    peak = run.report["predicted_vs_measured"]["peak"]
    assert "memory.host" in peak["of"]
    assert peak["ratio"] == pytest.approx(1.0, abs=0.10), peak
    row = run.report["predicted_vs_measured"]["state_bytes"]
    assert row["ratio"] == pytest.approx(1.0, abs=0.02), row


@pytest.mark.unit
def test_state_bytes_counts_the_accumulation_buffer_the_run_counts_as_gradients():
    """ZeRO-2 offload with accumulation keeps each parameter's accumulated gradient in a host
    buffer of its own (stage_1_and_2.py ``accumulated_grads_in_cpu``), which the memory
    observer counts as gradients (backends/common/deepspeed.py ``_GRAD_ATTRS``): the predicted
    state bytes count it too (gpt_small's default accumulation 2 read 1.200 without it)."""
    from observers.compare import predicted_state_bytes
    from planner.render import plan_dict

    cpu = ("model=gpt_nano", "cluster.accelerator=cpu", "cluster.devices=1", "strategy=zero2_offload",
           "trainer.micro_batch_size=2", "callbacks=none")
    one, two = (_plan(*cpu, f"trainer.global_batch_size={g}") for g in (2, 4))
    assert "accumulation" not in one.memory.host_items
    extra = two.memory.host_items["accumulation"]
    assert extra == one.memory.host_items["fp32_grads"]  # (fp32: each parameter's share, once)
    assert (predicted_state_bytes(plan_dict(two)["memory"])
            == predicted_state_bytes(plan_dict(one)["memory"]) + extra)


@pytest.mark.unit
def test_zero_infinity_books_its_pinned_swap_buffers_on_the_host():
    """NVMe offload's host side: the parameter swap buffers (count x size, 16-bit, one block)
    and the optimizer's (count x the largest sub-group, fp32), rounded when pinned."""
    p = _plan(*LLAMA_7B, "cluster.nvme_GB=1000", "strategy=zero_infinity", "strategy.nvme_path=/tmp")
    items = p.memory.host_items
    assert items["nvme_param_buffers"] == 5 * 100_000_000 * 2
    assert items["nvme_optimizer_buffers"] == 4 * 1_000_000_000 * 4
    assert items["pinned_rounding"] == pow2(1e9) - 1e9 + 4 * (pow2(4e9) - 4e9)
    assert "fp32_master" not in items and p.memory.nvme > 100 * GB


@pytest.mark.unit
def test_fsdp_cpu_offload_books_its_pinned_shards_and_the_host_step():
    """torch FSDP's CPUOffload (GPU only): the fp32 shard and its gradient pinned per unit, the
    moments and foreach AdamW's temporary on the host; no DeepSpeed runtime."""
    p = _plan("model=llama_7b", "cluster=node_8x_h100", "trainer.precision=bf16-mixed",
              "trainer.global_batch_size=64", "callbacks=none", "strategy=fsdp_offload")
    items, part = p.memory.host_items, p.memory.host_items["fp32_master"] / 4
    assert items["fp32_grads"] == items["fp32_master"] and items["optimizer_moments"] == pytest.approx(8 * part, rel=1e-6)
    assert items["step_temporaries"] == pytest.approx(4 * part, rel=1e-6) and items["pinned_rounding"] > 0
    assert "engine_runtime" not in items and items["process"] == PROCESS_BYTES["gpu"]


# ------------------------------------------------------------------ CPU: one memory
SMALL_CPU = ("model=gpt_small", "cluster.accelerator=cpu", "cluster.devices=1", "callbacks=none")


@pytest.mark.unit
def test_on_cpu_the_host_check_counts_every_ranks_device_bytes():
    """On CPU the device is the host: the node needs each rank's device peak, what it offloads
    and its process base from one RAM. The check left the device bytes out (an offload plan read
    "0.3 GB of 0.9 GB per device (fits with 0.7 GB to spare)" against 0.30 + 0.35 + 0.55 GB on
    0.95; a run measured 1.04 GB), never checked the host for other presets (fsdp2 "fits" on
    0.1 GB), and so recommended fsdp2 where the offload preset overflowed the host."""
    off = _plan(*SMALL_CPU, "strategy=zero2_offload", "trainer.global_batch_size=8",
                "cluster.host_memory_GB=0.95", "cluster.device_memory_GB=0.95")
    from strategies.footprint import cpu_peak

    def need(m) -> int:  # (the busier phase: the step's temporaries are not beside the activations)
        return cpu_peak(m.total, m.step, m.host, m.host_items) + m.host_items["process"]

    m = off.memory
    need_off = need(m)
    assert 1.1 * GB < need_off < 1.3 * GB and m.total < 0.95 * GB
    assert not off.fits and not off.memory_fits
    note = f"host memory: needs {need_off / GB:.1f} GB per node"
    assert any(n.startswith(note) for n in off.notes), off.notes
    assert "does NOT fit: host memory: needs" in off.summary(), off.summary()
    for strategy in ("fsdp2", "ddp"):  # no offload: the device bytes and the process base
        p = _plan(*SMALL_CPU, f"strategy={strategy}", "cluster.host_memory_GB=0.1")
        assert not p.fits and "host memory: needs" in p.summary(), p.summary()
    short = _plan(*SMALL_CPU, "strategy=zero2_offload", "cluster.host_memory_GB=0.5")
    assert not short.fits and "cheapest preset that fits" not in (short.hint or ""), short.hint
    import planner  # strategy=auto reads the same verdict: it picks nothing the node cannot hold
    from core.errors import ConfigError

    with pytest.raises(ConfigError, match="no runnable preset fits"):
        planner.choose(typed(compose([*SMALL_CPU, "strategy=auto", "cluster.host_memory_GB=0.5"])))
    # where it fits, what is spare is what the node's memory leaves each rank, not the device's share
    roomy = _plan(*SMALL_CPU, "strategy=zero2_offload", "trainer.global_batch_size=8",
                  "cluster.host_memory_GB=2", "cluster.device_memory_GB=2")
    spare = 2 * GB - need(roomy.memory)
    assert roomy.fits and f"fits with {spare / GB:.1f} GB to spare" in roomy.summary(), roomy.summary()
    assert roomy.host_margin == spare


@pytest.mark.unit
def test_on_cpu_the_peak_books_the_step_temporaries_at_the_step_not_beside_the_activations():
    """On CPU the device is the host, but at different moments: the optimizer's step
    temporaries (host item ``step_temporaries``) exist only in the step, when the activations
    are gone. gpt_small zero2_offload on 1 rank was planned at memory.total + memory.host and
    measured 0.87-0.90 of it (~64 MB fp32 low, whatever the activations); without the
    temporaries beside the backward peak 0.95-1.01. The rank's peak is the larger phase:
    backward (total + host - step_temporaries) or the step (memory.step + host), and the
    comparison's peak row, the node's host check and the spare all read that one figure."""
    from types import SimpleNamespace

    from observers.compare import Comparison
    from planner.render import plan_dict

    shapes = {"backward": ("trainer.global_batch_size=8",),  # (the audit's accumulation-1 run)
              "step": ("trainer.global_batch_size=1", "trainer.micro_batch_size=1", "model.seq_len=32")}
    for phase, shape in shapes.items():
        p = _plan(*SMALL_CPU, "strategy=zero2_offload", "cluster.host_memory_GB=2", *shape)
        m, items = p.memory, p.memory.host_items
        temps = items["step_temporaries"]
        assert temps == items["fp32_master"] > 0  # foreach AdamW on the host: one fp32 partition
        backward, step = m.total + m.host - temps, m.step + m.host
        assert (backward > step) is (phase == "backward"), (phase, backward, step)
        peak = max(backward, step)
        assert peak < m.total + m.host  # the old sum booked the temporaries beside the activations
        rss = SimpleNamespace(ranks=[{"peak_rss_growth": m.growth, "peak_rss_run": peak}])
        row = Comparison(plan_dict(p), rss).report()["predicted_vs_measured"]["peak"]
        assert row["predicted"] == peak and row["ratio"] == 1.0, (phase, row)
        assert "memory.host" in row["of"]
        assert p.host_margin == 2 * GB - (peak + items["process"]), phase


@pytest.mark.unit
def test_on_a_gpu_the_host_check_is_what_is_offloaded():
    """On a GPU the device bytes are the GPU's own: a preset that offloads nothing plans no host
    (unchanged), and an offload plan's host check counts the offloaded items and the process."""
    gpu = ("model=gpt_small", "cluster.accelerator=gpu", "cluster.devices=1", "callbacks=none",
           "cluster.device_memory_GB=80", "cluster.host_memory_GB=0.1")
    assert _plan(*gpu, "strategy=fsdp2").fits
    off = _plan(*gpu, "strategy=zero2_offload")
    need = off.memory.host + off.memory.host_items["process"]
    assert any(n.startswith(f"host memory: needs {need / GB:.1f} GB per node, has 0.1 GB") for n in off.notes)
