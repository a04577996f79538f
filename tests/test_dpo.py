"""DPO (objective=dpo, data=preference): the pairs' tokens and response masks, the loss against
the DPO formula computed by hand from the policy's and the reference's log-probabilities
(label smoothing included), the refusals at validate, and through train.py: the first step's
loss is the formula on the base model's log-probs, and ddp x2 (accumulation 2 per rank)
trains the model one process trains with the whole global batch at once (SGD, AdamW); fsdp2,
zero2, the Accelerate backend and LoRA in the slow tier."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from recipes.config import compose, describe
from recipes.job import CONFIG, RUN, validate
from strategies import ConfigError
from tests.conftest import TINY, assert_losses_close, assert_params_close, run_cli

pytest.importorskip("transformers")  # the hf extra

SEQ = 32


def _pairs(n: int = 24) -> list[dict]:
    """Records of different lengths; some prompts are chat messages, some strings."""
    words = Path(__file__).parents[1].joinpath("recipes/assets/corpus.txt").read_text().split()
    out = []
    for i in range(n):
        w = words[i * 7:i * 7 + 12]
        prompt = " ".join(w[:1 + i % 2])
        if i % 3 == 1:
            prompt = [{"role": "system", "content": "brief"}, {"role": "user", "content": prompt}]
        out.append({"prompt": prompt, "chosen": " ".join(w[3:4 + i % 3]),
                    "rejected": " ".join(w[6:7 + i % 2])})
    return out


@pytest.mark.unit
def test_the_planner_plans_the_reference_pass(chat_tokenizer, tmp_path):
    """Before training every rank runs the pairs through the whole fp32 model (recipes/dpo.py
    ``reference_logps``, a micro-batch at a time): llama_70b's 282 GB on devices of 200 GB, where
    fsdp2's training itself fits, does not fit; the same job as next-token training does. (DPO
    runs on data-parallel presets only: 3d is refused, by validation and by the planner.)"""
    from planner import plan_all, preflight
    from tests.conftest import typed

    big = ("model=llama_70b", "cluster=slurm_8x8_h100", "cluster.device_memory_GB=200", "strategy=fsdp2",
           "strategy.activation_checkpointing=true",
           "trainer.micro_batch_size=1", "trainer.global_batch_size=64", "callbacks=none")
    pairs = _jsonl(tmp_path / "pairs.jsonl", _pairs(24))
    dpo = preflight(typed(compose([*big, "objective=dpo", "data=preference", f"data.path={pairs}",
                                   f"data.tokenizer={chat_tokenizer}"])))
    lm = preflight(typed(compose(list(big))))
    assert lm.fits and dpo.memory.total < 200e9 and not dpo.fits
    assert dpo.message().startswith("does not fit on slurm_8x8_h100: objective=dpo's reference pass: "
                                     "each rank runs the pairs through the whole fp32 model"), dpo.message()
    plans = {p.strategy: p for p in plan_all(typed(compose([*big, "objective=dpo", "data=preference",
                                                             f"data.path={pairs}",
                                                             f"data.tokenizer={chat_tokenizer}"]))).plans}
    assert not plans["3d"].runnable and "objective=dpo runs on data-parallel presets only" in plans["3d"].problems[0]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def chat_tokenizer(hf_tokenizer, tmp_path_factory) -> Path:
    from tests.test_chat import TEMPLATE, _with_template

    return _with_template(hf_tokenizer, tmp_path_factory.mktemp("dpo_tok"), TEMPLATE)


def _data(tmp: Path, tokenizer: Path, n: int = 24):
    from recipes.trainer_config import DataConfig

    return DataConfig(name="preference", path=str(_jsonl(tmp / "pairs.jsonl", _pairs(n))),
                      tokenizer=str(tokenizer), packing="pad")


def _shape():
    from recipes.config import describe

    return describe(compose([*TINY, "model.vocab_size=516"]).model)


@pytest.mark.unit
def test_rows_count_only_the_response_and_keep_the_pair(chat_tokenizer, tmp_path):
    """Each sample is (chosen, rejected): the rendered prompt+response, the targets counted only
    where the token lies in the response (its content and end-of-turn marker)."""
    from transformers import AutoTokenizer

    from recipes.data import IGNORE
    from recipes.dpo import preference_pairs

    pairs = preference_pairs(_data(tmp_path, chat_tokenizer), _shape())
    tok = AutoTokenizer.from_pretrained(str(chat_tokenizer))
    rec = _pairs()[4]  # (a system message in its prompt; record 1 is longer than a row: cut)
    x, y = pairs[4]
    assert x.shape == y.shape == (2, SEQ)
    for row, side in enumerate(("chosen", "rejected")):
        counted = [t for t in y[row].tolist() if t != IGNORE]
        assert tok.decode(counted) == rec[side] + "<|end|>"
        prompt = tok.apply_chat_template(rec["prompt"], tokenize=False, add_generation_prompt=True)
        assert "brief" in prompt
        assert tok.decode(x[row][:len(tok(prompt)["input_ids"])]) == prompt


def _hand_loss(model, pairs, idx, ref_model, beta, ls):
    """The DPO formula with plain torch: sums of response log-probs under both models."""
    import torch

    def logps(m, x, y):
        lp = torch.log_softmax(m(x).float(), -1)
        keep = y != -100
        picked = lp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (picked * keep).sum(-1)

    x, y = pairs.x[idx], pairs.y[idx]
    pc, pr = logps(model, x[:, 0], y[:, 0]), logps(model, x[:, 1], y[:, 1])
    with torch.no_grad():
        rc, rr = logps(ref_model, x[:, 0], y[:, 0]), logps(ref_model, x[:, 1], y[:, 1])
    z = beta * ((pc - rc) - (pr - rr))
    return (-(1 - ls) * torch.nn.functional.logsigmoid(z) - ls * torch.nn.functional.logsigmoid(-z)).mean()


@pytest.mark.unit
@pytest.mark.parametrize("ls", [0.0, 0.2])
def test_loss_is_the_dpo_formula_by_hand(chat_tokenizer, tmp_path, ls):
    """recipes/dpo.py's loss (through recipes/training.py ``loss``) on a policy moved away from
    the reference equals the formula by hand (1e-5), label smoothing included, and its gradient
    too; at the reference itself it is ln 2."""
    import torch

    from recipes import training
    from recipes.dpo import Dpo, attach_reference, preference_pairs

    shape = _shape()
    pairs = preference_pairs(_data(tmp_path, chat_tokenizer), shape)
    attach_reference(pairs, shape, 0, tmp_path, "cpu")
    assert (tmp_path / "dpo_reference.pt").is_file()
    again = preference_pairs(_data(tmp_path, chat_tokenizer), shape)
    attach_reference(again, shape, 0, tmp_path, "cpu", resumed=True)  # (a resumed run: read back)
    assert torch.equal(again.ref, pairs.ref)
    ref_model, policy = training.build_model(shape, 0).eval(), training.build_model(shape, 0)
    idx = [3, 0, 7, 5]
    batch = tuple(torch.stack([pairs[i][k] for i in idx]) for k in range(3))
    dpo = Dpo(0.5, ls)
    at_ref = training.loss(policy, batch, objective=dpo)
    assert float(at_ref.detach()) == pytest.approx(math.log(2), abs=1e-5)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = training.loss(policy, batch, objective=dpo, step=1)  # (step 1's rewards, alone)
    (g_ours,) = torch.autograd.grad(ours, [policy.lm_head.weight] if hasattr(policy, "lm_head")
                                    else [next(policy.parameters())])
    hand = _hand_loss(policy, pairs, idx, ref_model, 0.5, ls)
    (g_hand,) = torch.autograd.grad(hand, [policy.lm_head.weight] if hasattr(policy, "lm_head")
                                    else [next(policy.parameters())])
    assert abs(float(ours.detach()) - math.log(2)) > 1e-3  # (the policy moved)
    assert float(ours.detach()) == pytest.approx(float(hand.detach()), abs=1e-5)
    torch.testing.assert_close(g_ours, g_hand, rtol=1e-4, atol=1e-7)
    stats = dpo.publish()
    assert stats["pairs"] == 4 and stats["step"] == 2 and 0 <= stats["accuracy"] <= 1
    assert stats["reward_margin"] == pytest.approx(stats["chosen_reward"] - stats["rejected_reward"])


@pytest.mark.unit
def test_the_cached_reference_is_this_models_and_read_back_only_on_a_resume(chat_tokenizer, tmp_path, caplog):
    """dpo_reference.pt was keyed on the pairs alone: a fresh start in the same run directory
    with another model (the audit: another model.path, trainer.resume_from=null) read the first
    model's log-probs, and its first loss was not ln 2. A fresh start computes the reference and
    replaces the file; a resume reads it back only when it was made for this model (the built-in
    model's seed here; a transformers model's directory and weight files), else says what
    differs and computes it."""
    import torch

    from recipes.dpo import REFERENCE_FILE, attach_reference, preference_pairs, reference_key

    shape, file = _shape(), tmp_path / REFERENCE_FILE

    def reference(seed: int, resumed: bool = False) -> torch.Tensor:
        pairs = preference_pairs(_data(tmp_path, chat_tokenizer), shape)
        attach_reference(pairs, shape, seed, tmp_path, "cpu", resumed=resumed)
        return pairs.ref

    own = reference(0)
    other = reference(1)  # another (random) model, a fresh start in the same directory
    assert not torch.allclose(other, own), "read the other model's cached reference"
    assert torch.equal(reference(0), own)  # (a fresh start over the other model's file: computed)
    cached = torch.load(file, weights_only=True)
    torch.save({**cached, "ref": cached["ref"] + 1}, file)  # (so that what is read shows)
    assert torch.equal(reference(0, resumed=True), own + 1)  # a resume of this model reads it
    with caplog.at_level("WARNING", logger="recipes.dpo"):
        assert torch.equal(reference(1, resumed=True), other)  # ... of another model computes it
    assert "was made for another model or other pairs (model.seed differ)" in caplog.text, caplog.text
    assert torch.load(file, weights_only=True)["key"]["model"]["seed"] == 1

    from tests.test_chat import _chat_llama

    hf = _chat_llama(tmp_path, chat_tokenizer)
    pairs = preference_pairs(_data(tmp_path, chat_tokenizer), _shape())

    def key(path: Path, *more: str, seed: int = 0) -> dict:
        return reference_key(pairs, describe(compose(["model=hf", f"model.path={path}", *more]).model), seed)

    first = key(hf)
    assert key(hf, "model.lora.rank=4", "model.lora.alpha=8") == first  # (adapters start at the base)
    assert key(hf, seed=5) == first  # (pretrained weights: the seed decides nothing)
    assert key(hf, "model.pretrained=false", seed=5) != key(hf, "model.pretrained=false")
    (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes() + b" ")
    assert key(hf) != first  # the weights rewritten in place: another model


@pytest.mark.unit
def test_the_cached_reference_is_these_pairs_in_this_order(chat_tokenizer, tmp_path, caplog):
    """The pairs' part of the cache key was [shape, sum of x, sum of y]: a pairs.jsonl reordered
    (records 0 and 1 swapped) or with chosen and rejected swapped inside a record kept it, and a
    resume read the old reference back, each pair against another's log-probs (the audit: step 2
    loss 1.0127743, 0.0512900 against the right reference). Either edit changes the key now, the
    same records keep it, and a resume over a reordered file computes the reordered reference."""
    import torch

    from recipes.dpo import attach_reference, preference_pairs, reference_key

    shape, records = _shape(), _pairs(8)

    def pairs(name: str, recs: list[dict]):
        (tmp_path / name).mkdir(exist_ok=True)
        data = _data(tmp_path, chat_tokenizer)
        data.path = str(_jsonl(tmp_path / name / "pairs.jsonl", recs))
        return preference_pairs(data, shape)

    reordered = [records[1], records[0], *records[2:]]
    swapped = [{**records[0], "chosen": records[0]["rejected"], "rejected": records[0]["chosen"]}, *records[1:]]
    key = reference_key(pairs("a", records), shape, 0)
    assert reference_key(pairs("same", [dict(r) for r in records]), shape, 0) == key
    assert reference_key(pairs("reordered", reordered), shape, 0)["pairs"] != key["pairs"]
    assert reference_key(pairs("swapped", swapped), shape, 0)["pairs"] != key["pairs"]

    first = pairs("run", records)
    attach_reference(first, shape, 0, tmp_path / "run", "cpu")
    again = pairs("run", reordered)  # (the run's file edited, then resumed)
    with caplog.at_level("WARNING", logger="recipes.dpo"):
        attach_reference(again, shape, 0, tmp_path / "run", "cpu", resumed=True)
    assert "(the pairs' tokens differ)" in caplog.text, caplog.text
    torch.testing.assert_close(again.ref, first.ref[[1, 0, *range(2, 8)]], rtol=1e-6, atol=1e-5)


def _common(tmp: Path, tokenizer: Path, *extra: str) -> tuple[str, ...]:
    src = _jsonl(tmp / "pairs.jsonl", _pairs(24))
    return (*TINY, "model.vocab_size=516", "objective=dpo", "objective.beta=0.5", "data=preference",
            f"data.path={src}", f"data.tokenizer={tokenizer}", "trainer.max_steps=3",
            "trainer.global_batch_size=8", "trainer.optimizer=sgd", "trainer.lr=0.5",
            "trainer.grad_clip=0", "trainer.export_params=true", "callbacks=none", *extra)


@pytest.mark.unit
def test_refusals_name_the_key_and_the_fix(chat_tokenizer, tmp_path):
    common = _common(tmp_path, chat_tokenizer)
    cases = {
        ("data=text", "data.path=null"): "objective=dpo trains on preference pairs, and data=text",
        ("data.packing=concat",): "data.packing=concat: objective=dpo reads one sequence per row",
        ("trainer.loss_chunk=8",): "trainer.loss_chunk=8: objective=dpo",
        ("data.val_fraction=0.1",): "data.val_fraction / data.val_path",
        ("objective=lm",): "data=preference holds preference pairs",
        ("strategy=pipeline", "cluster.devices=2"): "strategy=pipeline: objective=dpo runs on data-parallel",
        ("strategy=tp", "cluster.devices=2"): "strategy=tp: objective=dpo runs on data-parallel",
    }
    for extra, message in cases.items():
        with pytest.raises(ConfigError) as e:
            validate(compose([*common, *extra]), depth=RUN)
        assert message in str(e.value), (extra, str(e.value))
    with pytest.raises(ConfigError, match="data=preference needs data.path"):
        validate(compose([*common, "data.path=null"]), depth=CONFIG)
    validate(compose([*common, "strategy=ddp", "cluster.devices=2", "trainer.micro_batch_size=2"]),
             depth=RUN)  # (sound)


@pytest.mark.unit
def test_keys_the_objective_or_the_data_does_not_read_are_refused(chat_tokenizer, tmp_path):
    """objective.beta / label_smoothing under objective=lm, and data.train_on / messages_field /
    field under data=preference, were accepted and did nothing (the audit: an SFT run with
    label_smoothing=0.3 trained plain cross entropy). Away from their defaults each is one line
    naming the key, its value, what reads it and the fix; at their defaults nothing is said."""
    lm = (*TINY, "model.vocab_size=516", "data=synthetic")
    dpo = _common(tmp_path, chat_tokenizer)
    cases = {
        (*lm, "objective.beta=5"): "objective.beta=5 applies to objective=dpo only; objective=lm does "
                                   "not read it: remove it, or set objective=dpo",
        (*lm, "objective.label_smoothing=0.3"): "objective.label_smoothing=0.3 applies to objective=dpo only",
        (*dpo, "data.train_on=all"): "data.train_on=all applies to data=chat only; data=preference does "
                                     "not read it",
        (*dpo, "data.messages_field=conv"): "data.messages_field=conv applies to data=chat only",
        (*dpo, "data.field=body"): "data.field=body applies to data=jsonl, parquet",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError) as e:
            validate(compose(list(overrides)), depth=CONFIG)
        assert message in str(e.value), (overrides[-1], str(e.value))
        assert len(e.value.problems) == 1, e.value.problems
    validate(compose([*lm, "objective.beta=0.1", "objective.label_smoothing=0"]), depth=CONFIG)
    validate(compose([*dpo, "data.train_on=assistant", "data.field=text"]), depth=CONFIG)


@pytest.mark.unit
def test_a_resume_names_a_changed_objective_and_train_on(chat_tokenizer, tmp_path):
    """A resume with another objective.beta / label_smoothing (DPO) or data.train_on (chat SFT:
    the audit's step 3 trained on 2016 targets, not 843) said nothing, while lora.alpha and lr
    are named. The launch warns (and --dry-run notes) each, by its values in both runs, once;
    the same values, and a key the run's objective or data does not read, say nothing."""
    from launchers.dry_run import _resume
    from tests.test_chat import _conversations
    from tests.test_chat import _jsonl as _chats
    from tests.test_checkpoint import _validated, _written

    def notes(was: tuple[str, ...], *now: str) -> list[str]:
        ckpt = _written(tmp_path / str(len(list(tmp_path.iterdir()))), *was)
        job = _validated(*was, *now, f"trainer.resume_from={ckpt}")
        return [line for line in _resume(job, job.cfg, False).splitlines()[1:] if "loss settings" in line]

    dpo = tuple(o for o in _common(tmp_path, chat_tokenizer) if o not in TINY)
    assert notes(dpo, "trainer.max_steps=4") == []
    assert notes(dpo, "objective.beta=2.0", "objective.label_smoothing=0.3") == [
        "note: resume: this run's loss settings differ from the checkpoint's run's and apply from step 4 "
        "on: objective.beta 0.5 -> 2; objective.label_smoothing 0 -> 0.3; resume with the checkpoint's "
        "values to continue it as it was"]
    chat = ("model.vocab_size=516", "data=chat", f"data.path={_chats(tmp_path / 'chats.jsonl', _conversations())}",
            f"data.tokenizer={chat_tokenizer}", "data.val_fraction=0", "trainer.max_steps=3")
    said = notes(chat, "data.train_on=all")
    assert len(said) == 1 and ("apply from step 4 on: data.train_on assistant -> all (the loss counts "
                               "every target from here on, not the assistant turns alone)") in said[0], said
    assert notes(chat, "trainer.max_steps=5") == []


@pytest.mark.unit
def test_dpo_resuming_an_sft_checkpoint_is_refused(chat_tokenizer, tmp_path):
    """An objective=lm run resumed as objective=dpo trained against the run's initial model as the
    reference, not the SFT checkpoint it continued: the loss pulled the model back toward the
    model it was trained from, with only the loss note said. Refused before launch with the way
    to DPO from it; a DPO checkpoint resumed as DPO, and an SFT one as SFT, are not."""
    import checkpoints
    from checkpoints import store
    from tests.test_checkpoint import _validated, _written

    dpo = tuple(o for o in _common(tmp_path, chat_tokenizer) if o not in TINY)
    lm = ("model.vocab_size=516", "data=synthetic", "trainer.max_steps=3", "trainer.optimizer=sgd")
    sft = _written(tmp_path / "sft", *lm)
    why = checkpoints.refusal(store.read(sft), _validated(*dpo, "trainer.max_steps=5", f"trainer.resume_from={sft}"))
    assert why and f"{sft} was trained with objective=lm; objective=dpo measures the policy against its run's " \
        "initial model (model=gpt_nano as trainer.seed=1234 initialises it)" in why and "resume with objective=lm" in why, why
    own = _written(tmp_path / "dpo", *dpo)
    assert checkpoints.refusal(store.read(own), _validated(*dpo, "trainer.max_steps=5", f"trainer.resume_from={own}")) is None
    assert checkpoints.refusal(store.read(sft), _validated(*lm, "trainer.max_steps=5", f"trainer.resume_from={sft}")) is None


@pytest.mark.unit
def test_the_planner_prices_two_rows_per_pair(chat_tokenizer, tmp_path):
    """objective=dpo's micro batch of m pairs is 2m rows: the plan's activations (and batch) are
    those of a next-token job with micro batch 2m (measured by train.py's predicted-vs-measured
    table: activations ratio 1.000 on gpt_nano, 2.000 before)."""
    from planner import plan_all
    from tests.conftest import typed

    dpo = typed(compose([*_common(tmp_path, chat_tokenizer), "trainer.micro_batch_size=4"]))
    lm = typed(compose([*TINY, "model.vocab_size=516", "trainer.global_batch_size=16",
                        "trainer.micro_batch_size=8"]))
    one = typed(compose([*TINY, "model.vocab_size=516", "trainer.global_batch_size=8",
                         "trainer.micro_batch_size=4"]))
    act = [plan_all(j, chosen=True).plans[0].memory.activations for j in (dpo, lm, one)]
    assert act[0] == act[1] > act[2]


@pytest.fixture(scope="module")
def dpo_reference_run(chat_tokenizer, tmp_path_factory):
    """(common overrides, one process with the whole global batch in one micro-batch)."""
    tmp = tmp_path_factory.mktemp("dpo")
    common = _common(tmp, chat_tokenizer)
    return common, run_cli("train.py", *common, "strategy=single", "trainer.micro_batch_size=8",
                           out=tmp / "single", timeout=300)


@pytest.mark.subprocess
@pytest.mark.timeout(400)
def test_first_step_is_the_formula_and_the_report_has_rewards(dpo_reference_run, chat_tokenizer):
    """Through train.py: the first loss equals the formula by hand on the first global batch's
    pairs (the policy is the base model: ln 2 up to rounding), the reference is cached in the
    run directory, report.json ``dpo`` holds the last step's rewards (the policy moved off the
    reference)."""
    import torch

    from recipes import training
    from recipes.data import GlobalBatchSampler
    from recipes.dpo import preference_pairs

    common, run = dpo_reference_run
    shape = _shape()
    pairs = preference_pairs(_data(run.out, chat_tokenizer), shape)
    idx = GlobalBatchSampler(len(pairs), global_batch=8, micro_batch=8, dp_rank=0, dp_size=1,
                             seed=compose(list(common)).trainer.seed, steps=1).global_indices(0)
    model = training.build_model(shape, compose(list(common)).trainer.seed)
    with torch.no_grad():
        hand = float(_hand_loss(model, pairs, idx, model, 0.5, 0.0))
    assert run.losses[0] == pytest.approx(hand, abs=1e-5)
    assert (run.out / "dpo_reference.pt").is_file()
    dpo = run.report["dpo"]
    assert set(dpo) == {"chosen_reward", "rejected_reward", "reward_margin", "accuracy", "pairs", "step"}
    assert dpo["pairs"] == 8 and dpo["step"] == 3
    assert abs(dpo["reward_margin"]) > 1e-3 and run.losses[1] != run.losses[0]  # (the policy moved)


@pytest.mark.subprocess
@pytest.mark.timeout(400)
def test_a_fresh_start_computes_the_reference_a_resume_reads_it(dpo_reference_run, tmp_path):
    """Through train.py, in a finished run's directory whose dpo_reference.pt holds other values
    (planted: its chosen log-probs + 1): a resume (resume_from=auto, step 3 -> 4) reads them back; a
    fresh start (resume_from=null) read them too, and trained against them. It computes its
    own: its first loss is the first run's, and the file holds that run's reference again."""
    import shutil

    import torch

    from recipes.dpo import REFERENCE_FILE

    common, first = dpo_reference_run
    out = tmp_path / "run"
    shutil.copytree(first.out, out)
    own = torch.load(out / REFERENCE_FILE, weights_only=True)
    planted = own["ref"].clone()
    planted[:, 0] += 1  # (the chosen responses': the loss moves)
    torch.save({**own, "ref": planted}, out / REFERENCE_FILE)
    one = ("strategy=single", "trainer.micro_batch_size=8")
    resumed = run_cli("train.py", *common, *one, "trainer.max_steps=4", out=out, timeout=300)
    assert "dpo: reference log-probs of 24 pairs read from" in resumed.log, resumed.log[-3000:]
    fresh = run_cli("train.py", *common, *one, "trainer.max_steps=1", "trainer.resume_from=null", out=out,
                    timeout=300)
    assert fresh.losses[0] == pytest.approx(first.losses[0], abs=1e-6)
    assert "dpo: reference log-probs of 24 pairs computed on cpu" in fresh.log, fresh.log[-3000:]
    assert torch.equal(torch.load(out / REFERENCE_FILE, weights_only=True)["ref"], own["ref"])


LAYOUTS = {
    "ddp": ("strategy=ddp", "cluster.devices=2", "trainer.micro_batch_size=2"),
    "ddp-adamw": ("strategy=ddp", "cluster.devices=2", "trainer.micro_batch_size=2"),
    "fsdp2": ("strategy=fsdp2", "cluster.devices=2", "trainer.micro_batch_size=2"),
    "zero2": ("strategy=zero2", "cluster.devices=2", "trainer.micro_batch_size=2"),
    "ddp-accelerate": ("strategy=ddp", "cluster.devices=2", "trainer.micro_batch_size=2",
                       "backend=accelerate"),
}
LAYOUTS_CI = ("ddp",)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [pytest.param(k, marks=[] if k in LAYOUTS_CI else [pytest.mark.slow])
                                    for k in LAYOUTS])
