"""Chat fine-tuning data (data=chat): conversations rendered with the tokenizer's chat template,
the loss on assistant tokens only (checked against a hand-built rendering and a hand-masked
cross entropy), the data.path forms (a directory of shards, a glob, a save_to_disk directory),
the checks before launch, and the end-to-end run on a tiny local Llama with a chat template."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from recipes.config import DataConfig, compose
from recipes.data import CORPUS, IGNORE, TokenWindows, build_datasets, data_facts, held_out
from recipes.job import CONFIG, validate
from strategies import ConfigError
from tests.conftest import TINY, run_cli

pytest.importorskip("transformers")  # the hf extra

SHAPE = SimpleNamespace(seq_len=16, vocab_size=516)
ROLES = ("system", "user", "assistant", "end")
# Each message is <|role|>content<|end|>; the generation prompt is <|assistant|>, so an
# assistant turn's loss tokens are its content and its <|end|>.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# The same rendering, its assistant tokens marked by the template itself.
GENERATION = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}"
              "{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}{% else %}"
              "{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _with_template(src: Path, out: Path, template: str | None) -> Path:
    """``src``'s tokenizer plus the role tokens (ids 512..515) and ``template``, saved to ``out``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    tok.add_special_tokens({"additional_special_tokens": [f"<|{r}|>" for r in ROLES]})
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def chat_tokenizer(hf_tokenizer, tmp_path_factory) -> Path:
    """The tests' BPE tokenizer (vocab 512, EOS <|endoftext|>) with a simple chat template."""
    return _with_template(hf_tokenizer, tmp_path_factory.mktemp("chat_tok"), TEMPLATE)


def _conversations(n: int = 30) -> list[list[dict]]:
    """``n`` conversations of 1-3 exchanges cut from the bundled corpus, some with a system
    prompt, one ending on a user turn."""
    text = CORPUS.read_text()
    out = []
    def piece(i: int, k: int, size: int) -> str:
        return text[(i * 7 + k) * 300 : (i * 7 + k) * 300 + size]

    for i in range(n):
        msgs = [{"role": "system", "content": "Answer from the book."}] if i % 3 == 0 else []
        for k in range(1 + i % 3):
            msgs += [{"role": "user", "content": piece(i, 2 * k, 30 + (i * 13 + k) % 60)},
                     {"role": "assistant", "content": piece(i, 2 * k + 1, 20 + (i * 29 + k) % 90)}]
        if i == 5:
            msgs.append({"role": "user", "content": "And then?"})
        out.append(msgs)
    return out


def _jsonl(path: Path, convs: list[list[dict]], field: str = "messages") -> Path:
    path.write_text("".join(json.dumps({field: c, "id": i}) + "\n" for i, c in enumerate(convs)))
    return path


def _hand(tokenizer_dir: Path, convs: list[list[dict]]) -> tuple[list[int], list[int]]:
    """The token stream and its loss mask built by hand, without the template: per message
    <|role|>, its content's tokens, <|end|>; the content and <|end|> count for assistant
    messages; EOS after each conversation, not counted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids, mask = [], []
    for conv in convs:
        for m in conv:
            content = tok(m["content"], add_special_tokens=False)["input_ids"]
            a = int(m["role"] == "assistant")
            ids += [tok.convert_tokens_to_ids(f"<|{m['role']}|>"), *content, tok.convert_tokens_to_ids("<|end|>")]
            mask += [0, *[a] * len(content), a]
        ids.append(tok.eos_token_id)
        mask.append(0)
    return ids, mask


def _chat(**kw) -> DataConfig:
    return DataConfig(name="chat", **kw)


# ------------------------------------------------------------------------- tokens and mask
@pytest.mark.unit
def test_chat_tokens_and_mask_equal_a_hand_rendering(chat_tokenizer, tmp_path):
    """The cache holds the hand-built stream; the mask marks exactly the assistant contents and
    their end-of-turn; the windows' targets are IGNORE exactly where the mask is 0; train_on=all
    is another cache entry with the same tokens and no mask."""
    from recipes.tokens import token_file

    convs = _conversations()
    src = _jsonl(tmp_path / "c.jsonl", convs)
    ids, mask = _hand(chat_tokenizer, convs)
    kw = {"kind": "chat", "path": src, "field": "messages", "tokenizer": chat_tokenizer,
          "cache_dir": tmp_path / "cache"}
    stream = token_file(**kw)
    assert stream.array().tolist() == ids and stream.mask().tolist() == mask
    assert stream.n_loss_tokens == sum(mask) and stream.max_id == max(ids) == 515
    assert stream.n_docs == len(convs) and stream.vocab_size == 516
    again = token_file(**kw)
    assert not again.built and again.mask_path == stream.mask_path
    every = token_file(**kw, train_on="all")
    assert every.built and every.path != stream.path and every.mask() is None
    assert every.array().tolist() == ids and every.n_loss_tokens == len(ids)

    train = build_datasets(_chat(path=str(src), tokenizer=str(chat_tokenizer),
                                 cache_dir=str(tmp_path / "cache")), SHAPE, 0)[0]
    assert isinstance(train, TokenWindows)
    for i in range(len(train)):
        x, y = train[i]
        j = i * SHAPE.seq_len
        assert x.tolist() == ids[j : j + SHAPE.seq_len]
        assert y.tolist() == [t if m else IGNORE for t, m in zip(ids[j + 1 : j + SHAPE.seq_len + 1],
                                                                  mask[j + 1 : j + SHAPE.seq_len + 1])]


@pytest.mark.unit
def test_generation_blocks_mark_the_same_tokens(hf_tokenizer, chat_tokenizer, tmp_path):
    """A template's own {% generation %} blocks give the mask the incremental rendering gives."""
    from recipes.tokens import token_file

    gen = _with_template(hf_tokenizer, tmp_path / "gen", GENERATION)
    convs = _conversations(8)
    src = _jsonl(tmp_path / "c.jsonl", convs)
    kw = {"kind": "chat", "path": src, "field": "messages", "cache_dir": tmp_path / "c"}
    a, b = token_file(**kw, tokenizer=chat_tokenizer), token_file(**kw, tokenizer=gen)
    assert a.array().tolist() == b.array().tolist() == _hand(chat_tokenizer, convs)[0]
    assert a.mask().tolist() == b.mask().tolist() == _hand(chat_tokenizer, convs)[1]


