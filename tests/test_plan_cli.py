"""plan.py as a user runs it: the JSON contract, the reference numbers, the 70B answer in
seconds, the messages, and ``strategy=auto`` end to end through train.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from planner import GB
from tests.conftest import ROOT, typed



def _plan_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "plan.py", *args, "callbacks=none"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.subprocess
def test_cli_json_contract(tmp_path):
    before = set(ROOT.iterdir())
    proc = _plan_cli("model=llama_7b", "cluster=node_8x_a100_80g", "planner.format=json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert set(out) >= {"model", "cluster", "world_size", "accounting", "plans",
                        "recommendation"}
    assert out["model"] == "llama_7b" and out["world_size"] == 8
    assert set(out["recommendation"]) == {"strategy", "reason", "micro_batch_size",
                                          "activation_checkpointing", "with_checkpointing", "tight"}
    for p in out["plans"]:
        assert set(p) >= {"strategy", "fits", "memory", "communication", "bubble_fraction",
                          "step_seconds", "tp", "pp", "dp", "cp", "sp", "ep"}
        assert set(p["memory"]) == {"params", "grads", "master", "optimizer", "activations",
                                    "buffers", "loss", "step", "total", "growth", "host", "nvme",
                                    "host_items"}
        items = p["memory"].pop("host_items")  # offload's host bytes by item (planner/host.py)
        assert all(isinstance(v, int) for v in [*p["memory"].values(), *items.values()])
        assert set(p["communication"]) == {"bytes_per_step", "seconds_per_step", "by_collective"}
    assert set(ROOT.iterdir()) == before  # no outputs/, .hydra/ or log file


@pytest.mark.subprocess
def test_plan_py_plans_the_clusters_paths_from_anywhere(tmp_path):
    """README: plan.py checks what the config says, not this machine. The printed run line of
    a named shape carries ``model.path=/path/to/...`` (a cluster's path), and data.tokenizer
    defaults to it: plan.py refused it (exit 2, "data.tokenizer ... does not exist"); a model=hf
    directory with only config.json likewise ("no tokenizer.json"). Config-level problems
    (data=jsonl without data.path) are still refused."""
    proc = _plan_cli("model=llama3_8b", "cluster=h200_1x", "model.path=/path/to/llama3_8b", "strategy=fsdp",
                     "data=jsonl", "data.path=/path/to/data.jsonl")
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 128}))
    proc = _plan_cli("model=hf", f"model.path={tmp_path}", "cluster=node_8x_h100", "strategy=fsdp")
    assert proc.returncode == 0, proc.stderr
    proc = _plan_cli("model=llama_1b", "cluster=node_8x_h100", "data=jsonl")
    assert proc.returncode == 2 and "data=jsonl needs data.path" in proc.stderr, proc.stderr
    proc = _plan_cli("cluster.devices=two")  # (its hint named train.py)
    assert proc.returncode == 2 and "python plan.py --help lists the keys" in proc.stderr, proc.stderr


@pytest.mark.subprocess
def test_cli_params_only_reference_numbers():
    proc = _plan_cli("planner.params=1e10", "planner.accounting=mixed16", "cluster.devices=8",
                     "trainer.global_batch_size=64",  # a batch 8 ranks can split: ddp runs
                     "planner.format=json", "strategy=ddp")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["plans"][0]
    m = plan["memory"]
    assert m["params"] + m["grads"] + m["master"] + m["optimizer"] == 160 * GB
    # mixed16 is the documents' model: the states alone, no engine buffers
    assert m["activations"] == 0 and m["buffers"] == 0 and m["loss"] == 0
    assert m["total"] == 160 * GB


@pytest.mark.subprocess
def test_cli_70b_answers_in_seconds():
    start = time.monotonic()
    proc = _plan_cli("model=llama_70b", "cluster=slurm_8x8_h100")
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 20
    assert "recommendation:" in proc.stdout and "assumptions:" in proc.stdout


@pytest.mark.subprocess
def test_cli_not_fit_message():
    proc = _plan_cli("model=llama_7b", "cluster=node_8x_a100_80g", "strategy=ddp",
                     "trainer.precision=bf16-mixed", "trainer.micro_batch_size=1",
                     "trainer.global_batch_size=8")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "does not fit on node_8x_a100_80g: needs 154.0 GB per device, has 80.0 GB" in text


@pytest.mark.subprocess
def test_nothing_runs_names_the_shared_problem_and_how_many_layouts_it_stops():
    """Three ranks and a global batch of 16 in micro-batches of 8: every layout fits in memory
    and none can run; the recommendation names the batch key and its fix, for all of them."""
    proc = _plan_cli("model=gpt_nano", "cluster.devices=3", "cluster.accelerator=cpu",
                     "trainer.global_batch_size=16", "trainer.micro_batch_size=8")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "recommendation: none -- nothing can run here: the layouts that fit in memory cannot run (" in text
    assert re.search(r"\(\w+ and \d+ more: trainer.global_batch_size=16 is not divisible by", text), text
    assert "use global_batch_size=24 or 48" in text


@pytest.mark.subprocess
def test_plan_py_prints_the_contradiction_without_a_traceback():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "plan.py", "model=gpt_nano", "planner.trainable=1000000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "planner.trainable=1,000,000 exceeds" in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_strategy_auto_runs_the_recommended_preset_and_says_why(tmp_path):
    from planner import plan_all
    from recipes.config import compose
    from tests.conftest import TINY, run_cli

    overrides = (*TINY, "trainer.max_steps=2", "cluster.devices=2", "trainer.global_batch_size=8")
    cfg = compose([*overrides, "strategy=auto"])
    expected = plan_all(typed(cfg)).recommendation.strategy
    run = run_cli("train.py", *overrides, "strategy=auto", out=tmp_path / "auto")
    r = run.report
    assert r["strategy"] == expected != "auto"
    assert r["plan"]["chosen_by"].startswith(f"strategy=auto chose {expected}: ")
    assert r["world_size"] == 2


@pytest.mark.subprocess
def test_plan_py_prints_the_command_that_runs_the_recommendation():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "plan.py", "model=llama_7b", "cluster=node_8x_h100"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("run it: "))
    assert "python train.py model=llama_7b cluster=node_8x_h100 strategy=" in line


@pytest.mark.subprocess
@pytest.mark.parametrize("cluster, start", [
    ("slurm_8x8_h100", "python train.py -m hydra/launcher=submitit_slurm model=llama_1b cluster=slurm_8x8_h100 "),
    ("k8s", "python launch.py model=llama_1b cluster=k8s "),
    ("sagemaker_p5_2node", "python launch.py model=llama_1b cluster=sagemaker_p5_2node ")])
def test_the_run_it_line_starts_the_job_as_its_launcher_does(cluster, start):
    """For a Slurm, k8s or SageMaker cluster the line said ``python train.py ...``, which train.py
    refuses there ("each of the 64 ranks is a Slurm task; submit with ..."). The Slurm line as
    printed passes train.py's own --dry-run."""
    proc = _plan_cli("model=llama_1b", f"cluster={cluster}")
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith(("run it: ", "   or: "))]
    assert lines and all(x.split(": ", 1)[1].startswith(start) for x in lines), lines
    if cluster.startswith("slurm"):
        command = lines[0].removeprefix("run it: ").split("   ")[0].split()[1:]  # (train.py -m ...)
        dry = subprocess.run([sys.executable, *command, "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert dry.returncode == 0 and "would start job 0" in dry.stdout, dry.stdout + dry.stderr


@pytest.mark.subprocess
def test_strategy_auto_prints_the_command_of_what_it_chose():
    """plan.py strategy=auto on mixtral named fsdp_ep and printed no command; the ep=8 it chose
    was on the layout line only, and ``strategy=fsdp_ep`` (ep=2) plans 3.5x slower."""
    proc = _plan_cli("model=mixtral_8x7b", "cluster=slurm_8x8_h100", "strategy=auto")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("run it: "))
    command = line.split("   ")[0]
    assert "strategy=fsdp_ep strategy.ep=8" in command and "strategy=auto" not in command, line


@pytest.mark.subprocess
def test_a_tight_recommendation_is_not_offered_as_strategy_auto():
    """qwen2_5_7b on one H200: zero3 fits with 0.6 GB free, under planner.reserve_GB, so
    strategy=auto refuses it; the run it line said "(or strategy=auto)" all the same."""
    import subprocess
    import sys

    over = ["model=qwen2_5_7b", "cluster=h200_1x"]
    proc = subprocess.run([sys.executable, "plan.py", *over], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("run it: "))
    assert "strategy=zero3" in line and "or strategy=auto" not in line, line
    assert "tight: strategy=auto refuses it" in line
    auto = subprocess.run([sys.executable, "plan.py", *over, "strategy=auto"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert auto.returncode != 0 and "no runnable preset fits with margin" in auto.stderr + auto.stdout
    assert "choose it yourself (strategy=zero3)" in auto.stderr + auto.stdout


@pytest.mark.subprocess
def test_a_strategy_key_for_the_default_preset_is_not_carried_to_another():
    """``strategy.activation_checkpointing=true`` without a preset sets the default preset only;
    the ranking plans every other preset from its file. The run it line printed it beside
    ``strategy=fsdp`` anyway: fsdp planned at 70.3 GB and 7.2 s ran with checkpointing (33.0 GB,
    9.6 s). The line now leaves it out and says why."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "plan.py", "model=llama_13b", "cluster=node_8x_h100",
                           "strategy.activation_checkpointing=true"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("run it: "))
    assert "strategy=fsdp" in line and "activation_checkpointing" not in line, line
    assert "note: strategy.activation_checkpointing=true set the default preset (single)" in proc.stdout


@pytest.mark.subprocess
def test_a_parameter_count_what_if_prints_no_command_and_a_run_refuses_it(tmp_path):
    """planner.params=1e10 ranked the presets for 10B parameters and printed 'run it: python
    train.py planner.params=1e10 ... strategy=fsdp_tp strategy.tp=8', which trains the default
    model while its check planned 10B parameters (and refused a tiny run as needing 160 GB)."""
    import subprocess
    import sys

    plan = subprocess.run([sys.executable, "plan.py", "planner.params=1e10", "cluster=node_8x_h100"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    line = next(x for x in plan.stdout.splitlines() if x.startswith("run it: "))
    assert "train.py" not in line and "name the model" in line, line
    run = subprocess.run([sys.executable, "train.py", "planner.params=1e10", "trainer.max_steps=1",
                          f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert "planner.params=1e+10: plan.py's what-if of a parameter count" in run.stdout + run.stderr


@pytest.mark.unit
def test_a_sweep_given_to_plan_py_or_export_py_is_one_line_with_the_commands_that_work():
    """plan.py and export.py take one point. A comma list got Hydra's "Ambiguous value ... add
    --multirun" advice, and -m / --multirun then Hydra's LexerNoViableAltException. Now one line:
    the key, its values, a command per value (plan.py: or the ranking of every preset, or
    train.py -m ... --dry-run, which plans every point as jobs started here)."""
    from recipes.cli import one_point

    args = ["model=gpt_nano", "strategy=ddp,fsdp2", "cluster.devices=2"]
    line = one_point(["--multirun", *args], "plan.py")
    assert line == one_point(args, "plan.py") == one_point(["-m", *args], "plan.py")
    assert line.startswith("strategy=ddp,fsdp2: plan.py plans one point, and this sweeps strategy over ddp, "
                           "fsdp2; plan each value in a command of its own: python plan.py model=gpt_nano "
                           "strategy=ddp cluster.devices=2 (then strategy=fsdp2); or leave strategy out"), line
    assert ("python train.py -m model=gpt_nano strategy=ddp,fsdp2 cluster.devices=2 --dry-run plans every "
            "point too, as jobs started on this machine") in line and "\n" not in line
    assert one_point(["-m", "model=gpt_nano"], "plan.py") == \
        "-m: plan.py plans one point and takes no -m: python plan.py model=gpt_nano"
    assert "trainer.lr over 1, 2, 3;" in one_point(["trainer.lr=range(1,4)"], "plan.py")
    exported = one_point(["strategy=zero2,zero3", "export=deepspeed"], "export.py")
    assert exported == ("strategy=zero2,zero3: export.py writes the files of one point, and this sweeps strategy "
                        "over zero2, zero3; export each value in a command of its own: python export.py "
                        "strategy=zero2 export=deepspeed (then strategy=zero3)"), exported
    for one in (args[:1], ["strategy.buckets=[1,2]"], ["trainer.lr='1,2'"], ["logger=null"], []):
        assert one_point(one, "plan.py") is None, one  # (a list, a quoted comma: one value)


@pytest.mark.subprocess
def test_plan_py_with_multirun_exits_2_with_our_line_not_hydras_lexer_error():
    proc = _plan_cli("--multirun", "model=gpt_nano", "strategy=ddp,fsdp2", "cluster.devices=2")
    assert proc.returncode == 2 and not proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.startswith("strategy=ddp,fsdp2: plan.py plans one point") and proc.stderr.count("\n") == 1
    assert "Lexer" not in proc.stderr and "Ambiguous" not in proc.stderr, proc.stderr
    launched = subprocess.run([sys.executable, "launch.py", "-m", "cluster=k8s", "strategy=ddp,fsdp2", "--dry-run"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert launched.returncode == 2 and launched.stderr.startswith("strategy=ddp,fsdp2: launch.py submits one point")
