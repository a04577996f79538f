"""``callbacks.samples``: what the model says to a few prompts at each validation, greedy and
bounded, the same on every preset and backend.

The prompts are a file (one prompt per line, or JSON lines with a ``prompt`` key) or an inline
list. Each is encoded once: with the tokenizer's chat template when it has one (a user turn
and the generation prompt), else as plain tokens (``data.tokenizer``'s, or byte tokens with
data=text and data=synthetic, as our built-in GPT reads them). ``greedy`` then runs the loop
every rank runs together: each new token is the argmax of one forward of the whole sequence so
far (no cache; the last ``model.seq_len`` tokens) through the model *as the engine wraps it*
(DDP, FSDP1/2, ZeRO-3, TP: every rank's forward gathers what it needs), and rank 0's argmax is
broadcast so every rank appends the same token and stops at the same step (EOS, or
``max_new_tokens``). The model is in eval mode under no_grad throughout and goes back to the
mode it had: training sees nothing (no RNG is drawn, no gradient or state is touched).

Refused at validate: presets whose forward is not the whole sequence on every rank (a pipeline
runs a stage, context and Ulysses parallelism a shard of the sequence), data without a
validation split (samples come with validations), data=tokens without a tokenizer. Torch-free
at import (validation imports it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BYTE_DATA = ("text", "synthetic")  # data that our built-in GPT reads as byte tokens


def load_prompts(prompts: Any) -> list[str]:
    """The prompts ``callbacks.samples.prompts`` names: a list as given, or a file's (JSON lines
    with ``prompt`` when every non-empty line is such an object, else one prompt per line)."""
    if prompts is None:
        return []
    if not isinstance(prompts, str):
        return [str(p) for p in prompts]
    lines = [ln for ln in Path(prompts).expanduser().read_text(encoding="utf-8").splitlines() if ln.strip()]
    records = []
    for ln in lines:
        try:
            records.append(json.loads(ln))
        except ValueError:
            return lines
    if records and all(isinstance(r, dict) for r in records):
        if not all(isinstance(r.get("prompt"), str) for r in records):
            raise ValueError("a JSON line has no string \"prompt\"")
        return [r["prompt"] for r in records]
    return lines


def problems(samples: Any, data: Any, model: Any, mesh: Any, preset: str) -> list[str]:
    """Why ``callbacks.samples`` cannot run as configured (nothing when ``prompts`` is None)."""
    if samples.prompts is None:
        return []
    key = "callbacks.samples.prompts"
    try:
        prompts = load_prompts(samples.prompts)
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return [f"{key}={samples.prompts}: {why.lower()}: give a UTF-8 file with one prompt per line, or "
                "JSON lines with a \"prompt\" string, or a list (callbacks.samples.prompts='[Hi,Once]')"]
    out = [] if prompts else [f"{key}={samples.prompts} holds no prompt: give at least one, or "
                              f"{key}=null (off)"]
    if not data.validates:
        out.append(f"{key} is generated at each validation, and the data has no validation split: "
                   "set data.val_fraction (e.g. 0.05) or data.val_path; or "
                   f"{key}=null")
    if getattr(data, "mixture", None):
        from recipes.mixture import one_tokenizer

        if not one_tokenizer(data):
            out.append(f"{key} with data.mixture: the sources read different tokenizers, so the "
                       "prompts have no one encoding: give every source the same data.mixture[i]."
                       f"tokenizer; or {key}=null")
    elif data.tokenizer is None and data.name not in BYTE_DATA:
        out.append(f"{key} needs a tokenizer to encode the prompts, and data={data.name} has none: "
                   f"set data.tokenizer (the one the data was made with); or {key}=null")
    elif data.tokenizer is None and model is not None and model.vocab_size < 256:
        out.append(f"{key}: byte tokens need model.vocab_size >= 256 (it is {model.vocab_size}): "
                   f"set model.vocab_size=256, or {key}=null")
    if mesh is not None and (mesh.pp > 1 or mesh.seq > 1):
        what = "a pipeline runs one stage per rank" if mesh.pp > 1 else \
            "context/sequence parallelism gives each rank a shard of the sequence"
        out.append(f"{key} with strategy={preset}: greedy generation runs the whole sequence "
                   f"through the model on every rank, and {what}: use a preset without "
                   f"pipeline, context or sequence parallelism (ddp, fsdp2, zero3, tp), or {key}=null")
    return out


@dataclass
class Prompter:
    """Prompts to token ids and completions back to text, with the run's tokenizer (None: bytes)."""

    tokenizer: Any = None

    @classmethod
    def for_data(cls, data: Any) -> Prompter:
        if data.tokenizer is None:
            return cls(None)
        from recipes.tokens import load_tokenizer

        return cls(load_tokenizer(Path(data.tokenizer).expanduser()))

    @property
    def eos(self) -> int | None:
        return None if self.tokenizer is None else self.tokenizer.eos_token_id

    @property
    def chat(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            return list(prompt.encode("utf-8"))
        if self.chat:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok(prompt)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def greedy(model: Any, logits: Callable[[Any], Any], ids: list[int], *, max_new_tokens: int,
           seq_len: int, eos: int | None = None) -> list[int]:
    """The new tokens of a greedy continuation of ``ids``: ``logits(tokens)`` (a (1, t) CPU
    tensor, which it moves to the engine's device) -> (1, t, vocab) logits through the wrapped
    ``model``, called on every rank together; rank 0's argmax is every rank's. Eval mode and
    no_grad, the model's mode restored."""
    import torch
    import torch.distributed as dist

    collective = dist.is_available() and dist.is_initialized()
    was = model.training
    model.eval()
    new: list[int] = []
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                tokens = torch.tensor([(ids + new)[-seq_len:]], dtype=torch.long)
                out = logits(tokens)
                out = getattr(out, "logits", out)
                if hasattr(out, "full_tensor"):  # a DTensor (tensor-parallel logits)
                    out = out.full_tensor()
                token = out[0, -1].float().argmax().reshape(1)
                if collective:
                    dist.broadcast(token, src=0)
                new.append(int(token.item()))
                if eos is not None and new[-1] == eos:
                    break
    finally:
        model.train(was)
    return new