# Each turn ends with the EOS, as in instruct tokenizers (Llama 3's <|eot_id|>, Qwen's <|im_end|>).
EOS_TURNS = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.unit
def test_an_eos_that_ends_each_turn_does_not_cut_a_conversation(hf_tokenizer, tmp_path):
    """data.packing=pad serves each whole conversation on its row (its prompts with its replies),
    not one row per turn; data.packing=document, whose model restarts at every EOS, is refused
    by name before a step."""
    from transformers import AutoTokenizer

    from core.errors import DataError

    tok_dir = _with_template(hf_tokenizer, tmp_path / "tok", EOS_TURNS)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    convs = _conversations(12)
    kw = {"path": str(_jsonl(tmp_path / "c.jsonl", convs)), "tokenizer": str(tok_dir),
          "cache_dir": str(tmp_path / "cache"), "train_on": "all"}
    rows = build_datasets(_chat(packing="pad", **kw), SimpleNamespace(seq_len=1024, vocab_size=516), 0)[0]
    assert len(rows) == len(convs)
    for i, conv in enumerate(convs):
        x, y = rows[i]
        n = int((y != IGNORE).sum())
        got = x[1 if i else 0 : n].tolist() + [int(y[n - 1])]  # (a row's first input: the EOS before it)
        assert got == tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
    shape = SimpleNamespace(seq_len=16, vocab_size=516, document_eos=tok.eos_token_id)
    with pytest.raises(DataError, match=r"data.packing=document with data.path=.*inside the 12 "
                                        r"conversations .*set data.packing=pad"):
        build_datasets(_chat(packing="document", **kw), shape, 0)


@pytest.mark.unit
def test_a_template_that_is_not_incremental_is_a_clear_error(hf_tokenizer, tmp_path):
    from recipes.tokens import token_file

    # the last message is rendered unlike the earlier ones: no prefix to cut at
    odd = _with_template(hf_tokenizer, tmp_path / "odd", "{% for m in messages %}{% if loop.last %}[LAST]"
                         "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}")
    src = _jsonl(tmp_path / "c.jsonl", _conversations(2))
    with pytest.raises(ValueError, match="not render the conversation incrementally") as e:
        token_file(kind="chat", path=src, field="messages", tokenizer=odd, cache_dir=tmp_path / "c")
    assert "data.train_on=all" in str(e.value) and "generation" in str(e.value)
    assert token_file(kind="chat", path=src, field="messages", tokenizer=odd, cache_dir=tmp_path / "c",
                      train_on="all").mask() is None


