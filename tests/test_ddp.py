"""DDP and its gradient-compression hooks against the single-process reference (2 gloo ranks)."""

from __future__ import annotations

import pytest

from tests.conftest import EQUIV, assert_losses_close, assert_params_close

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


@pytest.mark.parametrize("micro", [4, 2], ids=["no-accumulation", "accumulation-2"])
def test_ddp_matches_single_process(train, single_reference, micro):
    run = train(*EQUIV, "strategy=ddp", "cluster.devices=2", f"trainer.micro_batch_size={micro}")
    r = run.report
    assert (r["world_size"], r["accumulation"]) == (2, 8 // (2 * micro))
    assert_losses_close(single_reference.losses, run.losses, rtol=1e-5)
    assert_params_close(single_reference.params(), run.params(), rtol=1e-5)
    assert run.losses[-1] < run.losses[0]
