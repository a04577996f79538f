"""Sequence parallelism against the single-process reference on gloo: DeepSpeed Ulysses
(``strategy.sp``: ulysses, zero3_ulysses) and torch's context parallelism (``strategy.cp``:
fsdp_cp, 3d's cp knob; ring attention, on CPU through the one registration of
parallel/context_parallel.py) -- losses and final parameters, the all-to-all / K-V bytes each
step sends on the ``sp`` / ``cp`` group equal to the planner's, saved activations per rank
divided by the degree at a long sequence. Every invalid shape is one clear error before launch,
exit 2.

Tolerances: losses 1e-5 relative (measured: 1e-7; the sequence shards' gradients are summed by
the engine in another order), parameters 1e-5 with SGD and 1e-3 with AdamW (its sqrt(v)
amplifies last-bit gradient differences, as in tests/test_parallel.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.config import compose
from recipes.job import validate
from strategies import ConfigError
from tests.cases import CASES
from tests.conftest import EQUIV, OPTIMIZERS, assert_losses_close, assert_params_close, by_optimizer, run_cli, typed

pytestmark = pytest.mark.timeout(900)
RTOL = 1e-5
PARAMS_RTOL = {"sgd": 1e-5, "adamw": 1e-3}
CPU = ("cluster.accelerator=cpu", "model=gpt_nano")
FOUR = ("cluster.devices=4", "cluster.oversubscribe=true")


@pytest.fixture(scope="module")
def runs(cached):
    def get(*overrides: str, optimizer: str = "sgd", timeout: float = 400):
        return cached(*EQUIV, *overrides, *OPTIMIZERS[optimizer], timeout=timeout)

    return get


def _reference(runs, optimizer: str):
    return runs(*CASES["single"].overrides, optimizer=optimizer)


def _equivalent(run, ref, optimizer: str) -> None:
    assert_losses_close(ref.losses, run.losses, rtol=RTOL)
    assert_params_close(ref.params(), run.params(), rtol=PARAMS_RTOL[optimizer])


# ----------------------------------------------------------------------------- equivalence
@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["ulysses", "fsdp_cp"])
def test_sequence_parallel_on_nccl_matches_one_gpu(runs, name):
    """What CPU cannot show: on CUDA, cp runs torch's own ring-attention handlers (the CPU one is
    ours, parallel/context_parallel.py) and Ulysses DeepSpeed's all-to-all over NCCL. 2 GPUs
    against one, fp32 (losses 1e-4: CUDA's attention kernels differ by the sequence length they
    see; not run on CPU CI)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (NCCL)")
    gpu = ("cluster.accelerator=gpu",)
    ref = runs(*CASES["single"].overrides, *gpu)
    run = runs(*CASES[name].overrides, *gpu)
    assert_losses_close(ref.losses, run.losses, rtol=1e-4)
    assert_params_close(ref.params(), run.params(), rtol=1e-3)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, optimizer", by_optimizer(["ulysses"], slow_adamw={"ulysses"}))
def test_ulysses_matches_single_process_and_sends_what_the_planner_says(runs, name, optimizer):
    """sp 2 on 2 ranks (one replica reading the same 8 samples, micro 4 x accumulation 2): the
    sequence shards' all-to-alls before and after attention, then ZeRO's gradient mean over
    both ranks, give the single process's losses and parameters. Per step each rank sends, on
    the sp group, (sp-1)/sp of q, k, v and the output per layer in forward and again in backward
    -- exactly the planner's ``sp_all_to_all``."""
    c = CASES[name]
    run = runs(*c.overrides, optimizer=optimizer)
    r = run.report
    assert (r["world_size"], r["accumulation"]) == (c.world, c.accumulation) == (2, 2)
    _equivalent(run, _reference(runs, optimizer), optimizer)
    sp = r["communication"]["by_group"]["sp"]["all_to_all"]
    assert sp["count"] == 2 * 2 * 4 * 2  # accumulation x layers x (q, k, v, out) x (fwd, bwd)
    planned = r["plan"]["communication"]["by_collective"]["sp_all_to_all"]
    assert planned["ranks"] == 2
    assert planned["bytes"] == pytest.approx(sp["wire_bytes"], rel=0.02)
    # gpt_nano: (2 x dim 32 + 2 x kv 16) x micro 4 x seq 32 / 2 x fp32 x 2 layers x 2 passes x 2
    assert sp["bytes"] == 96 * 4 * 16 * 4 * 2 * 2 * 2
    # ZeRO-1 under accumulation keeps the full gradients to the step (planned 1.25x low as the partition)
    state = r["predicted_vs_measured"]["state_bytes"]
    assert state["ratio"] == pytest.approx(1.0, abs=0.02), state


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_zero3_ulysses_on_four_ranks_matches_single_process(runs, optimizer):
    """dp 2 x sp 2 on 4 processes: samples split over the two sequence groups, parameters,
    gradients and optimizer state sharded over all four ranks (ZeRO-3)."""
    c = CASES["zero3_ulysses"]
    run = runs(*c.overrides, optimizer=optimizer, timeout=600)
    assert (run.report["world_size"], run.report["accumulation"]) == (4, c.accumulation) == (4, 2)
    _equivalent(run, _reference(runs, optimizer), optimizer)
    assert set(run.report["communication"]["by_group"]) >= {"sp", "data-shard"}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ulysses_on_accelerate_matches_single_process(runs):
    run = runs(*CASES["ulysses"].overrides, "backend=accelerate")
    assert run.report["backend"] == "accelerate"
    _equivalent(run, _reference(runs, "sgd"), "sgd")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["lightning", "accelerate"])