# ------------------------------------------------------------------------- the loss
@pytest.mark.unit
def test_loss_counts_only_assistant_tokens(chat_tokenizer, tmp_path):
    """The recipe's loss (every backend's and the pipeline's last stage's) on the chat windows
    equals a cross entropy over the hand mask's positions alone; a micro-batch without an
    assistant token adds 0 and zero gradients, not NaN."""
    import torch
    import torch.nn.functional as F

    from recipes.training import token_loss

    convs = _conversations()
    src = _jsonl(tmp_path / "c.jsonl", convs)
    ids, mask = _hand(chat_tokenizer, convs)
    train = build_datasets(_chat(path=str(src), tokenizer=str(chat_tokenizer), val_fraction=0.0,
                                 cache_dir=str(tmp_path / "c")), SHAPE, 0)[0]
    picks = [1, 4, 7, 9]
    targets = torch.stack([train[i][1] for i in picks])
    logits = torch.randn(len(picks), SHAPE.seq_len, SHAPE.vocab_size, generator=torch.Generator().manual_seed(0))
    rows, cols, wanted = [], [], []
    for r, i in enumerate(picks):  # the hand-masked computation: only positions the hand mask keeps
        for c in range(SHAPE.seq_len):
            p = i * SHAPE.seq_len + c + 1
            if mask[p]:
                rows.append(r), cols.append(c), wanted.append(ids[p])
    hand = F.cross_entropy(logits[rows, cols], torch.tensor(wanted))
    assert 0 < len(wanted) < targets.numel()
    torch.testing.assert_close(token_loss(logits, targets), hand, rtol=1e-6, atol=0)
    assert not torch.isclose(token_loss(logits, targets.masked_fill(targets == IGNORE, 0)), hand)

    none = torch.full_like(targets, IGNORE)
    leaf = logits.clone().requires_grad_()
    loss = token_loss(leaf, none)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(leaf.grad, torch.zeros_like(leaf))


# ------------------------------------------------------------------------- data.path forms
@pytest.mark.unit
def test_path_forms_read_the_same_records(chat_tokenizer, hf_tokenizer, tmp_path):
    """data=chat from one jsonl file, a directory of parquet shards, a glob of jsonl files, a
    save_to_disk Dataset and a DatasetDict (its train split): the same tokens and mask; jsonl /
    parquet text data likewise from a directory and a glob."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict

    from recipes.tokens import token_file

    convs = _conversations(12)
    one = _jsonl(tmp_path / "all.jsonl", convs)
    (tmp_path / "pq").mkdir()
    (tmp_path / "js").mkdir()
    for k in range(3):  # shards in name order
        pq.write_table(pa.table({"messages": convs[4 * k : 4 * k + 4]}), tmp_path / "pq" / f"part-{k:02d}.parquet")
        _jsonl(tmp_path / "js" / f"part-{k:02d}.jsonl", convs[4 * k : 4 * k + 4])
    (tmp_path / "pq" / "README.md").write_text("not data")
    Dataset.from_list([{"messages": c} for c in convs]).save_to_disk(str(tmp_path / "disk"))
    DatasetDict({"train": Dataset.from_list([{"messages": c} for c in convs]),
                 "test": Dataset.from_list([{"messages": convs[0]}])}).save_to_disk(str(tmp_path / "dict"))
    kw = {"kind": "chat", "field": "messages", "tokenizer": chat_tokenizer, "cache_dir": tmp_path / "c"}
    ref = token_file(path=one, **kw)
    got = {}
    for path in (tmp_path / "pq", f"{tmp_path}/js/part-*.jsonl", f"{tmp_path}/**/part-*.parquet",
                 tmp_path / "disk", tmp_path / "dict"):
        got[str(path)] = stream = token_file(path=path, **kw)
        assert stream.path != ref.path, path
        assert stream.array().tolist() == ref.array().tolist(), path
        assert stream.mask().tolist() == ref.mask().tolist(), path
    # the glob names the directory's files: the same cache entry
    assert not got[f"{tmp_path}/**/part-*.parquet"].built
    assert got[f"{tmp_path}/**/part-*.parquet"].path == got[str(tmp_path / "pq")].path

    docs = [m["content"] for c in convs for m in c]
    (tmp_path / "tx").mkdir()
    pq.write_table(pa.table({"text": docs[:20]}), tmp_path / "tx" / "a.parquet")
    pq.write_table(pa.table({"text": docs[20:]}), tmp_path / "tx" / "b.parquet")
    (tmp_path / "tj").mkdir()
    for name, part in (("a", docs[:20]), ("b", docs[20:])):
        (tmp_path / "tj" / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    kw = {"field": "text", "tokenizer": hf_tokenizer, "cache_dir": tmp_path / "c"}
    want = token_file(kind="jsonl", path=_docs_file(tmp_path / "docs.jsonl", docs), **kw).array().tolist()
    assert token_file(kind="parquet", path=tmp_path / "tx", **kw).array().tolist() == want
    assert token_file(kind="jsonl", path=f"{tmp_path}/tj/*.jsonl", **kw).array().tolist() == want


def _docs_file(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


# ------------------------------------------------------------------------- report facts
@pytest.mark.unit
def test_data_facts_count_training_targets(chat_tokenizer, tmp_path):
    """report.json's data: tokens = training windows x seq_len, loss_tokens = their counted
    targets (the hand mask's ones), the held-out windows excluded; equal for unmasked data."""
    convs = _conversations()
    src = _jsonl(tmp_path / "c.jsonl", convs)
    _, mask = _hand(chat_tokenizer, convs)
    cfg = {"path": str(src), "tokenizer": str(chat_tokenizer), "cache_dir": str(tmp_path / "c")}
    for fraction in (0.0, 0.1, 0.8):
        train, _ = build_datasets(_chat(**cfg, val_fraction=fraction), SHAPE, 0)
        n = len(train)
        assert data_facts(train) == {"tokens": n * SHAPE.seq_len,
                                     "loss_tokens": sum(mask[1 : n * SHAPE.seq_len + 1])}
        assert data_facts(train) == {"tokens": sum(int((train[i][1] != -100).numel()) for i in range(n)),
                                     "loss_tokens": sum(int((train[i][1] != IGNORE).sum()) for i in range(n))}
    every = build_datasets(_chat(**cfg, train_on="all", val_fraction=0.1), SHAPE, 0)[0]
    assert data_facts(every)["tokens"] == data_facts(every)["loss_tokens"] == len(every) * SHAPE.seq_len
    text = build_datasets(DataConfig(name="text"), SHAPE, 0)[0]
    assert data_facts(text) == {"tokens": len(text) * 16, "loss_tokens": len(text) * 16}
    synthetic = build_datasets(DataConfig(name="synthetic", num_samples=10), SHAPE, 0)[0]
    assert data_facts(synthetic) == {"tokens": 160, "loss_tokens": 160}


# ------------------------------------------------------------------------- before launch
def _problems(*overrides: str, vocab: int = 516) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", f"model.vocab_size={vocab}", *overrides]),
                 depth=CONFIG)
    return str(e.value)


