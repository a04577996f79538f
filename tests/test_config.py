"""Unit tier: composition of every config option, typed schemas, validation, registries, data order."""

from __future__ import annotations

import pytest
import yaml
from omegaconf import OmegaConf

import strategies
from recipes.config import compose
from recipes.job import validate
from strategies import ConfigError
from tests.conftest import ROOT
from tests.test_named_recipes import RECIPES

pytestmark = pytest.mark.unit

CONF = ROOT / "conf"
GROUPS = ["model", "strategy", "cluster", "backend", "data", "trainer", "callbacks", "logger",
          "experiment", "paths", "planner"]
# (the named recipes -- GPU clusters, weights at launch -- are tests/test_named_recipes.py's)
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))
           if not (g == "experiment" and p.stem in RECIPES)]


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes(group, option):
    cfg = compose([f"{group}={option}"])
    if group == "experiment":  # a `# @package _global_` delta: it changes other groups
        assert OmegaConf.to_yaml(cfg) != OmegaConf.to_yaml(compose([]))
        validate(cfg)
        return
    assert cfg[group] is not None
    if group == "strategy":
        assert cfg.strategy.name == option, "a preset's `name` must be its file name"


def test_defaults_compose_and_validate():
    job = validate(compose([]))
    assert (job.strategy.name, job.mesh.size, job.batch.accumulation) == ("single", 1, 2)


@pytest.mark.parametrize("override", ["trainer.max_stepz=3", "model.widht=3", "cluster.gpus=2",
                                      "strategy.bucket_cap=1"])
def test_unknown_key_fails_at_compose(override):
    with pytest.raises(Exception, match="not in struct|Could not override|Key .* is not"):
        compose(["strategy=ddp", override])


def test_wrong_type_fails_at_compose():
    with pytest.raises(Exception, match="max_steps"):
        compose(["trainer.max_steps=many"])


def test_unknown_strategy_lists_available():
    with pytest.raises(Exception) as e:
        compose(["strategy=zero7"])
    for name in ("ddp", "single"):
        assert name in str(e.value)


