"""The best checkpoint and early stopping, engine-neutral and torch-free: one judgement of the
validation history that both backends act on (``Validator.decide``), the checkpoint pruning
spares (``checkpoints``), the report states (observers/report.py) and a re-run reads
(``checkpoints.for_launch``) -- a pure function of the records, so a resumed run judges as the
uninterrupted one did.

The semantics are Hugging Face's (``load_best_model_at_end`` with the evaluation loss,
``EarlyStoppingCallback``): the best validation is the one with the strictly lowest loss (the
earliest of equal ones); a validation counts as an improvement when its loss is below the best
before it by more than ``min_delta``; after ``patience`` validations in a row without one, the run
stops. Also ``trainer.gradient_checkpointing``, the fine-tuner's name for
``strategy.activation_checkpointing``, resolved into that one key here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

EARLY_STOPPING = "early_stopping"
MAX_STEPS = "max_steps"


@dataclass(frozen=True)
class Verdict:
    """What the validation history says after its last record."""

    best: dict[str, Any] | None
    """The record with the lowest loss (earliest among equal ones); None without records."""
    improved: bool
    """The last record is the new best."""
    stale: int
    """Validations in a row, up to the last, that did not improve by more than min_delta."""
    last: int | None
    """The step of the last record."""

    def stops(self, patience: int) -> bool:
        return patience > 0 and self.stale >= patience


def judge(records: list[dict[str, Any]], min_delta: float = 0.0) -> Verdict:
    """``records``: the run's validations in order (``{step, loss, ...}``)."""
    best, improved, stale = None, False, 0
    for r in records:
        loss = float(r["loss"])
        better = best is None or loss < float(best["loss"])
        stale = 0 if best is None or (better and float(best["loss"]) - loss > min_delta) else stale + 1
        improved = better
        if better:
            best = r
    return Verdict(best, improved, stale, int(records[-1]["step"]) if records else None)


@dataclass(frozen=True)
class Decision:
    """What a backend does after the optimizer step ``step``."""

    keep: bool = False
    """trainer.keep_best: this step's validation is the new best; save its checkpoint."""
    stop: bool = False
    """trainer.early_stopping: end the run after this step (its checkpoint saved as at the end)."""


def decide(records: list[dict[str, Any]], trainer: Any, step: int) -> Decision:
    """The decision after ``step`` optimizer steps, given every validation so far (nothing when
    the last one is not of this step)."""
    if not records or int(records[-1]["step"]) != step:
        return Decision()
    es = trainer.early_stopping
    v = judge(records, es.min_delta)
    return Decision(keep=trainer.keep_best and v.improved,
                    stop=v.stops(es.patience) and step < trainer.max_steps)


def stopped(records: list[dict[str, Any]], trainer: Any, steps: int) -> dict[str, Any]:
    """The report's ``stopped``: why the run ended after ``steps`` optimizer steps."""
    es = trainer.early_stopping
    v = judge(records, es.min_delta)
    if steps < trainer.max_steps and v.last == steps and v.stops(es.patience):
        return {"reason": EARLY_STOPPING, "step": steps, "best_step": int(v.best["step"]),
                "best_val_loss": float(v.best["loss"]), "patience": es.patience,
                "min_delta": es.min_delta}
    return {"reason": MAX_STEPS, "step": steps}


