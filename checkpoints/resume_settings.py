"""On resume, this run's trainer settings govern, not the checkpoint's run's: the optimizer's
param-group settings (lr, betas, weight decay, eps; and how it steps: foreach, fused) as this
run's config built them are put back over what a loaded optimizer state carries, and the
schedule continues from the checkpoint's step count on this run's schedule. What differed is
returned for one warning (checkpoints/state.py ``load``); the schedule's keys that differ are named
before launch (``schedule_changes``). The model is the checkpoint's: its shapes (checkpoints
``_check_shapes``) and every key that is what its weights compute (``model_refusal``, refused
before launch); the model's settings that are neither (``model_changes``: LoRA's alpha and
dropout, dropout, a MoE model's capacity and balancing weight) apply from the resume on: said
before launch (checkpoints ``for_launch``), as are the loss's settings (``loss_changes``:
objective=dpo's beta and label smoothing, data=chat's train_on). What shapes the optimizer's state cannot change where
that state is loaded (``optimizer_refusal``, refused before launch: checkpoints ``refusal``);
where it is not (``model_only``: another engine, world size, ZeRO-3-or-not, or precision under
DeepSpeed), the model loads and the optimizer starts fresh."""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)


def of(optimizer: Any) -> list[dict[str, Any]]:
    """The optimizer's param-group settings as this run's config made them (the learning rate
    aside: the schedule sets it)."""
    return [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups]


def govern(optimizer: Any, settings: list[dict[str, Any]]) -> list[str]:
    """Put this run's settings back over the loaded groups (a loaded state dict carries the
    old run's: a resume with a new trainer.lr or weight decay ran the old ones, silently; and
    how this run steps -- foreach, fused, chosen for this layout -- is not the checkpoint's to
    say: an fsdp2 run's foreach=True in tp's mixed groups crashed the first step). Returns what
    differed, as ``key old -> new`` (``initial_lr``: trainer.lr)."""
    changed = set()
    for group, mine in zip(optimizer.param_groups, settings):
        for k, v in mine.items():
            if k not in _STEPPING and k in group and _differs(group[k], v):
                changed.add(f"{'lr' if k == 'initial_lr' else k} {_shown(group[k])} -> {_shown(v)}")
        group.update(mine)
    return sorted(changed)


_STEPPING = ("foreach", "fused", "capturable", "differentiable")
"""torch optimizers' param-group flags that choose the kernel, not training state."""