def test_every_data_parallel_preset_equals_one_process(dpo_reference_run, layout, tmp_path):
    """2 ranks, 2 pairs per micro-batch, accumulation 2: the same losses and final parameters as
    one process with the 8 pairs at once (SGD, 1e-5): the loss is the mean over the global
    batch's pairs whatever splits them."""
    common, ref = dpo_reference_run
    if layout.endswith("adamw"):
        adamw = ("trainer.optimizer=adamw", "trainer.lr=1e-3")
        common = (*common, *adamw)
        ref = run_cli("train.py", *common, "strategy=single", "trainer.micro_batch_size=8",
                      out=tmp_path / "single", timeout=300)
    run = run_cli("train.py", *common, *LAYOUTS[layout], out=tmp_path / layout, timeout=500)
    assert_losses_close(ref.losses, run.losses, rtol=1e-5)
    assert_params_close(ref.params(), run.params(), rtol=1e-5)
    assert run.report["dpo"]["pairs"] == 8
    assert run.report["dpo"]["reward_margin"] == pytest.approx(ref.report["dpo"]["reward_margin"],
                                                               rel=1e-4, abs=1e-6)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lora", [pytest.param(("model.lora.rank=4", "model.lora.alpha=8"), id="lora"),
                                  pytest.param((), id="full")])
def test_hf_model_lora_and_full_under_zero2_equal_one_process(chat_tokenizer, tmp_path, lora):
    """model=hf (a tiny Llama with the chat template), LoRA adapters or every parameter: the
    reference is the base model (the adapters' B starts at zero), so the first loss is ln 2, and
    ZeRO-2 on 2 ranks gives one process's losses and parameters (SGD, 1e-5)."""
    from tests.test_chat import _chat_llama

    model = _chat_llama(tmp_path, chat_tokenizer)
    common = (*[o for o in _common(tmp_path, chat_tokenizer) if not o.startswith(("model=", "model.vocab"))],
              "model=hf", f"model.path={model}", "model.seq_len=32", *lora, "model.dropout=0")
    one = run_cli("train.py", *common, "strategy=single", "trainer.micro_batch_size=8",
                  out=tmp_path / "single", timeout=300)
    zero2 = run_cli("train.py", *common, "strategy=zero2", "cluster.devices=2", "trainer.micro_batch_size=2",
                    out=tmp_path / "zero2", timeout=500)
    assert one.losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert_losses_close(one.losses, zero2.losses, rtol=1e-5)
    assert_params_close(one.params(), zero2.params(), rtol=1e-5)
