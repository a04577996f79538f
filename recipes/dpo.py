"""Direct Preference Optimization (``objective=dpo``, ``data=preference``).

Data: each JSONL record {prompt, chosen, rejected} gives one sample of two rows, prompt+chosen
and prompt+rejected rendered with the tokenizer's chat template, each padded (or cut) to
``model.seq_len + 1`` tokens; a target counts only where its token lies in the response (what
the template renders after ``render(prompt, add_generation_prompt=True)``). A sample is a pair,
so the sampler keeps the two rows in one micro-batch, and every layout's micro-batches hold the
same number of pairs: the mean over a micro-batch's pairs, averaged over micro-batches and
data-parallel ranks as every engine does, is the mean over the global batch's pairs.

Reference: before training, every rank runs the frozen base model (``build_model`` from the
seed, or the pretrained weights: with LoRA, the model before adapters, which equals it since
their B starts at zero) once over every pair on its device, and keeps each row's summed
response log-probability beside the tokens; rank 0 caches them in the run directory
(``dpo_reference.pt``, written whole or not at all), keyed on the pairs and on the model they
came from (``reference_key``). A fresh start computes them anew and replaces the file; a resumed
run reads it back only when it was made for this run's initial model and pairs (otherwise it
says what differs and computes them). Cost: one forward pass over the data per rank, with one
whole model on one device, before the engine shards it. The reference runs in
fp32 and eval mode: under mixed precision or with dropout the policy's first forward differs
from it by that rounding / noise (the first loss is ln 2 exactly only at 32-bit without dropout).

Loss per pair (TRL's sigmoid loss): z = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)),
-(1 - ls) logsigmoid(beta z) - ls logsigmoid(-beta z).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from core.errors import DataError
from recipes.data import IGNORE

log = logging.getLogger(__name__)

REFERENCE_FILE = "dpo_reference.pt"


# ---------------------------------------------------------------------------- data
def _messages(value: Any, role: str) -> list[dict]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def pair_row(tok: Any, prompt: Any, response: Any) -> tuple[list[int], list[int]]:
    """prompt + response rendered with ``tok``'s chat template, as (token ids, response mask):
    1 for each token whose first character lies after the rendered prompt and its generation
    prompt."""
    p, r = _messages(prompt, "user"), _messages(response, "assistant")
    before = tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(p + r, tokenize=False)
    if not full.startswith(before):
        raise DataError("the chat template does not render prompt + response with the prompt "
                        "(and its generation prompt) as a prefix, so the response tokens "
                        "cannot be told apart")
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [int(a >= len(before)) for a, _ in enc["offset_mapping"]]


def _row(ids: list[int], mask: list[int], seq_len: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``seq_len``: a response target counts, every other is IGNORE."""
    ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
    x = torch.full((seq_len,), pad, dtype=torch.int64)
    y = torch.full((seq_len,), IGNORE, dtype=torch.int64)
    n = len(ids) - 1
    x[:n] = torch.tensor(ids[:-1])
    y[:n] = torch.tensor([t if m else IGNORE for t, m in zip(ids[1:], mask[1:])])
    return x, y


class PreferencePairs(Dataset):
    """Sample i: (inputs [2, seq_len], targets [2, seq_len], reference log-probs [2]); row 0 the
    chosen response, row 1 the rejected one. Before ``attach_reference``: (inputs, targets)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, cut: int = 0):
        self.x, self.y, self.cut = x, y, cut
        self.seq_len = x.shape[-1]
        self.ref: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        if self.ref is None:
            return self.x[i], self.y[i]
        return self.x[i], self.y[i], self.ref[i]

    def counted(self) -> Any:
        """Each pair's response targets (both rows)."""
        return (self.y != IGNORE).sum((1, 2)).numpy()

    def counts(self, first: int = 0, stop: int | None = None) -> tuple[int, int]:
        """report.json ``data``: (targets, response targets) of pairs ``first .. stop - 1``."""
        n = int(self.y[first:stop].numel())
        return n, int((self.y[first:stop] != IGNORE).sum())