def continue_schedule(scheduler: Any, optimizer: Any, saved: dict[str, Any]) -> list[str]:
    """The checkpoint's step count with this run's schedule (trainer.lr, scheduler, warm-up,
    decay steps): the learning rate of the next step is this config's at that step (restoring
    the old state's base and last rates ran the old lr on; a cosine run extended by raising
    max_steps took one step at the old schedule's end, 0.0, then jumped)."""
    steps = int(saved["last_epoch"])
    lrs = [base * f(steps) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    scheduler.load_state_dict({**saved, "base_lrs": list(scheduler.base_lrs), "_last_lr": lrs})
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    old = saved.get("_last_lr") or []
    if old and any(_differs(a, b) for a, b in zip(old, lrs)):
        return [f"the schedule's lr at step {steps + 1} {_shown(old[0])} -> {_shown(lrs[0])}"]
    return []


MODEL_SETTINGS = ("lora.alpha", "lora.dropout", "dropout", "capacity_factor", "aux_loss_coef")
"""model.* settings a resume takes, named (``model_changes``): no parameter's shape, nor what the
weights compute -- the adapters' scale (alpha / rank x B A) and dropout, dropout, and a MoE
model's routing budget (tokens over it are dropped) and the balancing loss's weight."""

NOT_THE_MODEL = ("name", "path", "pretrained", "seq_len", "max_seq_len", "document_eos")
"""model.* keys that are not the model the checkpoint's weights are: its name, where its weights
and config.json are and whether they load (a resume loads the checkpoint's; ``model=hf``'s
architecture keys, read from config.json, are compared), the data's windows and documents
(checkpoints/data_stream.py names ``model.seq_len`` and ``data.packing``), and the longest
sequence it supports (a limit). Every other key of the schema is what the weights compute
(``model_refusal``), a key the schema gains included."""

MOE_SETTINGS = ("capacity_factor", "aux_loss_coef")
"""Of ``MODEL_SETTINGS``, those only a MoE model reads."""
_ABSENT = object()


def _model_keys() -> list[str]:
    """Every key of ``model``'s schema, LoRA's as ``lora.<key>``."""
    from dataclasses import fields

    from recipes.model_config import LoraConfig, ModelConfig

    return [k for f in fields(ModelConfig)
            for k in ([f"lora.{g.name}" for g in fields(LoraConfig)] if f.name == "lora" else [f.name])]


def _compared(saved: dict[str, Any], model: Any, keys: Any) -> list[tuple[str, Any, Any]]:
    """(key, the checkpoint's run's value, this run's) of each of ``keys`` that differs; LoRA's
    keys (but its rank) only where both runs have adapters, a MoE model's only where both are
    one (a dense model reads none; the rank and n_experts are compared), a key the checkpoint's
    config lacks (an older one) not at all."""
    lora = model.lora.rank and (saved.get("lora") or {}).get("rank", model.lora.rank)
    moe = model.n_experts and saved.get("n_experts", model.n_experts)
    out = []
    for key in keys:
        if (key.startswith("lora.") and key != "lora.rank" and not lora) or (key in MOE_SETTINGS and not moe):
            continue
        old, new = saved, model
        for part in key.split("."):
            old, new = (old if isinstance(old, dict) else {}).get(part, _ABSENT), getattr(new, part)
        if old is not _ABSENT and _differs(_canonical(old), _canonical(new)):
            out.append((key, old, new))
    return out


def _canonical(v: Any) -> Any:
    """A list of names (LoRA's target modules) as a set: their order is no other model."""
    return sorted(v) if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v) else v


def model_changes(saved: dict[str, Any], model: Any) -> list[str]:
    """``MODEL_SETTINGS`` that differ between the checkpoint's run (``saved``: its resolved
    ``model`` config) and this one, as ``model.<key> old -> new``. alpha scales the adapters'
    update (alpha / rank x B A), so a new one changes the model the run continues from, and says so."""
    return [f"model.{key} {_shown(old)} -> {_shown(new)}" + (
        " (the adapters' scale, alpha / rank: the run continues from other effective weights)"
        if key == "lora.alpha" else "") for key, old, new in _compared(saved, model, MODEL_SETTINGS)]


def model_refusal(saved: dict[str, Any], model: Any) -> str | None:
    """Why ``model`` cannot continue from the weights of the checkpoint's run (``saved``: its
    resolved ``model`` config); None when it can. Every key that is what the weights compute
    (not ``MODEL_SETTINGS``, not ``NOT_THE_MODEL``) must be the checkpoint's: the shape check
    passes n_heads and n_kv_heads changed at equal shapes (the same weights regrouped into other
    heads), rope_theta, norm_eps, and tie_embeddings (one of the two trained matrices dropped),
    and each resumed another model without a word. model=hf reads its keys from model.path's
    config.json (an override of them is refused), so the fix there is the path."""
    from recipes.hf_config import SHAPE_KEYS

    skip = set(MODEL_SETTINGS) | set(NOT_THE_MODEL)
    differ = _compared(saved, model, [k for k in _model_keys() if k not in skip])
    if not differ:
        return None
    from_json = [(k, old) for k, old, _ in differ if model.is_hf and k in SHAPE_KEYS]
    ours = [f"model.{k}={_override(old)}" for k, old, _ in differ if (k, old) not in from_json]
    fixes = [f"resume with {' '.join(ours)}"] if ours else []
    if from_json:
        fixes.append("point model.path at a model whose config.json gives the checkpoint's values (its "
                     f"run's: model.path={saved.get('path')})")
    said = ", ".join(f"model.{k}={_override(new)} (the checkpoint's run: {_override(old)})"
                     for k, old, new in differ)
    return (said + ": the checkpoint's weights are another model's -- these keys decide the parameters' "
            f"shapes or what the weights compute; {' and '.join(fixes)}, or start a new run with "
            "trainer.resume_from=null")


