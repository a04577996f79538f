"""A Lightning user's preset with keys of its own (``stratagem_strategy``), the DDP family's
unused-parameter error naming the preset's key, and the warning when Lightning's precision plugin
casts a module's parameters under the ZeRO and FSDP1 presets. One process, no process group."""

from __future__ import annotations

import pytest
import torch

from backends.lightning import stratagem_strategy
from strategies import ConfigError

pytestmark = pytest.mark.unit


def test_stratagem_strategy_builds_the_preset_with_its_keys():
    s = stratagem_strategy("ddp_int8", "strategy.find_unused_parameters=true")
    assert (type(s).__name__, s.preset.name) == ("PresetDDPStrategy", "ddp_int8")
    assert s._ddp_kwargs["find_unused_parameters"] is True and s.preset.comm_hook == "int8"
    assert stratagem_strategy("stratagem_ddp").preset.name == "ddp"  # (the registry's name too)


@pytest.mark.parametrize("override, said", [
    ("strategy.find_unused_parameters=maybe", "Value 'maybe' is not a valid bool"),
    ("strategy.find_unused=true", "no such key; did you mean strategy.find_unused_parameters? "
                                  "(strategy.find_unused_parameters=true)"),
])
def test_stratagem_strategy_refuses_a_bad_key_naming_it(override, said):
    with pytest.raises(ConfigError) as e:
        stratagem_strategy("ddp_int8", override)
    assert override in str(e.value) and said in str(e.value) and "find_unused_parameters" in str(e.value)


def test_the_hooks_say_a_mistyped_key_in_train_pys_words():
    """stratagem_strategy and stratagem_accelerator (both ``strategies.presets.load``) said
    OmegaConf's text for a mistyped key, without the "did you mean" train.py says."""
    from strategies import load

    said = "strategy.sync_evry=2: no such key; did you mean strategy.sync_every? (strategy.sync_every=2)"
    for build in (stratagem_strategy, lambda *a: load(a[0], a[1:])):
        with pytest.raises(ConfigError) as e:
            build("local_sgd", "strategy.sync_evry=2")
        assert e.value.problems == [said]


@pytest.mark.parametrize("preset, override, said", [
    ("local_sgd", "strategy.family=fsdp2", "strategy.family='fsdp2': set by the preset's schema (ddp), not a knob; "
     "remove the override"),
    ("ddp", "strategy.name=zero3", "strategy.name='zero3': set by the preset's file (strategy=ddp), not a knob; "
     "remove the override")])
def test_the_hooks_refuse_the_family_and_the_name_as_train_py_does(monkeypatch, preset, override, said):
    """Both hooks took ``strategy.family=fsdp2`` silently (a DDPConfig with family fsdp2), which
    train.py refuses, and ``strategy.name=zero3`` relabelled a ddp preset (train.py's plan line
    said zero3 for a run that trains DDP). Both paths now refuse each in the same line; train.py,
    which cannot see which file a composed preset came from, refuses a name of another family's."""
    from backends.accelerate.user import settle
    from recipes.config import compose
    from recipes.job import validate

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as lightning_hook:
        stratagem_strategy(preset, override)
    with pytest.raises(ConfigError) as accelerate_hook:
        settle(preset, overrides=(override,))
    assert lightning_hook.value.problems == accelerate_hook.value.problems == [said]
    with pytest.raises(ConfigError) as train:
        validate(compose([f"strategy={preset}", override, "model=gpt_nano"]))
    key = override.partition("=")[0]
    assert [p for p in train.value.problems if p.startswith(key)] == [
        said.replace("(strategy=ddp)", "(zero3 is a preset of the deepspeed family, this one of ddp)")]


def test_a_mistyped_preset_name_is_one_line_with_its_likely_spelling():
    """It was a KeyError, printed repr-quoted, without the suggestion train.py makes."""
    with pytest.raises(ConfigError) as e:
        stratagem_strategy("fsdp_2")
    assert e.value.problems[0].startswith("strategy=fsdp_2: no such strategy; did you mean fsdp2? "
                                          "(strategy=fsdp2); the options: 3d, ddp, "), e.value.problems


def test_the_unused_parameter_error_names_the_presets_key_not_lightnings_ddp():
    s = stratagem_strategy("ddp_int8")
    err = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one. "
                       "This error indicates that your module has parameters that were not used")
    s.on_exception(err)
    said = str(err)
    assert "stratagem_strategy('ddp_int8', 'strategy.find_unused_parameters=true')" in said, said
    assert "python train.py strategy=ddp_int8 strategy.find_unused_parameters=true" in said
    assert "replaces strategy=ddp_int8 with Lightning's plain DDP" in said
    other = RuntimeError("something else")
    s.on_exception(other)
    assert str(other) == "something else"


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4).to(torch.bfloat16)
        self.b = torch.nn.Linear(4, 2)


def test_the_cast_warning_names_the_parameters_the_dtype_and_the_fix():
    from backends.lightning.families import cast_warning

    said = cast_warning(Mixed(), "32-true", "zero2")
    assert said.startswith('strategy=zero2, Trainer(precision="32-true"): Lightning\'s precision plugin casts '
                           "2 of the module's parameters (20 values; bfloat16: a.weight, a.bias) to float32"), said
    assert 'Trainer(precision="bf16-true") keeps bfloat16' in said
    assert cast_warning(Mixed(), "bf16-mixed", "zero2") is None  # (mixed: the plugin casts nothing)
    assert cast_warning(Mixed().float(), "32-true", "zero2") is None
    assert "b.weight, b.bias" in cast_warning(Mixed(), "bf16-true", "stratagem_fsdp")


def test_the_cast_warning_counts_a_zero3_partitioned_parameter_whole():
    from backends.lightning.families import cast_warning

    m = Mixed()
    m.a.weight.data = m.a.weight.data.new_empty(0)  # as ZeRO-3 leaves it: the rest in ds_numel
    m.a.weight.ds_numel = 16
    assert "(20 values; bfloat16" in cast_warning(m, "32-true", "zero3")
