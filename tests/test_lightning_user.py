"""Every preset that runs on CPU trains from a plain Lightning user script -- a module that is not
ours, ``import strategies``, ``Trainer(strategy=<preset>, accelerator="cpu", devices=2)`` -- and
matches that script's own single-process run (SGD, 5 steps, 8 samples per step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import strategies
from tests.conftest import GLOO_ABORT, ROOT

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

SCRIPT = ROOT / "tests" / "lightning_user_script.py"
# Not runnable on CPU as presets: NCCL bf16 all-reduce, pinned memory, an NVMe path to give.
NOT_ON_CPU = {"ddp_bf16_compress", "fsdp_offload", "zero_infinity"}
# TP and PP presets need a model that declares its tp_plan / pp_plan (a plain user module gets a
# clear error naming them); tests/test_parallel.py trains them.
PARALLEL = {n for n in strategies.names() if strategies.load(n).family == "parallel"}
CPU_PRESETS = [n for n in strategies.names() if n not in NOT_ON_CPU | PARALLEL | {"single"}]
FULL_PARAMS = (16 * 64 + 64 + 64 * 64 + 64 + 64 + 1) * 4  # the script's model, fp32 bytes
# fp16 compression rounds gradients to 11 bits; everything else is exact up to fp32 summation.
RTOL = {"ddp_fp16_compress": 1e-3}


def _user_run(strategy: str, devices: int, tmp_path) -> dict:
    out = tmp_path / f"{strategy}.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), strategy, str(devices), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and GLOO_ABORT not in log, log[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return _user_run("single", 1, tmp_path_factory.mktemp("user"))


# CI: a replicating and a sharding engine (DDP, DeepSpeed ZeRO-3); the rest in the slow tier.
CI_PRESETS = {"ddp", "zero3"}


@pytest.mark.parametrize("preset", [p if p in CI_PRESETS else pytest.param(p, marks=pytest.mark.slow)
                                    for p in CPU_PRESETS])
def test_user_script_trains_with_preset(preset, single, tmp_path):
    run = _user_run(preset, 2, tmp_path)
    assert len(run["losses"]) == len(single["losses"]) == 5
    worst = max(abs(a - b) / abs(a) for a, b in zip(single["losses"], run["losses"]))
    assert worst <= RTOL.get(preset, 1e-5), (preset, single["losses"], run["losses"])
    assert run["losses"][-1] < run["losses"][0]
    if strategies.load(preset).family in ("fsdp", "fsdp2"):  # sharded on the user's module too
        assert run["params_bytes_rank0"] <= FULL_PARAMS * 0.55, run