def _override(v: Any) -> str:
    """As an override writes it: true, null, [q_proj,v_proj]."""
    if isinstance(v, bool) or v is None:
        return "null" if v is None else str(v).lower()
    return f"[{','.join(map(str, v))}]" if isinstance(v, (list, tuple)) else str(v)


def loads_optimizer(meta: dict[str, Any], job: Any) -> bool:
    """Whether resuming ``job`` from the checkpoint of ``meta`` loads that checkpoint's optimizer
    state (``model_only`` says why not)."""
    return model_only(meta, job) is None


def model_only(meta: dict[str, Any], job: Any) -> str | None:
    """Why resuming ``job`` from the checkpoint of ``meta`` loads the model only, the optimizer
    starting fresh; None where the optimizer state loads -- checkpoints/state.py ``load``'s
    conditions: DCP into a torch preset (any world size, any precision); DeepSpeed's own or
    zero2_ep's into the same payload on as many ranks and the same backend (ZeRO-3's layout only
    into ZeRO-3; DeepSpeed's only at the same precision: ``deepspeed_precision``)."""
    payload, trainer = meta.get("payload"), (meta.get("config") or {}).get("trainer") or {}
    if payload != job.run.checkpoint:
        return (f"the checkpoint holds {payload}'s state, strategy={job.strategy.name} keeps "
                f"{job.run.checkpoint}'s")
    if payload == "dcp":
        return None
    world, backend = int(meta.get("world_size", 0)), meta.get("backend")
    if (world, backend) != (job.mesh.size, job.backend):
        return f"the checkpoint was written on {world} rank(s) with backend={backend}"
    if payload != "deepspeed":
        return None
    stage = ((meta.get("config") or {}).get("strategy") or {}).get("stage") or 0
    if (stage >= 3) != ((getattr(job.strategy, "stage", 0) or 0) >= 3):
        into = "ZeRO-3" if stage >= 3 else "ZeRO-1/2"
        return f"the checkpoint holds ZeRO-{stage}'s layout, which DeepSpeed loads only into {into}"
    was = str(trainer.get("precision", "32"))
    if deepspeed_precision(was) != deepspeed_precision(job.trainer.precision):
        return (f"the checkpoint's run had trainer.precision={was}, this run {job.trainer.precision}, and "
                "DeepSpeed keeps its optimizer state per precision (bf16's in bf16_zero_pp_rank_* files, "
                f"fp16's with its loss scaler; trainer.precision={was} loads it)")
    return None


def deepspeed_precision(precision: str) -> str | None:
    """The DeepSpeed precision section ``trainer.precision`` enables (bf16 | fp16; None: fp32): an
    engine loads the ZeRO optimizer state of the same only (checkpoints/state.py ``load``)."""
    from core.precision import find

    found = find(precision)
    return found.deepspeed if found else str(precision)


def schedule_changes(saved: dict[str, Any], t: Any) -> list[str]:
    """The schedule's keys (recipes/training.py ``lr_factor``) that differ between the checkpoint's
    run's trainer config (``saved``) and this run's (``t``), as ``trainer.<key> old -> new``: the
    scheduler and warm-up; where both decay, the floor and where the decay ends (decay_steps, or
    max_steps where it is null). (trainer.lr: ``govern``.)"""
    out = [f"trainer.{k} {_override(saved[k])} -> {_override(getattr(t, k))}"
           for k in ("scheduler", "warmup_steps") if k in saved and _differs(saved[k], getattr(t, k))]
    if saved.get("scheduler", "constant") == "constant" or t.scheduler == "constant":
        return out
    if "min_lr_ratio" in saved and _differs(saved["min_lr_ratio"], t.min_lr_ratio):
        out.append(f"trainer.min_lr_ratio {_override(saved['min_lr_ratio'])} -> {_override(t.min_lr_ratio)}")
    was, decay = saved.get("max_steps"), saved.get("decay_steps")
    if was is None or (decay or was) == (t.decay_steps or t.max_steps):
        return out
    if decay != t.decay_steps:
        return [*out, f"trainer.decay_steps {_override(decay)} -> {_override(t.decay_steps)}"]
    return [*out, f"trainer.max_steps {was} -> {t.max_steps} (the {t.scheduler} decay ends there: "
                  "trainer.decay_steps is null)"]