@pytest.mark.unit
def test_bad_chat_data_fails_before_launch(chat_tokenizer, hf_tokenizer, tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", _conversations(3), field="conversation")
    tok = f"data.tokenizer={chat_tokenizer}"
    msg = _problems("data=chat", f"data.path={src}", tok)
    assert "data.messages_field='messages'" in msg and "conversation" in msg
    assert "set data.messages_field=" in msg
    msg = _problems("data=chat", f"data.path={src}", "data.messages_field=conversation",
                    f"data.tokenizer={hf_tokenizer}")
    assert f"data.tokenizer={hf_tokenizer} has no chat template" in msg and "chat_template" in msg
    msg = _problems("data=chat", f"data.path={src}", "data.messages_field=conversation", tok,
                    "data.train_on=prompt")
    assert "data.train_on" in msg and "assistant" in msg and "all" in msg
    sharegpt = _jsonl(tmp_path / "sharegpt.jsonl", [[{"role": "human", "content": "hi"}, {"role": "gpt", "content": "yo"}]])
    msg = _problems("data=chat", f"data.path={sharegpt}", tok)
    assert "the first record's roles are gpt, human, none of them 'assistant'" in msg and "data.train_on=all" in msg
    validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", "model.vocab_size=516", "data=chat",
                      f"data.path={sharegpt}", tok, "data.train_on=all"]), depth=CONFIG)
    flat = tmp_path / "flat.jsonl"
    flat.write_text(json.dumps({"messages": "hello"}) + "\n")
    msg = _problems("data=chat", f"data.path={flat}", tok)
    assert "not a non-empty list of messages" in msg and "role" in msg
    msg = _problems("data=chat", tok)
    assert "data=chat needs data.path" in msg
    msg = _problems("data=chat", f"data.path={src}", "data.messages_field=conversation")
    assert "data=chat needs a tokenizer" in msg
    msg = _problems("data=chat", f"data.path={tmp_path}/*.parquet", tok)
    assert "matches no file" in msg and "data.path=" in msg
    (tmp_path / "empty").mkdir()
    msg = _problems("data=parquet", f"data.path={tmp_path / 'empty'}", f"data.tokenizer={hf_tokenizer}")
    assert "a directory without *.parquet files" in msg and "glob" in msg
    # the good ones pass: a directory, a glob (tmp_path itself is refused now: its sharegpt.jsonl and
    # flat.jsonl hold "messages", not "conversation", which the run could not read)
    (tmp_path / "good").mkdir()
    shutil.copy(src, tmp_path / "good")
    msg = _problems("data=chat", f"data.path={tmp_path}", "data.messages_field=conversation", tok)
    assert "flat.jsonl's first record has no 'conversation' (it has: messages)" in msg, msg
    for path in (tmp_path / "good", f"{tmp_path}/c.js*"):
        validate(compose(["model=gpt_nano", "cluster.accelerator=cpu", "model.vocab_size=516", "data=chat",
                          f"data.path={path}", "data.messages_field=conversation", tok]), depth=CONFIG)


