"""The Accelerate backend (backends/accelerate/): every preset that runs on CPU trains the same
run as the Lightning backend -- the same per-step losses and final parameters as the
single-process reference (1e-5 relative, fp32, AdamW and SGD), the same bytes held per rank --
and the engine really is what the preset says (distributed type, wrapped module). Plus the
exported native configs run under their own tools (checkpoints: tests/test_checkpoint.py), and the presets
Accelerate cannot run are refused before launch, naming the backend that can.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cases import CASES, on_accelerate
from tests.conftest import (EQUIV, OPTIMIZERS, ROOT, TINY, assert_losses_close, assert_params_close,
                            engines_loaded)

pytestmark = pytest.mark.timeout(900)

TWO = ("cluster.devices=2", "trainer.micro_batch_size=4")
ACCELERATE = on_accelerate()  # the cases Accelerate runs, with what it must build for each


@pytest.fixture(scope="module")
def both(cached):
    def get(case: str, optimizer: str):
        overrides = (*EQUIV, *CASES[case].overrides, *OPTIMIZERS[optimizer])
        return cached(*overrides, "backend=lightning"), cached(*overrides, "backend=accelerate")

    return get


# SGD exposes a gradient-scale error that AdamW divides out: run it where the scale is decided
# (each engine family, and every accumulation case); the variants of a family (compression,
# SHARD_GRAD_OP, offload) share their family's scaling and run AdamW only.
SGD_CASES = {"single", "ddp", "ddp-accumulation", "fsdp", "fsdp-accumulation", "fsdp2", "zero1",
             "zero3", "zero2-accumulation"}
# Where SGD runs, its AdamW twin adds little (AdamW hides what SGD shows): the slow tier.
# CI keeps each engine family's scaling (SGD), each accumulation path Accelerate owns (DDP's
# no_sync, DeepSpeed's boundary) and the compression hook; offload and SHARD_GRAD_OP variants,
# ZeRO-1 and FSDP's accumulation (Lightning's tests cover them), and plain DDP's SGD (its
# accumulation case keeps DDP's scaling in CI) run in the slow tier.
SLOW_CASES = {("zero2_offload", "adamw"), ("zero3_offload", "adamw"), ("fsdp_grad_op", "adamw"),
              ("zero2", "adamw"), ("fsdp-accumulation", "sgd"), ("zero1", "sgd"),
              ("zero3-accumulation", "adamw"), ("ddp", "sgd"),
              ("zero2-accumulation", "sgd"), ("fsdp", "sgd"), ("fsdp2", "sgd"), ("ddp-accumulation", "sgd"),
              ("ddp_fp16_compress", "adamw")}
# (CI keeps on Accelerate: single, zero3; ddp and fsdp2 train the same as one process there in
# tests/test_schedules.py, fsdp2 a user's script in tests/test_accelerate_user.py; the fp16 hook's
# halved payload is counted on Accelerate in tests/test_observers.py, its closeness to DDP on
# Lightning in tests/test_ddp.py; ddp_int8's hook trains a user's Accelerate script in
# tests/test_accelerate_user.py)
MATRIX = [(c, o) if not (o == "adamw" and c in SGD_CASES or (c, o) in SLOW_CASES)
          else pytest.param(c, o, marks=pytest.mark.slow)
          for c in ACCELERATE for o in OPTIMIZERS if o != "sgd" or c in SGD_CASES]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case, optimizer", MATRIX)
def test_accelerate_trains_what_lightning_trains(both, reference, case, optimizer):
    lightning, accelerate = both(case, optimizer)
    ref = reference(optimizer)
    losses, params = CASES[case].tolerance
    a = accelerate.report
    assert a["backend"] == "accelerate"
    assert (a["engine"]["distributed_type"], a["engine"]["wrapped_model"]) == CASES[case].accelerate, a["engine"]
    assert_losses_close(ref.losses, accelerate.losses, rtol=losses)
    assert_losses_close(lightning.losses, accelerate.losses, rtol=losses)
    assert_params_close(ref.params(), accelerate.params(), rtol=params)
    # the same bytes held on every rank, params, grads and optimizer state
    held = ("params", "grads", "optimizer")
    for lr, ar in zip(lightning.report["memory"]["ranks"], a["memory"]["ranks"], strict=True):
        assert {k: lr[k] for k in held} == {k: ar[k] for k in held}, (case, lr, ar)
    # and the same bytes sent (FSDP's accumulation: every micro-batch reduce-scattered on both,
    # not Accelerate's no_sync holding unsharded gradients to the boundary)
    sent = [r.report["predicted_vs_measured"]["communication"]["measured"] for r in (lightning, accelerate)]
    assert sent[1] == pytest.approx(sent[0], rel=0.01), (case, sent)
    # the data's build is the start-up's data phase on both (it was model_build on Lightning,
    # first_step on Accelerate)
    assert all(r.report["startup"]["seconds"]["data"] > 0 for r in (lightning, accelerate)), case
    # the device the torch optimizer steps on (it was None under ZeRO-3, which hands its fp32
    # partitions to the torch optimizer only inside its step)
    assert lightning.report["optimizer"]["device"] == a["optimizer"]["device"] == "cpu", (case, a["optimizer"])


@pytest.mark.subprocess
def test_presets_accelerate_cannot_run_are_refused_naming_the_backend_that_can(train):
    run = train("backend=accelerate", "strategy=fsdp_hybrid", "cluster.devices=2", check=False)
    assert run.proc.returncode == 2, run.log[-3000:]
    assert "not supported by backend=accelerate" in run.log and "backend=lightning runs it" in run.log
    assert "Initializing distributed" not in run.log


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["tp", "pipeline"])
def test_a_preset_the_backend_cannot_run_is_one_error_whatever_planner_enforce(preset, tmp_path, capsys):
    """A backend that cannot run the preset is a configuration error, not a memory verdict: no
    "will not fit", no advice to set planner.enforce=false (which would only lead to the backend's
    refusal at launch), and --dry-run refuses it (exit 2) with or without planner.enforce."""
    import planner
    from launchers import dry_run
    from recipes.config import compose
    from recipes.job import RUN, validate
    from strategies import ConfigError

    over = ["model=gpt_nano", "backend=accelerate", f"strategy={preset}", "cluster.devices=2",
            "cluster.accelerator=cpu"]
    for enforce in ("true", "false"):
        job = validate(compose([*over, f"planner.enforce={enforce}"]), depth=RUN)
        with pytest.raises(ConfigError) as e:
            planner.check(job)
        assert "not supported by backend=accelerate" in str(e.value), str(e.value)
        assert "planner.enforce" not in str(e.value) and "will not fit" not in str(e.value), str(e.value)
        capsys.readouterr()
        code = dry_run.main([*over, f"planner.enforce={enforce}", f"hydra.run.dir={tmp_path}", "--dry-run"])
        out = capsys.readouterr().out
        assert code == 2 and "not supported by backend=accelerate" in out, (enforce, out)
        assert "would start" not in out and "planner.enforce=false to" not in out, (enforce, out)


def _export(tmp_path, *overrides: str) -> list[str]:
    proc = subprocess.run([sys.executable, str(ROOT / "export.py"), *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deprecated" not in proc.stderr, proc.stderr[-3000:]  # (the engines' noise, as in a run)
    return proc.stdout.split()


DS_PRESETS = ("zero1", "zero2", "zero2_offload", "zero3", "zero3_offload")


@pytest.fixture(scope="module")
def deepspeed_reads(tmp_path_factory) -> dict[str, list]:
    """preset -> what DeepSpeed's own config class reads from its exported JSON (stage, micro
    batch, accumulation, bf16); one DeepSpeed import for all of them."""
    paths = {}
    for preset in DS_PRESETS:
        d = tmp_path_factory.mktemp(preset)
        (path,) = _export(d, f"strategy={preset}", "cluster=node_8x_h100", "export=deepspeed")
        paths[preset] = str(d / path)
    code = ("import json, sys; from deepspeed.runtime.config import DeepSpeedConfig; "
            "cs = {p: DeepSpeedConfig(f) for p, f in json.loads(sys.argv[1]).items()}; "
            "print(json.dumps({p: [c.zero_optimization_stage, c.train_micro_batch_size_per_gpu, "
            "c.gradient_accumulation_steps, c.bfloat16_config.enabled] for p, c in cs.items()}))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(paths)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
@pytest.mark.parametrize("preset", DS_PRESETS)
def test_exported_deepspeed_json_parses(deepspeed_reads, preset):
    stage, micro, accumulation, bf16 = deepspeed_reads[preset]
    # node_8x_h100 implies bf16-mixed, micro batch 1, global 64 on 8 GPUs: accumulation 8
    assert (stage, micro, accumulation, bf16) == (int(preset[4]), 1, 8, True)


@pytest.mark.subprocess
def test_an_fsdp1_export_prints_no_deprecation(tmp_path):
    """Accelerate's FSDP1 plugin logs that sharding_strategy is deprecated each time it is built;
    a run filters it (backends/common/quiet.py), and export.py, which builds it too, now as well."""
    assert _export(tmp_path, "strategy=fsdp", "cluster=node_8x_h100", "export=accelerate")


ONE = ("cluster.devices=1", "trainer.micro_batch_size=8")


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset, world", [("fsdp2", TWO), pytest.param("zero3", TWO, marks=pytest.mark.slow),
                                           pytest.param("fsdp2", ONE, marks=pytest.mark.slow)],
                         ids=["fsdp2", "zero3", "fsdp2-one-process"])
def test_exported_accelerate_yaml_runs_under_accelerate_launch(tmp_path, reference, preset, world):
    """The exported YAML is what `accelerate launch` starts; the run trains and equals the
    single-process reference. One process: FSDP2 runs there (the state check expected no engine
    and refused the export; CI: the hook's one-process test, tests/test_accelerate_user.py)."""
    overrides = (*TINY, *EQUIV, f"strategy={preset}", *world,
                 *(("strategy.param_persistence_threshold=0",) if preset == "zero3" else ()))
    paths = _export(tmp_path, *overrides, "export=accelerate")
    yaml_path = tmp_path / paths[-1]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml_path),
           str(ROOT / "train.py"), *overrides, "backend=accelerate", f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["engine"]["distributed_type"] == ("FSDP" if preset == "fsdp2" else "DEEPSPEED")
    assert_losses_close(reference("adamw").losses, report["losses"], rtol=1e-5)


