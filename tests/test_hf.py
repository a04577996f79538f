"""Hugging Face models (model=hf): shape from config.json, pretrained weights loaded into every
preset's layout, equivalence with the single-process run, LoRA, and the export back to a
directory transformers loads. No downloads: the models are tiny Llamas written here with
``save_pretrained``; the data is the bundled text (byte tokens fit the 8192-token vocabulary).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the hf extra

from recipes.config import compose, describe  # noqa: E402
from recipes.job import RUN, validate  # noqa: E402
from strategies import ConfigError  # noqa: E402
from tests.conftest import ROOT, assert_losses_close, assert_params_close, typed  # noqa: E402

# data.tokenizer=null: byte tokens of the bundled text (these models come without a tokenizer).
HF = ("model=hf", "model.seq_len=32", "data.tokenizer=null", "trainer.max_steps=3", "trainer.global_batch_size=8",
      "trainer.optimizer=sgd", "trainer.lr=0.5", "trainer.grad_clip=0", "trainer.export_params=true")
# The host-memory peak is measured as anonymous resident memory; glibc's dynamic mmap threshold
# keeps freed blocks (ZeRO-3's build frees each full tensor after partitioning it) for reuse,
# which is not memory the model holds. A fixed threshold returns them to the system.
MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
LOADED = re.compile(r"rank 0 loaded pretrained weights from \S+: (\d+) bytes read; host memory peak \+(\d+)")


def _save(out: Path, family: str = "llama", weights: bool = True, **shape) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    config = AutoConfig.for_model(family, **(base | shape))
    if not weights:
        config.save_pretrained(out)
        return out
    torch.manual_seed(7)  # weights unlike any seed-built model's
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llama_deep(tmp_path_factory) -> Path:
    """Wider blocks and a 512-token vocabulary: no tensor is more than 5% of the model (in
    ``llama`` the embedding and the head are 44% each), so what a rank holds while loading tells
    a shard from the whole model."""
    return _save(tmp_path_factory.mktemp("llama_deep"), vocab_size=512, hidden_size=256,
                 intermediate_size=512, num_hidden_layers=4)


@pytest.fixture(scope="module")
def runs(llama, tmp_path_factory):
    """runs(*overrides) -> the Run of train.py on the tiny Llama, once per module."""
    from tests.conftest import TINY, normalized, run_cli

    done = {}

    def get(*overrides: str):
        key = normalized((*TINY, *HF, f"model.path={llama}", *overrides))
        if key not in done:
            out = tmp_path_factory.mktemp("hf") / "run"
            done[key] = run_cli("train.py", *key, out=out, timeout=300, env=MEASURE_ENV)
        return done[key]

    return get


# ---------------------------------------------------------------------------------- the shape
@pytest.mark.unit
@pytest.mark.parametrize("family,extra", [("llama", {}), ("llama", {"attention_bias": True}),
                                          ("mistral", {}), ("qwen2", {})])
def test_shape_from_config_counts_every_parameter(tmp_path, family, extra):
    """The planner's parameter counts (base and LoRA) equal the built model's, from config.json
    alone (no torch import at compose time)."""
    import torch

    from recipes import training

    path = _save(tmp_path, family, weights=False, **extra)
    cfg = compose(["model=hf", f"model.path={path}", "model.seq_len=32", "model.lora.rank=4",
                   "model.lora.target_modules=[q_proj,v_proj,down_proj]"])
    shape = describe(cfg.model)
    assert shape.architecture == family and shape.dim == 128 and shape.vocab_size == 8192
    with torch.device("meta"):
        model = training.build_model(shape, 0, meta=True)
    assert sum(p.numel() for p in model.parameters()) == shape.num_params() + shape.lora_params()
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == shape.lora_params()
    sizes: dict[int, int] = {}  # (tensor for tensor: what ZeRO-3's persistence threshold sorts)
    for p in model.parameters():
        sizes[p.numel()] = sizes.get(p.numel(), 0) + 1
    assert shape.tensor_sizes() == sizes


@pytest.mark.unit
def test_lora_traffic_is_planned_from_the_adapters(tmp_path):
    """Under LoRA only the adapters' gradients exist: PowerSGD compresses the thin A (r x in) and
    B (out x r) matrices, which shrink far less than the base model's (planned 425 B, measured
    3912: the base model's fraction), and local SGD / DiLoCo average the adapters alone (planned
    143232 B a step, measured 4373: the frozen base model's all-reduce)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    from planner import plan_all
    from recipes import training
    from strategies.families.ddp import powersgd_ratio

    path = _save(tmp_path, "llama", weights=False)
    over = ["model=hf", f"model.path={path}", "model.seq_len=32", "model.lora.rank=4", "data.tokenizer=null",
            "cluster.devices=2", "cluster.accelerator=cpu", "trainer.global_batch_size=8"]
    shape = describe(compose(over).model)
    with torch.device("meta"):
        model = training.build_model(shape, 0, meta=True)
    sent = 0  # what torch's PowerSGD hook sends at rank 1: factors where they save 2x, else the tensor
    for p in (p for p in model.parameters() if p.requires_grad):
        if p.dim() < 2:
            sent += p.numel()
            continue
        rows = p.shape[0]
        worth, whole, factors = _should_compress(rows, p.numel() // rows, 1, 2)
        sent += factors if worth else whole
    assert powersgd_ratio(shape, shape.num_params(), 1) * shape.lora_params() == pytest.approx(sent, rel=1e-12)
    def plan(name: str, *extra: str):
        plans = plan_all(typed(compose([*over, f"strategy={name}", *extra]))).plans
        return next(p for p in plans if p.strategy == name)

    reduce = plan("ddp_powersgd").communication.by_collective["grad_all_reduce"].bytes
    assert reduce == pytest.approx(sent * 4, rel=1e-6)
    for name in ("local_sgd", "diloco"):
        average = plan(name, "strategy.sync_every=4").communication.by_collective["param_average_all_reduce"].bytes
        assert average == pytest.approx(shape.lora_params() * 4 / 4, rel=1e-6), name

@pytest.mark.unit
def test_seq_len_defaults_to_the_models_limit_capped(tmp_path, llama):
    """model=hf's model.seq_len: the model's max_position_embeddings, at most 2048; a longer
    window is asked for by name."""
    from recipes.hf_config import SEQ_LEN_CAP

    def seq(path: Path, *o: str) -> int:
        return compose(["cluster.accelerator=cpu", "model=hf", f"model.path={path}", *o]).model.seq_len

    limit = json.loads((llama / "config.json").read_text())["max_position_embeddings"]
    assert seq(llama) == min(limit, SEQ_LEN_CAP) and seq(llama, "model.seq_len=16") == 16
    long = tmp_path / "long"
    long.mkdir()
    cfg = json.loads((llama / "config.json").read_text()) | {"max_position_embeddings": 131072}
    (long / "config.json").write_text(json.dumps(cfg))
    assert seq(long) == SEQ_LEN_CAP == 2048


@pytest.mark.unit
def test_bad_hf_input_is_refused_before_launch(tmp_path, llama):
    def problems(*overrides: str) -> str:
        with pytest.raises(ConfigError) as e:
            validate(compose(["cluster.accelerator=cpu", *overrides]), depth=RUN)
        return str(e.value)

    assert "model=hf needs model.path" in problems("model=hf")
    missing = problems("model=hf", f"model.path={tmp_path / 'none'}")
    assert "no such directory" in missing and "1 problem" in missing, missing  # (not again as data.tokenizer)
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({"model_type": "gemma"}))
    assert "model_type 'gemma' is not supported" in problems("model=hf", f"model.path={gemma}")
    hf = ("model=hf", f"model.path={llama}", "model.seq_len=32", "data.tokenizer=null")
    assert "model.seq_len=128 exceeds" in problems(*hf[:2], "model.seq_len=128", "data.tokenizer=null")
    assert "cuts or replaces modules the built-in GPT declares" in problems(*hf, "strategy=pipeline", "cluster.devices=2")
    sp = problems(*hf, "strategy=tp", "strategy.sequence_parallel=true", "cluster.devices=2")
    assert "strategy.sequence_parallel=true with strategy=tp and model=hf" in sp  # the key, not the preset
    assert "set strategy.sequence_parallel=false" in sp and "strategy=tp," not in sp
    lora = problems(*hf, "model.lora.rank=4", "strategy=zero3", "cluster.devices=2")
    assert "LoRA runs with" in lora and "ulysses" not in lora  # (a preset model=hf refuses is no choice)
    assert "model.lora.target_modules: lm_head" in problems(*hf, "model.lora.rank=4",
                                                            "model.lora.target_modules=[lm_head]")
    assert "applies to model=hf only" in problems("model=gpt_nano", "model.lora.rank=4")
    assert "trainer.save_hf=true writes a Hugging Face directory of a model=hf run" in problems(
        "model=gpt_nano", "trainer.save_hf=true")
    assert "set trainer.save_last=true" in problems(*hf, "trainer.save_hf=true", "trainer.save_last=false")


