"""A user's own Accelerate script on a preset (issue 39): tests/accelerate_user_script.py (its own
model, data and loop, as Accelerate's examples write one) plus the one-line hook
``stratagem_accelerator(preset)``, launched by ``accelerate launch --config_file <exported yaml>``
on CPU (gloo, 2 ranks). The engine is the preset's (distributed type, the prepared model's
class), each rank holds about half of the parameters, and the per-step losses and final
parameters equal the same script under Accelerate's own DDP (``Accelerator(cpu=True)``, no hook).
The exported config refuses the script without the hook (FSDP on CPU), and the hook refuses a
launcher's config for another engine; a config exported for one process runs the preset's engine
there (an fsdp2 state saved on 2 ranks loads in one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, assert_losses_close

pytestmark = pytest.mark.timeout(420)

SCRIPT = str(ROOT / "tests" / "accelerate_user_script.py")
TWO = ("model=gpt_nano", "cluster.accelerator=cpu", "cluster.devices=2", "trainer.micro_batch_size=4")
RTOL = 1e-5  # fp32 on gloo, 8 steps: zero3/SGD measured bit-equal to DDP (losses and parameters)


def _export(tmp_path, *overrides: str) -> str:
    """export.py's YAML (and JSON), written in this process (no second interpreter to start)."""
    import export

    out = tmp_path / "exported.accelerate.yaml"
    export.main([*TWO, *overrides, "export=accelerate", f"export.out={out}"])
    return str(out)