@pytest.mark.subprocess
@pytest.mark.parametrize("argv, answer", [
    (("--help",), "export=accelerate"),
    (("strategy=zero3", "cluster=node_8x_h100", "export=deepspeed"), "zero3-node_8x_h100.deepspeed.json")],
    ids=["help", "deepspeed-json"])
def test_export_imports_no_engine(tmp_path, argv, answer):
    """export.py answers --help and writes a DeepSpeed JSON without torch or an engine (the
    Accelerate YAML imports torch: its FSDP wrap policy names the model's block class)."""
    proc, loaded = engines_loaded(str(ROOT / "export.py"), *argv, cwd=tmp_path,
                                  env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert answer in proc.stdout
    assert loaded == [], f"export.py {' '.join(argv)} imported {loaded}"


@pytest.mark.subprocess
def test_export_refuses_a_bad_combination(tmp_path):
    proc = subprocess.run([sys.executable, "export.py", "strategy=fsdp", "export=deepspeed"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "export=deepspeed writes a DeepSpeed config, but strategy=fsdp" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.subprocess
def test_the_engines_import_leaves_the_first_optimizer_nothing_to_import():
    """The first torch optimizer built imports torch._dynamo (~2 s and ~75 MB cold), which
    ``import lightning`` pulls in but ``import accelerate`` did not: an Accelerate run's start-up
    charged it to model_build (checkpoint_load on a resume) and counted the modules' memory as run
    memory (peak_rss_run 2.6x Lightning's). The backend's import (``backends.get``) now has it."""
    code = ("import sys, backends\n"
            "backends.get('accelerate')\n"
            "import torch\n"
            "before = set(sys.modules)\n"
            "torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], foreach=True)\n"
            "print(sorted(set(sys.modules) - before)[:5])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout

@pytest.mark.unit
def test_export_refuses_an_out_it_cannot_write_before_writing(tmp_path, capsys):
    """export.out under a path that is not a directory, or naming a directory: a traceback
    (FileNotFoundError, IsADirectoryError), exit 1. Now one error, exit 2, nothing written."""
    import export

    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    for out, said in [
        (tmp_path / "a_file" / "x.json", f"export.out={tmp_path / 'a_file' / 'x.json'}: {tmp_path / 'a_file'} is a "
         "file, not a directory; point export.out at a file in a directory this user can write "
         "(export.out=/path/to/x.json)"),
        (tmp_path / "a_dir", f"export.out={tmp_path / 'a_dir'} is a directory, not a file: name the file to "
         f"write, e.g. export.out={tmp_path / 'a_dir' / 'zero2-local.deepspeed.json'}")]:
        with pytest.raises(SystemExit) as e:
            export.main(["strategy=zero2", "export=deepspeed", f"export.out={out}"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"  - {said}\n" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a_dir", "a_file"]


@pytest.mark.unit
def test_the_planners_backends_are_what_each_backend_runs():
    """Two statements of one fact: a backend refuses a preset before launch (its families'
    ``problems``) exactly when the preset's ``Capabilities.backends`` leaves it out, which is
    what the planner reads (it imports no backend)."""
    import backends
    import strategies
    from recipes.config import compose
    from recipes.job import CONFIG, validate

    for name in strategies.names():
        if name == "auto":
            continue
        model = "gpt_moe_nano" if name.endswith("_ep") else "gpt_nano"
        for b in ("lightning", "accelerate"):
            job = validate(compose([f"strategy={name}", f"backend={b}", f"model={model}", "cluster.devices=4",
                                    "cluster.oversubscribe=true", "cluster.accelerator=cpu",
                                    "trainer.global_batch_size=16", "trainer.micro_batch_size=1"]), depth=CONFIG)
            refused = backends.get(b).problems(job)
            assert (b in job.strategy.capabilities.backends) == (not refused), (name, b, refused)


@pytest.mark.unit
def test_on_accelerate_the_planner_recommends_only_what_accelerate_runs():
    """mixtral_8x7b on 64 H100s: the planner recommended fsdp_ep at ep=8 for backend=accelerate,
    and strategy=auto chose it, which Accelerate refuses before launch."""
    import strategies
    from planner import choose, plan_all
    from recipes.config import compose
    from recipes.job import CONFIG, validate

    over = ["model=mixtral_8x7b", "cluster=slurm_8x8_h100", "backend=accelerate"]
    report = plan_all(validate(compose(over), depth=CONFIG))
    plans = {p.strategy: p for p in report.plans}
    assert not plans["fsdp_ep"].runnable and "not supported by backend=accelerate" in plans["fsdp_ep"].problems[0]
    assert "accelerate" in strategies.load(report.recommendation.strategy).capabilities.backends
    picked, _ = choose(validate(compose([*over, "strategy=auto"]), depth=CONFIG, auto=None))
    assert picked.name == report.recommendation.strategy
    lightning = plan_all(validate(compose(over[:2]), depth=CONFIG)).recommendation
    assert lightning.strategy == "fsdp_ep"  # (what Lightning runs fastest)


@pytest.mark.unit
def test_export_of_auto_for_accelerate_picks_what_accelerate_runs(tmp_path, capsys):
    """export=accelerate strategy=auto planned for Lightning (the default backend): mixtral_8x7b
    on 64 H100s got fsdp_ep, which the accelerate export then refused. It plans for
    backend=accelerate, and a backend=lightning beside export=accelerate is refused."""
    import export

    out = tmp_path / "auto.accelerate.yaml"
    export.main(["strategy=auto", "model=mixtral_8x7b", "cluster=slurm_8x8_h100", "export=accelerate",
                 f"export.out={out}"])
    said = capsys.readouterr().err
    assert "strategy=auto chose zero3_offload" in said and "distributed_type: DEEPSPEED" in out.read_text()
    with pytest.raises(SystemExit):
        export.main(["strategy=zero2", "backend=lightning", "export=accelerate", f"export.out={out}"])
    assert "export=accelerate writes a config for backend=accelerate" in capsys.readouterr().err


@pytest.mark.subprocess
def test_export_of_auto_writes_the_preset_the_planner_picks(tmp_path):
    """llama_7b on 8 H100s does not fit replicated: strategy=auto's export wrote a plain DDP config
    (MULTI_GPU) under the name auto; it now writes the planner's pick and says why."""
    proc = subprocess.run([sys.executable, str(ROOT / "export.py"), "strategy=auto", "model=llama_7b",
                           "cluster=node_8x_h100", "export=accelerate"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "strategy=auto chose fsdp: replicated needs 154.0 GB per device" in proc.stderr
    written = tmp_path / proc.stdout.split()[-1]
    assert written.name == "fsdp-node_8x_h100.accelerate.yaml"
    assert "distributed_type: FSDP" in written.read_text()


@pytest.mark.subprocess
@pytest.mark.parametrize("preset, kind", [("ulysses", "accelerate"), ("zero3_ulysses", "deepspeed")])
def test_export_refuses_ulysses_naming_its_zero_base(tmp_path, preset, kind):
    """Ulysses is applied to the model by train.py: no native file carries it. The accelerate
    export crashed (a traceback) and the DeepSpeed one told a DeepSpeed preset to pick a zero* one."""
    proc = subprocess.run([sys.executable, str(ROOT / "export.py"), f"strategy={preset}", f"export={kind}",
                           "cluster=node_8x_h100"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    stage = 3 if preset == "zero3_ulysses" else 1
    assert (f"export={kind}: strategy={preset} adds DeepSpeed Ulysses sequence parallelism (strategy.sp=2)"
            in proc.stderr), proc.stderr
    assert f"export strategy=zero{stage} (ZeRO-{stage} alone)" in proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


@pytest.mark.subprocess
def test_exports_are_safe_at_scale(tmp_path):
    """ZeRO-3 on 8 nodes of 8 GPUs: the YAML turns on zero3_init_flag (a script's from_pretrained
    builds the model partitioned, not whole on every rank) and says, above its machine_rank: 0,
    how each node passes its own rank and node 0's address (printed too); the offload JSON pins
    host memory on a GPU cluster, not on CPU. Accelerate's own config class reads the YAML."""
    proc = subprocess.run([sys.executable, str(ROOT / "export.py"), "strategy=zero3_offload",
                           "cluster=slurm_8x8_h100", "export=accelerate"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ds_path, yaml_path = (tmp_path / p for p in proc.stdout.split())
    text = yaml_path.read_text()
    above = text.split("machine_rank: 0")[0]
    assert "--machine_rank <0..7, this node's>" in above and "--main_process_ip <node 0's address>" in above
    assert "--machine_rank <0..7, this node's>" in proc.stderr and "$SLURM_NODEID" in proc.stderr
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    cfg = load_config_from_file(str(yaml_path))
    assert isinstance(cfg, ClusterConfig)
    assert (cfg.num_machines, cfg.num_processes, cfg.machine_rank, cfg.main_process_port) == (8, 64, 0, 29500)
    assert cfg.deepspeed_config == {"deepspeed_config_file": str(ds_path.resolve()), "zero3_init_flag": True,
                                    "deepspeed_multinode_launcher": "standard"}  # (not pdsh: node_instructions)
    zero = json.loads(ds_path.read_text())["zero_optimization"]
    assert zero["offload_optimizer"]["pin_memory"] is True and zero["offload_param"]["pin_memory"] is True
    # one node, ZeRO-2, CPU: no per-node instructions, no ZeRO-3 init, nothing pinned
    proc = subprocess.run([sys.executable, str(ROOT / "export.py"), "strategy=zero2_offload", *TINY, *TWO,
                           "export=accelerate"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ds_path, yaml_path = (tmp_path / p for p in proc.stdout.split())
    cfg = load_config_from_file(str(yaml_path))
    assert cfg.num_machines == 1 and cfg.deepspeed_config["zero3_init_flag"] is False
    assert "--machine_rank" not in yaml_path.read_text() + proc.stderr
    assert json.loads(ds_path.read_text())["zero_optimization"]["offload_optimizer"]["pin_memory"] is False
