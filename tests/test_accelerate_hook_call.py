"""The call a user's script makes to train what an Accelerate export describes. A ZeRO export's
DeepSpeed JSON said bf16, clip 0.5 and 8 accumulated micro-batches, and the call export.py and the
YAML named, ``stratagem_accelerator('zero2')``, built none of them, without a word (an FSDP export's
accumulation the same; ``'strategy.*'`` keys were printed, the trainer's never). Now export.py
and the YAML's hook text name every export-affecting override as the hook's arguments -- the
preset's keys, precision, ZeRO's clipping, the accumulation -- and the micro batch as the
script's DataLoader's; from that call the hook builds the exported JSON, and under a launcher's
config naming a JSON its call does not build it says which keys differ and what to pass."""

from __future__ import annotations

import ast
import json
import logging

import pytest

pytestmark = pytest.mark.unit

CPU2 = ("model=gpt_nano", "cluster.accelerator=cpu", "cluster.devices=2")
AUDIT = ("strategy=zero2", *CPU2, "trainer.precision=bf16-mixed", "trainer.grad_clip=0.5",
         "trainer.global_batch_size=64", "trainer.micro_batch_size=4")
JSON_NAMED = "the preset's DeepSpeed JSON: "


@pytest.fixture
def two_ranks(monkeypatch):
    """The hook's view of an ``accelerate launch`` of 2 CPU ranks (rank 0), before any process group."""
    for var, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0"}.items():
        monkeypatch.setenv(var, value)
    return monkeypatch


def _export(tmp_path, capsys, *overrides: str) -> tuple[dict, str]:
    """export.py's YAML (as a mapping) and what it said on stderr."""
    import yaml

    import export

    out = tmp_path / "x.accelerate.yaml"
    export.main([*overrides, "export=accelerate", f"export.out={out}"])
    return yaml.safe_load(out.read_text()), capsys.readouterr().err