def read_pairs(path: str | Path) -> list[dict]:
    """The records of a .jsonl file, each checked for prompt, chosen and rejected."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            rec = json.loads(line)
            missing = [k for k in ("prompt", "chosen", "rejected") if k not in rec]
            if missing:
                raise DataError(f"data.path={path}: record {n} has no {', '.join(missing)} "
                                "(each needs prompt, chosen and rejected)")
            out.append(rec)
    if not out:
        raise DataError(f"data.path={path}: no records")
    return out


def preference_pairs(data_cfg: Any, shape: Any) -> PreferencePairs:
    """``data=preference``: the pairs of ``data.path`` tokenized with ``data.tokenizer``'s chat
    template (in memory, every rank alike)."""
    from recipes.tokens import load_tokenizer

    tok = load_tokenizer(Path(data_cfg.tokenizer))
    pad = tok.eos_token_id if tok.eos_token_id is not None else 0
    xs, ys, cut = [], [], 0
    for n, rec in enumerate(read_pairs(data_cfg.path)):
        rows = []
        for side in ("chosen", "rejected"):
            try:
                ids, mask = pair_row(tok, rec["prompt"], rec[side])
            except Exception as e:
                raise DataError(f"data.path={data_cfg.path}: record {n}'s prompt + {side} does not "
                                f"render with the chat template of data.tokenizer: {e}") from e
            if max(ids) >= shape.vocab_size:
                raise DataError(f"data.path={data_cfg.path}: token id {max(ids)} but model.vocab_size="
                                f"{shape.vocab_size}: use the model's own tokenizer")
            cut += len(ids) > shape.seq_len + 1
            rows.append(_row(ids, mask, shape.seq_len, pad))
        xs.append(torch.stack([r[0] for r in rows]))
        ys.append(torch.stack([r[1] for r in rows]))
    if cut:
        log.warning("data=preference: %d of %d sequences are longer than model.seq_len + 1 = %d "
                    "tokens and were cut (their response log-probability counts the tokens kept)",
                    cut, 2 * len(xs), shape.seq_len + 1)
    return PreferencePairs(torch.stack(xs), torch.stack(ys), cut)


# ---------------------------------------------------------------------------- reference
def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's sum of its counted targets' log-probabilities, in fp32."""
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                          reduction="none")
    return -nll.view(targets.shape).sum(-1)


def reference_logps(pairs: PreferencePairs, shape: Any, seed: int, device: str | torch.device,
                    batch: int = 8) -> torch.Tensor:
    """[pairs, 2] log-probabilities of the responses under the base model (eval mode, fp32)."""
    from recipes.training import build_model

    model = build_model(shape, seed).to(device).eval()
    out = []
    with torch.no_grad():
        for a in range(0, len(pairs), batch):
            x, y = pairs.x[a:a + batch].to(device), pairs.y[a:a + batch].to(device)
            out.append(sequence_logps(model(x.flatten(0, 1)), y.flatten(0, 1)).view(-1, 2).cpu())
    del model
    return torch.cat(out)


def attach_reference(pairs: PreferencePairs, shape: Any, seed: int, out: Path, accelerator: str,
                     batch: int = 8, *, resumed: bool = False) -> None:
    """The reference log-probs of every pair: on a resume (``resumed``), read from
    ``out/dpo_reference.pt`` when it was made for these pairs and this model
    (``reference_key``); else -- a fresh start, or a cache of another model, other pairs or none
    -- computed here (each rank, ``batch`` pairs a forward: the training micro-batch's, so its
    logits are no larger than training's) and written by rank 0 in place of the file. The
    planner plans this pass (planner/plan.py ``reference_problems``)."""
    path = Path(out) / REFERENCE_FILE
    key = reference_key(pairs, shape, seed)
    if resumed:
        why = _read_cache(pairs, path, key)
        if why is None:
            log.info("dpo: reference log-probs of %d pairs read from %s", len(pairs), path)
            return
        log.warning("dpo: resumed, but %s: the reference log-probs are computed anew from this "
                    "run's initial model", why)
    local = int(os.environ.get("LOCAL_RANK") or 0)
    device = f"cuda:{local}" if accelerator != "cpu" and torch.cuda.is_available() else "cpu"
    pairs.ref = reference_logps(pairs, shape, seed, device, batch)
    log.info("dpo: reference log-probs of %d pairs computed on %s", len(pairs), device)
    if int(os.environ.get("RANK") or 0) == 0:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        torch.save({"key": key, "ref": pairs.ref}, tmp)
        os.replace(tmp, path)  # (whole or absent: a resumed run reads it, other ranks may too)


def reference_key(pairs: PreferencePairs, shape: Any, seed: int) -> dict[str, Any]:
    """What decides the reference log-probs: the pairs' tokens (``pairs_digest``: each row's
    tokens and response mask in their order), and the model before training
    -- its shape fields; for a transformers model, its directory and, with
    ``model.pretrained``, each safetensors file's name, size and modification time (weights
    rewritten in place are another model); for random weights (the built-in models,
    ``model.pretrained=false``), the seed. Not the adapters (their B starts at zero), dropout
    (the pass runs in eval mode) or the packing."""
    import dataclasses

    model = {k: v for k, v in dataclasses.asdict(shape).items()
             if k not in ("name", "lora", "dropout", "document_eos", "seq_len")}
    if shape.is_hf:
        from recipes.hf_config import locate

        where = locate(shape.path).resolve()
        model["path"] = str(where)
        if shape.pretrained:
            model["weights"] = [[f.name, f.stat().st_size, f.stat().st_mtime_ns]
                                for f in sorted(where.glob("*.safetensors"))]
    if not (shape.is_hf and shape.pretrained):
        model["seed"] = seed
    return {"pairs": [*pairs.x.shape, pairs_digest(pairs)], "model": model}