@pytest.mark.unit
def test_tp_plans_the_whole_vocabularys_logits_of_a_hf_model(llama):
    """A model=hf run has no calibration: the closed form split its fp32 logits over tp, but
    the runnable TP presets keep the whole vocabulary's on every rank (the audit measured 1.84x
    the planned activations under tp, 1.04 under every other preset)."""
    from planner import preflight
    from tests.conftest import typed

    hf = ["cluster.accelerator=cpu", "model=hf", f"model.path={llama}", "model.seq_len=32", "data.tokenizer=null",
          "trainer.micro_batch_size=8", "trainer.global_batch_size=16", "cluster.devices=2"]
    tp = preflight(typed(compose([*hf, "strategy=tp"])))
    ddp = preflight(typed(compose([*hf, "strategy=ddp"])))
    logits = 4 * 8 * 32 * 8192  # fp32, micro x seq x vocab
    assert tp.memory.activations >= logits, (tp.memory.activations, logits)
    assert tp.memory.activations < ddp.memory.activations  # (the blocks' own still split)


def _hf_problems(*overrides: str, depth: int = RUN) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose(["cluster.accelerator=cpu", *overrides]), depth=depth)
    return str(e.value)


@pytest.mark.unit
def test_a_cached_model_id_gives_the_tokenizer_default_too(tmp_path, monkeypatch, hf_tokenizer):
    """model.path a model id in the local Hugging Face cache (HF_HUB_CACHE): data.tokenizer's
    default is the same cached snapshot, for plan.py and train.py alike."""
    import shutil

    from recipes.job import CONFIG

    snap = tmp_path / "hub" / "models--local--tiny" / "snapshots" / "abc123"
    _save(snap, weights=False)
    for f in hf_tokenizer.iterdir():
        shutil.copy2(f, snap / f.name)
    (tmp_path / "hub" / "models--local--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--local--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "In the beginning"}) + "\n")
    cfg = ["cluster.accelerator=cpu", "model=hf", "model.path=local/tiny", "model.seq_len=32", "data=jsonl",
           f"data.path={data}"]
    for depth in (CONFIG, RUN):
        job = validate(compose(cfg), depth=depth)
        assert job.model.n_layers == 2 and job.data.tokenizer == str(snap), job.data.tokenizer


@pytest.mark.unit
def test_a_shape_override_on_model_hf_is_refused(llama):
    """model=hf builds the model from config.json: a shape key set to another value would be
    planned and reported but not built, so it is refused (plan.py too), naming both values."""
    from recipes.job import CONFIG

    hf = ("model=hf", f"model.path={llama}", "model.seq_len=32", "data.tokenizer=null")
    msg = _hf_problems(*hf, "model.n_layers=8", "model.dim=256", depth=CONFIG)
    assert "model.n_layers=8 (config.json: 2)" in msg and "model.dim=256 (config.json: 128)" in msg, msg
    assert "1 problem" in msg and "remove" in msg and "edit" in msg and str(llama) in msg, msg
    validate(compose(["cluster.accelerator=cpu", *hf, "model.n_layers=2"]), depth=RUN)  # (the same: no change)


@pytest.mark.unit
def test_model_dropout_on_a_transformers_model_is_refused_and_config_json_gives_attention_dropout(
        llama, tmp_path):
    """model.dropout (the built-in GPT's attention, residual and embedding dropout) was accepted
    for model=hf and built nothing: transformers' Llama/Mistral/Qwen2 have attention dropout
    only, from config.json. Refused at every depth, naming the key, the value and config.json's
    field; that field is what the build applies (two training forwards differ, eval ones not)."""
    import torch

    from recipes.hf import HFCausalLM
    from recipes.job import CONFIG

    hf = ("model=hf", f"model.path={llama}", "model.seq_len=32", "data.tokenizer=null")
    for depth in (CONFIG, RUN):
        msg = _hf_problems(*hf, "model.dropout=0.3", depth=depth)
        assert "model.dropout=0.3 with model=hf" in msg and "1 problem" in msg, msg
        assert '"attention_dropout": 0.3 in config.json' in msg and "model.dropout=0" in msg, msg
    named = _hf_problems("model=llama3_1b", f"model.path={llama}", "model.dropout=0.1", depth=CONFIG)
    assert "model.dropout=0.1 with model=llama3_1b" in named, named
    validate(compose(["cluster.accelerator=cpu", *hf, "model.dropout=0"]), depth=RUN)
    dropping = _save(tmp_path / "dropping", weights=False, attention_dropout=0.5)
    model = HFCausalLM(describe(compose([*hf[:-3], f"model.path={dropping}", "model.seq_len=32",
                                         "model.pretrained=false"]).model))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert not torch.equal(model(tokens), model(tokens))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))