@pytest.mark.subprocess
def test_a_bad_record_found_while_tokenizing_is_one_line_and_exit_2(chat_tokenizer, tmp_path):
    """What the checks before launch cannot see (they read the first record): a line of the file
    that is not JSON (datasets said "JSON parse error ... in row 44", with a traceback), and
    conversations without an assistant role (a traceback): one line naming it, exit 2."""
    from core.errors import DataError
    from recipes.tokens import token_file

    lines = [json.dumps({"messages": c}) for c in _conversations(4)]
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([*lines[:3], '{"messages": [{"role" "user"}]}', lines[3]]) + "\n")
    roles = _jsonl(tmp_path / "roles.jsonl", [[{"role": "human", "content": "hi"}, {"role": "bot", "content": "yo"}]])
    cases = {broken: f"data.path={broken}: line 4 is not JSON (Expecting ':' delimiter, column 23): fix or "
                     "remove that line",
             roles: f"data.path={roles}: no assistant message in any conversation"}
    for path, said in cases.items():
        with pytest.raises(DataError, match=said.replace("(", r"\(").replace(")", r"\)")):
            token_file(kind="chat", path=path, field="messages", tokenizer=chat_tokenizer, cache_dir=tmp_path)
    for ranks in (1, 2):  # (two: every rank's DataError is the run's one line, not a lost rank)
        run = run_cli("train.py", *TINY, "model.vocab_size=516", "data=chat", f"data.path={broken}",
                      f"data.tokenizer={chat_tokenizer}", f"data.cache_dir={tmp_path / 'cache'}",
                      *(("strategy=ddp", "cluster.devices=2") if ranks == 2 else ()),
                      out=tmp_path / f"run{ranks}", check=False)
        assert run.proc.returncode == 2, run.log[-3000:]
        assert "Traceback" not in run.log and "in row" not in run.log, run.log[-3000:]  # (torch's, datasets')
        assert run.proc.stderr.strip().splitlines()[-1].endswith(cases[broken]), run.proc.stderr[-2000:]


