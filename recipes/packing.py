"""``data.packing`` (``recipes.trainer_config.PACKINGS``): how documents share the model's windows.

Tokenized inputs are one stream of documents, each followed by the tokenizer's EOS
(recipes/tokens.py). A document here is the run of tokens from an EOS (which then plays the
document's BOS: it predicts the first token) to the next EOS (the document's last target); the
stream's first document starts at token 0.

- ``concat`` (the default): windows cut the stream; attention and rotary positions run across
  documents inside a window.
- ``document``: the same windows, but attention is block-diagonal (a token sees only earlier
  tokens of its own document) and rotary positions restart at each document: a packed window's
  loss is the sum of its documents' losses run one by one (recipes/gpt.py ``document_layout``).
  SDPA with a boolean mask (FlexAttention's block sparsity is left for later); the model knows
  the EOS id (``ModelConfig.document_eos``, set at validation). ``model=hf`` passes
  transformers the same positions (``position_ids``, recipes/hf.py ``document_positions``) and
  no attention mask: transformers finds the documents where the positions restart and builds
  the block-causal mask itself (sdpa and eager; recipes/hf.py ``PACKED_ATTENTION``).
- ``pad``: one document per row (a longer one continues on further rows, as concat cuts it),
  padded with EOS whose targets the loss ignores (recipes/data.py ``DocumentRows``). Its
  documents end where the token cache recorded each one's end (recipes/tokens.py), not at every
  EOS: a chat template may end each turn with the EOS, and ``document`` (which restarts at each
  EOS) refuses such data at its build. Causal attention never looks
  at the padding after a token, so no mask is needed; it spends the padding's compute.
"""

from __future__ import annotations

from typing import Any


def problems(data: Any, model: Any, mesh: Any, preset: str) -> list[str]:
    """What ``data.packing`` cannot do with this data, model and layout (before launch)."""
    if data.packing == "concat":
        return []
    out = []
    if not data.tokenized:
        out.append(f"data.packing={data.packing} with data={data.name}"
                   f"{' and no data.tokenizer' if data.name == 'text' else ''}: documents are found by "
                   "the tokenizer's EOS between them, so packing needs tokenized data (jsonl, parquet, "
                   "chat, or text with data.tokenizer); use data.packing=concat")
    if data.packing != "document":
        return out
    if mesh.pp > 1:
        out.append(f"data.packing=document with strategy={preset} (pipeline degree {mesh.pp}): "
                   "the later stages see hidden states, not the tokens that place the documents; "
                   "use data.packing=pad, or a preset without a pipeline")
    if mesh.seq > 1:
        out.append(f"data.packing=document with strategy={preset} (sequence degree {mesh.seq}): "
                   "a sequence shard holds part of a document mask that ring attention and "
                   "Ulysses' all-to-all do not carry; use data.packing=pad, or a data-parallel preset")
    return out


def document_eos(data: Any) -> int | None:
    """The EOS id ``data.packing=document`` masks at (the tokenizer's, read from its JSON files);
    None for any other packing."""
    if data.packing != "document" or not data.tokenized or data.tokenizer is None:
        return None
    from recipes.token_inputs import tokenizer_info

    return tokenizer_info(data.tokenizer).eos_id
