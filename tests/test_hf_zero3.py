"""model=hf under ZeRO-3 (built under ``zero.Init``) when config.json names a ``pad_token_id``:
transformers' weight init zeroes the padding row (``module.weight[module.padding_idx]``),
which on a partitioned, empty embedding is an IndexError. The build must not run that pass on
partitions (recipes/hf.py ``HFCausalLM.__init__``), and the run must equal the single-process
one: pretrained weights (with a tied head too), random ones from the seed, parameters offloaded
to the CPU, and the Accelerate backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the hf extra

from tests.conftest import TINY, assert_losses_close, assert_params_close, normalized, run_cli  # noqa: E402
from tests.test_hf import HF, _save  # noqa: E402


@pytest.fixture(scope="module")
def llama_pad(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llamas whose config names a padding token (their embedding gets a ``padding_idx``),
    with their own head and with the head tied to the embedding; the bundled text's byte tokens
    fit the 259-token vocabulary."""
    shape = dict(vocab_size=259, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=258)
    return {head: _save(tmp_path_factory.mktemp(f"llama_pad_{head}"), **shape,
                        tie_word_embeddings=head == "tied") for head in ("untied", "tied")}


@pytest.fixture(scope="module")
def pad_runs(llama_pad, tmp_path_factory):
    """pad_runs(head, *overrides) -> the Run of train.py on ``llama_pad[head]``, once per module."""
    done = {}

    def get(head: str, *overrides: str):
        key = normalized((*TINY, *HF, f"model.path={llama_pad[head]}", *overrides))
        if key not in done:
            out = tmp_path_factory.mktemp("hf_pad") / "run"
            done[key] = run_cli("train.py", *key, out=out, timeout=300)
        return done[key]

    return get


ZERO3 = ("strategy=zero3",)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("head,zero,both", [
    ("untied", ZERO3, ()),
    pytest.param("tied", ZERO3, (), marks=pytest.mark.slow),
    pytest.param("untied", ZERO3, ("model.pretrained=false",), marks=pytest.mark.slow),
    pytest.param("untied", ("strategy=zero3_offload",), (), marks=pytest.mark.slow),
    pytest.param("untied", (*ZERO3, "backend=accelerate"), (), marks=pytest.mark.slow)],
    ids=["pretrained", "tied", "random-init", "offload", "accelerate"])
def test_a_padding_token_trains_under_zero3_as_in_one_process(pad_runs, head, zero, both):
    """2 ranks of ZeRO-3 build the model partitioned and equal the single-process run: every
    step's loss and every final parameter (SGD: a wrong weight or gradient scale shows). A tied
    head is the embedding there too (the skipped init also tied it); random weights come from
    the seed, one gathered module at a time. (LoRA is refused with ZeRO-3 before launch:
    partitioned parameters lose per-parameter requires_grad.)"""
    single = pad_runs(head, "strategy=single", "trainer.micro_batch_size=8", *both)
    run = pad_runs(head, *zero, "cluster.devices=2", "trainer.micro_batch_size=4", *both)
    assert_losses_close(single.losses, run.losses, rtol=1e-5)
    assert_params_close(single.params(), run.params(), rtol=1e-5)
