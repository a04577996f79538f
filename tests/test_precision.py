"""One precision vocabulary (``core.precision``): our names, their regimes and every engine's
spelling read from one table."""

from __future__ import annotations

import ast

import pytest

from core import precision
from core.precision import PRECISION, PRECISIONS, REGIMES, find, from_lightning, of, regime
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


def test_core_imports_no_torch_or_other_package_of_ours_at_module_level():
    for path in sorted((ROOT / "core").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert all(n.split(".")[0] in ("__future__", "dataclasses", "typing", "enum", "core")
                           for n in names), (path, names)