def test_batch_arithmetic_error_prints_the_arithmetic():
    cfg = compose(["strategy=ddp", "cluster.devices=2", "cluster.accelerator=cpu",
                   "trainer.global_batch_size=10", "trainer.micro_batch_size=4"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    assert "trainer.global_batch_size=10" in msg and "= 8" in msg and "10 / 8 = 1.25" in msg


def test_every_problem_is_reported_at_once():
    cfg = compose(["strategy=single", "cluster.devices=2", "trainer.precision=64",
                   "cluster.accelerator=tpu", "trainer.micro_batch_size=3"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert len(e.value.problems) >= 4, e.value.problems


def test_too_many_cpu_processes_is_explained():
    cfg = compose(["strategy=ddp", "cluster.devices=64", "cluster.accelerator=cpu",
                   "trainer.global_batch_size=64", "trainer.micro_batch_size=1"])
    with pytest.raises(ConfigError, match="cluster.devices=64 CPU processes .* cluster.oversubscribe=true"):
        validate(cfg)
    cfg.cluster.oversubscribe = True
    assert validate(cfg).mesh.size == 64


def test_gpu_requested_without_cuda_is_explained():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="cluster.accelerator=gpu but no CUDA device"):
        validate(compose(["cluster.accelerator=gpu"]))


def test_bf16_hook_refused_on_cpu_before_launch():
    cfg = compose(["strategy=ddp_bf16_compress", "cluster.devices=2", "cluster.accelerator=cpu"])
    with pytest.raises(ConfigError, match="comm_hook=bf16 needs NCCL"):
        validate(cfg)


# Presets that need CUDA (NCCL's bf16 hook, a GPU to offload from) or that the planner picks.
GPU_ONLY = {"ddp_bf16_compress", "fsdp_offload", "zero_infinity", "auto"}
# Presets of a mixture-of-experts model (the default model is dense: they refuse it by name,
# tests/test_moe.py): validated with model=gpt_moe_nano.
MOE_ONLY = {"fsdp_ep": "model=gpt_moe_nano", "zero2_ep": "model=gpt_moe_nano"}


@pytest.mark.parametrize("name", sorted(set(strategies.names()) - GPU_ONLY))
def test_every_preset_validates_with_every_other_setting_at_its_default(name):
    """The smallest world each preset's mesh accepts, nothing else set: it must validate (a
    pipeline derives its micro-batches from the default batch)."""
    problems = {}
    for devices in (1, 2, 4, 8):
        cfg = compose([f"strategy={name}", f"cluster.devices={devices}", "cluster.accelerator=cpu",
                       "cluster.oversubscribe=true", *([MOE_ONLY[name]] if name in MOE_ONLY else [])])
        try:
            validate(cfg)
            return
        except ConfigError as e:
            problems[devices] = e.problems
    pytest.fail(f"{name} validates at no world size with the default trainer: {problems}")


@pytest.mark.parametrize(("schedule", "micro", "expected"), [
    ("1f1b", 2, 4), ("gpipe", 1, 8), ("1f1b", 8, None), ("interleaved_1f1b", 2, 4),
    ("interleaved_1f1b", 4, 2), ("gpipe", 8, 1), ("1f1b", 3, None)])
def test_pipeline_microbatches_derive_from_the_batch(schedule, micro, expected):
    """global 8 on one pipeline replica of pp=2: the step's samples / micro_batch_size, when the
    schedule runs that many (1f1b: >= pp; interleaved: a multiple of pp); else a clear error."""
    cfg = compose(["strategy=pipeline", "cluster.devices=2", "cluster.accelerator=cpu",
                   "model.n_layers=4", f"strategy.schedule={schedule}",
                   "trainer.global_batch_size=8", f"trainer.micro_batch_size={micro}"])
    if expected is None:
        with pytest.raises(ConfigError, match="micro_batch_size|not divisible"):
            validate(cfg)
        return
    job = validate(cfg)
    assert job.strategy.microbatches == expected
    assert job.batch.micro_size * job.batch.chunks * job.batch.accumulation == 8


def test_pipeline_batch_error_names_every_factor():
    """3d on 8 processes with the default batch: 16 / (8 x dp 2) = 1 micro-batch, but 1f1b on 2
    stages needs 2 -- the message says so and names the micro-batch size that runs."""
    cfg = compose(["strategy=3d", "cluster.devices=8", "cluster.accelerator=cpu",
                   "cluster.oversubscribe=true"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    for part in ("global_batch_size(16)", "micro_batch_size(8)", "data-parallel size(2)",
                 "pp=2 needs 2", "trainer.micro_batch_size=1, 2 or 4"):
        assert part in msg, msg


# --- the strategy registry: YAML files, family schemas and Lightning agree ---------------------

def test_every_preset_joins_lightnings_registry_without_replacing_its_own():
    """Each preset builds from Lightning's registry under stratagem_<name>, and under its own
    name unless Lightning registers that name itself (ddp, fsdp): those stay Lightning's."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, StrategyRegistry

    from backends.lightning.preset import PresetStrategy

    for name in strategies.names():
        for key in (f"stratagem_{name}", name):
            if key == name and name in ("ddp", "fsdp"):
                continue
            built = StrategyRegistry.get(key)
            assert isinstance(built, PresetStrategy) and built.preset.name == name, (key, built)
    assert type(StrategyRegistry.get("ddp")) is DDPStrategy
    assert StrategyRegistry["fsdp"]["strategy"] is FSDPStrategy


@pytest.mark.parametrize("name", strategies.names())
def test_each_preset_resolves_to_its_family(name):
    cfg = strategies.load(name)
    assert cfg.name == name
    assert isinstance(cfg, strategies.families()[cfg.family])
    raw = yaml.safe_load((CONF / "strategy" / f"{name}.yaml").read_text())
    assert raw.get("name") == name


def test_unknown_preset_name_lists_presets():
    with pytest.raises(ConfigError, match="strategy=nope: no such strategy; the options: .*ddp"):
        strategies.load("nope")


def test_duplicate_family_is_refused():
    from dataclasses import dataclass

    from strategies.base import StrategyConfig, family

    with pytest.raises(ValueError, match="registered twice"):
        @family("ddp")
        @dataclass
        class Other(StrategyConfig):
            pass


# --- the world / mesh arithmetic -----------------------------------------------------------

def test_mesh_arithmetic_error_prints_it():
    from strategies import Mesh

    (msg,) = Mesh(nodes=1, devices=6, tp=4).problems()
    assert msg.startswith("world size 6 (cluster.nodes=1 x cluster.devices=6) is not a multiple of "
                          "strategy.tp=4, the ranks of one model replica (data-parallel degree 1.5)"), msg
    assert msg.endswith("set cluster.devices=4 or 8, or degrees whose product divides 6"), msg
    (msg,) = Mesh(nodes=2, devices=3, tp=2, pp=2).problems()
    assert "world size 6 (cluster.nodes=2 x cluster.devices=3) is not a multiple of strategy.tp=2 x " \
           "strategy.pp=2 = 4" in msg and "set cluster.devices=2 or 4" in msg, msg


# --- data order: a function of seed and global batch only -----------------------------------

@pytest.mark.parametrize(("dp", "micro"), [(1, 8), (1, 2), (2, 4), (2, 1), (4, 2), (8, 1)])
def test_union_of_ranks_is_the_global_batch(dp, micro):
    from recipes.data import GlobalBatchSampler

    def step_sets(dp, micro, steps=7):
        per_rank = [list(GlobalBatchSampler(50, global_batch=8, micro_batch=micro, dp_rank=r,
                                            dp_size=dp, seed=3, steps=steps)) for r in range(dp)]
        acc = 8 // (micro * dp)
        return [sorted(i for r in range(dp) for mb in per_rank[r][s * acc:(s + 1) * acc] for i in mb)
                for s in range(steps)]

    assert step_sets(dp, micro) == step_sets(1, 8)


def test_resumed_sampler_continues_the_stream():
    from recipes.data import GlobalBatchSampler

    kw = dict(global_batch=4, micro_batch=2, dp_rank=0, dp_size=1, seed=0, steps=6)
    full = list(GlobalBatchSampler(30, **kw))
    assert list(GlobalBatchSampler(30, start_step=4, **kw)) == full[8:]


# --- the model: exact shapes without building real weights ---------------------------------

# (model=hf reads its shape from a model directory: tests/test_hf.py checks its counts; the named
# transformers shapes, llama3_8b ..., tests/test_named_recipes.py against their model cards)
@pytest.mark.parametrize("name", [p.stem for p in sorted((CONF / "model").glob("*.yaml")) if p.stem != "hf"
                                  and OmegaConf.load(p).get("architecture", "gpt") == "gpt"])
def test_param_count_matches_a_meta_build(name):
    import torch

    from recipes.gpt import GPT

    shape = _model(name)
    with torch.device("meta"):
        model = GPT(shape)
    assert shape.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_the_first_loss_is_near_ln_vocab_tied_or_not(tied):
    """An untrained model guesses near uniformly: a tied table scaled as an embedding (N(0, 1))
    made the head's logits sqrt(dim) wide (gpt_nano's first loss 31.8, not ~5.6)."""
    import math

    import torch
    import torch.nn.functional as F

    from recipes.gpt import GPT

    shape = _model("gpt_nano")
    shape.tie_embeddings = tied
    torch.manual_seed(0)
    model = GPT(shape)
    tokens = torch.randint(shape.vocab_size, (4, shape.seq_len + 1))
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    assert abs(loss - math.log(shape.vocab_size)) < 0.3, loss


def _model(name: str):
    from recipes.config import ModelConfig

    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml")))


def test_reference_param_counts():
    counts = {n: _model(n).num_params()
              for n in ("gpt_nano", "gpt_small", "llama_7b", "llama_70b")}
    assert counts["gpt_nano"] < 1_000_000
    assert 9e6 < counts["gpt_small"] < 12e6
    assert round(counts["llama_7b"] / 1e9, 2) == 6.74
    assert round(counts["llama_70b"] / 1e9, 1) == 69.0


def test_per_combination_tweak_applies_only_to_its_pair():
    """conf/strategy_model/<strategy>_<model>.yaml is an optional, interpolated group."""
    assert compose(["strategy=zero3", "model=gpt_nano"]).strategy.param_persistence_threshold == 0
    assert compose(["strategy=zero3", "model=gpt_small"]).strategy.param_persistence_threshold == 100_000


@pytest.mark.unit
def test_resume_from_null_starts_fresh_and_passes_validation():
    from recipes.job import CONFIG, validate

    job = validate(compose(["trainer.resume_from=null"]), depth=CONFIG)
    assert job.trainer.resume_from is None
