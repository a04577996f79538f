"""Named experiments for popular models (conf/experiment/<model>_sft|_lora.yaml, torchtune's
published hyper-parameters): each plans on its named cluster with no weights and fits, its
``--cfg job`` composes, and before launch a named shape (conf/model/llama3_8b.yaml ...) needs
model.path and a checkpoint of that very shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from recipes.config import compose
from recipes.job import CONFIG, LAUNCH, validate
from strategies import ConfigError
from tests.conftest import ROOT, run_cli

RECIPES = {  # name: (model, cluster, devices, full fine-tune or LoRA rank)
    "llama3_1b_sft": ("llama3_1b", "node_8x_h100", 4, 0),
    "llama3_1b_lora": ("llama3_1b", "node_8x_h100", 2, 64),
    "llama3_8b_sft": ("llama3_8b", "node_8x_h100", 4, 0),
    "llama3_8b_lora": ("llama3_8b", "node_8x_h100", 2, 8),
    "qwen2_5_7b_sft": ("qwen2_5_7b", "node_8x_h100", 2, 0),
    "qwen2_5_7b_lora": ("qwen2_5_7b", "node_8x_h100", 2, 8),
    "mistral_7b_sft": ("mistral_7b", "node_8x_h100", 4, 0),
    "mistral_7b_lora": ("mistral_7b", "node_8x_h100", 2, 64),
}
# The published parameter counts (model cards): the shapes are those models.
PARAMS = {"llama3_1b": 1.24e9, "llama3_8b": 8.03e9, "qwen2_5_7b": 7.62e9, "mistral_7b": 7.24e9}


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_plans_on_its_cluster_and_fits(name):
    """What ``python plan.py experiment=<name>`` does, without weights: the experiment's model,
    cluster and preset, and the planner's verdict on them: it fits."""
    from planner import preflight

    model, cluster, devices, rank = RECIPES[name]
    job = validate(compose([f"experiment={name}"]), depth=CONFIG)
    assert (job.model.name, job.cluster.name, job.cluster.devices) == (model, cluster, devices)
    assert job.model.is_hf and job.model.path is None and job.model.lora.rank == rank
    assert job.model.num_params() == pytest.approx(PARAMS[model], rel=0.01)
    assert job.trainer.precision == "bf16-mixed" and job.model.seq_len == 2048
    assert job.trainer.global_batch_size % (job.trainer.micro_batch_size * devices) == 0
    plan = preflight(job)
    assert plan.fits, plan.message()


@pytest.mark.unit
def test_every_experiment_file_is_a_named_recipe_or_a_demo():
    files = {p.stem for p in (Path(__file__).parents[1] / "conf" / "experiment").glob("*.yaml")}
    assert set(RECIPES) <= files


@pytest.mark.subprocess
def test_plan_py_and_cfg_job_on_a_recipe(tmp_path):
    """The command lines the YAML's comment gives: plan.py says it fits; --cfg job composes."""
    plan = run_cli("plan.py", "experiment=llama3_8b_lora", out=tmp_path / "plan", timeout=120)
    assert "plan: fsdp2 on node_8x_h100 (2 devices)" in plan.log and "fits with" in plan.log
    cmd = [sys.executable, str(ROOT / "train.py"), "experiment=llama3_8b_lora", "--cfg", "job"]
    job = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert job.returncode == 0, job.stderr[-3000:]
    cfg = yaml.safe_load(job.stdout)
    got = (cfg["model"]["name"], cfg["model"]["lora"]["rank"], cfg["trainer"]["global_batch_size"])
    assert got == ("llama3_8b", 8, 128)