def line(s: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """The console's one line for an early stop (``s``: ``stopped``'s), the rule ``judge`` applied
    with its numbers: each of the last ``patience`` validations against the best before it."""
    best, seen = None, []
    for r in records:
        seen.append((r, best))
        if best is None or float(r["loss"]) < best:  # (as judge: strictly lower; NaN never)
            best = float(r["loss"])
    n = s["patience"]
    which = f"each of the last {n} validations" if n > 1 else "the last validation"
    return (f"early stopping at step {s['step']}: {which} improved on the best before it by no more "
            f"than trainer.early_stopping.min_delta={s['min_delta']:g} (trainer.early_stopping.patience={n}: "
            f"{'; '.join(_against(r, before) for r, before in seen[-n:])}); best "
            f"{s['best_val_loss']:.4f} at step {s['best_step']}")


def _against(record: dict[str, Any], before: float | None) -> str:
    """``step 6: 5.2652, 0.2576 below 5.5228``: a validation and the best before it."""
    loss = float(record["loss"])
    said = f"step {record['step']}: {loss:.4f}"
    if before is None or loss != loss:  # (NaN)
        return said
    if loss == before:
        return f"{said}, equal to {before:.4f}"
    return f"{said}, {abs(before - loss):.4g} {'below' if loss < before else 'above'} {before:.4f}"


def problems(t: Any, data: Any) -> list[str]:
    """keep_best and early stopping need validations during the run, and val_every a split to
    validate on; their companions."""
    out, es = [], t.early_stopping
    wants = [k for k, on in (("trainer.keep_best=true", t.keep_best),
                             (f"trainer.early_stopping.patience={es.patience}", es.patience > 0)) if on]
    for key in wants:
        if not data.validates:
            out.append(f"{key} judges the run by its validation loss, and the data has no validation "
                       "split: set data.val_fraction (e.g. 0.05) or data.val_path, with "
                       "trainer.val_every=N; or remove it")
        elif t.val_every == 0:
            out.append(f"{key} judges the run by its validation loss, and trainer.val_every=0 "
                       "validates only at the end: set trainer.val_every=N (validate every N "
                       "steps); or remove it")
    if t.val_every and not data.validates and not wants:
        out.append(_nothing_to_validate(t, data))
    if es.min_delta > 0 and es.patience == 0:
        out.append(f"trainer.early_stopping.min_delta={es.min_delta} with trainer.early_stopping."
                   "patience=0 (off) does nothing: set trainer.early_stopping.patience=N, or remove it")
    if t.save_hf_from == "best" and not t.keep_best:
        out.append("trainer.save_hf_from=best exports the best checkpoint, which only "
                   "trainer.keep_best=true keeps: set trainer.keep_best=true, or "
                   "trainer.save_hf_from=last")
    return out


def _nothing_to_validate(t: Any, data: Any) -> str:
    """``trainer.val_every=N`` where the data has no validation split (it validated nothing,
    silently)."""
    what = f"trainer.val_every={t.val_every} validates every {t.val_every} steps, and"
    if data.name == "preference":
        return f"{what} objective=dpo has no held-out evaluation yet: remove it"
    if data.mixture:
        return (f"{what} no source of data.mixture holds out validation: set data.mixture[i].val_fraction "
                "(e.g. 0.05) or data.mixture[i].val_path; or remove it")
    return (f"{what} the data has no validation split: set data.val_fraction (e.g. 0.05) or "
            "data.val_path; or remove it")


def gradient_checkpointing(cfg: Any) -> tuple[Any, list[str]]:
    """``trainer.gradient_checkpointing`` into ``strategy.activation_checkpointing``, the one key
    the engines and the planner read: true turns it on (full) where it is off, and keeps true or
    selective; false with it on is a conflict; None (the default) leaves it. Returns the config
    to validate (a copy when changed) and the problem, if any. Then (``_planned_settings``)
    what the planner plans every preset with becomes the run's too."""
    cfg, problems = _gradient_checkpointing(cfg)
    s = cfg.get("strategy")
    if s is not None and s.get("name") == "auto" and (s.get("ac_every") or 1) != 1:
        problems.append(f"strategy.ac_every={s.get('ac_every')} with strategy=auto: the chosen preset "
                        "takes only the placeholder's strategy.activation_checkpointing; name the "
                        "preset to checkpoint every n-th block (python plan.py ranks them)")
    return (cfg if problems else _planned_settings(cfg)), problems


def _planned_settings(cfg: Any) -> Any:
    """``planner.activation_checkpointing`` plans every preset with (or without) checkpointing,
    and ``planner.microbatches`` every pipeline with that many micro-batches: the run, planned
    so, runs so (the preset's key takes it). Under strategy=auto the
    placeholder's key (``strategy.activation_checkpointing=true``, or the alias) is the
    planner's: every candidate is planned, and the chosen one run, with it."""
    s, p = cfg.get("strategy"), cfg.get("planner")
    if s is None or p is None or "activation_checkpointing" not in s or "activation_checkpointing" not in p:
        return cfg
    forced, ac = p.get("activation_checkpointing"), s.get("activation_checkpointing")
    if s.get("name") == "auto" and forced is None and ac:
        cfg = copy.deepcopy(cfg)
        cfg.planner.activation_checkpointing = ac
    elif s.get("name") != "auto" and forced is not None and forced != ac:
        cfg = copy.deepcopy(cfg)
        cfg.strategy.activation_checkpointing = forced
    m = p.get("microbatches")  # (the same for a pipeline's micro-batches)
    if m is not None and "microbatches" in s and (s.get("pp") or 1) > 1 and s.get("microbatches") != m:
        cfg = copy.deepcopy(cfg)
        cfg.strategy.microbatches = m
    return cfg


def _gradient_checkpointing(cfg: Any) -> tuple[Any, list[str]]:
    t, s = cfg.get("trainer"), cfg.get("strategy")
    gc = None if t is None else t.get("gradient_checkpointing")
    if gc is None or s is None or "activation_checkpointing" not in s:
        return cfg, []
    ac = s.get("activation_checkpointing")
    if gc is True and ac is False:
        cfg = copy.deepcopy(cfg)
        cfg.strategy.activation_checkpointing = True
        return cfg, []
    if gc is False and ac is not False:
        return cfg, [f"trainer.gradient_checkpointing=false and strategy.activation_checkpointing={ac}"
                     f" (strategy={s.get('name')}) say opposite things about one switch: remove "
                     "trainer.gradient_checkpointing (the fine-tuner's name for it), or set "
                     "strategy.activation_checkpointing=false"]
    return cfg, []
