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
    """AdamW clipped at 0.5, below every step's norm (~0.7-0.9 here): the reported norm is the
    unclipped one, equal to the single process's, and the clipped runs train the same."""
    clip = (*EQUIV, "trainer.grad_clip=0.5")
    single = cached(*clip, *CASES["single"].overrides)
    assert min(single.report["grad_norms"]) > 0.6  # not the clipped 0.5
    run = cached(*clip, *CASES[case].overrides)
    assert run.report["grad_norms"] == pytest.approx(single.report["grad_norms"], rel=1e-5)
    assert_losses_close(single.losses, run.losses, rtol=CASES[case].tolerance[0])


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
