"""Learning-rate schedules and optimizer knobs: the same recipe on every backend and family.

The closed forms are checked once (unit); then one schedule with weight decay on its own groups
(norms, biases and embeddings exempt) is trained with plain SGD -- whose update is lr x gradient,
so a wrong learning rate or a decay applied to the wrong parameters moves the losses -- on a
representative preset of each engine family and both backends, against the single-process run.
"""

from __future__ import annotations

import math
import re

import pytest

from tests.cases import CASES
from tests.conftest import EQUIV, OPTIMIZERS, assert_losses_close, assert_params_close

# cosine after 2 warm-up steps, to 10% of lr at step 5 (then held): every phase within 6 steps;
# SGD with weight decay 0.1 on the decayed group
SCHEDULE = ("trainer.scheduler=cosine", "trainer.warmup_steps=2", "trainer.min_lr_ratio=0.1",
            "trainer.decay_steps=5", "trainer.weight_decay=0.1", *OPTIMIZERS["sgd"])


def _config(**kw):
    from recipes.config import TrainerConfig

    return TrainerConfig(**{"max_steps": 10, "lr": 1.0, **kw})


@pytest.mark.unit
@pytest.mark.parametrize("scheduler", ["constant", "cosine", "linear"])
def test_each_schedule_has_its_closed_form(scheduler):
    from recipes.training import lr_factor

    f = lr_factor(_config(scheduler=scheduler, warmup_steps=3, min_lr_ratio=0.2))
    got = [f(s) for s in range(12)]
    assert got[:3] == pytest.approx([1 / 4, 2 / 4, 3 / 4])  # linear warm-up, the same for each
    progress = [min(1.0, (s - 3) / 7) for s in range(3, 12)]
    want = {"constant": [1.0] * 9,
            "cosine": [0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * p)) for p in progress],
            "linear": [1 - 0.8 * p for p in progress]}[scheduler]
    assert got[3:] == pytest.approx(want)
    if scheduler != "constant":
        assert got[3] == 1.0 and got[10] == got[11] == pytest.approx(0.2)  # peak, then floor held


@pytest.mark.unit
def test_decay_steps_ends_the_decay_early():
    from recipes.training import lr_factor

    f = lr_factor(_config(scheduler="linear", decay_steps=4))
    assert [f(s) for s in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


@pytest.mark.unit
def test_norms_biases_and_embeddings_get_no_weight_decay_under_any_wrapper():
    import torch

    from recipes.config import compose, describe
    from recipes.gpt import GPT
    from recipes.training import no_decay_names, param_groups

    model = GPT(describe(compose(["model=gpt_nano"]).model))
    names = [n for n, _ in model.named_parameters()]
    exempt = no_decay_names(model)
    assert exempt == {n for n, p in model.named_parameters() if p.ndim < 2} | {"tok_embeddings.weight"}
    assert all(model.get_parameter(n).ndim == 2 for n in set(names) - exempt)
    # as engines name them: Lightning's forward redirection, FSDP1 units, checkpoint wrappers
    wrapped = [("_forward_module.model." + re.sub(r"^(layers\.\d+)\.", r"\1._fsdp_wrapped_module."
                                                  r"_checkpoint_wrapped_module.", n), p)
               for n, p in model.named_parameters()]
    assert "_forward_module.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.attn_norm.weight" \
        in dict(wrapped)
    groups = param_groups(wrapped, _config(weight_decay=0.1), names, exempt)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert {id(p) for p in groups[1]["params"]} == {id(model.get_parameter(n)) for n in exempt}
    with pytest.raises(ValueError, match="trainer.no_decay=false"):
        param_groups([("_fsdp_wrapped_module._flat_param", torch.nn.Parameter(torch.zeros(3)))],
                     _config(weight_decay=0.1), names, exempt)
    # no weight decay, or no_decay=false: one group, every parameter
    assert len(param_groups(wrapped, _config(), names, exempt)) == 1
    assert len(param_groups(wrapped, _config(weight_decay=0.1, no_decay=False), names, exempt)) == 1


@pytest.mark.unit
@pytest.mark.parametrize("overrides, needle", [
    (("trainer.scheduler=cosine", "trainer.warmup_steps=60", "trainer.max_steps=60"),
     "trainer.scheduler=cosine decays between trainer.warmup_steps=60 and trainer.max_steps=60"),
    (("trainer.decay_steps=30",), "trainer.decay_steps=30 with trainer.scheduler=constant does nothing"),
    (("trainer.betas=[0.9,1.0]",), "trainer.betas=[0.9, 1.0]: AdamW takes two numbers"),
    (("trainer.scheduler=step",), "trainer.scheduler='step' is not one of constant, cosine, linear"),
    (("trainer.min_lr_ratio=2",), "trainer.min_lr_ratio=2.0: must be >= 0 and <= 1"),
])
def test_schedule_settings_that_cannot_work_are_refused(overrides, needle):
    from recipes.config import compose
    from recipes.job import validate
    from strategies import ConfigError

    with pytest.raises(ConfigError, match=None) as e:
        validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", *overrides]))
    assert needle in str(e.value), str(e.value)


@pytest.mark.unit
def test_flat_parameters_refuse_no_decay_with_weight_decay():
    from recipes.config import compose
    from recipes.job import validate
    from strategies import ConfigError

    base = ["model=gpt_nano", "cluster.accelerator=cpu", "strategy=fsdp", "cluster.devices=2",
            "strategy.use_orig_params=false", "trainer.weight_decay=0.1"]
    with pytest.raises(ConfigError) as e:
        validate(compose(base))
    assert "needs per-parameter optimizer groups" in str(e.value) and "trainer.no_decay=false" in str(e.value)
    validate(compose([*base, "trainer.no_decay=false"]))


# one representative per engine family, both backends (Accelerate where it builds the family)
# (ZeRO-2 on Accelerate, the ZeRO family's second, in the slow tier; so is tp, whose sharded
# groups the clipping case below runs in CI.)
FAMILIES = [("ddp", "accelerate"), pytest.param("fsdp", "lightning", marks=pytest.mark.slow),
            ("fsdp2", "accelerate"), ("zero3", "lightning"),
            pytest.param("zero2", "accelerate", marks=pytest.mark.slow),
            pytest.param("tp", "lightning", marks=pytest.mark.slow), ("gpipe", "lightning")]


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("case", "backend"), FAMILIES,
                         ids=["-".join(c.values if hasattr(c, "values") else c) for c in FAMILIES])