@pytest.mark.unit
def test_a_tokenizer_past_an_hf_models_vocabulary_advises_what_works(tmp_path, hf_tokenizer):
    """model=hf's vocabulary is config.json's: the advice is the model's own tokenizer (or a
    model whose vocabulary covers it), not model.vocab_size; the same for shards' ids, before
    launch and where the data is read."""
    import numpy as np

    from core.errors import DataError
    from recipes.config import DataConfig
    from recipes.data import build_datasets
    from recipes.job import CONFIG

    small = _save(tmp_path / "small", weights=False, vocab_size=256)
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "In the beginning"}) + "\n")
    msg = _hf_problems("model=hf", f"model.path={small}", "model.seq_len=32", "data=jsonl", f"data.path={data}",
                       f"data.tokenizer={hf_tokenizer}")
    assert "has 512 token ids" in msg and "set model.vocab_size" not in msg, msg
    assert "the model's own tokenizer" in msg and "vocabulary covers" in msg, msg
    (tmp_path / "s").mkdir()  # the same for pre-tokenized shards, before launch and when read
    np.array([5, 300, 7, 9] * 10, dtype=np.uint16).tofile(tmp_path / "s" / "000.bin")
    shards = ("model=hf", f"model.path={small}", "model.seq_len=8", "data=tokens", f"data.path={tmp_path / 's'}",
              f"data.cache_dir={tmp_path / 'c'}")
    msg = _hf_problems(*shards)
    assert "holds token id 300 but the model's vocabulary (config.json's vocab_size) is 256" in msg, msg
    assert "set model.vocab_size" not in msg and "vocabulary covers 301 ids" in msg, msg
    job = validate(compose(["cluster.accelerator=cpu", *shards[:3], "data.tokenizer=null"]), depth=CONFIG)
    data = DataConfig(name="tokens", path=str(tmp_path / "s"), cache_dir=str(tmp_path / "c2"))
    with pytest.raises(DataError, match="config.json's vocab_size\\) is 256") as e:
        build_datasets(data, job.model, 0)
    assert "set model.vocab_size" not in str(e.value)


