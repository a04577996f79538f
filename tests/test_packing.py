"""data.packing (recipes/packing.py): document masks give a packed window the loss of its
documents run one by one; pad rows hold one document each, their padding uncounted; both train
the same model on every layout (the loss is token-true); what cannot carry a document mask is
refused before launch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from recipes.config import compose
from recipes.data import IGNORE, DocumentRows, counted_per_sample
from recipes.job import validate
from strategies import ConfigError
from tests.conftest import run_cli
from tests.test_chat import assert_same_model, chat_tokenizer, sgd_chat_job  # noqa: F401  (a fixture)

CPU = ("model=gpt_nano", "cluster.accelerator=cpu", "model.dropout=0", "trainer.precision=32")
EOS = 3


def _model(document: bool):
    from recipes import training

    shape = validate(compose(list(CPU))).model
    return training.build_model(replace(shape, document_eos=EOS if document else None), 0).eval()


@pytest.mark.unit
def test_a_packed_window_with_document_masks_equals_its_documents_run_one_by_one():
    """Two windows of packed documents (the first cut at the window's start, as windows cut the
    stream): every token's loss equals that of its document alone (its EOS first, as its BOS),
    within 1e-5; without the mask (concat) the later documents' losses differ."""
    g = torch.Generator().manual_seed(0)
    packed, plain = _model(True), _model(False)
    vocab = packed.shape.vocab_size

    def doc(n: int) -> torch.Tensor:
        return torch.randint(EOS + 1, vocab, (n,), generator=g)

    e = torch.tensor([EOS])
    rows = [[doc(9), e, doc(6), e, doc(15), e], [e, doc(20), e, doc(3), e, doc(6), e]]
    streams = [torch.cat(r) for r in rows]
    assert {len(s) for s in streams} == {33}
    x, y = torch.stack([s[:-1] for s in streams]), torch.stack([s[1:] for s in streams])
    with torch.no_grad():
        got = F.cross_entropy(packed(x).flatten(0, 1), y.flatten(), reduction="none").view(2, -1)
        mixed = F.cross_entropy(plain(x).flatten(0, 1), y.flatten(), reduction="none").view(2, -1)
        for r, s in enumerate(streams):
            starts = [0, *(i for i in range(1, len(s) - 1) if s[i] == EOS)]
            for a, b in zip(starts, [*starts[1:], len(s) - 1]):
                alone = F.cross_entropy(plain(s[a:b][None])[0], s[a + 1:b + 1], reduction="none")
                assert torch.allclose(got[r, a:b], alone, atol=1e-5, rtol=1e-5), (r, a, b)
    assert (mixed - got).abs().max() > 1e-2  # concat lets documents see each other


@pytest.mark.unit
def test_pad_rows_hold_one_document_each_and_count_no_padding():
    """One document per row (its EOS first, the next EOS its last target), a long one continued
    on a second row; padding is EOS in, IGNORE out; a loss mask carries over; the counted
    targets are what the token-true loss and report.json count."""
    stream = np.array([5, 6, 7, EOS, 8, 9, 10, 11, 12, 13, EOS, 14, EOS], dtype=np.uint16)
    mask = np.array([0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 1], dtype=np.uint8)
    rows = DocumentRows(stream, 4, EOS)
    got = [(x.tolist(), y.tolist()) for x, y in (rows[i] for i in range(len(rows)))]
    i = IGNORE
    assert got == [([5, 6, 7, EOS], [6, 7, EOS, i]),
                   ([EOS, 8, 9, 10], [8, 9, 10, 11]), ([11, 12, 13, EOS], [12, 13, EOS, i]),
                   ([EOS, 14, EOS, EOS], [14, EOS, i, i])]
    masked = DocumentRows(stream, 4, EOS, mask=mask)
    assert masked[1][1].tolist() == [i, i, 10, 11]
    assert counted_per_sample(masked).tolist() == [int((masked[k][1] != i).sum()) for k in range(4)]
    assert rows.counts() == (12, 12) and masked.counts() == (12, 9)