def test_a_schedule_with_weight_decay_groups_trains_the_same_everywhere(cached, case, backend):
    single = cached(*EQUIV, *CASES["single"].overrides, *SCHEDULE)
    from recipes.training import lr_factor

    want = [0.5 * lr_factor(_config(max_steps=6, scheduler="cosine", warmup_steps=2, min_lr_ratio=0.1,
                                           decay_steps=5))(s) for s in range(6)]
    assert single.report["lrs"] == pytest.approx(want)  # lr 0.5 (SGD's), as each step used it
    run = cached(*EQUIV, *CASES[case].overrides, *SCHEDULE, f"backend={backend}")
    assert run.report["lrs"] == pytest.approx(want)
    losses, params = CASES[case].tolerance
    assert_losses_close(single.losses, run.losses, rtol=losses)
    assert_params_close(single.params(), run.params(), rtol=params)
    # the global gradient norm, gathered over shards, meshes and stages, is the unsharded one
    assert run.report["grad_norms"] == pytest.approx(single.report["grad_norms"], rel=max(losses, 1e-5))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [pytest.param("fsdp", marks=pytest.mark.slow), "zero3", "tp"])  # (fsdp: test_clients clips it)
def test_with_clipping_the_norm_is_before_clipping_and_the_same_everywhere(cached, case):
    """AdamW clipped at 0.5, below every step's norm (~0.6-0.7 here): the reported norm is the
    unclipped one, equal to the single process's to 1e-6, and the clipped runs train the same. At
    vocab 8192 the output head's gradient (8192 x 32) is one torch's fp32 CPU norm reads 5e-5 low
    whole and less so in shards: single, tp and zero3 clipped by norms 8e-5 apart before
    parallel/clip.py. FSDP1's root unit still measures its flat shards so (README)."""
    clip = (*EQUIV, "trainer.grad_clip=0.5", "model.vocab_size=8192")
    single = cached(*clip, *CASES["single"].overrides)
    assert min(single.report["grad_norms"]) > 0.55  # not the clipped 0.5
    run = cached(*clip, *CASES[case].overrides)
    rel = 2e-4 if case == "fsdp" else 1e-6  # (FSDP1: 8e-5 to 9e-5 at every step)
    assert run.report["grad_norms"] == pytest.approx(single.report["grad_norms"], rel=rel)
    assert_losses_close(single.losses, run.losses, rtol=CASES[case].tolerance[0])


def _large_gradients(params, scale: float = 1e-3) -> float:
    """Seeded gradients for ``params``; their global norm, in float64."""
    import torch

    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            p.grad = distribute_tensor(p.grad, p.device_mesh, p.placements)
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    return float(sum(g.double().square().sum() for g in local) ** 0.5)


def _assert_clipped(params, before, max_norm: float, norm: float) -> None:
    """Each gradient is its value before, times torch's coefficient max_norm / (norm + 1e-6)."""
    coef = max_norm / (norm + 1e-6)
    for p, b in zip(params, before):
        got = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        assert float((got - b * coef).abs().max()) <= 1e-6 * float(b.abs().max()) * coef


