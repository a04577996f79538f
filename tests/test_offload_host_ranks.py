"""Issue #38, the two-rank gap: what a second data-parallel rank adds to an offload run's peak.

Measured on CPU (RSS high-water marks around each DeepSpeed 0.19.8 call of a 29M-parameter
train.py run, 2 ranks): the extra bytes are not gloo's buffers but the flat copies DeepSpeed
makes of a gradient bucket to reduce it, beside the bucket, at backward's end --
ZeRO-2: stage_1_and_2.py ``allreduce_bucket``'s ``self.flatten(bucket)`` (+57.4 MB, one bucket's
bf16 gradients; none on one rank, where the bucket is one slice and flatten a view); ZeRO-3:
coalesced_collectives.py ``reduce_scatter_coalesced``'s ``torch.cat`` (+57.4 MB) and gloo's
``reduce_scatter_tensor`` (+57.4 MB, a copy of its input; NCCL makes none), on 1 rank too.
The planner books them in the device plan (on a GPU they are device memory, on CPU the host's):
strategies/footprint.py ``reduction_copies``. Where everything reduced fits one bucket (these
models: reduce_bucket_size is 2e8 elements) the only flush is backward's last, after every
activation is freed, so they are in the end-of-backward phase (``memory.step``), not beside the
activations (``memory.buffers``): with them there, ZeRO-3's growth was planned 451 MB against
342 measured (tests/test_observers.py). The RSS proof is tests/test_offload_host.py's 2-rank cases
(slow tier)."""

from __future__ import annotations

import pytest

from tests.conftest import typed

SHAPE = ("model.dim=768", "model.n_layers=4", "model.ffn_dim=2048", "model.n_heads=12", "model.n_kv_heads=12")
CPU = ("model=gpt_nano", "cluster.accelerator=cpu", "trainer.precision=bf16-mixed", "callbacks=none",
       "trainer.micro_batch_size=2", *SHAPE)


def _memory(*overrides: str):
    from planner import preflight
    from recipes.config import compose

    return preflight(typed(compose(list(overrides)))).memory


def _cpu(strategy: str, ranks: int, *more: str):
    return _memory(*CPU, f"strategy={strategy}", f"cluster.devices={ranks}",
                   f"trainer.global_batch_size={2 * ranks}", *more)


@pytest.mark.unit
def test_zero2_books_the_bucket_flatten_copy_only_with_a_second_rank():
    one, two = _cpu("zero2_offload", 1), _cpu("zero2_offload", 2)
    grads = two.params  # bf16: the whole model's gradients, as many bytes as its bf16 parameters
    # one rank: the ipg bucket alone; two: the bucket and its flat copy, made by the only flush,
    # at backward's end (reduce_bucket_size is 2e8 elements, more than the model): beside the
    # bucket, not beside the activations
    assert one.buffers == two.buffers == grads
    assert two.step == one.step + grads
    assert two.total == max(one.total, two.step) and two.growth == two.total - (two.step - grads)
    smaller = _cpu("zero2_offload", 2, "strategy.reduce_bucket_size=1000000")
    # flushed through backward: overlap_comm's two buckets (the model fills both) and one copy,
    # each 1e6 bf16 elements, beside the activations
    assert smaller.buffers == 3 * 1_000_000 * 2


@pytest.mark.unit
def test_zero3_books_the_coalesced_cat_and_gloos_reduce_scatter_copy():
    """ZeRO-3 reduces full gradients on 1 and 2 ranks alike: the same copies; on a host two
    (torch.cat, gloo's reduce_scatter_tensor), on a GPU one (NCCL reduce-scatters in place)."""
    one, two = _cpu("zero3_offload", 1), _cpu("zero3_offload", 2)
    assert one.buffers == two.buffers
    from strategies.zero_footprint import ZeroFootprint
    from strategies.footprint import Sizes, StateBytes, reduction_copies

    sb = StateBytes(params=2, grads=2, master=4, optimizer=8, gather=2, reduce=2, activation=2)
    fp = ZeroFootprint(stage=3, reduce_bucket=200_000_000)
    n = dict(params=3e7, trainable=3e7, bytes=sb, dp=2, shard=2)
    assert reduction_copies(fp, Sizes(**n, resident=True)) == 2 * 3e7 * 2
    assert reduction_copies(fp, Sizes(**n)) == 3e7 * 2
    assert reduction_copies(fp, Sizes(**{**n, "params": 1e9, "trainable": 1e9})) == 2e8 * 2  # one bucket
    zero2 = ZeroFootprint(stage=2, reduce_bucket=200_000_000)
    assert reduction_copies(zero2, Sizes(**n, resident=True)) == 3e7 * 2  # gloo's all_reduce: in place
    assert reduction_copies(zero2, Sizes(**{**n, "dp": 1, "shard": 1})) == 0


@pytest.mark.unit
def test_zero2_on_eight_gpus_books_one_bucket_copy_in_device_memory():
    """llama_7b, zero2 on 8 GPUs: the reduction copy is one reduce_bucket_size bucket (2e8
    bf16 elements, 0.4 GB) beside the bucket, on the device."""
    base = ("model=llama_7b", "cluster=node_8x_h100", "trainer.precision=bf16-mixed",
            "trainer.global_batch_size=64", "callbacks=none")
    for strategy in ("zero2", "zero2_offload"):
        m = _memory(*base, f"strategy={strategy}")
        assert m.buffers >= 2e8 * 2 * 2, (strategy, m.buffers)
