"""``callbacks.samples``: greedy completions of a few prompts at each validation.

At each validation every rank runs recipes/samples.py's ``greedy`` together through the
engine's ``logits`` (the model as the engine wraps it: collectives inside its forward), so the
loop is the same on every backend and preset. Rank 0 logs one block per validation; the report
key ``samples`` is every completion, ``{step, prompt, completion}``, the whole run's (a resumed
run continues the record its checkpoint carries); the logger observer draws each block as text
(TensorBoard) or a table (wandb) where it can (``latest``), and skips it otherwise (csv).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from core.knobs import free, knob

from observers.base import Engine, Observer, Selection, observer

log = logging.getLogger(__name__)


class Samples(Observer):
    def __init__(self, prompts: list[str], data: Any, *, max_new_tokens: int, seq_len: int):
        self.prompts, self.data = prompts, data
        self.max_new_tokens, self.seq_len = max_new_tokens, seq_len
        self.records: list[dict[str, Any]] = []
        self.latest: list[dict[str, Any]] = []
        """The last validation's block (the logger observer reads it after this one)."""
        self._prompter: Any = None
        self._encoded: list[list[int]] = []

    def on_resume(self, engine: Engine, step: int, history: dict[str, Any]) -> None:
        self.records = [dict(r) for r in history.get("samples", []) if r["step"] <= step]

    def history(self) -> dict[str, Any]:
        return {"samples": list(self.records)}

    def on_train_start(self, engine: Engine, step: int) -> None:
        from recipes.samples import Prompter

        self._prompter = Prompter.for_data(self.data)
        self._encoded = [self._prompter.encode(p) for p in self.prompts]

    def on_validation_end(self, engine: Engine, step: int, metrics: dict[str, Any]) -> None:
        from recipes.samples import greedy

        block = []
        for prompt, ids in zip(self.prompts, self._encoded):
            new = greedy(engine.model, engine.logits, ids, max_new_tokens=self.max_new_tokens,
                         seq_len=self.seq_len, eos=self._prompter.eos)
            block.append({"step": step, "prompt": prompt, "completion": self._prompter.decode(new)})
        self.records += block
        self.latest = block
        if engine.rank == 0:
            log.info("%s", text(block))

    def report(self) -> dict[str, Any]:
        return {"samples": self.records}


def text(block: list[dict[str, Any]]) -> str:
    """One validation's completions as the console shows them."""
    lines = [f"samples at step {block[0]['step']}:" if block else "samples: none"]
    for i, r in enumerate(block, 1):
        lines += [f"  [{i}] {r['prompt']!r}", f"      -> {r['completion']!r}"]
    return "\n".join(lines)


def markdown(block: list[dict[str, Any]]) -> str:
    """One validation's completions as a markdown table (TensorBoard's text panel)."""
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", "<br>")

    return "\n".join(["| prompt | completion |", "|---|---|",
                      *(f"| {cell(r['prompt'])} | {cell(r['completion'])} |" for r in block)])


@dataclass
class SamplesObserverConfig:
    """What the model says to a few prompts at each validation (recipes/samples.py)."""

    prompts: Any = free(None, "a file or a list of prompts, read and checked at validate "
                              "(recipes/samples.py problems)")
    """A UTF-8 file (one prompt per line, or JSON lines with a "prompt" string) or a list
    (``callbacks.samples.prompts='[Once upon a time,The king]'``); None: off. Each prompt goes
    through the tokenizer's chat template when it has one; report key ``samples``."""
    max_new_tokens: int = knob(32, min=1)
    """Greedy tokens generated per prompt (fewer when the model says EOS)."""


@dataclass
class SamplesKnobs:
    samples: SamplesObserverConfig = field(default_factory=SamplesObserverConfig)


@observer("samples", order=85, knobs=SamplesKnobs)
def _selected(s: Selection) -> Observer | None:
    """callbacks.samples.prompts set: before the logger (90), which draws ``latest``."""
    cfg = s.job.callbacks.samples
    if cfg.prompts is None:
        return None
    from recipes.samples import load_prompts

    return Samples(load_prompts(cfg.prompts), s.job.data, max_new_tokens=cfg.max_new_tokens,
                   seq_len=s.job.model.seq_len)
