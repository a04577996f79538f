"""data.packing=document with model=hf (recipes/hf.py ``document_positions``): transformers gets
rotary positions that restart at each document and no attention mask, finds the documents where
the positions restart (masking_utils.find_packed_sequence_indices) and builds the block-causal
mask itself, so a packed window's loss is its documents' losses run one by one -- on Llama,
Qwen2 and Mistral (whose sliding-window mask goes through create_sliding_window_causal_mask);
and train.py trains the same model with it on DDP x2 as in one process. No downloads: tiny
random models written here with ``save_pretrained``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")  # the hf extra

from recipes.config import compose, describe  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.test_chat import assert_same_model, chat_tokenizer, sgd_chat_job  # noqa: E402,F401  (a fixture)

EOS = 3
VOCAB = 516  # the tests' chat tokenizer (512 ids and its template's specials) fits


def _save(out: Path, family: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def _model(path: Path, document: bool):
    from recipes import training

    shape = describe(compose(["model=hf", f"model.path={path}", "model.seq_len=64"]).model)
    return training.build_model(replace(shape, document_eos=EOS if document else None), 0).eval()


@pytest.mark.unit
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_a_packed_window_equals_its_documents_run_one_by_one(tmp_path, family):
    """Two windows of packed documents (the first cut at the window's start): every token's loss
    equals that of its document alone (its EOS first, as its BOS) within 1e-5 (measured: ~1e-6);
    without position_ids (concat) the later documents' losses differ."""
    from recipes.hf import document_positions

    path = _save(tmp_path / family, family)
    packed, plain = _model(path, True), _model(path, False)
    g = torch.Generator().manual_seed(0)

    def doc(n: int) -> torch.Tensor:
        return torch.randint(EOS + 1, VOCAB, (n,), generator=g)

    e = torch.tensor([EOS])
    rows = [[doc(9), e, doc(6), e, doc(15), e], [e, doc(20), e, doc(3), e, doc(6), e]]
    streams = [torch.cat(r) for r in rows]
    assert {len(s) for s in streams} == {33}
    x, y = torch.stack([s[:-1] for s in streams]), torch.stack([s[1:] for s in streams])
    assert document_positions(x, EOS)[0, 8:12].tolist() == [8, 0, 1, 2]
    worst = 0.0
    with torch.no_grad():
        got = F.cross_entropy(packed(x).flatten(0, 1), y.flatten(), reduction="none").view(2, -1)
        mixed = F.cross_entropy(plain(x).flatten(0, 1), y.flatten(), reduction="none").view(2, -1)
        for r, s in enumerate(streams):
            starts = [0, *(i for i in range(1, len(s) - 1) if s[i] == EOS)]
            for a, b in zip(starts, [*starts[1:], len(s) - 1]):
                alone = F.cross_entropy(plain(s[a:b][None])[0], s[a + 1:b + 1], reduction="none")
                assert torch.allclose(got[r, a:b], alone, atol=1e-5, rtol=1e-5), (r, a, b)
                worst = max(worst, float((got[r, a:b] - alone).abs().max()))
    assert worst < 1e-5
    assert (mixed - got).abs().max() > 1e-2  # concat lets documents see each other


@pytest.mark.unit
def test_model_hf_takes_document_packing_and_other_refusals_stay(tmp_path, hf_tokenizer):
    """validate accepts model=hf with data.packing=document and hands the model the tokenizer's
    EOS; the pipeline and sequence-shard refusals still apply."""
    from recipes.job import CONFIG, RUN, validate
    from recipes.token_inputs import tokenizer_info
    from strategies import ConfigError

    path = _save(tmp_path / "llama", "llama")
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "one document"}\n{"text": "and another"}\n')
    base = ["model=hf", f"model.path={path}", "model.seq_len=64", "cluster.accelerator=cpu",
            "trainer.precision=32", "data=jsonl", f"data.path={data}", f"data.tokenizer={hf_tokenizer}",
            "data.packing=document"]
    job = validate(compose(base), depth=CONFIG)
    assert job.model.document_eos == tokenizer_info(str(hf_tokenizer)).eos_id
    for preset, what in (("ulysses", "sequence degree 2"), ("pipeline", "pipeline degree 2")):
        with pytest.raises(ConfigError) as e:
            validate(compose([*base, f"strategy={preset}", "cluster.devices=2"]), depth=RUN)
        assert what in str(e.value) and "packing=document with model=hf" not in str(e.value), str(e.value)


@pytest.mark.unit
def test_other_attention_implementations_are_refused_by_name(tmp_path, monkeypatch):
    from recipes import hf

    path = _save(tmp_path / "llama", "llama")
    shape = describe(compose(["model=hf", f"model.path={path}", "model.seq_len=64"]).model)
    monkeypatch.setattr(hf, "ATTENTION", "flex_attention")
    with pytest.raises(ValueError, match="'flex_attention' does not build the document mask"):
        hf.HFCausalLM(replace(shape, document_eos=EOS))


# ------------------------------------------------------------------ through train.py
@pytest.mark.multiprocess
@pytest.mark.slow  # 94 s here (two train.py runs of model=hf): over the CI tier's 30 s
@pytest.mark.timeout(600)
def test_packed_documents_on_hf_train_the_same_model_on_ddp(chat_tokenizer, tmp_path):
    """model=hf, data.packing=document, SGD: DDP x2 (one sample per rank and micro-batch) gives
    one process's losses, validation loss and parameters within 1e-5. (model.pretrained=false:
    random weights from the seed, the path that HFCausalLM._gathered's fix made run.)"""
    path = _save(tmp_path / "llama", "llama")
    common = (*sgd_chat_job(tmp_path, chat_tokenizer, 40, steps=2, global_batch=4, micro=1),
              "model=hf", f"model.path={path}", "model.pretrained=false", "model.seq_len=128",
              "data.packing=document")
    ref = run_cli("train.py", *common, "strategy=single", "trainer.micro_batch_size=4",
                  out=tmp_path / "single", timeout=300)
    run = run_cli("train.py", *common, "strategy=ddp", "cluster.devices=2", out=tmp_path / "ddp",
                  timeout=400)
    assert_same_model(ref, run)