@pytest.mark.subprocess
def test_a_named_shape_s_printed_commands_carry_model_path_and_a_dry_run_asks_for_it(tmp_path):
    """A named shape plans without weights, but trains from them: plan.py's run-it line names
    model.path (a placeholder to fill, said so), and --dry-run refuses the command without it --
    as the run itself would -- where it used to say it would start."""
    plan = run_cli("plan.py", "model=llama3_8b", "cluster=node_8x_h100", out=tmp_path / "plan", timeout=120)
    run_it = next(x for x in plan.proc.stdout.splitlines() if x.startswith("run it:"))
    assert "model.path=/path/to/llama3_8b" in run_it and "put the checkpoint's directory" in plan.proc.stdout
    dry = subprocess.run([sys.executable, str(ROOT / "train.py"), "model=llama3_8b", "cluster=node_8x_h100",
                          "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert dry.returncode == 2 and "plans without weights, but training builds the model from them" \
        in dry.stdout, dry.stdout[-3000:]
    assert "invalid       model=llama3_8b cluster=node_8x_h100" in dry.stdout  # (not "the base config")


def _config_only(out: Path, **shape) -> Path:
    """A model directory holding only config.json (no weights: model.pretrained=false), written
    as JSON: recipes/hf_config.py reads it so, and importing transformers would cost seconds."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"model_type": "llama", **shape}))
    return out


LLAMA3_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
ON_CPU = ("cluster=local", "cluster.accelerator=cpu", "cluster.devices=2", "trainer.precision=32",
          "trainer.micro_batch_size=1", "trainer.global_batch_size=8", "data.tokenizer=null",
          "planner.enforce=false")


@pytest.mark.unit
def test_a_recipe_validates_for_launch_with_a_checkpoint_of_its_shape(tmp_path):
    """train.py's validate (LAUNCH depth) takes every key of a recipe with a checkpoint of its
    shape (here its config.json, random weights); without model.path, or with another shape's
    checkpoint, it is one problem naming the key and the fix."""
    good = _config_only(tmp_path / "llama3_1b", **LLAMA3_1B)
    assert json.loads((good / "config.json").read_text())["hidden_size"] == 2048
    job = validate(compose(["experiment=llama3_1b_lora", *ON_CPU, f"model.path={good}",
                            "model.pretrained=false", "trainer.save_hf=true"]), depth=LAUNCH)
    assert job.model.lora.target_modules == ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]
    assert (job.trainer.lr, job.trainer.scheduler, job.trainer.warmup_steps) == (3e-4, "cosine", 100)

    with pytest.raises(ConfigError) as e:
        validate(compose(["experiment=llama3_1b_lora", *ON_CPU]), depth=LAUNCH)
    assert "model=llama3_1b (architecture llama) plans without weights" in str(e.value)
    assert "set model.path" in str(e.value)

    other = _config_only(tmp_path / "small", **(LLAMA3_1B | {"hidden_size": 1024, "num_hidden_layers": 4}))
    with pytest.raises(ConfigError) as e:
        validate(compose(["experiment=llama3_1b_lora", *ON_CPU, f"model.path={other}",
                          "model.pretrained=false"]), depth=LAUNCH)
    msg = str(e.value)
    assert ("the checkpoint is not this shape: dim 2048 (config.json: 1024), n_layers 16 "
            "(config.json: 4)") in msg
    assert f"model=hf model.path={other}" in msg


@pytest.mark.subprocess
@pytest.mark.slow  # a two-rank train.py run of a transformers model on CPU
@pytest.mark.timeout(600)
def test_a_recipe_trains_a_tiny_llama_through_train_py(tmp_path):
    """llama3_1b_lora's keys (FSDP2, LoRA on attention and MLP, cosine with warm-up, AdamW with
    torch's betas, decay on every adapter) run end to end: two steps of a tiny random Llama
    (model=hf, the one override a shape needs) on two CPU ranks."""
    from tests.test_hf import _save

    tiny = _save(tmp_path / "tiny")
    run = run_cli("train.py", "experiment=llama3_1b_lora", "model=hf", f"model.path={tiny}",
                  "model.seq_len=32", "data.tokenizer=null", *ON_CPU[:-1], "trainer.max_steps=2",
                  "trainer.warmup_steps=1", "callbacks.progress_bar=false", "callbacks.plots=false",
                  out=tmp_path / "run", timeout=500)
    assert len(run.report["losses"]) == 2