def _launch(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def _ranks(proc: subprocess.Popen, world: int = 2, said: list[str] | None = None) -> list[dict]:
    """Each rank's JSON line; ``said``: gets the launch's stderr."""
    out, err = proc.communicate(timeout=300)
    if said is not None:
        said.append(err)
    assert proc.returncode == 0, (out + err)[-4000:]
    decoder, starts = json.JSONDecoder(), [i for i in range(len(out)) if out.startswith('{"rank": ', i)]
    # (each rank's object wherever it starts: the launcher's pipe once joined two ranks' lines)
    rows = sorted((decoder.raw_decode(out, i)[0] for i in starts), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(world)), out[-2000:]
    return rows


def _ddp(optimizer: str, *args: str) -> subprocess.Popen:
    """The reference: the script without the hook, on Accelerate's own CPU DDP."""
    return _launch("--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                   "--dynamo_backend", "no", "--main_process_port", "29517", SCRIPT, "--cpu",
                   "--optimizer", optimizer, *args)


STEPS = ("--samples", str(24 * 8))  # 24 steps of 4 x 2: 14 past the ddp family's start_step (10)


@pytest.fixture(scope="module")
def ddp_sgd() -> list[dict]:
    """Accelerate's own DDP under SGD, 24 steps (the reference of the fsdp2 and ddp-family cases)."""
    return _ranks(_ddp("sgd", *STEPS))


def _assert_preset(rows: list[dict], ref: list[dict], distributed_type: str, model_type: str) -> None:
    for r in rows:
        assert (r["world"], r["distributed_type"], r["model_type"]) == (2, distributed_type, model_type)
        share = r["held_param_bytes"] / r["total_param_bytes"]
        assert 0.45 < share < 0.6, f"rank {r['rank']} holds {share:.2f} of the parameters"
    assert ref[0]["distributed_type"] == "MULTI_CPU" and ref[0]["model_type"] == "DistributedDataParallel"
    assert ref[0]["held_param_bytes"] == ref[0]["total_param_bytes"]
    assert_losses_close(ref[0]["losses"], rows[0]["losses"], rtol=RTOL)
    ours, theirs = rows[0]["params"], ref[0]["params"]
    assert ours.keys() == theirs.keys() and ours
    for k in ours:
        assert ours[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6), k


@pytest.fixture(scope="module")
def fsdp2_saved(tmp_path_factory) -> tuple[list[dict], str]:
    """fsdp2 on 2 ranks wrapping the script's ToyBlock, SGD, 24 steps, ``save_state`` after the
    last: the sharding test's run, and the state the one-process test loads."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    yaml_path = _export(tmp, "strategy=fsdp2", "export.wrap=ToyBlock")
    state = str(tmp / "state")
    return _ranks(_launch("--config_file", yaml_path, SCRIPT, "--strategy", "fsdp2", "--optimizer", "sgd",
                          *STEPS, "--save_at", "24", "--state_dir", state)), state


@pytest.mark.multiprocess
def test_fsdp2_user_script_shards_and_equals_ddp(fsdp2_saved, ddp_sgd):
    """fsdp2, wrapping the script's own block class (export.wrap=ToyBlock): FSDP2 units on the
    root and each ToyBlock, half the parameters a rank, DDP's losses and parameters under SGD."""
    rows, _ = fsdp2_saved
    _assert_preset(rows, ddp_sgd, "FSDP", "FSDPToyRegressor")
    assert rows[0]["fsdp_units"] == 3  # the root and the two ToyBlocks


@pytest.mark.multiprocess
def test_an_fsdp2_state_from_two_ranks_loads_in_one_process(tmp_path, fsdp2_saved):
    """export.py strategy=fsdp2 cluster.devices=1 under `accelerate launch`: the hook refused its
    own export ("runs FSDP, but strategy=fsdp2 runs NO"), so a state sharded on 2 ranks could not
    be loaded on one. It now runs FSDP2 in one process, as Accelerate does on a GPU, and
    ``load_state`` reads the 2 ranks' shards: the parameters are the saved run's, every one."""
    import export

    saved, state = fsdp2_saved
    one = tmp_path / "one.accelerate.yaml"
    export.main([*TWO, "cluster.devices=1", "strategy=fsdp2", "export.wrap=ToyBlock", "export=accelerate",
                 f"export.out={one}"])
    # (24 batches of 4 in one process, all skipped: nothing trains after the load)
    loaded, = _ranks(_launch("--config_file", str(one), SCRIPT, "--strategy", "fsdp2", "--optimizer", "sgd",
                             "--samples", str(4 * 24), "--resume_at", "24", "--state_dir", state), world=1)
    assert (loaded["world"], loaded["distributed_type"]) == (1, "FSDP")
    assert loaded["model_type"] == "FSDPToyRegressor" and loaded["fsdp_units"] == 3
    assert loaded["losses"] == [] and loaded["params"] == saved[0]["params"] and loaded["params"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp1_user_script_shards_and_equals_ddp(tmp_path, ddp_sgd):
    """fsdp (FSDP1) wrapping ToyBlock, half the parameters a rank, DDP's losses and parameters;
    the script's ``accelerator.get_state_dict`` (Accelerate's FSDP1 gather with offload_to_cpu)
    segfaulted rank 0 on CPU: the hook gathers with torch's own call there."""
    yaml_path = _export(tmp_path, "strategy=fsdp", "export.wrap=ToyBlock")
    rows = _ranks(_launch("--config_file", yaml_path, SCRIPT, "--strategy", "fsdp", "--optimizer", "sgd", *STEPS))
    _assert_preset(rows, ddp_sgd, "FSDP", "FullyShardedDataParallel")


# the ddp family's presets whose gradients or parameters are not plain DDP's -> the comm hook DDP
# logs (ours, backends/common/ddp_comm.py and powersgd.py, or torch's); Accelerate's enum names
# fp16 and bf16 only
DDP_HOOKED = {"ddp_int8": "int8_hook", "ddp_topk": "topk_hook", "ddp_powersgd": "powersgd_hook",
              "local_sgd": "post_localSGD_hook", "diloco": "post_localSGD_hook",
              "ddp_fp16_compress": "fp16_compress_hook"}
START = 10  # the presets' start_step / powersgd_warmup_steps: plain all-reduce before it
# local SGD and DiLoCo: steps that end on the replicas' last average (sync_every 8: the averager
# counts from start_step, DiLoCo's outer step from the step after); the others run 24 steps
LAST_AVERAGE = {"local_sgd": START + 8 + 1, "diloco": START + 8}


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset", [p if p == "ddp_int8" else pytest.param(p, marks=pytest.mark.slow)
                                    for p in DDP_HOOKED])