@pytest.mark.unit
def test_token_ids_past_the_vocabulary_fail_before_launch_once_per_shard(tmp_path, monkeypatch):
    """data=tokens with an id >= model.vocab_size: an error naming the key, the value, the id and
    the fix, before launch and in build_datasets; each shard's largest id is read once (cached
    by path, size and mtime) and again only when the shard changes."""
    from recipes import token_checks as tokens  # (where the shards' largest ids are read)

    (tmp_path / "s").mkdir()
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "s" / "000.bin")
    np.array([5, 300, 7, 9] * 10, dtype=np.uint16).tofile(tmp_path / "s" / "001.bin")
    cache = f"data.cache_dir={tmp_path / 'c'}"
    reads = []
    real = tokens._max_id
    monkeypatch.setattr(tokens, "_max_id", lambda f, dtype: reads.append(f.name) or real(f, dtype))
    msg = _problems("data=tokens", f"data.path={tmp_path / 's'}", cache, vocab=256)
    assert (f"data.path={tmp_path / 's'}: shard 001.bin holds token id 300 but model.vocab_size=256" in msg
            and "model.vocab_size>=301" in msg and "data.dtype=uint16" in msg)
    assert sorted(reads) == ["000.bin", "001.bin"]
    _problems("data=tokens", f"data.path={tmp_path / 's'}", cache, vocab=256)
    assert sorted(reads) == ["000.bin", "001.bin"]  # cached: not read again
    shape = SimpleNamespace(seq_len=16, vocab_size=256)
    data = DataConfig(name="tokens", path=str(tmp_path / "s"), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="holds token id 300 but model.vocab_size=256"):
        build_datasets(data, shape, 0)
    assert len(reads) == 2
    np.array([5, 200, 7, 9] * 10, dtype=np.uint16).tofile(tmp_path / "s" / "001.bin")
    st = (tmp_path / "s" / "001.bin").stat()
    os.utime(tmp_path / "s" / "001.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert len(build_datasets(data, shape, 0)[0]) == 6 + 2
    assert sorted(reads) == ["000.bin", "001.bin", "001.bin"]  # the changed shard, read again


# ------------------------------------------------------------------------- end to end
def _chat_llama(tmp_path: Path, chat_tokenizer: Path) -> Path:
    """test_hf's tiny Llama (vocab 8192) with the chat tokenizer in its directory."""
    from tests.test_hf import _save

    model = _save(tmp_path / "llama")
    for f in chat_tokenizer.iterdir():
        shutil.copy2(f, model / f.name)
    return model


def _first_loss(model_dir: Path, ids: list[int], mask: list[int] | None, *, seq_len: int,
                val_fraction: float, global_batch: int, seed: int = 1234) -> float:
    """transformers' model on the first global batch, targets masked by hand."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from recipes.data import GlobalBatchSampler

    n = (len(ids) - 1) // seq_len
    n -= held_out(n, val_fraction, 1) if val_fraction else 0  # (data.val_samples=1: the fraction as asked)
    order = GlobalBatchSampler(n, global_batch=global_batch, micro_batch=global_batch, dp_rank=0, dp_size=1,
                               seed=seed, steps=1).global_indices(0)
    x = torch.tensor([ids[i * seq_len : i * seq_len + seq_len] for i in order])
    y = torch.tensor([[t if mask is None or m else IGNORE
                       for t, m in zip(ids[i * seq_len + 1 : i * seq_len + seq_len + 1],
                                       (mask or [1] * len(ids))[i * seq_len + 1 : i * seq_len + seq_len + 1])]
                      for i in order])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE).item()


@pytest.mark.subprocess
@pytest.mark.timeout(600)
def test_chat_sft_end_to_end_on_a_tiny_llama(chat_tokenizer, tmp_path):
    """python train.py model=hf model.path=<dir with a chat template> data=chat data.path=<jsonl>:
    the first loss is transformers' model's cross entropy over the hand mask's assistant
    targets of the first global batch (and not the unmasked one); report.json's data counts
    the training targets and the assistant ones; validation runs on the held-out windows."""
    convs = _conversations(40)
    src = _jsonl(tmp_path / "chats.jsonl", convs)
    model = _chat_llama(tmp_path, chat_tokenizer)
    ids, mask = _hand(chat_tokenizer, convs)
    overrides = [o for o in TINY if not o.startswith("model=")]
    run = run_cli("train.py", *overrides, "model=hf", f"model.path={model}", "model.seq_len=32",
                  "data=chat", f"data.path={src}", f"data.cache_dir={tmp_path / 'cache'}",
                  "strategy=single", "trainer.max_steps=2", "trainer.global_batch_size=8",
                  "trainer.micro_batch_size=8", "trainer.optimizer=sgd", "trainer.lr=0.5",
                  "trainer.grad_clip=0", "data.val_samples=1", out=tmp_path / "run", timeout=500)
    report = run.report
    kw = {"seq_len": 32, "val_fraction": 0.01, "global_batch": 8}
    masked = _first_loss(model, ids, mask, **kw)
    assert report["losses"][0] == pytest.approx(masked, rel=1e-5)
    # (a random model's losses are all near ln(8192); the unmasked one is still 100x the tolerance away)
    assert abs(_first_loss(model, ids, None, **kw) - masked) > 100 * 1e-5 * masked
    n = (len(ids) - 1) // 32
    n -= held_out(n, 0.01, 1)
    assert report["data"] == {"tokens": n * 32, "loss_tokens": sum(mask[1 : n * 32 + 1]),
                              "epochs": round(2 * 8 / n, 6)}  # (max_steps x global batch / samples)
    assert report["validation"] and report["validation"][-1]["step"] == 2
    assert "tokenized" in run.log


# Layouts of the same chat job (global batch 8, micro 2 unless named): each trains the model the
# single process trains with the whole global batch in one micro-batch. CI runs data parallelism
# with accumulation, the pipeline and a sequence shard; the rest of the matrix is slow.
TOKEN_TRUE = {
    "micro1": ("strategy=single", "trainer.micro_batch_size=1"),
    "ddp": ("strategy=ddp", "cluster.devices=2"),
    "pipeline": ("strategy=pipeline", "cluster.devices=2"),
    "ulysses": ("strategy=ulysses", "cluster.devices=2"),
    "fsdp_cp": ("strategy=fsdp_cp", "cluster.devices=2"),
    "fsdp2": ("strategy=fsdp2", "cluster.devices=2"),
    "zero2": ("strategy=zero2", "cluster.devices=2"),
    "ddp-accelerate": ("strategy=ddp", "cluster.devices=2", "backend=accelerate"),
    "ulysses-accelerate": ("strategy=ulysses", "cluster.devices=2", "backend=accelerate"),
}
TOKEN_TRUE_CI = ("ddp", "pipeline", "ulysses")  # (ddp: micro 2, accumulation 2 over 2 ranks)


def sgd_chat_job(tmp: Path, tokenizer: Path, conversations: int, *, steps: int, global_batch: int,
                 micro: int) -> tuple[str, ...]:
    """The overrides of a tiny chat fine-tune that every layout must train alike: SGD without
    clipping (a wrong token weighting moves the losses), validation at the last step, the final
    parameters exported."""
    src = _jsonl(tmp / "chats.jsonl", _conversations(conversations))
    return (*TINY, "model.vocab_size=516", "data=chat", f"data.path={src}", f"data.tokenizer={tokenizer}",
            f"data.cache_dir={tmp / 'cache'}", "data.val_fraction=0.2", f"trainer.val_every={steps}",
            f"trainer.max_steps={steps}", f"trainer.global_batch_size={global_batch}",
            f"trainer.micro_batch_size={micro}", "trainer.optimizer=sgd", "trainer.lr=0.5",
            "trainer.grad_clip=0", "trainer.export_params=true", "callbacks=none")


def assert_same_model(ref, run, rtol: float = 1e-5, params_rtol: float | None = None) -> None:
    """Two runs trained the same model: losses, parameters (``params_rtol``, default ``rtol``) and
    validation losses."""
    from tests.conftest import assert_losses_close, assert_params_close

    assert_losses_close(ref.losses, run.losses, rtol=rtol)
    assert_params_close(ref.params(), run.params(), rtol=rtol if params_rtol is None else params_rtol)
    val = [[v["loss"] for v in r.report["validation"]] for r in (ref, run)]
    assert len(val[0]) == 1
    assert_losses_close(*val, rtol=rtol)


@pytest.fixture(scope="module")
def chat_job(chat_tokenizer, tmp_path_factory):
    """(common overrides, the reference Run): chat data whose samples count very different
    numbers of assistant targets, SGD without clipping (a wrong token weighting moves the
    losses), validation on; the reference is one process with the whole global batch at once."""
    tmp = tmp_path_factory.mktemp("token_true")
    common = sgd_chat_job(tmp, chat_tokenizer, 48, steps=3, global_batch=8, micro=2)
    ref = run_cli("train.py", *common, "strategy=single", "trainer.micro_batch_size=8",
                  out=tmp / "reference", timeout=300)
    return common, ref


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [pytest.param(k, marks=[] if k in TOKEN_TRUE_CI else [pytest.mark.slow])
                                    for k in TOKEN_TRUE])
def test_masked_loss_is_the_token_mean_of_the_global_batch_on_every_layout(chat_job, layout, tmp_path):
    """The loss of a step is the sum of the assistant targets' losses over the whole global batch
    divided by their number, whatever splits it (micro-batches, ranks, pipeline micro-batches,
    sequence shards): every layout gives the reference's losses, validation loss and parameters
    (SGD, 1e-5). A per-micro-batch mean (the old loss) moves them by percents."""
    common, ref = chat_job
    assert_same_model(ref, run_cli("train.py", *common, *TOKEN_TRUE[layout], out=tmp_path / layout, timeout=400))


ADAMW_RTOL = 2e-4  # measured: ddp 3.8e-5 (one w1 entry); losses and validation stay at 1e-5
ADAMW = ("trainer.optimizer=adamw", "trainer.lr=3e-3", "trainer.grad_clip=1.0")
"""The AdamW twin of the chat job: AdamW hides a constant scale of the gradient, SGD does not;
clipping at 1.0 binds on these steps, so the global norm must be the same on every layout."""


@pytest.fixture(scope="module")
def chat_job_adamw(chat_job, tmp_path_factory):
    common = (*chat_job[0], *ADAMW)
    ref = run_cli("train.py", *common, "strategy=single", "trainer.micro_batch_size=8",
                  out=tmp_path_factory.mktemp("token_true_adamw") / "reference", timeout=300)
    return common, ref


@pytest.mark.multiprocess
@pytest.mark.slow  # (the SGD matrix above is the proof of the token weighting; CI runs three of it)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(TOKEN_TRUE))
def test_masked_loss_under_adamw_and_clipping_is_the_same_on_every_layout(chat_job_adamw, layout, tmp_path):
    """The token-true loss's AdamW twin: AdamW with binding clipping trains the reference's model
    on every layout (losses 1e-5; parameters ADAMW_RTOL: AdamW divides by the root of its second
    moment, which lifts float noise in near-zero gradients)."""
    common, ref = chat_job_adamw
    assert_same_model(ref, run_cli("train.py", *common, *TOKEN_TRUE[layout], out=tmp_path / layout, timeout=400),
                      params_rtol=ADAMW_RTOL)


@pytest.mark.multiprocess
@pytest.mark.slow  # (CI: LoRA's equality in tests/test_hf.py, the chat masks under ddp and a pipeline here)
@pytest.mark.timeout(900)
def test_chat_lora_under_zero2_equals_one_process_and_saves_a_model_that_generates(chat_tokenizer, tmp_path):
    """The fine-tuner's journey: chat data, LoRA, ZeRO-2 on 2 ranks -- the same losses and
    parameters as one process (SGD, the same micro-batch size) -- and trainer.save_hf's
    directory loads with from_pretrained, renders a chat prompt and generates with its KV cache,
    giving the trained model's logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes import training
    from recipes.config import describe
    from tests.conftest import assert_losses_close, assert_params_close

    src = _jsonl(tmp_path / "chats.jsonl", _conversations(40))
    model = _chat_llama(tmp_path, chat_tokenizer)
    lora = ("model.lora.rank=4", "model.lora.alpha=8")
    common = (*[o for o in TINY if not o.startswith("model=")], "model=hf", f"model.path={model}",
              "model.seq_len=32", *lora, "data=chat", f"data.path={src}", f"data.cache_dir={tmp_path / 'cache'}",
              "data.val_fraction=0", "trainer.max_steps=3", "trainer.global_batch_size=8",
              "trainer.micro_batch_size=4", "trainer.optimizer=sgd", "trainer.lr=0.5", "trainer.grad_clip=0",
              "trainer.export_params=true")
    one = run_cli("train.py", *common, "strategy=single", out=tmp_path / "single", timeout=300)
    zero2 = run_cli("train.py", *common, "strategy=zero2", "cluster.devices=2", "trainer.save_hf=true",
                    out=tmp_path / "zero2", timeout=400)
    assert_losses_close(one.losses, zero2.losses, rtol=1e-5)
    assert_params_close(one.params(), zero2.params(), rtol=1e-5)
    assert zero2.report["data"]["loss_tokens"] < zero2.report["data"]["tokens"]

    out = zero2.out / "hf"
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044 & ~_umask()  # as the umask allows
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in exported.state_dict())
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "In the beginning"}],
                                     add_generation_prompt=True, return_tensors="pt")
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    generated = exported.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=True)
    assert generated.shape[1] == prompt.shape[1] + 4
    assert exported.config.use_cache is True

    cfg = compose([*common, "strategy=single"])
    trained = training.build_model(describe(cfg.model), 0)
    trained.load_state_dict(zero2.params())
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=prompt).logits, trained(prompt), rtol=1e-4, atol=1e-5)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.unit
def test_counted_share_reads_each_samples_counted_targets_through_subsets():
    """The token-true weights count each window's counted targets (through nested subsets, as
    the validation split and data.val_samples cut them), and unmasked data has none to weigh."""
    import torch
    from torch.utils.data import Subset

    from recipes.data import CountedShare, counted_per_sample

    rng = np.random.default_rng(0)
    arrays = [np.arange(161) % 50, np.arange(97) % 50]
    masks = [rng.integers(0, 2, 161).astype(np.uint8), None]
    ds = TokenWindows(arrays, 16, masks=masks)
    per = counted_per_sample(ds)
    assert per.tolist() == [int((ds[i][1] != IGNORE).sum()) for i in range(len(ds))]
    nested = Subset(Subset(ds, range(2, len(ds))), [3, 0, 5])
    assert counted_per_sample(nested).tolist() == [per[5], per[2], per[7]]
    share = CountedShare(ds, global_batch=4, seed=1)
    idx = share.order.global_indices(2)
    assert share(2) == sum(per[i] for i in idx) / (4 * 16)
    assert counted_per_sample(TokenWindows(arrays, 16)) is None
    assert CountedShare(TokenWindows(arrays, 16), global_batch=4, seed=1)(0) == 1.0
    # the loss divides by the targets x share, and where all count, by their count (bitwise)
    from recipes.training import token_weight

    y = torch.ones(2, 16, dtype=torch.long)
    assert token_weight(y, 0.25) == 8.0 and int(token_weight(y, 1.0)) == 32