def dpo_refusal(ckpt: Any, job: Any) -> str | None:
    """objective=dpo resuming a checkpoint of another objective (an SFT run's): DPO's reference is
    its run's initial model (recipes/dpo.py), not the checkpoint, so the loss would pull the SFT
    model toward the model it was trained from. Refused before launch with the way to DPO from it."""
    was = (ckpt.meta.get("config") or {}).get("objective")
    now = job.objective
    if not isinstance(was, dict) or now is None or now.name != "dpo" or was.get("name") in (None, "dpo"):
        return None
    start = (f"model.path={job.model.path}'s weights" if job.model.is_hf else
             f"model={job.model.name} as trainer.seed={job.trainer.seed} initialises it")
    fix = (f"DPO from this model as a new run (python convert.py {ckpt.path} --to hf --out <dir>, then "
           "model.path=<dir> in a new run directory)" if job.model.is_hf else
           "DPO starts a new run from its initial model (a model=hf run's checkpoint can be its start: "
           "convert.py --to hf, then model.path=)")
    return (f"{ckpt.path} was trained with objective={was['name']}; objective=dpo measures the policy "
            f"against its run's initial model ({start}), not against this checkpoint, so resuming it as "
            f"DPO would train toward the wrong reference: {fix}, or resume with objective={was['name']}")


def optimizer_refusal(ckpt: Any, job: Any) -> str | None:
    """Why ``job``'s optimizer cannot take the optimizer state of ``ckpt`` (where one is loaded:
    ``loads_optimizer``); None when it can. Its kind (``trainer.optimizer``: AdamW's moments are
    no SGD momentum -- torch DCP raised a missing key on every rank, DeepSpeed ran on silently),
    SGD's momentum from 0 (plain SGD keeps no buffers to load), and under DeepSpeed the parameter
    groups (``trainer.weight_decay`` > 0 with ``no_decay`` splits one into two; torch DCP keys
    the state by parameter and takes either)."""
    old, t = (ckpt.meta.get("config") or {}).get("trainer") or {}, job.trainer
    if not old or not loads_optimizer(ckpt.meta, job):
        return None
    fresh = "start a new run with trainer.resume_from=null" + (
        f" (from its weights: python convert.py {ckpt.path} --to hf --out <dir>, then model.path=<dir>)"
        if getattr(job.model, "is_hf", False) else "")
    kind = old.get("optimizer", t.optimizer)
    if kind != t.optimizer:
        return (f"trainer.optimizer={t.optimizer}, the checkpoint's run {kind}: the checkpoint holds {kind}'s "
                f"optimizer state, which {t.optimizer} cannot continue from; resume with "
                f"trainer.optimizer={kind}, or {fresh}")
    if t.optimizer == "sgd" and t.momentum and old.get("momentum", t.momentum) == 0:
        return (f"trainer.momentum={t.momentum}, the checkpoint's run 0: its plain SGD kept no momentum "
                f"buffers to continue from; resume with trainer.momentum=0, or {fresh}")
    decay, split = old.get("weight_decay", t.weight_decay), old.get("no_decay", t.no_decay)
    was, now = _groups(decay, split), _groups(t.weight_decay, t.no_decay)
    if ckpt.meta.get("payload") == "dcp" or was == now:
        return None
    return (f"trainer.weight_decay={_shown(t.weight_decay)} with trainer.no_decay={str(t.no_decay).lower()}: "
            f"{now} optimizer parameter group(s), the checkpoint's run {was} (weight_decay={_shown(decay)}, "
            f"no_decay={str(split).lower()}); DeepSpeed loads its optimizer state only into the groups it "
            f"was saved from: resume with trainer.weight_decay={_shown(decay)} trainer.no_decay="
            f"{str(split).lower()}" + (", or with trainer.no_decay=false (one group: every parameter decayed)"
                                       if was == 1 else ""))


def _groups(weight_decay: float, no_decay: bool) -> int:
    """The optimizer's parameter groups (recipes/training.py ``param_groups``)."""
    return 2 if no_decay and weight_decay > 0 else 1


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    return a != b


