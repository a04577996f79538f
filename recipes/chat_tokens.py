"""Chat conversations to tokens and their loss mask (``chat_tokens``; recipes/tokens.py caches
them): each conversation rendered with the tokenizer's chat template; with
``assistant_only`` a mask marks the assistant turns as the template renders them (what
``render(messages[:i], add_generation_prompt=True)`` adds up to ``render(messages[:i+1])``: the
reply and its end-of-turn marker, not the header that prompts it). A template with
``{% generation %}`` blocks marks them itself (transformers' ``return_assistant_tokens_mask``).
A token counts when its first character is inside an assistant turn; the EOS appended between
conversations does not.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

from core.errors import DataError
from recipes.token_inputs import GENERATION, _messages_problem

# ---------------------------------------------------------------------------- chat
def chat_tokens(tok: Any, conversations: list[Any], eos: int, *, assistant_only: bool = True,
                first: int = 0, source: str = "data.path") -> tuple[list[list[int]], list[list[int]] | None]:
    """Each conversation's tokens (rendered with ``tok``'s chat template, EOS appended unless
    the template ends with it) and, with ``assistant_only``, its loss mask (1: an assistant
    token). ``first``: how many conversations come before these (errors count records from 1,
    as token_checks.bad_record does)."""
    template = tok.chat_template
    if assistant_only and isinstance(template, str) and GENERATION.search(template):
        return _generation_masks(tok, conversations, eos, first, source)
    texts, spans = [], []
    for n, messages in enumerate(conversations):
        if (why := _messages_problem(messages)) is not None:
            raise DataError(f"{source}: record {first + n + 1}'s messages are {why}")
        try:
            text, sp = _render(tok, messages, assistant_only)
        except Exception as e:
            raise DataError(f"{source}: record {first + n + 1} does not render with the chat template "
                            f"of data.tokenizer: {e}") from e
        texts.append(text)
        spans.append(sp)
    ids_out: list[list[int]] = []
    masks_out: list[list[int]] | None = [] if assistant_only else None
    if tok.is_fast:
        enc = tok(texts, add_special_tokens=False, return_offsets_mapping=assistant_only)
        for k, ids in enumerate(enc["input_ids"]):
            ids = list(ids)
            if assistant_only:
                masks_out.append(_span_mask([a for a, _ in enc["offset_mapping"][k]], spans[k]))
            ids_out.append(ids)
    else:  # no offsets: tokenize the pieces between span boundaries separately
        for text, sp in zip(texts, spans):
            cuts = sorted({0, len(text), *(b for s in sp for b in s)})
            ids, mask = [], []
            for a, b in itertools.pairwise(cuts):
                piece = tok(text[a:b], add_special_tokens=False)["input_ids"]
                ids += piece
                mask += [int(any(s <= a < e for s, e in sp))] * len(piece)
            ids_out.append(ids)
            if assistant_only:
                masks_out.append(mask)
    for k, ids in enumerate(ids_out):
        if not ids or ids[-1] != eos:
            ids.append(eos)
            if masks_out is not None:
                masks_out[k].append(0)
    return ids_out, masks_out


def _render(tok: Any, messages: list[dict], spans: bool) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    def render(msgs: list[dict], prompt: bool) -> str:
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)

    full = render(messages, False)
    out: list[tuple[int, int]] = []
    if not spans:
        return full, out
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        try:
            before = render(messages[:i], True)
        except Exception:  # (a template that cannot render no messages)
            if i:
                raise
            before = ""
        after = render(messages[: i + 1], False)
        if not (after.startswith(before) and full.startswith(after)):
            raise DataError(
                f"the template does not render the conversation incrementally (message {i}'s "
                "rendering is not a prefix of the whole), so its assistant tokens cannot be told "
                "apart: mark them with {% generation %} ... {% endgeneration %} in the template, or "
                "set data.train_on=all")
        out.append((len(before), len(after)))
    return full, out


def _span_mask(starts: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character lies in one of the (sorted, disjoint) spans."""
    lo = [s for s, _ in spans]
    mask = []
    for a in starts:
        i = bisect.bisect_right(lo, a) - 1
        mask.append(int(i >= 0 and a < spans[i][1]))
    return mask


def _generation_masks(tok: Any, conversations: list[Any], eos: int, first: int, source: str
                      ) -> tuple[list[list[int]], list[list[int]]]:
    """A template's own ``{% generation %}`` blocks as the loss mask."""
    ids_out, masks_out = [], []
    for n, messages in enumerate(conversations):
        if (why := _messages_problem(messages)) is not None:
            raise DataError(f"{source}: record {first + n + 1}'s messages are {why}")
        try:
            enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        except Exception as e:
            raise DataError(f"{source}: record {first + n + 1} does not render with the chat template "
                            f"of data.tokenizer: {e}") from e
        ids, mask = list(enc["input_ids"]), [int(b) for b in enc["assistant_masks"]]
        if not ids or ids[-1] != eos:
            ids.append(eos)
            mask.append(0)
        ids_out.append(ids)
        masks_out.append(mask)
    return ids_out, masks_out