def test_ulysses_validation_loss_equals_single_process(runs, backend):
    """Held-out samples: each rank runs its sequence shard of the same samples; the summed
    (token-loss, count) pairs give the single process's mean."""
    val = ("data.val_fraction=0.05", "trainer.val_every=3")
    ref = runs(*CASES["single"].overrides, *val)
    run = runs(*CASES["ulysses"].overrides, *val, f"backend={backend}")
    assert len(ref.report["validation"]) == len(run.report["validation"]) == 2
    for a, b in zip(ref.report["validation"], run.report["validation"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, optimizer", by_optimizer(["fsdp_cp"], slow_adamw={"fsdp_cp"}))
def test_context_parallel_matches_single_process_and_sends_what_the_planner_says(runs, name, optimizer):
    """cp 2 on 2 ranks (one replica; each rank 2 of the 4 head-tail chunks of every sequence,
    FSDP2 over both): torch's ring attention gives the single process's losses and parameters.
    Per step each rank sends, on the cp group, its keys and values once in forward (an
    all-gather), again in backward, and the fp32 key/value gradients twice around the ring (an
    all-to-all per pass) -- exactly the planner's ``cp_kv_send_recv``."""
    c = CASES[name]
    run = runs(*c.overrides, optimizer=optimizer)
    r = run.report
    assert (r["world_size"], r["accumulation"]) == (c.world, c.accumulation) == (2, 2)
    _equivalent(run, _reference(runs, optimizer), optimizer)
    cp = r["communication"]["by_group"]["cp"]
    kv = 2 * 16 * 4 * 16 * 4  # K and V: 2 x kv width 16 x micro 4 x seq 32 / 2 x fp32
    ring = 2 * 2 * 2  # accumulation x layers x (forward, backward)
    passes = 2 * 2 * 2  # accumulation x layers x cp passes of the gradients (backward only)
    assert cp["all_to_all"]["count"] == passes
    assert cp["all_to_all"]["wire_bytes"] == passes * kv  # a ring pass sends the whole chunk
    fsdp = cp["all_gather"]["count"] - ring  # FSDP2's gathers share the group (dp 1: world = cp)
    assert fsdp == 2 * (3 + 2)  # accumulation x (2 blocks + root forward, 2 blocks backward)
    planned = r["plan"]["communication"]["by_collective"]["cp_kv_send_recv"]
    assert planned["ranks"] == 2
    assert planned["bytes"] == ring * kv + passes * kv


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["fsdp_cp-dp", "3d-cp-tp", "3d-cp-pp"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_context_parallel_compositions_on_four_ranks_match_single_process(runs, name, optimizer):
    """dp 2 x cp 2 (FSDP2 over all four), cp 2 x tp 2 and cp 2 x pp 2 (3d's cp knob: TP inside
    each sequence shard, or pipeline stages of sequence shards): the single process's losses and
    parameters; the ring's traffic is on its own group, as planned."""
    c = CASES[name]
    run = runs(*c.overrides, optimizer=optimizer, timeout=600)
    # (the pipeline runs the step's 4 micro-batches in one schedule: no accumulation)
    assert (run.report["world_size"], run.report["accumulation"]) == (4, 1 if "pp" in name else c.accumulation)
    _equivalent(run, _reference(runs, optimizer), optimizer)
    groups = run.report["communication"]["by_group"]
    assert set(groups["cp"]) >= {"all_gather", "all_to_all"}, groups
    planned = run.report["plan"]["communication"]["by_collective"]["cp_kv_send_recv"]
    measured = groups["cp"]["all_gather"]["wire_bytes"] + groups["cp"]["all_to_all"]["wire_bytes"]
    assert planned["bytes"] == pytest.approx(measured, rel=0.02)
    # and the whole step: TP's all-reduces and the pipeline's sends carry seq_len / cp tokens
    # (planned on the whole sequence the ratio read 0.636 at cp 2 x tp 2, 0.904 at cp 2 x pp 2)
    comm = run.report["predicted_vs_measured"]["communication"]
    assert comm["ratio"] == pytest.approx(1.0, abs=0.01), comm


@pytest.mark.slow
@pytest.mark.multiprocess
def test_context_parallel_validation_loss_equals_single_process(runs):
    val = ("data.val_fraction=0.05", "trainer.val_every=3")
    ref = runs(*CASES["single"].overrides, *val)
    run = runs(*CASES["fsdp_cp"].overrides, *val)
    assert len(ref.report["validation"]) == len(run.report["validation"]) == 2
    for a, b in zip(ref.report["validation"], run.report["validation"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)


LONG = ("model.seq_len=2048", "data=synthetic", "trainer.max_steps=2", "trainer.global_batch_size=2",
        "trainer.micro_batch_size=1", "trainer.optimizer=sgd", "trainer.lr=0.1", "trainer.grad_clip=0")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sequence_parallelism_divides_saved_activations_by_the_degree_at_a_long_sequence(runs, cached):
    """gpt_nano at seq 2048: what a rank saves for backward (observers/memory.py) falls by the
    degree (+-10%) under Ulysses (sp 2) and ring attention (cp 2), and the planner predicts the
    same division."""
    single = cached(*LONG, "strategy=single")
    one = single.report["memory"]["ranks"][0]["activations"]
    p1 = single.report["memory"]["predicted"]["activations"]
    for preset in ("ulysses", "fsdp_cp"):
        run = cached(*LONG, f"strategy={preset}", "cluster.devices=2")
        for rank in run.report["memory"]["ranks"]:
            assert rank["activations"] == pytest.approx(one / 2, rel=0.10), (preset, one, rank)
        p2 = run.report["memory"]["predicted"]["activations"]
        assert p2 == pytest.approx(p1 / 2, rel=0.02), preset


# ----------------------------------------------------------------------------- before launch
def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose([*CPU, *overrides]))
    return str(e.value)


@pytest.mark.unit
def test_heads_not_divisible_by_the_ulysses_degree_is_one_clear_error():
    """Query heads must divide over sp; KV heads need not (they are replicated, as DeepSpeed does)."""
    msg = _problems("strategy=ulysses", *FOUR, "strategy.sp=4", "model.n_heads=2", "model.n_kv_heads=2")
    assert "model.n_heads=2 is not divisible by strategy.sp=4" in msg, msg
    assert "n_kv_heads" not in msg
    validate(compose([*CPU, "strategy=ulysses", *FOUR, "strategy.sp=4"]))  # gpt_nano: 4 heads, 2 KV


@pytest.mark.unit
@pytest.mark.parametrize("path", ["README.md", "conf/strategy/ulysses.yaml",
                                  "conf/strategy/zero3_ulysses.yaml", "strategies/families/deepspeed.py"])
def test_the_docs_say_what_ulysses_requires(path):
    """The check above requires query heads and seq_len divisible by sp, not KV heads: the README,
    the presets' comments and the sp knob's docstring say that, not more."""
    text = (Path(__file__).resolve().parents[1] / path).read_text()
    assert "KV heads and" not in text and "n_kv_heads and seq_len" not in text, path
    assert "replicated" in text and "seq_len" in text, path


@pytest.mark.multiprocess
@pytest.mark.slow  # (CI: Ulysses' equality with divisible KV heads, test_ulysses_* above)
def test_ulysses_with_kv_heads_sp_does_not_divide_equals_one_process(runs):
    """One KV head over sp=2: each rank's query heads get their own copy of it before the
    all-to-all; the same losses and parameters as one process (SGD)."""
    one = ("model.n_kv_heads=1",)
    ref = runs(*CASES["single"].overrides, *one)
    _equivalent(runs("strategy=ulysses", "cluster.devices=2", *one), ref, "sgd")


@pytest.mark.unit
def test_world_not_divisible_by_the_sequence_degree_prints_the_arithmetic():
    msg = _problems("strategy=ulysses", "cluster.devices=3", "cluster.oversubscribe=true")
    assert "world size 3 (cluster.nodes=1 x cluster.devices=3) is not a multiple of strategy.sp=2" in msg, msg


@pytest.mark.unit
def test_sequence_not_divisible_by_two_cp_is_one_clear_error():
    msg = _problems("strategy=fsdp_cp", "cluster.devices=2", "model.seq_len=30")
    assert "model.seq_len=30 is not divisible by 2 x strategy.cp=2 = 4" in msg, msg


@pytest.mark.unit
@pytest.mark.parametrize("overrides", [("strategy=fsdp_cp", "cluster.devices=2"),
                                       ("strategy=3d", *FOUR, "strategy.cp=2", "strategy.tp=1",
                                        "strategy.pp=1")])
def test_attention_dropout_under_context_parallelism_is_refused_with_the_fix(overrides):
    """Ring attention runs no attention dropout (CPU: the ranks failed inside
    scaled_dot_product_attention, mixing a Tensor and a DTensor); refused before launch, every
    cp > 1 composition; the fix it names validates."""
    msg = _problems(*overrides, "model.dropout=0.1")
    assert "model.dropout=0.1 with strategy.cp=2" in msg, msg
    assert "set model.dropout=0" in msg and "strategy=ulysses" in msg, msg
    validate(compose([*CPU, *overrides, "model.dropout=0"]))
    validate(compose([*CPU, "strategy=ulysses", "cluster.devices=2", "model.dropout=0.1"]))


@pytest.mark.subprocess
def test_invalid_sequence_shapes_exit_2_before_launch(tmp_path):
    run = run_cli("train.py", *CPU, "model=gpt_nano", "strategy=ulysses", *FOUR, "strategy.sp=4",
                  "model.n_heads=2", "model.n_kv_heads=2", out=tmp_path / "heads", check=False, timeout=120)
    assert run.proc.returncode == 2, run.log[-2000:]
    assert "model.n_heads=2 is not divisible by strategy.sp=4" in run.log
    plan = run_cli("plan.py", *CPU, "model=gpt_nano", "strategy=fsdp_cp", "cluster.devices=2",
                   "model.seq_len=30", out=tmp_path / "cp", check=False, timeout=120)
    assert plan.proc.returncode == 2, plan.log[-2000:]
    assert "not divisible by 2 x strategy.cp=2" in plan.log


@pytest.mark.unit
def test_sequence_shards_are_contiguous_and_cover_the_window():
    import torch

    from recipes.data import SequenceShard

    x, y = torch.arange(16).view(2, 8), torch.arange(16).view(2, 8) + 1
    parts = [SequenceShard(r, 2)([(x[0], y[0]), (x[1], y[1])]) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts], dim=1), x)
    assert torch.equal(torch.cat([p[1] for p in parts], dim=1), y)


# ----------------------------------------------------------------------------- the planner
@pytest.mark.unit
def test_planner_prices_ulysses_and_ring_attention():
    """Ulysses: 4 x s x b x h / sp per layer (MHA), forward and backward, (sp-1)/sp of it sent;
    ring attention: K and V passed cp - 1 times per layer forward; activations / degree."""
    from planner import plan_all

    def comm(*overrides):
        cfg = compose(["cluster=node_8x_h100", "model=llama_7b", "model.seq_len=32768",
                       "trainer.micro_batch_size=1", "trainer.global_batch_size=8", *overrides])
        return plan_all(typed(cfg), chosen=True).plans[0]

    s, b, h, layers, m = 32768, 1, 4096, 32, 8  # m: 8 micro-batches per step (dp 1), bf16
    uly = comm("strategy=zero3_ulysses", "strategy.sp=8")
    x = uly.communication.by_collective["sp_all_to_all"]
    assert x.ranks == 8
    assert x.bytes == pytest.approx(4 * s * b * h / 8 * 2 * layers * 2 * 7 / 8 * m, rel=1e-9)
    z3 = comm("strategy=zero3")
    assert uly.activations_full == pytest.approx(z3.activations_full / 8, rel=0.02)
    ring = comm("strategy=fsdp_cp", "strategy.cp=8")
    kv = 2 * h  # llama_7b: full-width K and V (no GQA)
    y = ring.communication.by_collective["cp_kv_send_recv"]
    # K, V in bf16 to 7 ranks forward and backward, their fp32 gradients 8 passes round the ring
    assert y.bytes == pytest.approx(kv * b * s / 8 * layers * (7 * 2 * 2 + 8 * 4) * m, rel=1e-9)


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["ulysses", "fsdp_cp"])
def test_moe_models_with_sequence_shards_are_refused(preset):
    """A MoE routes and balances per sequence: a rank holding a shard of it would not."""
    msg = _problems(f"strategy={preset}", "cluster.devices=2", "model=gpt_moe_nano")
    assert "model=gpt_moe_nano (a mixture of experts) with a sequence-parallel preset" in msg, msg
    assert "fsdp_ep" in msg


@pytest.mark.unit
def test_auto_takes_ulysses_at_the_degree_a_long_sequence_needs():
    """llama_7b at 32k tokens on one 8 x H100 node: sharding alone leaves ~100 GB of activations
    per device; the planner raises Ulysses' degree from its preset's 2 until it fits (sp 8) and
    strategy=auto runs it there."""
    from planner import choose

    cfg = compose(["cluster=node_8x_h100", "model=llama_7b", "model.seq_len=32768",
                   "trainer.micro_batch_size=1", "trainer.global_batch_size=8", "strategy=auto"])
    picked, reason = choose(typed(cfg))
    assert picked.name in ("ulysses", "zero3_ulysses") and picked.sp == 8, (picked.name, reason)
    assert "sequence parallel" in reason
