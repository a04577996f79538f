"""The model a sharding preset builds: on the meta device, sharded, then each rank gives only its
shards storage and the values a whole build draws from the same seed (recipes/gpt.py
``GPT.init_shards``). Before, every rank built the whole fp32 model on the host first: at
llama_70b that is 282 GB per rank, 2.3 TB on an 8-GPU node of 2 TB."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

def _ranks(tied: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(ROOT / "tests" / "meta_build_script.py"), tied],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                               # (freed blocks go back to the kernel: RSS follows live bytes)
                               "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out, decoder = proc.stdout, json.JSONDecoder()
    # (each rank's object wherever it starts: the launcher's pipe can join two ranks' lines)
    return sorted((decoder.raw_decode(out, i)[0] for i in range(len(out)) if out.startswith('{"rank": ', i)),
                  key=lambda r: r["rank"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tied", ["untied", pytest.param("tied", marks=pytest.mark.slow)])
def test_a_sharded_build_holds_its_shards_and_draws_the_whole_builds_values(tied):
    """FSDP2 over 2 ranks, 16 blocks: a rank's build peaks at its half plus one block (0.56 of
    the whole model; a whole build then sharding: 1.45). Under fsdp2, tp and fsdp_tp the
    parameters equal the whole build's, bitwise (tied: the embedding's values, not the head's)."""
    ranks = _ranks(tied)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["growth"] < 0.75, r
        assert r["equal"] == ["fsdp2", "tp", "fsdp_tp"], r


@pytest.mark.unit
def test_the_planners_sharded_build_is_what_the_lightning_strategies_build():
    """Two statements of one fact: a Lightning strategy that builds on the meta device
    (``builds_on_meta``) must be one the planner exempts from the whole-build host check
    (``Capabilities.sharded_build``), and a preset the planner exempts must build sharded there
    (on the meta device, or ZeRO-3 under zero.Init)."""
    import strategies
    from backends.lightning.families import builder_for

    for name in strategies.names():
        preset = strategies.load(name)
        cls = builder_for(preset)
        if cls is None or preset.capabilities.planned_only:
            continue
        on_meta = getattr(cls, "builds_on_meta", False)
        zero3 = getattr(preset, "stage", 0) == 3
        assert ("lightning" in preset.capabilities.sharded_build) == (on_meta or zero3), name