def test_a_ddp_family_preset_runs_its_hook_in_a_users_loop(preset, tmp_path, ddp_sgd):
    """``stratagem_accelerator(<ddp preset>)`` in a user's own loop: DDP with the preset's comm hook
    registered (it used to be plain DDP for every hook Accelerate's enum cannot name: int8, top-k,
    PowerSGD, local SGD, DiLoCo), equal to Accelerate's own DDP until start_step and not after;
    the replicas equal at the end: compression keeps them so, and local SGD and DiLoCo average
    them from the optimizer's step hooks (without those they drift apart after start_step).
    The hooks' maths are proven on train.py's path (test_ddp_efficient, test_ddp)."""
    steps = LAST_AVERAGE.get(preset, 24)
    yaml_path = _export(tmp_path, f"strategy={preset}")
    rows = _ranks(_launch("--config_file", yaml_path, SCRIPT, "--strategy", preset, "--optimizer", "sgd",
                          "--samples", str(8 * steps)))
    assert [(r["distributed_type"], r["comm_hook"]) for r in rows] == [("MULTI_CPU", DDP_HOOKED[preset])] * 2
    assert ddp_sgd[0]["comm_hook"] is None
    ours, theirs = rows[0]["losses"], ddp_sgd[0]["losses"][:steps]
    assert len(ours) == len(theirs) == steps
    warm = 0 if preset == "ddp_fp16_compress" else START
    if warm:
        assert_losses_close(theirs[:warm], ours[:warm], rtol=1e-6)
    assert_losses_close(theirs, ours, rtol=0.5)  # (still training the same model)
    assert max(abs(a - b) / abs(a) for a, b in zip(theirs[warm:], ours[warm:])) > 1e-6, (theirs, ours)
    assert rows[0]["params"] == rows[1]["params"]


CLIPPED = ("--clip", "0.1", "--accumulation", "2")  # binds at every step (norms 7-17)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["zero2", "zero3", "fsdp2"])
def test_a_users_clipping_and_accumulation_equal_ddps(preset, tmp_path):
    """The script clips with ``accelerator.clip_grad_norm_(params, 0.1)`` and accumulates 2
    micro-batches (``accelerator.accumulate``), SGD: losses and norms equal Accelerate's own DDP.
    Under ZeRO, Accelerate's clip_grad_norm_ only returns the norm (DeepSpeed clips inside its
    step at its config's value): the hook's ``grad_clip`` is that value (without it the run diverged
    to inf without a word); FSDP2 clips where the script says."""
    hook = ("--hook_clip",) if preset.startswith("zero") else ()
    yaml_path = _export(tmp_path, f"strategy={preset}")
    rows = _ranks(_launch("--config_file", yaml_path, SCRIPT, "--strategy", preset, "--optimizer", "sgd",
                          *CLIPPED, *hook))
    ref = _ranks(_ddp("sgd", *CLIPPED))
    assert len(ref[0]["norms"]) == 4 and min(ref[0]["norms"]) > 0.1  # (clipping binds every step)
    assert rows[0]["norms"] == pytest.approx(ref[0]["norms"], rel=1e-5)
    assert_losses_close(ref[0]["losses"], rows[0]["losses"], rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_zero_preset_refuses_a_clip_it_would_not_apply(tmp_path):
    """zero2 without the hook's grad_clip, the script clipping at 0.1: refused at the first
    clip_grad_norm_, naming the fix."""
    rows = _launch("--config_file", _export(tmp_path, "strategy=zero2"), SCRIPT, "--strategy", "zero2",
                   "--optimizer", "sgd", *CLIPPED)
    out, err = rows.communicate(timeout=300)
    assert rows.returncode != 0, out[-2000:]
    assert "stratagem_accelerator('zero2', grad_clip=0.1)" in err, err[-3000:]


@pytest.mark.unit
def test_the_hooks_grad_clip_is_deepspeeds_and_only_deepspeeds(monkeypatch):
    """``grad_clip`` reaches the ZeRO config's gradient_clipping; for another engine it is refused
    (clip in the loop), before any process group."""
    from backends.accelerate.user import settle
    from core.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    plugin = settle("zero2", grad_clip=0.1, accumulation=2).kwargs["deepspeed_plugin"]
    assert plugin.deepspeed_config["gradient_clipping"] == 0.1
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 2
    assert settle("zero3").kwargs["deepspeed_plugin"].deepspeed_config["gradient_clipping"] == 0.0
    with pytest.raises(ConfigError, match=r"grad_clip=0.1 is DeepSpeed's .* accelerator.clip_grad_norm_"):
        settle("fsdp2", grad_clip=0.1)


SAVE_AT = 14  # past start_step (10), before local SGD's next average (18): replicas apart


DROPOUT = ("--dropout", "0.1", "--loader_generator")
"""Dropout, and the DataLoader's own generator (README: without one the resumed masks differ)."""


def _saved_and_resumed(tmp_path, preset: str, *export: str, resume_as: str | None = None, said=None):
    """The script under ``preset`` for 24 steps, ``accelerator.save_state`` after SAVE_AT (training
    on), then again from that state (``load_state``, ``skip_first_batches``) under ``resume_as``;
    a decaying LR schedule prepared in a call of its own (``--sched``). local_sgd's script passes
    its own ``project_config`` through the hook (automatic checkpoint naming: save_state and
    load_state find the directory themselves), with dropout, and after the save scores its eval
    loop without and inside ``accelerator.rank0_replica()`` (``said``: that run's stderr); the
    others name the directory."""
    yaml_path = _export(tmp_path, f"strategy={preset}", *export)
    where = (("--project_dir", str(tmp_path), *DROPOUT) if preset == "local_sgd"
             else ("--state_dir", str(tmp_path / "state")))
    run = ("--config_file", yaml_path, SCRIPT, "--samples", str(8 * 24), "--sched", *where)
    scored = ("--eval_at", str(SAVE_AT)) if preset == "local_sgd" else ()
    straight = _ranks(_launch(*run, "--strategy", preset, "--save_at", str(SAVE_AT), *scored), said=said)
    return straight, _launch(*run, "--strategy", resume_as or preset, "--resume_at", str(SAVE_AT))


@pytest.fixture(scope="module")
def local_sgd_runs(tmp_path_factory) -> tuple[list[dict], list[dict], str, object]:
    """local_sgd's straight run (its eval loop at SAVE_AT, replicas apart), its resumed run, the
    straight run's stderr and the directory: the resume test's, the eval test's, and the DDP
    engine's LRs for the ZeRO schedule's test."""
    tmp, said = tmp_path_factory.mktemp("local_sgd"), []
    straight, resumed = _saved_and_resumed(tmp, "local_sgd", said=said)
    return straight, _ranks(resumed), said[0], tmp


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset, export", [("local_sgd", ())] + [
    pytest.param(p, e, marks=pytest.mark.slow) for p, e in (
        ("ddp_powersgd", ()), ("ddp_topk", ()), ("ddp_int8", ()), ("diloco", ()),
        ("fsdp2", ("export.wrap=ToyBlock",)), ("zero2", ()))])