@pytest.mark.unit
def test_an_empty_lora_target_list_is_refused(llama):
    msg = _hf_problems("model=hf", f"model.path={llama}", "model.seq_len=32", "data.tokenizer=null",
                       "model.lora.rank=4", "model.lora.target_modules=[]")
    assert "model.lora.target_modules=[]" in msg and "q_proj, k_proj, v_proj, o_proj" in msg, msg


@pytest.mark.unit
def test_lora_settings_without_a_lora_rank_are_refused(llama):
    """model.lora.alpha / dropout / target_modules set with model.lora.rank=0 (the default) were
    accepted and did nothing: a full fine-tune ran. One line each, naming the key and the fix;
    the same keys with a rank pass."""
    hf = ("model=hf", f"model.path={llama}", "model.seq_len=32", "data.tokenizer=null")
    msg = _hf_problems(*hf, "model.lora.alpha=32", "model.lora.target_modules=[q_proj]")
    assert ("model.lora.alpha=32.0 does nothing with model.lora.rank=0 (no adapters: every parameter "
            "trains): set model.lora.rank (e.g. 16, model=hf) to fine-tune with LoRA, or remove it") in msg, msg
    assert "model.lora.target_modules=['q_proj'] does nothing" in msg and "dropout" not in msg, msg
    validate(compose(["cluster.accelerator=cpu", *hf, "model.lora.rank=4", "model.lora.alpha=32",
                      "model.lora.dropout=0.1"]), depth=RUN)


