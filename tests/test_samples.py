"""callbacks.samples (issue 41): greedy completions of a few prompts at each validation, run by
every rank together through the model as the engine wraps it (recipes/samples.py's one loop).

Proven here: generation does not change training -- ddp x2 with validations (a separate
validation file, so the training data is the same) and samples has the losses and final
parameters, bitwise, of the equivalence tests' run without either (SGD, whose update shows any
gradient change); the completions at the last validation are, token for token, the greedy
continuation one process computes from the run's exported parameters (the same checkpoint).
Slow: the same on fsdp2, zero3, tp and Accelerate's ddp and fsdp2 (the sharded forwards gather
what they need on every rank), and a model=hf chat model's prompts through its chat template on
zero3 and fsdp2. What cannot run a collective greedy loop (a pipeline stage, a sequence shard)
and what cannot encode a prompt is one ConfigError at validate.

Cost: the default tier trains one ddp x2 run of its own (about 30 s here); the run without
samples is conftest's session-cached equivalence run.
"""

from __future__ import annotations

import json
import pytest

from recipes.config import compose
from recipes.job import RUN, validate
from strategies import ConfigError
from tests.cases import CASES
from tests.conftest import EQUIV, OPTIMIZERS, ROOT, TINY, run_cli

pytestmark = pytest.mark.timeout(600)
PROMPTS = ("Once upon a time", "The king said")
NEW = 8
# A separate validation file leaves the training data as it is: a run with validations and
# samples is compared with the equivalence tests' own run of the same preset (no validation at
# all; conftest's session cache, so the suite trains it once for both).
VAL = (f"data.val_path={ROOT / 'recipes' / 'assets' / 'corpus.txt'}", "data.val_samples=8",
       "trainer.val_every=3")
ON = (f"callbacks.samples.prompts=[{','.join(PROMPTS)}]", f"callbacks.samples.max_new_tokens={NEW}")


def _case(name: str, backend: str = "lightning") -> tuple[str, ...]:
    """The equivalence setting of a preset with SGD (any gradient change shows)."""
    return (*EQUIV, *OPTIMIZERS["sgd"], *CASES[name].overrides, f"backend={backend}")


def _reference_completions(run, overrides: tuple[str, ...]) -> list[str]:
    """The greedy continuation of each prompt by one process, from the run's final parameters
    (params.pt), through the plain model: no engine, no collective."""
    from recipes import training
    from recipes.samples import Prompter, greedy

    plain = [o for o in overrides if not o.startswith("strategy.")]  # (the preset's own keys)
    job = validate(compose([*TINY, *plain, "strategy=single", "cluster.devices=1",
                            "trainer.micro_batch_size=8"]), depth=RUN)
    model = training.build_model(job.model, job.trainer.seed)
    model.load_state_dict(run.params())
    prompter = Prompter.for_data(job.data)
    return [prompter.decode(greedy(model, model, prompter.encode(p), max_new_tokens=NEW,
                                   seq_len=job.model.seq_len, eos=prompter.eos)) for p in PROMPTS]


def _samples_change_nothing(cached, name: str, backend: str = "lightning") -> None:
    """With validations and samples, the same losses and final parameters, bitwise, as the run
    without either; the samples of each validation (steps 3 and 6), rank 0's block on the
    console once per validation; the last ones equal one process's greedy generation from the
    same parameters."""
    import torch

    off, on = cached(*_case(name, backend)), cached(*_case(name, backend), *VAL, *ON, timeout=500)
    assert on.losses == off.losses
    a, b = on.params(), off.params()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "samples" not in off.report and [v["step"] for v in on.report["validation"]] == [3, 6]
    samples = on.report["samples"]
    assert [(s["step"], s["prompt"]) for s in samples] == [(st, p) for st in (3, 6) for p in PROMPTS]
    assert all(isinstance(s["completion"], str) and s["completion"] for s in samples)
    assert [s["completion"] for s in samples if s["step"] == 6] == _reference_completions(on, _case(name, backend))
    assert on.log.count("samples at step") == 2


@pytest.mark.multiprocess
def test_ddp_samples_change_nothing_and_equal_one_process(cached):
    """ddp x2 (Lightning): one run of its own (the one without samples is the equivalence
    tests')."""
    _samples_change_nothing(cached, "ddp")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name, backend", [("fsdp2", "lightning"), ("zero3", "lightning"), ("tp", "lightning"),
                                           ("ddp", "accelerate"), ("fsdp2", "accelerate")])
def test_sharded_samples_change_nothing_and_equal_one_process(cached, name, backend):
    """The sharded forward on every rank (each gathers its shards), rank 0's argmax broadcast."""
    _samples_change_nothing(cached, name, backend)