@pytest.mark.unit
def test_the_clipping_norm_of_large_cpu_gradients_is_exact():
    """torch's fp32 norm on CPU accumulates a large tensor inexactly (8M random elements: 2e-4
    relative; gpt_nano's gradient at vocab 8192, its output head's near-equal rows: 8e-5 low),
    by an amount that depends on how the tensor is cut, so single, FSDP2/TP and DeepSpeed clipped
    by different norms and trained different models. clip_global_ measures to 1e-6 of float64
    (fp32 norms of 32k-element pieces read the model's 9e-6 low) and clips by that norm."""
    import torch
    import torch.nn.functional as F

    from parallel.clip import clip_global_
    from recipes.config import compose, describe
    from recipes.data import GlobalBatchSampler, TextDataset
    from recipes.training import build_model

    model = build_model(describe(compose(["model=gpt_nano", "model.vocab_size=8192"]).model), 1234)
    data = TextDataset(None, 32)
    order = GlobalBatchSampler(len(data), global_batch=8, micro_batch=8, dp_rank=0, dp_size=1, seed=1234, steps=1)
    tokens, targets = (torch.stack(x) for x in zip(*(data[i] for i in order.global_indices(0))))
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    params = list(model.parameters())
    exact = float(sum(p.grad.double().square().sum() for p in params) ** 0.5)
    assert float(clip_global_(params, 0.0)) == pytest.approx(exact, rel=1e-6)

    params = [torch.nn.Parameter(torch.empty(s)) for s in ((2048, 4096), (8192, 32), (64,))]
    exact = _large_gradients(params)
    before = [p.grad.clone() for p in params]
    assert float(clip_global_(params, 0.0)) == pytest.approx(exact, rel=1e-6)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))  # 0: measured, not clipped
    norm = clip_global_(params, exact / 2)
    assert norm.dtype == torch.float32 and float(norm) == pytest.approx(exact, rel=1e-6)
    _assert_clipped(params, before, exact / 2, float(norm))


@pytest.mark.unit
def test_dtensor_gradients_on_any_placements_take_the_same_exact_norm():
    """FSDP2's and TP's gradients (DTensors, sharded or replicated, beside plain ones, and a
    pipeline's group) go through the same exact measure, and are clipped in place as DTensors."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from parallel.clip import clip_global_

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        layouts = [((2048, 4096), (Shard(0), Shard(1))), ((8192, 32), (Replicate(), Shard(0))),
                   ((64,), (Replicate(), Replicate())), ((128, 32), None)]
        params = [torch.nn.Parameter(torch.empty(s) if at is None else
                                     distribute_tensor(torch.empty(s), mesh, at)) for s, at in layouts]
        exact = _large_gradients(params)
        before = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for p in params]
        norm = clip_global_(params, exact / 2, (dist.group.WORLD,))
        assert not hasattr(norm, "to_local") and float(norm) == pytest.approx(exact, rel=1e-6)
        assert [isinstance(p.grad, DTensor) for p in params] == [True, True, True, False]  # in place
        _assert_clipped(params, before, exact / 2, float(norm))
    finally:
        dist.destroy_process_group()


@pytest.mark.subprocess
@pytest.mark.timeout(300)
def test_the_reported_norm_is_the_norm_of_the_gradient_that_moved_the_weights(tmp_path):
    """One SGD step without clipping or decay: p1 = p0 - lr x g, so |g| = |p0 - p1| / lr, from the
    initial weights built here and the exported ones -- independent of the engine's norm code."""
    import torch

    from recipes.config import compose, describe
    from recipes.training import build_model
    from tests.conftest import TINY, run_cli

    over = ("strategy=single", "trainer.max_steps=1", "trainer.export_params=true", "trainer.lr=0.5",
            "trainer.optimizer=sgd", "trainer.grad_clip=0", "callbacks=none")
    run = run_cli("train.py", *TINY, *over, out=tmp_path / "run")
    p0 = build_model(describe(compose([*TINY, *over]).model), 1234).state_dict()
    p1 = run.params()
    step = torch.cat([(p0[k] - p1[k]).flatten() for k in p1 if k in p0]).double()
    assert run.report["grad_norms"][0] == pytest.approx(float(step.norm()) / 0.5, rel=1e-4)

@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_the_decay_groups_change_the_run(cached):
    """The exempt group is not a no-op: decaying every parameter trains differently."""
    single = cached(*EQUIV, *CASES["single"].overrides, *SCHEDULE)
    everything = cached(*EQUIV, *CASES["single"].overrides, *SCHEDULE, "trainer.no_decay=false")
    assert single.losses[0] == everything.losses[0]  # (the first step's loss precedes any update)
    assert max(abs(a - b) for a, b in zip(single.losses, everything.losses)) > 1e-4