def test_a_users_save_state_resumes_exactly(preset, export, tmp_path, request):
    """A user's ``accelerator.save_state`` / ``load_state`` (as Accelerate's complete_nlp_example
    checkpoints), AdamW: the resumed run's losses, LRs and every rank's parameters are the straight
    run's. The ddp family's own state on each rank (error feedback, PowerSGD's Q, local SGD's
    replicas and optimizers, DiLoCo's outer step) goes with it, one file a rank; local SGD's
    model was saved as one tensor of eight before (its averaged parameters shared one storage,
    and Accelerate's safetensors save drops all but one). local_sgd's model has dropout, and its
    DataLoader its own generator, as README says (without it the resumed losses differ). The
    schedule is prepared alone (ZeRO's was returned bare before: not saved, so restarted)."""
    if preset == "local_sgd":
        straight, resumed, _, tmp_path = request.getfixturevalue("local_sgd_runs")
    else:
        straight, resumed = _saved_and_resumed(tmp_path, preset, *export)
        resumed = _ranks(resumed)
    if preset == "local_sgd":
        assert (tmp_path / "checkpoints" / "checkpoint_0" / "stratagem_rank_state" / "rank1.pt").is_file()
        assert straight[0]["params"] != straight[1]["params"]  # (replicas apart at the end: step 24)
    for a, b in zip(straight, resumed):
        assert len(b["losses"]) == 24 - SAVE_AT
        assert b["losses"] == pytest.approx(a["losses"][SAVE_AT:], rel=1e-6, abs=0)
        assert b["lrs"] == a["lrs"][SAVE_AT:] and len(a["lrs"]) == 24
        assert b["params"].keys() == a["params"].keys()
        for k in a["params"]:
            assert b["params"][k] == pytest.approx(a["params"][k], rel=1e-6, abs=1e-7), (b["rank"], k)


SAID = "with accelerator.rank0_replica():"
"""What the hook's one warning gives as the fix, when an eval gathers each rank's own replica."""