@pytest.mark.unit
def test_packing_refusals_name_the_key_and_the_way_out():
    def problems(*o: str) -> str:
        with pytest.raises(ConfigError) as e:
            validate(compose([*CPU, *o]))
        return str(e.value)

    msg = problems("data=synthetic", "data.packing=pad")
    assert "data.packing=pad with data=synthetic" in msg and "data.packing=concat" in msg
    assert "and no data.tokenizer" in problems("data.packing=document")  # byte-level text
    two = ("cluster.devices=2",)
    for preset, what in (("pipeline", "pipeline degree 2"), ("ulysses", "sequence degree 2"),
                         ("fsdp_cp", "sequence degree 2")):
        msg = problems("data=synthetic", "data.packing=document", f"strategy={preset}", *two)
        assert f"strategy={preset} ({what})" in msg and "data.packing=pad" in msg, msg
    assert "document_eos" not in msg


@pytest.mark.unit
def test_the_planner_counts_the_document_mask():
    from planner.activations import activation_bytes, document_mask_bytes

    shape = validate(compose(["model=llama_1b", "cluster.accelerator=cpu"])).model
    doc = replace(shape, document_eos=2)
    mask = document_mask_bytes(doc, micro=4)
    assert mask == 4 * shape.seq_len ** 2 and document_mask_bytes(shape, micro=4) == 0
    assert activation_bytes(doc, micro=4) - activation_bytes(shape, micro=4) == mask
    assert document_mask_bytes(doc, micro=4, seq=2) == mask // 2


# ------------------------------------------------------------------ through train.py
LAYOUTS = {
    "document-ddp": ("data.packing=document", "strategy=ddp", "cluster.devices=2"),
    "pad-ddp": ("data.packing=pad", "strategy=ddp", "cluster.devices=2"),
    "pad-ulysses": ("data.packing=pad", "strategy=ulysses", "cluster.devices=2"),
    "document-fsdp2": ("data.packing=document", "strategy=fsdp2", "cluster.devices=2"),
    "document-tp": ("data.packing=document", "strategy=tp", "cluster.devices=2"),
    "document-zero2-accelerate": ("data.packing=document", "strategy=zero2", "cluster.devices=2",
                                  "backend=accelerate"),
}
CI = ("document-ddp",)


@pytest.fixture(scope="module")
def packed_job(chat_tokenizer, tmp_path_factory):
    """Chat data packed each way; the references: one process, the whole global batch at once."""
    tmp = tmp_path_factory.mktemp("packing")
    common = (*sgd_chat_job(tmp, chat_tokenizer, 40, steps=2, global_batch=4, micro=1), "model.seq_len=128")
    refs: dict[str, object] = {}

    def reference(packing: str):
        if packing not in refs:
            refs[packing] = run_cli("train.py", *common, f"data.packing={packing}", "strategy=single",
                                    "trainer.micro_batch_size=4", out=tmp / packing, timeout=300)
        return refs[packing]

    return common, reference


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [pytest.param(k, marks=[] if k in CI else [pytest.mark.slow])
                                    for k in LAYOUTS])
def test_packed_documents_train_the_same_model_on_every_layout(packed_job, layout, tmp_path):
    """SGD, 1e-5: losses, validation loss and parameters equal one process with the whole batch;
    the report counts only real targets (pad: fewer than rows x seq_len)."""
    common, reference = packed_job
    packing = layout.split("-")[0]
    ref = reference(packing)
    run = run_cli("train.py", *common, *LAYOUTS[layout], out=tmp_path / layout, timeout=400)
    assert_same_model(ref, run)
    data = run.report["data"]
    assert data["loss_tokens"] < data["tokens"]


@pytest.mark.unit
def test_document_packing_hands_the_model_the_tokenizers_eos(hf_tokenizer):
    """Validation derives model.document_eos from the tokenizer (its JSON files: no
    transformers); other packings leave the model causal over the window."""
    text = ("data=text", f"data.tokenizer={hf_tokenizer}", "model.vocab_size=512")
    assert validate(compose([*CPU, *text, "data.packing=document"])).model.document_eos == 0
    assert validate(compose([*CPU, *text, "data.packing=pad"])).model.document_eos is None
