"""A user's Accelerate script WITHOUT the hook (issue 39): what an exported config lets a plain
``Accelerator()`` train.

* CPU export, ZeRO presets (offload too): the YAML's ``deepspeed_config_file`` is the hook's
  refusal text, which Accelerate's ``DeepSpeedPlugin()`` -- built from the launcher's variables
  at the script's ``Accelerator()``, ``cpu=True`` or not -- refuses by name; the script
  (tests/accelerate_user_script.py, unmodified) stops there under real ``accelerate launch``
  instead of training DDP (``Accelerator(cpu=True)``) or lone processes (``Accelerator()``).
* GPU export: ``user.unhooked`` decides what Accelerate alone trains (its own engine on GPUs;
  DDP with ``cpu=True``; every rank alone without GPUs) and export.py says so; the CPU-machine
  cells are checked against real launches (slow), the GPU cells by the decision alone.
* The Lightning client matrix (tests/test_clients.py) again with AdamW (slow): SGD shows a
  constant gradient scale, AdamW the optimizer state each engine shards.
"""

from __future__ import annotations

import re

import pytest

from tests.test_accelerate_user import SCRIPT, TWO, _export, _launch, _ranks
from tests.test_clients import TRAINING

pytestmark = pytest.mark.timeout(420)

GPU = ("model=gpt_nano", "cluster.accelerator=gpu", "cluster.devices=2")
ZERO_CPU = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
# the hook's call a CPU export names (tests/test_accelerate_hook_call.py): TWO's clip 1.0 and its
# accumulation 2 (global 16 = micro 4 x 2 ranks x 2); zero3 with gpt_nano: the threshold that
# conf/strategy_model/zero3_gpt_nano.yaml sets
NANO_ZERO3 = "'strategy.param_persistence_threshold=0', "


def zero_call(preset: str) -> str:
    keys = NANO_ZERO3 if preset == "zero3" else ""
    return f"stratagem_accelerator('{preset}', {keys}grad_clip=1.0, gradient_accumulation_steps=2)"


def _refused(tmp_path, preset: str, *script_args: str) -> str:
    """The unhooked script under the preset's CPU export, 2 ranks: it must stop at Accelerator()."""
    proc = _launch("--config_file", _export(tmp_path, f"strategy={preset}"), SCRIPT, *script_args)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and '{"rank": ' not in out, (out + err)[-3000:]
    return err


@pytest.mark.multiprocess
def test_zero2_cpu_export_refuses_a_script_without_the_hook(tmp_path):
    """nlp_example's --cpu: Accelerator(cpu=True), which under this export trained DDP on 2 gloo
    ranks with exit 0. It now stops at that line, naming the hook (the launcher ends the other rank)."""
    err = _refused(tmp_path, "zero2", "--cpu")
    said = "Received: STRATAGEM_HOOK_REQUIRED: on CPU, Accelerate alone drops DeepSpeed"
    assert said in err and zero_call("zero2") in err, err[-3000:]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("preset, script_args", [("zero3", ()), ("zero3_offload", ("--cpu",)),
                                                  ("zero2_offload", ())])
def test_zero_cpu_exports_refuse_a_script_without_the_hook(tmp_path, preset, script_args):
    """Accelerator() (each rank alone: it crashed at its first gather) and Accelerator(cpu=True)."""
    err = _refused(tmp_path, preset, *script_args)
    assert "STRATAGEM_HOOK_REQUIRED" in err and zero_call(preset) in err, err[-3000:]


@pytest.mark.unit
@pytest.mark.parametrize("preset", ZERO_CPU)
def test_zero_cpu_export_is_refused_by_accelerates_own_plugin(tmp_path, monkeypatch, preset):
    """What `accelerate launch` sets from the CPU export, then the plugin a plain Accelerator()
    builds from it: refused naming the preset's hook; the JSON the YAML names is written and
    parses (the hook and train.py pass their own plugin and never read the YAML's value)."""
    import json

    import yaml
    from accelerate.utils import DeepSpeedPlugin

    from backends.accelerate.user import _launched_engine

    cfg = yaml.safe_load(open(_export(tmp_path, f"strategy={preset}")))
    value = cfg["deepspeed_config"]["deepspeed_config_file"]
    assert cfg["distributed_type"] == "DEEPSPEED" and value.startswith("STRATAGEM_HOOK_REQUIRED")
    json_path = value.rsplit("the preset's DeepSpeed JSON: ", 1)[1].rstrip(")")
    assert json.load(open(json_path))["zero_optimization"]["stage"] == int(preset[4])
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(cfg["deepspeed_config"]))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", value)
    with pytest.raises(ValueError, match=rf"Received: STRATAGEM_HOOK_REQUIRED.*strategy={preset} only.*"
                                         + re.escape(zero_call(preset))):
        DeepSpeedPlugin()
    assert _launched_engine() == "DEEPSPEED"  # what the hook checks its preset against