@pytest.mark.multiprocess
def test_a_users_eval_under_local_sgd_scores_rank0s_replica_inside_the_block(local_sgd_runs):
    """local_sgd between two averagings (SAVE_AT), the script's own eval loop (per-sample MSE
    through ``gather_for_metrics``): without the block it reports a mix of the two ranks' replicas
    (rank 0's on its batches, rank 1's on the others: no model's score), and rank 0 warns once;
    inside ``accelerator.rank0_replica()`` both ranks report rank 0's replica's score on all the
    samples, and each rank's own parameters are back bit for bit after it: the resumed run, which
    loaded the state saved before the eval and scored nothing, trains as the straight run did."""
    straight, resumed, err, _ = local_sgd_runs
    own = [r["eval"]["own"] for r in straight]  # (each rank's replica on the whole eval set, alone)
    assert own[0] != pytest.approx(own[1], rel=1e-3)  # (the replicas apart there)
    for r in straight:
        assert r["eval"]["block"] == pytest.approx(own[0], rel=1e-6)
        assert r["eval"]["mixed"] != pytest.approx(own[0], rel=1e-3)
        assert r["eval"]["restored"]
    assert err.count(SAID) == 1, err[-3000:]
    # (by the eval's gather: the training loop's accelerator.gather of its loss, in train mode while
    # the replicas were apart, steps 12-14, said nothing)
    assert "accelerator.gather_for_metrics() under strategy=local_sgd on 2 processes" in err, err[-3000:]
    for a, b in zip(straight, resumed):
        assert b["losses"] == a["losses"][SAVE_AT:] and b["params"] == a["params"], b["rank"]