@pytest.mark.unit
def test_the_tokenizer_hints_of_a_model_path_name_what_works(tmp_path, llama):
    """data=chat with model.path set: the null tokenizer's line does not say the model has no
    model.path, nor does a model directory without a tokenizer suggest byte tokens (chat has
    none); a record's bad messages read as a sentence."""
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"text": "hi"}]}) + "\n")
    chat = ("model=hf", f"model.path={llama}", "model.seq_len=32", "data=chat", f"data.path={data}")
    msg = _hf_problems(*chat, "data.tokenizer=null")
    assert "data=chat needs a tokenizer" in msg and "no model.path" not in msg, msg
    msg = _hf_problems(*chat)
    assert "has no tokenizer.json" in msg and "data.tokenizer=null" not in msg, msg
    assert "'messages' is a list holding \"{'text': 'hi'}\", which is not" in msg and "is holds" not in msg, msg


@pytest.mark.subprocess
def test_planner_trains_only_the_adapters(llama):
    """The plan of a LoRA run: gradients and optimizer state for the adapters alone (q, k, v, o
    by default: rank x (in + out) each, per layer), the frozen base's parameters held whole."""
    cmd = [sys.executable, str(ROOT / "plan.py"), "model=hf", f"model.path={llama}", "model.seq_len=32",
           "model.lora.rank=8", "cluster.accelerator=cpu", "planner.format=json", "data.tokenizer=null"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ddp = next(p for p in json.loads(done.stdout)["plans"] if p["strategy"] == "ddp")
    adapters = 2 * 8 * ((128 + 128) + (128 + 64) + (128 + 64) + (128 + 128))
    base = describe(compose(["model=hf", f"model.path={llama}", "model.seq_len=32"]).model).num_params()
    assert ddp["memory"]["grads"] == 4 * adapters
    assert ddp["memory"]["params"] == 4 * (base + adapters)


# ---------------------------------------------------------------------------- full fine-tune
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("preset", ["fsdp2", pytest.param("zero3", marks=pytest.mark.slow)])
def test_pretrained_weights_train_equally_under_sharded_presets(runs, llama_deep, preset):
    """Loaded into whole parameters (single, then split by TP), FSDP2 shards (meta build: each
    rank reads only its rows) and ZeRO-3 partitions (zero.Init: one tensor at a time): the first loss equals
    transformers' own model on the same batch, and every step and final parameter equals the
    single-process run's (SGD: a wrong weight or gradient scale shows). On ``llama`` a rank's
    half plus one 4 MB embedding held came to the whole model (9.59 of 9.57 MB, once in CI).
    CI keeps FSDP2's sharded meta build; ZeRO-3's zero.Init load is the slow tier's."""
    deep = f"model.path={llama_deep}"
    single = runs("strategy=single", "trainer.micro_batch_size=8", deep)
    assert single.losses[0] == pytest.approx(_first_loss(llama_deep), rel=1e-5)
    full = os.path.getsize(llama_deep / "model.safetensors")
    run = runs(f"strategy={preset}", "cluster.devices=2", "trainer.micro_batch_size=4", deep)
    assert_losses_close(single.losses, run.losses, rtol=1e-5)
    assert_params_close(single.params(), run.params(), rtol=1e-5)
    read, peak = map(int, LOADED.search(run.log).groups())
    assert peak < full, f"{preset}: rank 0's host memory grew {peak} bytes while loading a {full}-byte model"
    if preset == "fsdp2":  # rank 0 read its half of every tensor
        assert read == pytest.approx(full / 2, rel=0.05)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("other", [
    pytest.param(("strategy=tp", "trainer.micro_batch_size=8"), marks=pytest.mark.slow),
    pytest.param(("backend=accelerate", "strategy=fsdp2", "trainer.micro_batch_size=4"), marks=pytest.mark.slow),
    # a checkpoint mid-run: rank 0 alone builds the model's meta shapes for it, which under
    # Accelerate's transformers ZeRO-3 hook partitioned (a broadcast no other rank joined: abort)
    ("backend=accelerate", "strategy=zero3", "trainer.micro_batch_size=4", "trainer.checkpoint_every=2")],
    ids=["tp", "accelerate-fsdp2", "accelerate-zero3"])
def test_pretrained_weights_train_equally_under_tp_and_accelerate(runs, other):
    """Tensor parallelism from the model's declared tp_plan (q/k/v/gate/up column, o/down row),
    and the same model on the other backend, equal the single-process run."""
    single = runs("strategy=single", "trainer.micro_batch_size=8")
    run = runs(*other, "cluster.devices=2")
    assert_losses_close(single.losses, run.losses, rtol=1e-5)
    assert_params_close(single.params(), run.params(), rtol=1e-5)


def _first_loss(path: Path) -> float:
    """transformers' model from ``path`` on the first global batch of HF's data order."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from recipes.data import GlobalBatchSampler, TextDataset

    data = TextDataset(None, 32)
    order = GlobalBatchSampler(len(data), global_batch=8, micro_batch=8, dp_rank=0, dp_size=1,
                               seed=1234, steps=1)
    tokens, targets = (torch.stack(x) for x in zip(*(data[i] for i in order.global_indices(0))))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).item()


@pytest.mark.unit
def test_the_hf_export_keeps_the_source_checkpoints_dtype(tmp_path):
    """save_hf (trainer.save_hf, convert.py --to hf) wrote fp32 and config.json dtype float32
    whatever the source (a bf16 8B model exported at twice its size). It writes the source
    config.json's dtype: bf16 weights and config, the LoRA adapters merged in fp32 first (the
    trained model's logits to bf16 rounding), or kept apart in fp32 (peft's default) beside a
    bf16 base; random weights (model.pretrained=false) export fp32."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from recipes import training
    from recipes.hf import save_hf

    src = _save(tmp_path / "bf16", vocab_size=512, hidden_size=64, intermediate_size=128)
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(src)
    assert json.loads((src / "config.json").read_text())["dtype"] == "bfloat16"

    def exported(out: Path, *more: str, merge: bool = True) -> tuple[str, set, torch.nn.Module]:
        shape = describe(compose(["model=hf", f"model.path={src}", "model.seq_len=32", "model.lora.rank=4",
                                  *more]).model)
        model = training.build_model(shape, 0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)  # (trained adapters: the merge matters)
        save_hf({k: v.clone() for k, v in model.state_dict().items()}, shape, out,  # (merged in place)
                merge_lora=merge)
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        return json.loads((out / "config.json").read_text())["dtype"], dtypes, model

    dtype, dtypes, trained = exported(tmp_path / "merged")
    assert (dtype, dtypes) == ("bfloat16", {"BF16"}), (dtype, dtypes)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        want = trained.eval()(tokens)
        got = merged(input_ids=tokens).logits.float()
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)  # (bf16 weights and compute)
    dtype, dtypes, _ = exported(tmp_path / "apart", merge=False)
    assert (dtype, dtypes) == ("bfloat16", {"BF16"})
    with safe_open(str(tmp_path / "apart" / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    assert exported(tmp_path / "random", "model.pretrained=false")[:2] == ("float32", {"F32"})


# ---------------------------------------------------------------------------------- LoRA
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "trainer.checkpoint_every=3", "cluster.devices=2",
        "trainer.micro_batch_size=4")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_an_unmerged_export_loads_with_peft_and_a_moved_model_is_found(llama, tmp_path, caplog):
    """``convert.py --no-merge-lora``: <out>/adapter names its base (<out>) and its task, so
    peft's AutoPeftModelForCausalLM loads it (task_type was null: a plain PeftModel) and it gives
    the merged export's logits. A run whose model.path moved since was a traceback; it is one
    line naming ``--model-path``, which then converts. (A resume of its checkpoint with another
    model.lora.alpha or dropout -- no parameter's shape -- was silent; the launch names them.)"""
    import shutil

    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    import checkpoints
    from tests.conftest import TINY, run_cli

    source = tmp_path / "base"
    shutil.copytree(llama, source)
    run = run_cli("train.py", *TINY, *HF, f"model.path={source}", "model.lora.rank=4", out=tmp_path / "run")
    ckpt, moved = run.out / "checkpoints" / "step3", tmp_path / "moved"
    again = ("cluster.accelerator=cpu", *TINY, *HF, f"model.path={source}", "model.lora.rank=4",
             "trainer.max_steps=4", f"trainer.resume_from={ckpt}")
    with caplog.at_level("WARNING", logger="checkpoints"):
        checkpoints.for_launch(validate(compose(list(again)), depth=RUN), run.out, cleanup=False)
        assert "settings differ" not in caplog.text  # (the same settings: nothing to say)
        changed = compose([*again, "model.lora.alpha=64", "model.lora.dropout=0.1"])
        checkpoints.for_launch(validate(changed, depth=RUN), run.out, cleanup=False)
    assert ("apply from step 4 on: model.lora.alpha 16 -> 64 (the adapters' scale, alpha / rank: the run "
            "continues from other effective weights); model.lora.dropout 0 -> 0.1") in caplog.text, caplog.text
    source.rename(moved)
    convert = [sys.executable, str(ROOT / "convert.py"), str(ckpt), "--to", "hf"]
    lost = subprocess.run([*convert, "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert lost.returncode == 2 and "Traceback" not in lost.stderr, lost.stderr[-3000:]
    assert f"model.path={source}: no such directory" in lost.stderr and "--model-path" in lost.stderr
    for out, more in ((tmp_path / "merged", ()), (tmp_path / "apart", ("--no-merge-lora",))):
        done = subprocess.run([*convert, "--out", str(out), "--model-path", str(moved), *more],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    adapter = json.loads((tmp_path / "apart" / "adapter" / "adapter_config.json").read_text())
    assert (adapter["task_type"], adapter["base_model_name_or_path"]) == ("CAUSAL_LM", str(tmp_path / "apart"))
    peft_model = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "apart" / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=tokens).logits, merged(input_ids=tokens).logits,
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_lora_trains_adapters_only_equally_and_exports_merged(runs, llama, tmp_path):
    import torch
    from safetensors.torch import load_file

    ddp = runs("strategy=ddp", *LORA)
    base = load_file(str(llama / "model.safetensors"))
    params = ddp.params()
    adapters = {k for k in params if "lora_" in k}
    assert adapters and all(k.startswith("hf.") for k in params)
    for k, v in params.items():  # the base is frozen: exactly the file's weights
        if k not in adapters:
            key = k.removeprefix("hf.").replace(".base_layer", "")
            assert torch.equal(v, base[key]), k
    assert any(params[k].abs().sum() > 0 for k in adapters if "lora_B" in k)  # B starts at 0
    assert ddp.losses[-1] < ddp.losses[0]
    fsdp2 = runs("strategy=fsdp2", *LORA)
    assert_losses_close(ddp.losses, fsdp2.losses, rtol=1e-5)
    assert_params_close(ddp.params(), fsdp2.params(), rtol=1e-5)

    # The merged export loads in transformers and gives the trained model's logits.
    out = tmp_path / "export"
    ckpt = fsdp2.out / "checkpoints" / "step3"
    done = subprocess.run([sys.executable, str(ROOT / "convert.py"), str(ckpt), "--to", "hf", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    from recipes import training

    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in exported.state_dict())
    # generate() keeps its KV cache: the export carries the source's use_cache (true), not the
    # false that training builds the model with
    assert exported.config.use_cache is True and exported.generation_config.use_cache is True
    for name in ("config.json", "generation_config.json"):
        if (out / name).exists():
            assert json.loads((out / name).read_text()).get("use_cache", True) is True, name
    cfg = compose([*HF, "model=hf", f"model.path={llama}", *LORA])
    trained = training.build_model(describe(cfg.model), 0)
    trained.load_state_dict(params)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, trained(tokens), rtol=1e-4, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero", ["zero1", pytest.param("zero2", marks=pytest.mark.slow)])
def test_lora_under_zero_equals_ddp_and_its_checkpoint_converts_whole(runs, zero, tmp_path):
    """DeepSpeed's zero_to_fp32 returns only the trained parameters of a stage-1 checkpoint (it
    records frozen ones when it partitions gradients): the conversion must still give the whole
    model, base weights included, as save_hf and convert.py write it."""
    from safetensors.torch import load_file

    ddp, run = runs("strategy=ddp", *LORA), runs(f"strategy={zero}", *LORA)
    assert_losses_close(ddp.losses, run.losses, rtol=1e-5)
    assert_params_close(ddp.params(), run.params(), rtol=1e-5)
    out = tmp_path / "full.safetensors"
    done = subprocess.run([sys.executable, str(ROOT / "convert.py"), str(run.out / "checkpoints" / "step3"),
                           "--to", "full", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_params_close(ddp.params(), load_file(str(out)), rtol=1e-5)


# ------------------------------------------------------------------- the user's whole flow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_model_directory_with_its_tokenizer_fine_tunes_on_jsonl(hf_tokenizer, tmp_path):
    """What a user does: a model directory holding its tokenizer, a jsonl corpus tokenized with
    it (data.tokenizer defaults to model.path), held-out validation, then the export, which
    carries the tokenizer along."""
    import shutil

    from tests.conftest import TINY, run_cli

    model = _save(tmp_path / "model")
    for f in hf_tokenizer.iterdir():
        shutil.copy2(f, model / f.name)
    corpus = (ROOT / "recipes" / "assets" / "corpus.txt").read_text().split("\n\n")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in corpus if doc.strip()))
    run = run_cli("train.py", *TINY, *[o for o in HF if not o.startswith("data.")],
                  f"model.path={model}", "data=jsonl", f"data.path={data}",
                  f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.05", "trainer.val_every=2",
                  "trainer.checkpoint_every=3", "strategy=single", "trainer.micro_batch_size=8",
                  out=tmp_path / "run", timeout=300)
    validation = run.report["validation"]
    assert [v["step"] for v in validation] == [2, 3] and validation[-1]["loss"] < validation[0]["loss"]
    out = tmp_path / "export"
    done = subprocess.run([sys.executable, str(ROOT / "convert.py"), str(run.out / "checkpoints" / "step3"),
                           "--to", "hf", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).eos_token == "<|endoftext|>"
    again = subprocess.run([sys.executable, str(ROOT / "convert.py"), str(run.out / "checkpoints" / "step3"),
                            "--to", "hf", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 2 and "never overwrites" in again.stderr + again.stdout  # the export stays