def _settled(call: str):
    """What the hook decides from a printed ``stratagem_accelerator(...)`` call (its arguments,
    as ``stratagem_accelerator`` hands them to ``settle``)."""
    from backends.accelerate.user import settle

    node = ast.parse(call, mode="eval").body
    assert node.func.id == "stratagem_accelerator", call
    args, kw = [ast.literal_eval(a) for a in node.args], {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    return settle(args[0], overrides=tuple(args[1:]), precision=kw.get("precision"),
                  grad_clip=kw.get("grad_clip", 0.0), accumulation=kw.get("gradient_accumulation_steps", 1))


def _engine_json(settled) -> dict:
    """The DeepSpeed config the hook builds, but the micro batch (the script's DataLoader's)."""
    built = settled.builder.preset.deepspeed_json(settled.builder.run)
    return {k: v for k, v in built.items() if k != "train_micro_batch_size_per_gpu"}


def test_a_zero_export_names_the_call_that_builds_its_json(tmp_path, capsys, two_ranks, caplog):
    cfg, said = _export(tmp_path, capsys, *AUDIT)
    call = "stratagem_accelerator('zero2', precision='bf16', grad_clip=0.5, gradient_accumulation_steps=8)"
    named = cfg["deepspeed_config"]["deepspeed_config_file"]
    assert f"accelerator = {call}`" in named and f"accelerator = {call}`" in said, (named, said)
    assert "a DataLoader of batch_size=4 per process" in said and "accelerator.accumulate(model)" in said
    path = named.rsplit(JSON_NAMED, 1)[1].removesuffix(")")
    exported = json.loads(open(path).read())
    assert (exported["gradient_clipping"], exported["bf16"], exported["gradient_accumulation_steps"]) == (
        0.5, {"enabled": True}, 8)
    exported.pop("train_micro_batch_size_per_gpu")
    assert _engine_json(_settled(call)) == exported

    # under that YAML (its CPU text, or a GPU export's plain path): the audit's call is told what it drops
    for value in (named, path):
        two_ranks.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", value)
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            _settled("stratagem_accelerator('zero2')")
            told = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(told) == 1, told
            for part in (path, "gradient_clipping: 0.5 there, 0.0 here", "grad_clip=0.5",
                         "gradient_accumulation_steps: 8 there, 1 here", "precision='bf16'"):
                assert part in told[0], (part, told[0])
            caplog.clear()
            _settled(call)
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_every_export_affecting_override_is_in_the_printed_call(tmp_path, capsys, two_ranks):
    """The preset's keys -- typed, set by the config (conf/strategy_model/zero3_gpt_nano.yaml's
    threshold, which the hook built at 1e5 where the JSON said 0) or by
    trainer.gradient_checkpointing -- go in as on the command line, FSDP's accumulation as
    Accelerate's gradient_accumulation_steps, clipping outside ZeRO in the loop; each call builds
    the preset the export describes."""
    zero3 = ("strategy=zero3", *CPU2, "trainer.micro_batch_size=4", "strategy.reduce_bucket_size=1000")
    cfg, said = _export(tmp_path, capsys, *zero3)
    call = ("stratagem_accelerator('zero3', 'strategy.reduce_bucket_size=1000', "
            "'strategy.param_persistence_threshold=0', grad_clip=1.0, gradient_accumulation_steps=2)")
    assert f"accelerator = {call}`" in said and call in cfg["deepspeed_config"]["deepspeed_config_file"]
    path = cfg["deepspeed_config"]["deepspeed_config_file"].rsplit(JSON_NAMED, 1)[1].removesuffix(")")
    exported = json.loads(open(path).read())
    exported.pop("train_micro_batch_size_per_gpu")
    assert _engine_json(_settled(call)) == exported

    fsdp2 = ("strategy=fsdp2", *CPU2, "trainer.precision=bf16-mixed", "trainer.grad_clip=0.5",
             "trainer.global_batch_size=64", "trainer.micro_batch_size=4", "trainer.gradient_checkpointing=true")
    cfg, said = _export(tmp_path, capsys, *fsdp2)
    call = ("stratagem_accelerator('fsdp2', 'strategy.activation_checkpointing=true', precision='bf16', "
            "gradient_accumulation_steps=8)")
    assert f"accelerator = {call}`" in said and call in cfg["fsdp_config"]["fsdp_auto_wrap_policy"]
    assert "`accelerator.clip_grad_norm_(model.parameters(), 0.5)`" in said
    built = _settled(call)
    assert (built.builder.preset.activation_checkpointing, built.mixed, built.builder.run.accumulation) == (
        True, "bf16", 8)

    cfg, said = _export(tmp_path, capsys, "strategy=local_sgd", *CPU2, "strategy.sync_every=2")
    call = "stratagem_accelerator('local_sgd', 'strategy.sync_every=2')"
    assert said.count(f"accelerator = {call}`") == 2, said  # (what the YAML lacks, and the script's call)
    assert _settled(call).builder.preset.sync_every == 2


def test_a_users_own_preset_is_called_as_the_built_in_one_it_extends(tmp_path, capsys, two_ranks):
    """export.py --config-dir <theirs> strategy=my_zero3 (``defaults: [zero3, _self_]`` and two
    bucket sizes) crashed in ``overrides_of`` ("'my_zero3' is not a preset"): the hook composes
    presets from conf/ and cannot see the user's file, so the printed call names the built-in preset
    of its family it differs least from, with the user's keys; that call builds the exported JSON."""
    mine = tmp_path / "myconf" / "strategy"
    mine.mkdir(parents=True)
    (mine / "my_zero3.yaml").write_text("defaults: [zero3, _self_]\nname: my_zero3\n"
                                        "reduce_bucket_size: 1000000\nprefetch_bucket_size: 500000\n")
    cfg, said = _export(tmp_path, capsys, "--config-dir", str(tmp_path / "myconf"), "strategy=my_zero3", *CPU2)
    call = ("stratagem_accelerator('zero3', 'strategy.reduce_bucket_size=1000000', "
            "'strategy.prefetch_bucket_size=500000', grad_clip=1.0)")
    assert f"accelerator = {call}`" in said, said
    path = cfg["deepspeed_config"]["deepspeed_config_file"].rsplit(JSON_NAMED, 1)[1].removesuffix(")")
    exported = json.loads(open(path).read())
    exported.pop("train_micro_batch_size_per_gpu")
    assert _engine_json(_settled(call)) == exported
