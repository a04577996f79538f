"""One precision vocabulary (``core.precision``): our names, their regimes and every engine's
spelling read from one table; and a Lightning builder keeps the Run train.py gives it, deriving
one (once) only when reached through Lightning's registry."""

from __future__ import annotations

import ast
import sys

import pytest

from core import precision
from core.precision import PRECISION, PRECISIONS, REGIMES, find, from_lightning, of, regime
from recipes.config import compose
from recipes.job import validate
from tests.conftest import ROOT

pytestmark = pytest.mark.unit


def test_one_table_spells_each_precision_for_every_engine():
    assert PRECISIONS == ("32", "bf16-mixed", "16-mixed") and REGIMES == ("32", "autocast", "bf16")
    assert {n: p.lightning for n, p in PRECISION.items()} == {
        "32": "32-true", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}
    assert {n: p.accelerate for n, p in PRECISION.items()} == {"32": "no", "bf16-mixed": "bf16", "16-mixed": "fp16"}
    assert [of(n).deepspeed_config() for n in PRECISIONS] == [
        {}, {"bf16": {"enabled": True}}, {"fp16": {"enabled": True}}]
    for name in PRECISIONS:  # Lightning's flag and back
        assert from_lightning(of(name).lightning) == name and find(of(name).lightning) is of(name)
    assert from_lightning("32") == "32" and from_lightning("bf16-true") == "bf16-true"
    assert find("bf16-true") is None
    with pytest.raises(ValueError, match="allowed 32, bf16-mixed, 16-mixed"):
        of("fp8")


def test_dtypes_are_named_and_resolved_at_use():
    import torch

    assert precision.low_dtype("32") is None and precision.low_dtype("bf16-true") is None
    assert precision.low_dtype("bf16-mixed") is torch.bfloat16
    assert precision.low_dtype("16-mixed") is torch.float16
    assert of("bf16-mixed").reduce(True) == "float32" and of("16-mixed").reduce(False) == "float16"
    assert [of(n).measured("gpu") for n in PRECISIONS] == ["float32", "bfloat16", "float16"]
    assert [of(n).measured("cpu") for n in PRECISIONS] == ["float32", "bfloat16", "bfloat16"]


def test_regimes():
    assert regime("32", True) == "32" and regime("32-true", False) == "32"
    assert regime("bf16-mixed", False) == "autocast" and regime("16-mixed", True) == "bf16"
    assert regime("bf16-true", False) == "bf16"


def test_core_imports_only_the_standard_library_and_itself_at_module_level():
    """The ground floor: no torch, no engine, no other package of ours at import (torch, where
    core names a dtype, is asked at use)."""
    for path in sorted((ROOT / "core").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert all(n.split(".")[0] in sys.stdlib_module_names or n.split(".")[0] == "core"
                           for n in names), (path, names)


def _job(*overrides: str):
    return validate(compose(["strategy=ddp", "cluster.devices=2", "cluster.accelerator=cpu",
                             "trainer.global_batch_size=8", "trainer.micro_batch_size=2", *overrides]))


def test_the_lightning_builder_keeps_the_run_it_is_given():
    from backends.lightning import families

    job = _job("trainer.precision=bf16-mixed")
    strategy = families.build(job.strategy, job.run)
    assert strategy.run() is job.run  # the batch and clipping included, not re-derived


def test_through_the_registry_the_run_is_derived_once_from_lightnings_world():
    from backends.lightning import families
    from backends.lightning.trainer import L

    strategy = families.build(_job().strategy)
    assert strategy.run().mesh.size == 1  # not attached to a Trainer yet: derived, not kept
    assert strategy._run is None
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, precision="bf16-mixed",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    run = trainer.strategy.run()
    assert run.mesh.size == 2 and run.precision == "bf16-mixed" and run.accelerator == "cpu"
    assert trainer.strategy.run() is run


@pytest.mark.parametrize("overrides", [("strategy=single", "cluster.devices=1"), ("strategy=ddp",),
                                       ("strategy=fsdp",), ("strategy=zero2",),
                                       ("strategy=ddp", "backend=accelerate")])
def test_fp16_mixed_on_cpu_is_refused_once_for_every_backend_and_preset(overrides):
    """On CPU Lightning would train bf16-mixed in 16-mixed's place (its accelerator connector, a
    warning only; the report said 16-mixed), FSDP1 fp16 unscaled (ShardedGradScaler disables
    itself without CUDA); Accelerate and DeepSpeed have no fp16 there. One refusal, the fix named."""
    from strategies import ConfigError

    with pytest.raises(ConfigError) as e:
        _job("trainer.precision=16-mixed", *overrides)
    assert len(e.value.problems) == 1, e.value.problems
    assert e.value.problems[0].startswith("trainer.precision=16-mixed on CPU")
    assert "use trainer.precision=bf16-mixed or 32, or cluster.accelerator=gpu" in e.value.problems[0]


def test_fsdp1_takes_lightnings_fp16_precision_plugin():
    """Lightning 2.6's FSDPPrecision refuses a scaler handed to its constructor under 16-mixed (it
    checks the class default precision first): our plugin swap crashed every FSDP1 run at
    16-mixed, GPU included. It keeps Lightning's scaler; on CPU Lightning's rule applies (bf16-mixed,
    no scaler), as for its other strategies."""
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision

    from backends.lightning import families

    job = _job("strategy=fsdp")
    strategy = families.build(job.strategy, job.run)
    given = FSDPPrecision("16-mixed")
    strategy.precision_plugin = given  # (no accelerator yet: as on a GPU, the scaler kept)
    assert strategy.precision_plugin.precision == "16-mixed"
    assert strategy.precision_plugin.scaler is given.scaler is not None
    strategy.accelerator = CPUAccelerator()
    with pytest.warns(UserWarning, match="FSDP trains precision='bf16-mixed' instead"):
        strategy.precision_plugin = FSDPPrecision("16-mixed")
    assert strategy.precision_plugin.precision == "bf16-mixed" and strategy.precision_plugin.scaler is None