@pytest.mark.multiprocess
def test_a_schedule_prepared_alone_steps_and_resumes_under_zero2_as_under_ddp(tmp_path, local_sgd_runs):
    """zero2, 4 micro-batches a step, a decaying LambdaLR prepared in its own ``prepare`` call after
    the model's (Accelerate's DeepSpeed path wraps a schedule only beside the model, so it came back
    bare: stepped on every micro-batch, 0.08/0.06 where DDP's 0.09/0.08, and not saved): the hook
    wraps and registers it as Accelerate does on DDP -- the LRs per optimizer step are the DDP
    engine's (local_sgd's run: Accelerate's scheduler steps once a process per optimizer step,
    none on an accumulating micro-batch) -- and the state saved after step 1, loaded into the same
    run, trains the last two steps again as they went (losses, LRs, parameters)."""
    state = str(tmp_path / "state")
    rows = _ranks(_launch("--config_file", _export(tmp_path, "strategy=zero2"), SCRIPT, "--strategy", "zero2",
                          "--sched", "--accumulation", "4", "--samples", str(8 * 12), "--save_at", "4",
                          "--state_dir", state, "--reload"))
    ddp = local_sgd_runs[0][0]["lrs"]
    for r in rows:
        assert r["sched_type"] == "AcceleratedScheduler"
        assert r["lrs"] == ddp[:3]
        again = r["again"]
        assert again["lrs"] == r["lrs"][1:] and again["losses"] == r["losses"][4:]
        assert again["params"] == r["params"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_load_state_refuses_a_state_without_the_presets_own(tmp_path):
    """A state saved under ddp (no per-rank state), loaded under local_sgd: every rank stops with
    one error naming what is missing, before any weight loads (none waits on another)."""
    _, resumed = _saved_and_resumed(tmp_path, "ddp", resume_as="local_sgd")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode != 0, out[-2000:]
    said = "stratagem_rank_state/rank0.pt (saved without stratagem_accelerator), so it does not hold " \
           "local SGD's per-rank replicas"
    assert err.count(said) >= 2, err[-3000:]


@pytest.mark.unit
def test_the_scripts_own_accelerator_arguments_pass_through_the_hook(monkeypatch):
    """What the script gave ``Accelerator()`` goes through ``stratagem_accelerator`` (its handlers
    beside the preset's, an InitProcessGroupKwargs as the timeout); what the preset decides is
    refused with the argument to use, before any process group."""
    from datetime import timedelta

    from accelerate.utils import DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs

    from backends.accelerate.user import _yours, settle
    from core.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ddp = settle("ddp_int8").kwargs
    scaler = GradScalerKwargs(init_scale=1024)
    kwargs, rest, timeout = _yours("ddp_int8", ddp, {"log_with": "tensorboard", "project_dir": "out",
                                                     "kwargs_handlers": [scaler, InitProcessGroupKwargs(
                                                         timeout=timedelta(seconds=90))]}, None)
    assert rest == {"log_with": "tensorboard", "project_dir": "out"} and timeout == 90
    assert [type(h).__name__ for h in kwargs["kwargs_handlers"]] == ["DistributedDataParallelKwargs",
                                                                     "GradScalerKwargs"]
    assert _yours("ddp", ddp, {}, 5.0) == (ddp, {}, 5.0)
    with pytest.raises(ConfigError, match=r"decide mixed_precision; leave it out \(pass precision= for "):
        _yours("fsdp2", {}, {"mixed_precision": "bf16"}, None)
    with pytest.raises(ConfigError, match=r"DistributedDataParallelKwargs\(...\)\] under strategy=ddp_int8: "
                                          r"the preset sets its own \(.*bucket_cap_mb=25"):
        _yours("ddp_int8", ddp, {"kwargs_handlers": [DistributedDataParallelKwargs()]}, None)


@pytest.mark.unit
def test_the_presets_keys_reach_the_hook_as_on_the_command_line(monkeypatch):
    """export.py strategy=local_sgd strategy.sync_every=2 ... wrote the same YAML as without them and
    the hook built the preset's defaults (period 8): the script names the keys, as export.py says;
    a key the preset lacks or a bad value is one line."""
    from backends.accelerate.user import _second_model, settle
    from core.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    local = settle("local_sgd", overrides=("strategy.sync_every=2", "strategy.start_step=1")).builder.preset
    assert (local.sync_every, local.start_step) == (2, 1)
    plugin = settle("fsdp2", overrides=("strategy.reshard_after_forward=false",)).kwargs["fsdp_plugin"]
    assert plugin.reshard_after_forward is False
    ds = settle("zero3", overrides=("strategy.param_persistence_threshold=0",)).kwargs["deepspeed_plugin"]
    assert ds.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    with pytest.raises(ConfigError, match=r"strategy.sync_evry=2: no such key; did you mean strategy.sync_every\? "):
        settle("local_sgd", overrides=("strategy.sync_evry=2",))
    with pytest.raises(ConfigError, match=r"strategy.sync_every=0: must be >= 1"):
        settle("local_sgd", overrides=("strategy.sync_every=0",))
    with pytest.raises(ConfigError, match=r"second model under strategy=ddp_powersgd: .*PowerSGD"):
        _second_model("ddp_powersgd", settle("ddp_powersgd").builder)
    _second_model("ddp", settle("ddp").builder)  # (no hook of one model's: Accelerate's own DDP each)


@pytest.mark.unit
def test_the_deepspeed_plugin_is_named_as_accelerates(monkeypatch):
    """The Accelerate log line (``accelerate: DEEPSPEED x 2 process(es), <plugin>``) and the
    plugin's repr named our private subclass, ``_Plugin``; FSDP's say FullyShardedDataParallelPlugin."""
    from accelerate.utils import DeepSpeedPlugin

    from backends.accelerate.user import settle

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    plugin = settle("zero2").kwargs["deepspeed_plugin"]
    assert isinstance(plugin, DeepSpeedPlugin) and type(plugin).__name__ == "DeepSpeedPlugin"
    assert repr(plugin).startswith("DeepSpeedPlugin("), repr(plugin)[:80]


@pytest.mark.unit
def test_export_says_a_ddp_family_yaml_drops_its_hook(tmp_path, capsys):
    """A ddp-family YAML is Accelerate's plain multi-process DDP (no field for a comm hook or a
    sync): export.py says what a script without the hook loses, naming the hook; nothing for ddp."""
    import export

    for preset, lost in (("ddp_int8", "strategy.comm_hook=int8"), ("diloco", "strategy.sync=diloco")):
        export.main([f"strategy={preset}", *TWO, "export=accelerate", f"export.out={tmp_path / 'd.yaml'}"])
        said = capsys.readouterr().err
        assert "trains plain DDP from this file" in said and lost in said, said
        assert f"stratagem_accelerator('{preset}', gradient_accumulation_steps=2)" in said  # (TWO: 16 = 4 x 2 x 2)
    export.main(["strategy=ddp", *TWO, "export=accelerate", f"export.out={tmp_path / 'p.yaml'}"])
    assert "without the hook" not in capsys.readouterr().err
    export.main(["strategy=local_sgd", "strategy.sync_every=2", *TWO, "export=accelerate",
                 f"export.out={tmp_path / 'l.yaml'}"])
    said = capsys.readouterr().err
    assert "stratagem_accelerator('local_sgd', 'strategy.sync_every=2', gradient_accumulation_steps=2)" in said


@pytest.mark.multiprocess
@pytest.mark.slow
def test_exported_fsdp_yaml_refuses_a_script_without_the_hook(tmp_path):
    """The CPU export under `accelerate launch`, the script building its own Accelerator(cpu=True)
    (which would train DDP): it stops there, naming the hook. (Default tier: the same refusal
    in-process, test_exported_fsdp_yaml_refuses_plain_accelerate.)"""
    yaml_path = _export(tmp_path, "strategy=fsdp2")
    unhooked = _launch("--config_file", yaml_path, "--num_processes", "1", SCRIPT, "--cpu")
    out, err = unhooked.communicate(timeout=300)
    assert unhooked.returncode != 0 and not out.strip().startswith("{"), out[-2000:]
    assert "STRATAGEM_HOOK_REQUIRED" in err and "stratagem_accelerator('fsdp2', gradient_accumulation_steps=2)" in err, \
        err[-3000:]


@pytest.mark.unit
def test_exported_fsdp_yaml_refuses_plain_accelerate(tmp_path, monkeypatch):
    """What `accelerate launch` sets from the CPU export's fsdp_config, then the plugin a plain
    Accelerator() builds from it: refused, naming the hook; the hook's own plugin is not."""
    import yaml
    from accelerate.utils import FullyShardedDataParallelPlugin

    from backends.accelerate.user import _wrap

    fsdp = yaml.safe_load(open(_export(tmp_path, "strategy=fsdp2")))["fsdp_config"]
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", fsdp["fsdp_auto_wrap_policy"])
    monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", str(fsdp["fsdp_min_num_params"]))
    with pytest.raises(ValueError, match=r"Invalid auto wrap policy: STRATAGEM_HOOK_REQUIRED.*"
                                         r"stratagem_accelerator\('fsdp2', gradient_accumulation_steps=2\)"):
        FullyShardedDataParallelPlugin()
    assert _wrap(None) == fsdp["fsdp_min_num_params"] == 100_000_000  # the hook: by size


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_zero3_user_script_shards_and_equals_ddp(tmp_path, optimizer):
    yaml_path = _export(tmp_path, "strategy=zero3")
    hooked = _launch("--config_file", yaml_path, SCRIPT, "--strategy", "zero3", "--optimizer", optimizer)
    ref = _ddp(optimizer)
    _assert_preset(_ranks(hooked), _ranks(ref), "DEEPSPEED", "DeepSpeedEngine")


@pytest.mark.subprocess
def test_a_zero_preset_in_one_process_runs_deepspeeds_engine_as_the_plain_script_trains(tmp_path):
    """ZeRO-Offload on one GPU is `python script.py` with the hook: Accelerate runs DeepSpeed's
    engine in one process. The hook expected no engine there and refused it; DeepSpeed, without
    torch's env:// variables, looked for MPI. Now it trains what the plain one-process script
    trains (SGD, fp32: the same losses)."""
    def one(*args: str) -> dict:
        done = subprocess.run([sys.executable, SCRIPT, "--optimizer", "sgd", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        return json.loads(next(x for x in done.stdout.splitlines() if x.startswith('{"rank": ')))

    plain, zero = one("--cpu"), one("--strategy", "zero3_offload")
    assert (zero["world"], zero["distributed_type"], zero["model_type"]) == (1, "DEEPSPEED", "DeepSpeedEngine")
    assert_losses_close(plain["losses"], zero["losses"], rtol=RTOL)


@pytest.mark.unit
@pytest.mark.parametrize("preset, engine", [("fsdp2", "fsdp2"), ("fsdp", "fsdp1"), ("zero2", "deepspeed")])
def test_the_hook_takes_a_one_process_export_of_its_preset(tmp_path, monkeypatch, preset, engine):
    """export.py at cluster.devices=1 writes the preset's engine (FSDP, DEEPSPEED), which
    Accelerate runs in one process too; the hook refused the FSDP one ("runs FSDP, but
    strategy=fsdp2 runs NO: export this preset's config", the file it was given). It now runs the
    preset's engine there, as `accelerate launch` sets the file's variables (torchrun's
    LOCAL_RANK: the FSDP launch); without a launcher one process still wraps nothing."""
    import yaml

    from backends.accelerate.state import expected_type
    from backends.accelerate.user import LAUNCHED, _engine, settle

    import export

    out = tmp_path / "one.accelerate.yaml"
    export.main([*TWO, "cluster.devices=1", f"strategy={preset}", "export=accelerate", f"export.out={out}"])
    config = yaml.safe_load(out.read_text())
    kind = "DEEPSPEED" if engine == "deepspeed" else "FSDP"
    assert (config["num_processes"], config["distributed_type"]) == (1, kind)
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.setenv(key, "1" if "WORLD" in key else "0")
    monkeypatch.setenv(LAUNCHED[kind], "true")
    s = settle(preset)
    assert (expected_type(s.kwargs, s.world, s.on_cpu), _engine(s.kwargs, s.world)) == (kind, engine)
    for key in ("LOCAL_RANK", "RANK", LAUNCHED[kind]):  # `python script.py`
        monkeypatch.delenv(key)
    s = settle(preset)
    assert _engine(s.kwargs, s.world) == ("deepspeed" if engine == "deepspeed" else "plain")


@pytest.mark.unit
def test_hook_refuses_a_launchers_config_for_another_engine(monkeypatch):
    """A ZeRO export launched with the fsdp2 hook: refused before any process group."""
    from backends.accelerate import stratagem_accelerator
    from core.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match=r"runs DEEPSPEED .* but strategy=fsdp2 runs FSDP"):
        stratagem_accelerator("fsdp2")


@pytest.mark.unit
def test_the_public_hook_takes_the_presets_keys(monkeypatch):
    """``from backends.accelerate import stratagem_accelerator; stratagem_accelerator('local_sgd',
    'strategy.sync_every=2')``, the call README shows and export.py prints, raised TypeError (the
    package's wrapper took no positional keys): they reach the preset now -- a bad value is the
    preset's own line, a good one passes on to the next check (here: a launcher's config for
    another engine, which stops it before any process group)."""
    from backends.accelerate import stratagem_accelerator
    from core.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"strategy.sync_every=0: must be >= 1"):
        stratagem_accelerator("local_sgd", "strategy.sync_every=0")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match=r"runs DEEPSPEED .* but strategy=local_sgd runs"):
        stratagem_accelerator("local_sgd", "strategy.sync_every=2")