def pairs_digest(pairs: PreferencePairs) -> str:
    """SHA-256 of the pairs' inputs and targets, byte for byte: another order of the records, or
    chosen and rejected swapped inside one, is another digest (sums of the tokens, the key
    before, were the same for both, and a resume paired each row with another's reference)."""
    import hashlib

    h = hashlib.sha256()
    for t in (pairs.x, pairs.y):
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().numpy().data)
    return h.hexdigest()


def _read_cache(pairs: PreferencePairs, path: Path, key: dict[str, Any]) -> str | None:
    """Attach the cached reference when ``path`` holds the one of ``key``; else why not."""
    if not path.is_file():
        return f"{path} is not there"
    cached = torch.load(path, map_location="cpu", weights_only=True)
    have = cached.get("key")
    if have == key:
        pairs.ref = cached["ref"]
        return None
    if not isinstance(have, dict):
        return f"{path} does not say which model it was made for (an older run's)"
    old, new = ({"pairs": k.get("pairs"), **{f"model.{n}": v for n, v in (k.get("model") or {}).items()}}
                for k in (have, key))
    differ = [n for n in sorted(set(old) | set(new)) if old.get(n) != new.get(n)]
    named = ", ".join("the pairs' tokens" if n == "pairs" else n for n in differ)
    return f"{path} was made for another model or other pairs ({named or 'its key'} differ)"


# ---------------------------------------------------------------------------- loss
def dpo_losses(policy: torch.Tensor, reference: torch.Tensor, beta: float,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-pair losses, rewards [pairs, 2]) from [pairs, 2] log-probs (chosen, rejected)."""
    ratios = policy - reference
    z = ratios[:, 0] - ratios[:, 1]
    losses = -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    return losses, beta * ratios.detach()


class Dpo:
    """The ``objective=dpo`` loss of a micro-batch (the mean over its pairs), and the rewards of
    the last step's pairs, summed here and over ranks by ``publish`` into report.json ``dpo``."""

    def __init__(self, beta: float, label_smoothing: float, meta: dict[str, Any] | None = None):
        self.beta, self.label_smoothing, self.meta = beta, label_smoothing, meta
        self._step, self._sums = -1, None

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...], step: int) -> torch.Tensor:
        x, y, ref = batch
        policy = sequence_logps(model(x.flatten(0, 1)), y.flatten(0, 1)).view(-1, 2)
        losses, rewards = dpo_losses(policy, ref.to(policy), self.beta, self.label_smoothing)
        sums = torch.stack([torch.tensor(float(len(losses)), device=rewards.device),
                            rewards[:, 0].sum(), rewards[:, 1].sum(),
                            (rewards[:, 0] > rewards[:, 1]).float().sum()]).double()
        if step != self._step or self._sums is None:
            self._step, self._sums = step, sums
        else:
            self._sums = self._sums + sums
        return losses.mean()

    def publish(self) -> dict[str, float] | None:
        """report.json ``dpo`` (the last step's global batch): ``chosen_reward``,
        ``rejected_reward`` (mean beta x log-ratio), ``reward_margin`` (their difference),
        ``accuracy`` (share of pairs whose chosen reward is the higher), ``pairs``. Every rank
        calls it (a collective)."""
        import torch.distributed as dist

        if self._sums is None:
            return None
        sums = self._sums.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        n, chosen, rejected, right = (float(v) for v in sums.cpu())
        out = {"chosen_reward": chosen / n, "rejected_reward": rejected / n,
               "reward_margin": (chosen - rejected) / n, "accuracy": right / n, "pairs": int(n),
               "step": self._step + 1}
        if self.meta is not None:
            self.meta["dpo"] = out
        return out


def objective_for(job: Any, train: Dataset, out: Path, meta: dict[str, Any], *,
                  resumed: bool) -> Dpo | None:
    """The run's objective: None (next-token loss) or, for objective=dpo, ``Dpo`` with the
    training pairs' reference log-probs attached (``resumed``: the run continues from a
    checkpoint, so the cached reference of its initial model is read back)."""
    o = getattr(job, "objective", None)
    if o is None or o.name != "dpo":
        return None
    attach_reference(train, job.model, job.trainer.seed, out, job.run.accelerator,
                     batch=job.trainer.micro_batch_size, resumed=resumed)
    return Dpo(o.beta, o.label_smoothing, meta)