def _shown(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(tuple(v) if isinstance(v, list) else v)


def notes(ckpt: Any, job: Any) -> list[str]:
    """What a resume of ``ckpt`` by ``job`` warns of before launch (checkpoints ``for_launch``
    logs each; ``--dry-run`` prints each as a note): a path at trainer.max_steps that only loads,
    another global batch and another data stream (checkpoints/data_stream.py), the model and loss
    settings and the schedule keys that apply from the checkpoint's step on."""
    from checkpoints import AUTO, data_stream

    done = None
    if job.trainer.resume_from != AUTO and ckpt.step >= job.trainer.max_steps:
        done = (f"resume: {ckpt.path} is at step {ckpt.step} = trainer.max_steps: nothing is left to train; "
                "the run loads it and reports it (raise trainer.max_steps to continue)")
    said = (done, data_stream.batch_note(ckpt, job), data_stream.stream_note(ckpt, job),
            model_note(ckpt, job), loss_note(ckpt, job), schedule_note(ckpt, job))
    return [line for line in said if line]


def model_note(ckpt: Any, job: Any) -> str | None:
    """The model.* settings a resume takes (``MODEL_SETTINGS``: LoRA's alpha and dropout, ...) that
    differ from the checkpoint's run: they apply from here, said once."""
    changed = model_changes(ckpt.meta.get("config", {}).get("model") or {}, job.model)
    if not changed:
        return None
    return (f"resume: this run's model settings differ from the checkpoint's run's and apply from step "
            f"{ckpt.step + 1} on: {'; '.join(changed)}; resume with the checkpoint's values to continue it as it was")


def loss_changes(saved: dict[str, Any], job: Any) -> list[str]:
    """The loss's settings that differ between the checkpoint's run (``saved``: its resolved
    config) and ``job``, as ``key old -> new``: the objective; where both runs are
    objective=dpo, its beta and label smoothing; where both read data=chat (one source), which
    targets the loss counts (``data.train_on``: the same windows, other targets -- not a new data
    stream, which checkpoints/data_stream.py names). A key the checkpoint's config lacks (an
    older one) is not compared."""
    out, was, now = [], saved.get("objective"), job.objective
    if isinstance(was, dict) and now is not None and "name" in was:
        if was["name"] != now.name:
            out.append(f"objective {was['name']} -> {now.name}")
        elif now.name == "dpo":
            out += [f"objective.{k} {_shown(was[k])} -> {_shown(getattr(now, k))}"
                    for k in ("beta", "label_smoothing") if k in was and _differs(was[k], getattr(now, k))]
    data, d = saved.get("data") or {}, job.data
    if (data.get("name") == d.name == "chat" and not (data.get("mixture") or d.mixture)
            and data.get("train_on", d.train_on) != d.train_on):
        counts = ("every target from here on, not the assistant turns alone" if d.train_on == "all"
                  else "the assistant turns alone from here on, not every target")
        out.append(f"data.train_on {data['train_on']} -> {d.train_on} (the loss counts {counts})")
    return out


def loss_note(ckpt: Any, job: Any) -> str | None:
    """The loss's settings that differ from the checkpoint's run (``loss_changes``: a new
    objective.beta is a choice a run may make): they apply from here, said once, before launch."""
    changed = loss_changes(ckpt.meta.get("config") or {}, job)
    if not changed:
        return None
    return (f"resume: this run's loss settings differ from the checkpoint's run's and apply from step "
            f"{ckpt.step + 1} on: {'; '.join(changed)}; resume with the checkpoint's values to continue it "
            "as it was")


def schedule_note(ckpt: Any, job: Any) -> str | None:
    """The schedule's keys that differ from the checkpoint's run (``schedule_changes``): they apply
    from here (``continue_schedule``), said once, before launch."""
    saved = (ckpt.meta.get("config") or {}).get("trainer") or {}
    changed = schedule_changes(saved, job.trainer) if saved else []
    if not changed:
        return None
    return (f"resume: this run's schedule differs from the checkpoint's run's and applies from step "
            f"{ckpt.step + 1} on (the lr follows this run's schedule): {'; '.join(changed)}")