@pytest.mark.unit
@pytest.mark.parametrize("wrap, policy", [(None, "SIZE_BASED_WRAP"), ("Block", "TRANSFORMER_BASED_WRAP")])
def test_exported_wrap_fits_any_model(wrap, policy):
    """A GPU export is Accelerate's own config: wrap by size unless export.wrap names the class
    (never our Block unasked); a CPU export's policy is the hook's refusal."""
    from backends.accelerate.export import accelerate_config
    from recipes.compose import compose
    from recipes.job import RUN, validate

    extra = [f"export.wrap={wrap}"] if wrap else []
    job = validate(compose(["strategy=fsdp2", "cluster=node_8x_h100", "export=accelerate", *extra]), depth=RUN)
    fsdp = accelerate_config(job)["fsdp_config"]
    assert fsdp["fsdp_auto_wrap_policy"] == policy
    assert fsdp.get("fsdp_transformer_layer_cls_to_wrap") == wrap
    assert ("fsdp_min_num_params" in fsdp) == (wrap is None)
    cpu = validate(compose(["strategy=fsdp2", *TWO, "export=accelerate"]), depth=RUN)
    assert accelerate_config(cpu)["fsdp_config"]["fsdp_auto_wrap_policy"].startswith("STRATAGEM_HOOK_REQUIRED")


PARTITIONED = """
from backends.accelerate import stratagem_accelerator
acc = stratagem_accelerator({preset!r})
from transformers import AutoModelForCausalLM
p = AutoModelForCausalLM.from_pretrained({path!r}).model.embed_tokens.weight
import pathlib
pathlib.Path({out!r}, f"rank{{acc.process_index}}").write_text(str(p.numel() == 0 and getattr(p, "ds_numel", 0) > 0))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset, partitioned", [("zero3", True), ("zero2", False)])
def test_a_scripts_from_pretrained_builds_partitioned_under_zero3(tmp_path, preset, partitioned):
    """After the hook's Accelerator, a script's from_pretrained builds under zero.Init at ZeRO-3
    (transformers' hook, as Accelerate's zero3_init_flag does), whole below it. (train.py keeps
    that hook off: it partitions the model itself.)"""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    script = tmp_path / "script.py"
    script.write_text(PARTITIONED.format(preset=preset, path=str(tmp_path / "llama"), out=str(tmp_path)))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--standalone", str(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    # (each rank's answer in its own file: the ranks' stdout lines interleave)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [str(partitioned)] * 2
