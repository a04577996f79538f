"""trainer.compile=true: torch.compile of each block, applied in the fixed order TP -> activation
checkpointing -> compile -> FSDP (parallel/parallelize.py), equal to eager under single, ddp,
fsdp2 and zero2 (and, measured once by hand, ulysses on both backends and a 2-stage pipeline:
1e-7); refused by name where the engine cannot run compiled blocks (FSDP1, ZeRO-3, tensor
parallelism on torch 2.13).

Tolerance: inductor fuses the norms, rotary and SwiGLU element-wise code into its own kernels
(the matmuls stay aten's), so results may differ from eager in the last bits; measured on
gpt_nano, 6 steps: losses within 2e-7 relative, parameters within 2e-7 of their largest
magnitude. Asserted: 1e-5 for both (the equivalence tests' EXACT), AdamW parameters 1e-3 (its
sqrt(v) amplifies last-bit gradient differences, as in tests/test_parallel.py).

Inductor caches compiled kernels; each test session gets its own cache directory
(TORCHINDUCTOR_CACHE_DIR), so a stale /tmp cache never answers for this tree.
"""

from __future__ import annotations

import pytest

from recipes.config import compose
from recipes.job import validate
from strategies import ConfigError
from tests.cases import CASES
from tests.conftest import (EQUIV, OPTIMIZERS, TINY, assert_losses_close, assert_params_close, normalized,
                            run_cli)

pytestmark = pytest.mark.timeout(900)
RTOL = {"sgd": (1e-5, 1e-5), "adamw": (1e-5, 1e-3)}
COMPILED = ("single", "ddp", "fsdp2", "zero2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cached):
    """Eager runs come from the session cache (the equivalence tests' own); compiled ones run
    here with a private inductor cache shared by this module's runs."""
    inductor = tmp_path_factory.mktemp("inductor")
    done = {}

    def get(name: str, optimizer: str, compiled: bool):
        overrides = (*EQUIV, *OPTIMIZERS[optimizer], *CASES[name].overrides)
        if not compiled:
            return cached(*overrides)
        key = normalized((*TINY, "backend=lightning", *overrides, "trainer.compile=true"))
        if key not in done:
            done[key] = run_cli("train.py", *key, out=tmp_path_factory.mktemp("compiled") / "run",
                                timeout=600, env={"TORCHINDUCTOR_CACHE_DIR": str(inductor)})
        return done[key]

    return get


def _equal(runs, name: str, optimizer: str) -> None:
    eager, compiled = runs(name, optimizer, False), runs(name, optimizer, True)
    loss_tol, param_tol = RTOL[optimizer]
    assert_losses_close(eager.losses, compiled.losses, rtol=loss_tol)
    assert_params_close(eager.params(), compiled.params(), rtol=param_tol)


@pytest.mark.subprocess
def test_compiled_single_equals_eager(runs):
    """CI's representative: one process, SGD (any gradient error shows)."""
    _equal(runs, "single", "sgd")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name, optimizer", [(n, o) for n in COMPILED for o in OPTIMIZERS
                                             if (n, o) != ("single", "sgd")]
                         + [("ulysses", "sgd"), ("1f1b", "sgd")])
def test_compiled_equals_eager(runs, name, optimizer):
    _equal(runs, name, optimizer)


# ----------------------------------------------------------------------------- the plan's order
@pytest.mark.unit
def test_compile_comes_after_checkpointing_and_before_fsdp2():
    """The fixed order: each block is checkpointed, then the checkpointed block is compiled (the
    recomputation is compiled too), then FSDP2 would shard the compiled blocks (outside)."""
    torch = pytest.importorskip("torch")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from recipes.config import ModelConfig
    from recipes.gpt import GPT
    from parallel.parallelize import ParallelPlan, parallelize

    model = GPT(ModelConfig(name="gpt_nano", dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            vocab_size=256, seq_len=32, dropout=0.0, ffn_dim=64))
    names = sorted(model.state_dict())
    parallelize(model, ParallelPlan(activation_checkpointing=True, compile=True))
    for layer in model.layers.values():
        assert isinstance(layer, CheckpointWrapper)
        assert layer._compiled_call_impl is not None  # the wrapper is what runs compiled
    assert sorted(k.replace("_checkpoint_wrapped_module.", "") for k in model.state_dict()) == names
    assert model.norm._compiled_call_impl is None  # blocks only
    del torch


@pytest.mark.unit
def test_compile_reaches_every_preset_plan_through_the_run():
    from parallel.parallelize import plan_for

    job = validate(compose(["strategy=fsdp2", "cluster.devices=2", "cluster.accelerator=cpu",
                            "trainer.compile=true"]))
    assert job.run.compile and plan_for(job.strategy, job.run).compile
    job = validate(compose(["strategy=fsdp2", "cluster.devices=2", "cluster.accelerator=cpu"]))
    assert not plan_for(job.strategy, job.run).compile


@pytest.mark.unit
@pytest.mark.parametrize("preset, reason", [("fsdp", "FSDP1"), ("zero3", "ZeRO-3"),
                                            ("zero3_ulysses", "ZeRO-3"),
                                            ("tp", "tensor parallel, tp=2")])
def test_engines_that_cannot_compile_blocks_refuse_by_name(preset, reason):
    cfg = compose([f"strategy={preset}", "cluster.devices=2", "cluster.accelerator=cpu",
                   "trainer.compile=true"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    assert f"trainer.compile=true with strategy={preset} ({reason})" in msg, msg
    assert "trainer.compile=false" in msg


# (PowerSGD under compile: tests/test_powersgd_compile.py)