@pytest.mark.unit
def test_a_step_with_no_counted_target_is_said_once(caplog, monkeypatch):
    """A global batch whose windows hold no target the loss counts (data.train_on=assistant and
    only system / user tokens in them) logged loss 0.0000 and grad norm 0 with no word (the
    audit: every step of a sparse chat set). Its loss stays 0 (no NaN for early stopping and
    keep_best to trip on), and rank 0 warns once, at the first such step, naming it; other
    ranks, later such steps and steps with targets say nothing."""
    from recipes.data import CountedShare

    arrays = [np.arange(16 * 8 + 1) % 50]
    masks = [np.zeros(16 * 8 + 1, dtype=np.uint8)]
    masks[0][: 16 * 2] = 1  # (windows 0 and 1 count targets, 2..7 none)
    ds = TokenWindows(arrays, 16, masks=masks)
    share = CountedShare(ds, global_batch=2, seed=1)
    empty = [s for s in range(8) if not any(i < 2 for i in share.order.global_indices(s))]
    full = [s for s in range(8) if s not in empty]
    assert empty and full
    with caplog.at_level("WARNING", logger="recipes.data"):
        assert share(full[0]) > 0 and not caplog.records
        assert share(empty[0]) == 1 / (2 * 16)  # (the clamp: a loss of 0, not 0 / 0)
        for s in empty[1:] + empty:
            share(s)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(
        f"step {empty[0] + 1}: its global batch of 2 samples holds no target the loss counts"), said
    caplog.clear()
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level("WARNING", logger="recipes.data"):
        CountedShare(ds, global_batch=2, seed=1)(empty[0])
    assert not caplog.records