def _config(preset: str, cpu: bool) -> dict:
    from backends.accelerate.export import accelerate_config
    from recipes.compose import compose
    from recipes.job import RUN, validate

    job = validate(compose([f"strategy={preset}", *(TWO if cpu else GPU), "export=accelerate"]), depth=RUN)
    return accelerate_config(job, "/x/ds.json")


@pytest.mark.unit
def test_what_a_script_without_the_hook_trains():
    """The decision (``user.unhooked``) over exports x machine x ``Accelerator(cpu=)``: a CPU
    export refuses on every machine; a GPU export is the preset's engine only on GPUs without
    ``cpu=True``; a DDP preset's YAML is DDP (without the preset's hooks) or lone."""
    from backends.accelerate.user import UNHOOKED, unhooked

    cells = {(cuda, cpu) for cuda in (True, False) for cpu in (True, False)}
    for preset in ("fsdp2", "zero3_offload"):
        assert {unhooked(_config(preset, True), cuda=a, cpu=b) for a, b in cells} == {"refused"}
        gpu = _config(preset, False)
        got = {(a, b): unhooked(gpu, cuda=a, cpu=b) for a, b in cells}
        assert got == {(True, False): "preset", (True, True): "ddp", (False, True): "ddp",
                       (False, False): "lone"}, preset
    ddp = _config("ddp_powersgd", False)
    assert [unhooked(ddp, cuda=a, cpu=False) for a in (True, False)] == ["ddp", "lone"]
    assert unhooked({**gpu, "num_processes": 1}, cuda=False, cpu=False) == "preset"
    assert set(UNHOOKED) == {"refused", "preset", "ddp", "lone"}


@pytest.mark.unit
def test_export_says_what_a_gpu_export_leaves_unchecked(tmp_path, capsys):
    """export.py prints, for a GPU ZeRO/FSDP export, the runs a plain Accelerator() trains
    without a word, naming the hook; nothing for a CPU export (it refuses them) or for DDP."""
    import export

    gpu = (*GPU, "export=accelerate")
    export.main(["strategy=zero3", *gpu, f"export.out={tmp_path / 'g.yaml'}"])
    said = capsys.readouterr().err
    assert "trains DDP with Accelerator(cpu=True)" in said and "every rank alone on a machine without GPUs" in said
    assert f"stratagem_accelerator('zero3', {NANO_ZERO3}grad_clip=1.0)" in said  # (GPU: micro 8 x 2, no accumulation)
    for args in (("strategy=fsdp2", *TWO, "export=accelerate"), ("strategy=ddp", *gpu)):
        export.main([*args, f"export.out={tmp_path / 'o.yaml'}"])
        assert "without the hook" not in capsys.readouterr().err, args


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("cpu, want", [(True, "ddp"), (False, "lone")])
def test_a_gpu_export_on_this_machine_trains_what_the_decision_says(tmp_path, cpu, want):
    """The decision's cells for a machine without GPUs, against Accelerate itself: the fsdp2 GPU
    export under `accelerate launch`, the script unhooked: DDP on gloo with --cpu, else two
    ranks that each think they are rank 0 of 1."""
    import torch
    import yaml

    from backends.accelerate.user import unhooked

    assert not torch.cuda.is_available()
    import export

    path = str(tmp_path / "gpu.accelerate.yaml")
    export.main(["strategy=fsdp2", *GPU, "trainer.micro_batch_size=4", "export=accelerate", f"export.out={path}"])
    assert unhooked(yaml.safe_load(open(path)), cuda=False, cpu=cpu) == want
    proc = _launch("--config_file", path, SCRIPT, *(("--cpu",) if cpu else ()), "--optimizer", "sgd")
    if want == "ddp":
        rows = _ranks(proc)
        assert {(r["world"], r["distributed_type"], r["model_type"]) for r in rows} == \
            {(2, "MULTI_CPU", "DistributedDataParallel")}
        return
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out + err)[-3000:]
    lone = [line for line in out.splitlines() if line.startswith('{"rank": ')]
    assert len(lone) == 2 and all('"rank": 0, "world": 1, "distributed_type": "NO"' in r for r in lone), out[-2000:]



ADAMW_RTOL = {"ddp_fp16_compress": 5e-3}
"""Where AdamW needs another tolerance than test_clients' SGD (measured): fp16-rounded gradients,
which AdamW's normalization turns into whole-size update errors for the small ones -- the
predictions' signed sum 2.6e-3 off (cancellation), the losses at most 1.5e-4."""


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("preset", TRAINING)
def test_a_documented_lightning_client_gets_its_preset_with_adamw(preset, tmp_path):
    """test_clients' matrix (fit, validate, test, predict, fit again, validate; 2 CPU ranks,
    norm clipping) with AdamW: its moments are what ZeRO and FSDP shard."""
    from tests.test_clients import CLIP, LOOSE, RTOL, assert_calls_equal, client_run, reference

    run = client_run(preset, tmp_path / "calls.json", optimizer="adamw")
    rtol = ADAMW_RTOL.get(preset, LOOSE.get(preset, RTOL))
    assert_calls_equal(run["calls"], reference(CLIP, "adamw"), rtol)