# ----------------------------------------------------------------------------- the prompts
@pytest.mark.unit
def test_prompts_from_a_list_lines_or_jsonl(tmp_path):
    from recipes.samples import load_prompts

    lines = tmp_path / "p.txt"
    lines.write_text("Hello there\n\nOnce upon a time\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
    assert load_prompts(str(lines)) == ["Hello there", "Once upon a time"]
    assert load_prompts(str(jsonl)) == list(PROMPTS)
    assert load_prompts(["a", 1]) == ["a", "1"]
    assert load_prompts(None) == []


@pytest.mark.unit
def test_encoding_uses_the_chat_template_when_there_is_one(hf_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from recipes.samples import Prompter

    tok = AutoTokenizer.from_pretrained(str(hf_tokenizer), local_files_only=True)
    plain = Prompter(tok)
    assert not plain.chat and plain.decode(plain.encode("Once upon a time")) == "Once upon a time"
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}" \
                        "{% if add_generation_prompt %}<assistant>{% endif %}"
    chat = Prompter(tok)
    assert chat.chat and chat.decode(chat.encode("Hi")) == "<user>Hi<assistant>"
    assert Prompter(None).encode("Hé") == list("Hé".encode()) and Prompter(None).eos is None


@pytest.mark.unit
def test_greedy_restores_the_mode_and_stops_at_eos():
    import torch

    from recipes.samples import greedy

    class Next(torch.nn.Module):  # always predicts (last token + 1) mod 10
        def forward(self, tokens):
            assert not self.training and not torch.is_grad_enabled()
            return torch.nn.functional.one_hot((tokens + 1) % 10, 10).float()

    model = Next().train()
    assert greedy(model, model, [3], max_new_tokens=4, seq_len=2) == [4, 5, 6, 7]
    assert greedy(model, model, [3], max_new_tokens=9, seq_len=2, eos=6) == [4, 5, 6]
    assert model.training


@pytest.mark.unit
def test_loggers_draw_each_block_where_they_can(tmp_path):
    """TensorBoard: a markdown table per validation (text ``samples``); csv: nothing, quietly."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from observers.loggers import CSVLog, TensorBoardLog

    block = [{"step": 3, "prompt": "a|b", "completion": "c\nd"}]
    tb = TensorBoardLog(8, tmp_path, {})
    tb.open()
    tb.write_samples(3, block)
    tb.close({})
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    [(step, text)] = [(e.step, e.tensor_proto.string_val[0].decode())
                      for e in events.Tensors("samples/text_summary")]
    assert step == 3 and text.endswith("| a\\|b | c<br>d |")
    CSVLog(8, tmp_path, {}).write_samples(3, block)  # (report.json has them)


# ----------------------------------------------------------------------------- refusals
UNIT = ("trainer.global_batch_size=8", "data.val_fraction=0.05", "trainer.val_every=2")


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose([*TINY, *UNIT, *overrides]), depth=RUN)
    return str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize("preset, what", [("pipeline", "pipeline"), ("ulysses", "sequence"),
                                          ("fsdp_cp", "context")])
def test_presets_without_a_whole_sequence_forward_are_refused(preset, what):
    msg = _problems(*ON, f"strategy={preset}", "cluster.devices=2", "trainer.micro_batch_size=2")
    assert f"callbacks.samples.prompts with strategy={preset}" in msg and what in msg
    assert "callbacks.samples.prompts=null" in msg


@pytest.mark.unit
def test_what_cannot_be_sampled_is_refused(tmp_path):
    assert "set data.val_fraction" in _problems(*ON, "data.val_fraction=0")
    assert "set data.tokenizer" in _problems(*ON, "data=tokens", f"data.path={tmp_path}")
    missing = tmp_path / "none.txt"
    assert f"callbacks.samples.prompts={missing}" in _problems(f"callbacks.samples.prompts={missing}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    assert "\"prompt\"" in _problems(f"callbacks.samples.prompts={bad}")
    assert "callbacks.samples.max_new_tokens=0" in _problems(*ON, "callbacks.samples.max_new_tokens=0")
    validate(compose([*TINY, *UNIT, *ON]), depth=RUN)  # (the tests' setting itself is sound)


# ----------------------------------------------------------------------------- a chat model
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.role == 'assistant' %}"
            "<|endoftext|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("preset", ["zero3", "fsdp2"])
def test_chat_samples_on_a_sharded_hf_model(hf_tokenizer, tmp_path, preset):
    """model=hf (a tiny Llama beside the tests' tokenizer, given a chat template) with data=chat
    on 2 ranks: each prompt is the template's user turn and generation prompt, and the
    completions are one process's greedy generation from the exported parameters."""
    import shutil

    from tests.test_hf import _save

    model = _save(tmp_path / "model", vocab_size=512)
    for f in hf_tokenizer.iterdir():
        shutil.copy2(f, model / f.name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    text = (ROOT / "recipes" / "assets" / "corpus.txt").read_text()
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": text[i * 200:i * 200 + 60]},
        {"role": "assistant", "content": text[i * 200 + 60:i * 200 + 160]}]}) + "\n" for i in range(200)))
    overrides = ("model=hf", f"model.path={model}", "model.seq_len=32", "data=chat", f"data.path={chats}",
                 f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.05", "data.val_samples=8",
                 "trainer.max_steps=2", "trainer.global_batch_size=8", "trainer.export_params=true",
                 *OPTIMIZERS["sgd"])
    run = run_cli("train.py", *TINY, *overrides, f"strategy={preset}", "cluster.devices=2",
                  "trainer.micro_batch_size=4", *ON, out=tmp_path / "run", timeout=500)
    from transformers import AutoTokenizer

    from recipes.samples import Prompter

    assert Prompter(AutoTokenizer.from_pretrained(str(model), local_files_only=True)).chat
    samples = run.report["samples"]
    assert [(s["step"], s["prompt"]) for s in samples] == [(2, p) for p in PROMPTS]
    assert [s["completion"] for s in samples] == _reference_completions(run, overrides)
