"""trainer.seed decides the training RNG too (model.dropout > 0): the same config and seed give
the same run, bitwise, on both backends, and a resume continues it exactly; each rank's seed
follows core.mesh.training_seed (ranks holding different tokens draw different masks, tensor-
parallel peers the same)."""

from __future__ import annotations

import shutil

import pytest
import torch

from core.mesh import Mesh, training_seed
from tests.conftest import TINY, run_cli

DROPOUT = ("model.dropout=0.1", "trainer.max_steps=4", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
           "trainer.checkpoint_every=2", "trainer.export_params=true", "callbacks=none")


def _seeds(mesh: Mesh, seed: int = 7) -> list[int]:
    return [training_seed(seed, mesh, r) for r in range(mesh.size)]


@pytest.mark.unit
def test_each_rank_holding_other_tokens_draws_its_own_masks_and_tensor_peers_share_them():
    assert _seeds(Mesh(1, 1)) == [7]
    assert _seeds(Mesh(1, 4)) == [7, 8, 9, 10]  # ddp, fsdp, zero: other samples
    assert _seeds(Mesh(2, 2, shard=2)) == [7, 8, 9, 10]  # hsdp: replicas and shards alike
    assert _seeds(Mesh(1, 4, sp=2)) == [7, 8, 9, 10]  # ulysses: other sequence shards
    assert _seeds(Mesh(1, 4, cp=2)) == [7, 8, 9, 10]  # fsdp_cp: ring attention's shards
    assert _seeds(Mesh(1, 4, ep=2)) == [7, 8, 9, 10]  # ep folds into data: other samples
    assert _seeds(Mesh(1, 4, pp=4)) == [7, 8, 9, 10]  # every pipeline stage its own
    assert _seeds(Mesh(1, 2, tp=2)) == [7, 7]  # tensor peers: the same activations
    assert _seeds(Mesh(1, 8, tp=2, pp=2)) == [7, 7, 8, 8, 9, 9, 10, 10]  # (data, pipeline, tensor)
    # (data, context, pipeline, tensor): only the innermost tensor coordinate is shared
    mesh = Mesh(1, 16, tp=2, pp=2, cp=2)
    seeds = _seeds(mesh)
    assert seeds[::2] == seeds[1::2] and sorted(set(seeds)) == list(range(7, 15))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
# (Accelerate's in the slow tier: the seeding is checkpoints.start's and the loader
# recipes.data.train_loader's, one path for both backends, which Lightning's case proves in CI)
@pytest.mark.parametrize("backend", ["lightning", pytest.param("accelerate", marks=pytest.mark.slow)])
def test_dropout_runs_of_one_seed_are_bitwise_equal_and_resume_exactly(tmp_path, backend):
    args = (*TINY, *DROPOUT, f"backend={backend}")
    # (one fresh interpreter, one forked from tests/zygote.py's: two forked runs would start from
    # its one RNG state, and equal each other unseeded)
    first = run_cli("train.py", *args, out=tmp_path / "first", timeout=240, fresh=True)
    again = run_cli("train.py", *args, out=tmp_path / "again", timeout=240)
    assert first.losses == again.losses, (first.losses, again.losses)
    a, b = first.params(), again.params()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # 2 steps, then resumed to 4 from the step-2 checkpoint: the same masks as the straight run
    shutil.copytree(first.out / "checkpoints" / "step2", tmp_path / "resumed" / "checkpoints" / "step2")
    resumed = run_cli("train.py", *args, out=tmp_path / "resumed", timeout=240)
    assert "resumed from" in resumed.log
    assert resumed.losses == first.losses, (resumed.losses, first.losses)
    c = resumed.params()
    assert all(torch.equal(a[k], c[k]) for k in a)
