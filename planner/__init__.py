"""The planner: will it fit, what will it cost, which strategy -- before any device is touched.

Every entry point takes a validated ``recipes.job.Job`` (``planner.inputs.Inputs``: its groups
as typed objects; the planner never reads a composed config): ``plan_all(job)`` plans every
preset of ``conf/strategy/`` plus the planned-only TP / PP / 3D layouts and recommends one;
``preflight(job)`` plans the job's own preset, ``check(job)`` refuses it when it will not fit
(``planner.enforce``), ``choose(job)`` is ``strategy=auto``'s choice. The model is the job's
torch-free description (``job.model``), or another one passed as ``model``. They return plain
dataclasses; ``planner.render`` turns them into a table or JSON. By concern: inputs, states
(model states), activations, communication, plan (one layout: memory and time), recommend
(candidates and the ladder), render.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from planner.activations import (activation_bytes, boundary_activation_bytes, korthikanti_layer_bytes,
                                 layer_activation_bytes)
from planner.communication import (Collective, Communication, all_gather_bytes, reduce_scatter_bytes,
                                   ring_all_reduce_bytes, transfer_seconds)
from planner.inputs import Candidate, Inputs, ModelDescription, Setup, candidate, rows_per_sample
from planner.compute import bubble_fraction
from planner.plan import plan_candidate
from planner.results import ACCOUNTING_NOTE, Memory, Plan, Recommendation, Report
from planner.recommend import MOVE_UP, largest_micro_batch, nothing_fits, planned_candidates, rank, recommend
from planner.render import plan_dict, report_dict
from planner.states import ACCOUNTINGS, GB, GiB, MiB, gb, model_states, state_bytes
from strategies.footprint import StateBytes
from strategies.base import StrategyConfig
from strategies.presets import load, names


class WillNotFit(Exception):
    """The planner predicts the run will not fit (and ``planner.enforce`` is on)."""

    def __init__(self, message: str, plan: dict[str, Any] | None = None):
        super().__init__(message)
        self.plan = plan


def plan_all(job: Inputs, model: ModelDescription | None = None, *, chosen: bool = False) -> Report:
    """Plan every preset (the job's ``preset`` with its overrides in place of its own file) and
    the planned-only layouts; ``chosen``: only the job's preset. ``model``: another description
    of the model than ``job.model``."""
    su = Setup.of(job, model)
    cands = _candidates(su, job.preset, chosen)
    plans = [plan_candidate(c, su) for c in cands]
    if chosen:  # (the job's own: named as the job names it, a user's option by its option)
        plans[0].label = getattr(job, "label", "")
    rec = _recommend(plans) if not chosen else Recommendation(plans[0].strategy, "chosen")
    ckpt, pool, checkpointed = su, cands, None
    if not chosen and (with_su := _checkpointing(su)) is not None:
        ckpt, with_ckpt = with_su, _candidates(with_su, job.preset, chosen)  # (degrees chosen again)
        checkpointed = ([plan_candidate(c, ckpt) for c in with_ckpt], with_ckpt)
        _suggest_checkpointing(rec, plans, *checkpointed)
        pool = with_ckpt if rec.activation_checkpointing else cands
    best = next((c for c in pool if c.name == rec.strategy), None)
    if best is not None and not best.planned_only:
        rec.config = best.config if not rec.activation_checkpointing else dataclasses.replace(
            best.config, activation_checkpointing=True)
    if best is not None and not chosen and rows_per_sample(job) == 1:  # (dpo: rows are not samples)
        if (micro := largest_micro_batch(best, ckpt if rec.activation_checkpointing else su)) is not None:
            rec.micro_batch_size = micro
            rec.reason += (f"; it also fits micro batch {micro} (trainer.micro_batch_size={micro}: "
                           f"fewer accumulation steps)")
    for p in plans:
        if not p.fits:
            p.hint = _hint(*((plans, cands, checkpointed) if not chosen else _others(su, p)), su=su)
    name = f"{su.params:,} parameters" if su.shape is None else str(job.model.name)
    return Report(model=name, cluster=su.cluster.name, world_size=su.world_size,
                  accounting=su.options.accounting, plans=rank(plans, rec), recommendation=rec,
                  assumptions=assumptions(su), batch=_batch(su))


def _candidates(su: Setup, own: StrategyConfig, chosen: bool) -> list[Candidate]:
    """What plan_all plans: the job's preset as composed, and (unless ``chosen``) every other
    preset at the degrees the planner chooses for it on ``su``, and the planned-only layouts."""
    if chosen:
        return [candidate(own)]
    megatron = planned_candidates(su, su.options.tp, su.options.pp)
    return [candidate(own if n == own.name else _as_planned(n, su, megatron)) for n in names()] + megatron


def _recommend(plans: list[Plan]) -> Recommendation:
    """What strategy=auto runs: the best runnable preset that fits with margin (a tight one only
    when nothing else fits, and saying so); planned-only layouts are named apart."""
    runnable = [p for p in plans if not p.planned_only]
    rec = recommend(runnable, roomy=True)
    if rec.strategy is None:
        rec = recommend(runnable)
    planned = [p for p in plans if p.planned_only and p.fits and not p.problems]
    if rec.strategy is None:
        would = (f"; the planned-only {', '.join(p.strategy for p in planned)} would (no preset runs "
                 "them yet)" if planned else "")
        rec.reason = nothing_fits(runnable) + would
        return rec
    ours = next(p for p in plans if p.strategy == rec.strategy)
    faster = min(planned, key=lambda p: p.step_seconds, default=None)
    if faster is not None and faster.step_seconds * MOVE_UP < ours.step_seconds:
        rec.reason += (f"; planned only (listed apart): {faster.strategy} would be "
                       f"{ours.step_seconds / faster.step_seconds:.2f}x faster (step ~ "
                       f"{faster.step_seconds:.3g} s), with a TP/PP implementation")
    return rec


CHECKPOINTING = "strategy.activation_checkpointing=true"


def _suggest_checkpointing(rec: Recommendation, plans: list[Plan], checkpointed: list[Plan],
                           cands: list[Candidate]) -> None:
    """Activation checkpointing when it changes the answer (``checkpointed``: the layouts with
    it, planned from ``cands``, whose degrees were chosen with it): when nothing runnable fits
    without it, the best that fits with it becomes the recommendation
    (``rec.activation_checkpointing``); when the recommendation is tight and a layout fits with
    margin with it, or one is MOVE_UP times faster with it, the reason names it and the command
    (``rec.with_checkpointing``)."""
    other = _recommend(checkpointed)
    if other.strategy is None:
        return
    theirs = next(p for p in checkpointed if p.strategy == other.strategy)
    mine = next((p for p in plans if p.strategy == rec.strategy), None)
    if mine is None:
        rec.strategy, rec.activation_checkpointing, rec.tight = other.strategy, True, other.tight
        rec.reason = (f"{rec.reason}; with activation checkpointing ({CHECKPOINTING}) {other.strategy} "
                      f"fits: {other.reason}")
        return
    tight = mine.tight and not theirs.tight
    if other.strategy != rec.strategy and (tight or theirs.step_seconds * MOVE_UP < mine.step_seconds):
        rec.with_checkpointing = other.strategy
        why = (f"with margin ({gb(theirs.margin)} free)" if tight else
               f"{mine.step_seconds / theirs.step_seconds:.2f}x faster")
        config = next(c.config for c in cands if c.name == other.strategy)
        command = " ".join(run_overrides(dataclasses.replace(config, activation_checkpointing=True)))
        rec.reason += (f"; with activation checkpointing ({command}) "
                       f"{other.strategy} fits {why}: {gb(theirs.memory.total)} per device, step ~ "
                       f"{theirs.step_seconds:.3g} s")


def _batch(su: Setup) -> str:
    t = su.trainer
    return (f"global batch {t.global_batch_size} x seq {su.seq_len}, micro batch {t.micro_batch_size}, "
            f"precision {t.precision}")


def _degrees(preset: StrategyConfig, megatron: list[Candidate], su: Setup) -> StrategyConfig:
    """A TP / PP preset the user did not compose, at the degrees this cluster and model call
    for (``planner.tp``/``planner.pp``, else TP inside a node and the smallest fitting PP).
    Where those degrees do not divide the world (one node: TP takes the whole node, and the
    preset's own PP comes on top), the layout of the preset's kind that does and fits with the
    shortest step (``_mesh_degrees``)."""
    if not {"tp", "pp"} <= set(preset.capabilities.degrees):  # (sequence / expert degrees stay)
        return preset
    derived = {c.name: c.config for c in megatron}
    tp = derived["megatron_tp"].tp if "megatron_tp" in derived else preset.tp
    pp = derived["megatron_pp"].pp if "megatron_pp" in derived else preset.pp
    if preset.pp > 1 and preset.tp > 1 and "megatron_3d" in derived:
        tp, pp = derived["megatron_3d"].tp, derived["megatron_3d"].pp
    chosen = preset.with_degrees(tp=tp if preset.tp > 1 else 1, pp=pp if preset.pp > 1 else 1)
    options = [] if su.options.tp > 1 or su.options.pp > 1 else _mesh_degrees(preset, su)
    if su.world_size % (chosen.tp * chosen.pp) == 0 or not options:
        return chosen
    plans = [(plan_candidate(candidate(o), su), o) for o in options]
    fitting = [(p.step_seconds, i) for i, (p, _) in enumerate(plans) if p.fits]
    best = min(fitting)[1] if fitting else min(range(len(plans)), key=lambda i: plans[i][0].memory.total)
    return plans[best][1]


def _mesh_degrees(preset: StrategyConfig, su: Setup) -> list[StrategyConfig]:
    """``preset`` at each (tp, pp) that divides the world, TP inside a node dividing the
    attention heads, each degree above 1 where the preset's is (its kind kept)."""
    world, node = su.world_size, su.cluster.devices
    heads = math.gcd(su.shape.n_heads, su.shape.n_kv_heads) if su.shape else node
    tps = [t for t in range(2, node + 1) if node % t == 0 and heads % t == 0] if preset.tp > 1 else [1]
    pps = [p for p in range(2, world + 1) if world % p == 0] if preset.pp > 1 else [1]
    return [preset.with_degrees(tp=t, pp=p) for t in tps for p in pps if world % (t * p) == 0]


def _seq_degree(preset: StrategyConfig, su: Setup) -> StrategyConfig:
    """A Ulysses preset the user did not compose, at the smallest sequence degree that fits:
    degrees inside one node dividing the heads, KV heads and sequence (DeepSpeed keeps its
    all-to-all within a node); the largest of them when none fits. Other presets as they are."""
    if "sp" not in preset.capabilities.degrees or getattr(preset, "sp", 1) <= 1 or su.shape is None:
        return preset
    n = su.cluster.devices
    options = [d for d in range(2, n + 1) if n % d == 0 and all(
        getattr(su.shape, k) % d == 0 for k in ("n_heads", "n_kv_heads", "seq_len"))]
    for d in options:
        p = preset.with_degrees(sp=d)
        if plan_candidate(candidate(p), su).fits:
            return p
    return preset.with_degrees(sp=options[-1]) if options else preset


def _ep_degree(preset: StrategyConfig, su: Setup) -> StrategyConfig:
    """An expert-parallel preset the user did not compose, at the expert degree that fits with
    the shortest step: degrees inside one node (the token all-to-all stays on its links) that
    divide the model's experts and the data-parallel ranks; the largest when none fits."""
    if "ep" not in preset.capabilities.degrees or su.shape is None or not getattr(su.shape, "is_moe", False):
        return preset
    n, experts = su.cluster.devices, su.shape.n_experts
    options = [d for d in range(1, n + 1) if n % d == 0 and experts % d == 0]
    if not options:
        return preset
    plans = [(plan_candidate(candidate(preset.with_degrees(ep=d)), su), d) for d in options]
    fitting = [(p.step_seconds, d) for p, d in plans if p.fits]
    return preset.with_degrees(ep=min(fitting)[1] if fitting else options[-1])


def _as_planned(name: str, su: Setup, megatron: list[Candidate]) -> StrategyConfig:
    """A preset the user did not compose, at the degrees the planner chooses for it here (and
    ``planner.activation_checkpointing`` and ``planner.microbatches`` when set: what it was
    planned with, it runs with)."""
    preset, o = _ep_degree(_seq_degree(_degrees(load(name), megatron, su), su), su), su.options
    if o.activation_checkpointing is not None:
        preset = dataclasses.replace(preset, activation_checkpointing=o.activation_checkpointing)
    if o.microbatches is not None and preset.pipeline_microbatches() is not None:  # (a pipeline)
        preset = dataclasses.replace(preset, microbatches=o.microbatches)
    return preset


def _checkpointing(su: Setup) -> Setup | None:
    """``su`` with activation checkpointing planned on; None where the job decided it
    (``planner.activation_checkpointing``) or there is no shape to checkpoint."""
    if su.shape is None or su.options.activation_checkpointing is not None:
        return None
    return dataclasses.replace(su, options=dataclasses.replace(su.options, activation_checkpointing=True))


Planned = tuple[list[Plan], list[Candidate]]


def _others(su: Setup, skip: Plan) -> tuple[list[Plan], list[Candidate], Planned | None]:
    """The presets other than ``skip``'s as planned here, and every preset with activation
    checkpointing (``skip``'s too) where the job left it to the planner."""
    megatron = planned_candidates(su, su.options.tp, su.options.pp)
    cands = [candidate(_as_planned(n, su, megatron)) for n in names() if n != skip.strategy]
    checkpointed = None
    if (ckpt := _checkpointing(su)) is not None:
        megatron = planned_candidates(ckpt, ckpt.options.tp, ckpt.options.pp)
        with_ckpt = [candidate(_as_planned(n, ckpt, megatron)) for n in names()]
        checkpointed = ([plan_candidate(c, ckpt) for c in with_ckpt], with_ckpt)
    return [plan_candidate(c, su) for c in cands], cands, checkpointed


def _hint(plans: list[Plan], cands: list[Candidate], checkpointed: Planned | None = None, *,
          su: Setup) -> str:
    """What to run instead: the best runnable preset that fits, spelled at the degrees it was
    planned with (``run_overrides``); else the best that fits with activation checkpointing
    (``checkpointed``: the presets planned with it), with it in the command; or why nothing does
    and only the fixes that are not set and could help (``_fixes``)."""
    for pool, ckpt in ((plans, cands), checkpointed) if checkpointed else ((plans, cands),):
        rec = recommend([p for p in pool if p.runnable])
        if rec.strategy:
            config = next(c.config for c in ckpt if c.name == rec.strategy)
            if pool is not plans:
                config = dataclasses.replace(config, activation_checkpointing=True)
            return f"cheapest preset that fits: {rec.strategy} ({' '.join(run_overrides(config))})"
    planned = recommend([p for p in plans if p.planned_only])
    if planned.strategy:
        return f"no preset fits; the planned-only layout {planned.strategy} would"
    live = [p for pool in (plans, *([checkpointed[0]] if checkpointed else [])) for p in pool
            if not p.blocking and not p.planned_only]  # (with checkpointing too, where planned)
    # (on CPU the device is the host: checkpointing and micro batches change its need too)
    if any(p.memory.total <= p.device_bytes for p in live if p.overflows and p.host_margin is None):
        return ("no preset fits: those with room on the device overflow the host or NVMe (more nodes "
                "split offloaded state; activation checkpointing and micro batches do not change it)")
    return f"no preset fits: use {_fixes(live, su, tried=checkpointed is not None)}"


def _fixes(live: list[Plan], su: Setup, *, tried: bool) -> str:
    """What could make a layout fit when every one that can run overflows the device (``live``):
    more devices (more nodes also split what overflows the host or NVMe); a smaller micro batch
    above 1; activation checkpointing where it is not on and was not already planned (``tried``:
    the presets were planned with it and none fits), full where it is selective."""
    out = ["more devices" + (" (more nodes also split the offloaded state)" if any(p.overflows for p in live)
                             else "")]
    ac = su.options.activation_checkpointing
    if su.trainer.micro_batch_size > 1:
        out.append("a smaller micro batch")
    if not tried and su.shape is not None and ac is not True:
        out.append(f"{'full ' if ac else ''}activation checkpointing (planner.activation_checkpointing=true)")
    return ", ".join(out[:-1]) + f" or {out[-1]}" if len(out) > 1 else out[0]


def choose(job: Inputs, model: ModelDescription | None = None) -> tuple[StrategyConfig, str]:
    """``strategy=auto``: the recommended preset for the job's model, cluster and batch (TP/PP
    presets at the planned degrees), and why; ``recipes.job.validate(..., auto=choose)`` then
    checks and derives it as if the config had named it. With ``planner.calibrate=true`` this
    machine is measured here first (once, then cached: ``planner.machine.ensure``). Raises
    ConfigError when no runnable preset fits."""
    from planner import machine
    from core.errors import ConfigError

    machine.ensure(job)  # planner.calibrate=true: this machine measured once (a subprocess), cached
    report = plan_all(job, model)
    rec = report.recommendation
    if (picked := rec.config) is None:
        raise ConfigError(f"strategy=auto: no runnable preset fits on {report.cluster}: {rec.reason}; "
                          "choose strategy=<preset> (python plan.py ranks them)")
    if rec.tight:
        raise ConfigError(f"strategy=auto: no runnable preset fits with margin on {report.cluster}: "
                          f"{rec.strategy} is the best and {rec.reason}; choose it yourself "
                          f"({' '.join(run_overrides(picked))}) or lower planner.reserve_GB")
    return picked, rec.reason


def run_overrides(picked: StrategyConfig) -> list[str]:
    """``strategy=<preset>`` and a ``strategy.<key>=<value>`` for every setting in which
    ``picked`` differs from the preset as composed: the command line that trains (and plans)
    exactly what was recommended."""
    def spell(v: Any) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    base = load(picked.name)
    return [f"strategy={picked.name}"] + [
        f"strategy.{f.name}={spell(getattr(picked, f.name))}" for f in dataclasses.fields(picked)
        if f.init and getattr(picked, f.name) != getattr(base, f.name)]


def preflight(job: Inputs, model: ModelDescription | None = None) -> Plan:
    """The plan of the job's own preset (``.fits``, ``.summary()``, ``.message()``); the cheapest
    fitting preset is searched only when it does not fit."""
    return plan_all(job, model, chosen=True).plans[0]


def what_ifs(job: Inputs) -> list[str]:
    """``planner.params`` / ``planner.trainable`` as set: a parameter count plan.py prices, which
    no run trains (plan.py prints no command for it; ``check`` refuses it)."""
    return [f"planner.{k}={v:g}" for k in ("params", "trainable")
            if (v := getattr(job.planner, k)) is not None]


def check(job: Inputs, *, to: str = "launch") -> Plan:
    """The pre-launch check (train.py, a sweep's preflight, launch.py's submission): the plan of
    the job's preset; raises ``WillNotFit`` when it is predicted not to fit and
    ``planner.enforce`` is on (``to``: what ``planner.enforce=false`` would do anyway). The one
    place that rule lives. A preset that cannot run here at all (a backend that does not run it)
    is no memory verdict: a ``ConfigError`` whatever ``planner.enforce``, which waives nothing
    there (the backend would refuse it at launch). With ``planner.calibrate=true`` this machine
    is measured first. A run is planned with what it allocates (``as_run``: accounting actual,
    whatever ``planner.accounting`` says; the plan's first note says so where it differs)."""
    from planner import machine
    from core.errors import ConfigError

    if asked := what_ifs(job):  # (plan.py's questions: the run's own counts come from model=...)
        raise ConfigError([f"{', '.join(asked)}: plan.py's what-if of a parameter count, which a run "
                           f"does not train; the run's own come from model= (and model.lora): remove it"])
    machine.ensure(job)
    job, said = as_run(job)
    result = preflight(job)
    result.notes[:0] = [said] if said else []
    if result.blocking:  # (with what would run instead, when a preset does)
        *first, last = result.blocking
        raise ConfigError([*first, last + (f"; {result.hint}" if result.hint else "")])
    if not result.fits and job.planner.enforce:
        raise WillNotFit(result.message() + f" (set planner.enforce=false to {to} anyway)",
                         plan_dict(result))
    return result


def as_run(job: Inputs) -> tuple[Inputs, str | None]:
    """The job as its run is planned: ``planner.accounting=actual``, what the engines allocate at
    its precision, whatever the config says -- mixed16 and mixed20 are plan.py's view of the
    reference documents' model (no engine buffers; mixed16 sends a 32-bit run's gradients in 16
    bits), and the run's verdict and report.json's predicted-vs-measured are what the planner
    predicts for this run. With the line that says so (train.py logs it with the plan), or None
    where the config asked for ``actual``."""
    asked = job.planner.accounting
    if asked == "actual":
        return job, None
    return dataclasses.replace(job, planner=dataclasses.replace(job.planner, accounting="actual")), (
        f"{ACCOUNTING_NOTE}{asked} is plan.py's view of the reference documents' model; this run is "
        f"planned, checked and compared with what it allocates at precision {job.trainer.precision} "
        "(accounting actual)")


def mfu_formula(su: Setup) -> str:
    """How compute time is priced, with the peak it divides by (printed wherever MFU appears)."""
    from planner.compute import mfu, peak_flops

    flops = ("(6 x matmul params + 12 x layers x seq x dim) x tokens" if su.shape is not None
             else "6 x params x tokens")
    if su.machine is not None:
        peak = (f"the matmul rate measured on this machine, {peak_flops(su) / 1e12:.3g} TFLOP/s per "
                f"process (planner.calibrate, precision {su.machine.precision})")
        util = f"MFU {mfu(su):.2f}, what a transformer block reached of it there"
    else:
        peak = f"cluster.peak_tflops {su.cluster.peak_tflops:g} TFLOP/s per device"
        util = f"planner.mfu {mfu(su):g}"
    return f"{flops} / (devices x peak x MFU): peak = {peak}; {util}"


def assumptions(su: Setup) -> list[str]:
    acc = {"mixed16": "mixed16: 2 bf16 param + 2 bf16 grad + 4 fp32 master + 8 Adam = 16 B/param, the "
                      "reference documents' model (states as the layout shards them; no engine buffers)",
           "mixed20": "mixed20: 2 bf16 param + 2 bf16 + 4 fp32 grad + 4 fp32 master + 8 Adam = 20 B/param, "
                      "the deep-dive's model (no engine buffers)",
           "actual": f"actual: what precision={su.trainer.precision} allocates (AdamW; torch AMP keeps "
                     "fp32 params, DeepSpeed bf16 params + fp32 master)"}[su.options.accounting]
    out = [*([su.hardware] if su.hardware else []),
           f"GB = 1e9 bytes, GiB = 2^30; memory is per device; accounting {acc}",
           f"compute = {mfu_formula(su)}; activation checkpointing adds one forward (x 4/3)"
           + ("; step = compute / (1 - bubble) + exposed communication + the optimizer step "
              "(AdamW's measured ns per parameter this device steps; offloaded: the host's, its copies "
              "at the measured host<->device rate) + the engine's own work (ZeRO's, offloaded ZeRO's or "
              "FSDP2's measured ns per parameter this device holds, per micro-batch), never under the "
              "measured floor (a tiny model's step: per step + per block and micro-batch)"
              if su.machine is not None else ""),
           "collective time = bandwidth + latency (ring: 2(N-1)/N x bytes per rank for all-reduce, "
           "(N-1)/N for all-gather / reduce-scatter; groups spanning nodes run at inter_node_GBps; "
           f"each launch (bucket, unit, layer) pays 2 log2 N (all-reduce) or N-1 steps of "
           f"{su.options.intra_latency_us:g} us inside a node, {su.options.inter_latency_us:g} us across)"
           + (f"; inside this node per operation as measured: {su.machine.describe()}"
              if su.machine is not None else ""),
           "overlap: gradient all-reduce / reduce-scatter hide under backward, ZeRO-3/FSDP "
           "gathers under forward/backward (prefetch); ZeRO-1/2 post-step all-gather, TP "
           "all-reduces, pipeline sends and offload copies are exposed"
           + ("; on this measured CPU machine nothing overlaps (gloo runs collectives on the "
              "cores the compute uses)" if su.machine is not None and su.cluster.accelerator == "cpu"
              else "")]
    if su.shape is None:
        out.append("planner.params: no activations or TP/PP traffic; buffers and launches use an "
                   "estimated block of P / L parameters, L = (P / (12 x 128^2))^(1/3) layers "
                   "(hidden ~ 128 x layers, as GPT-3 and Llama)")
    else:
        attn = ("flash attention (no s x s scores)" if su.options.flash_attention
                else "materialised attention scores")
        from planner.activations import calibration

        arch = getattr(su.shape, "architecture", "")
        how = (f"calibrated for {arch} (planner/activations.json, traced per precision regime, "
               "with and without dropout, and under tensor and sequence parallelism)" if arch in calibration()
               else "Korthikanti et al. 2022 per layer")
        chunk = getattr(su.trainer, "loss_chunk", 0) or 0
        logits = ("fp32 logits for the loss, whose backward adds 8 x seq x micro x vocab bytes at "
                  "backward's start" if not chunk else
                  f"the loss chunked (trainer.loss_chunk={chunk}; tensor- and pipeline-parallel "
                  "layouts excepted): one chunk's fp32 logits (4 x chunk x vocab bytes) and its "
                  "backward (8 x chunk x vocab) at forward's end, plus the head's input and weight "
                  "gradients held from forward (4 x (seq x micro + vocab) x dim)")
        out.append(f"activations: {how}, SwiGLU/GQA terms, {attn}, "
                   f"micro batch {su.trainer.micro_batch_size} x seq {su.seq_len}; {logits}")
    out.append("planned-only TP / PP / 3D layouts use ZeRO-1 over data parallel (activations: "
               "Korthikanti et al.'s closed forms, what Megatron-LM saves); pipeline bubble: each "
               "schedule's chunk order as torch runs it, simulated with a backward of twice the "
               "forward (GPipe / 1F1B: (P-1)/(m+P-1); interleaved: (P-1)/(v m+P-1)); activations: "
               "the chunks each rank's schedule keeps alive at once (1F1B: min(P, m) on stage 0, "
               "GPipe: all m)")
    if getattr(su.trainer, "float8", "none") != "none":
        out.append(f"trainer.float8={su.trainer.float8}: states and activations as bf16 (torchao keeps "
                   "the fp32 weights and saves each Linear's bf16 input); FSDP2 under tensorwise gathers "
                   "the blocks' Linear weights in 1 byte; compute priced at the bf16 peak (float8's "
                   "faster matmuls not modelled: the plan is conservative)")
    return out


__all__ = ["mfu_formula", "ACCOUNTINGS", "as_run", "GB", "GiB", "MiB", "Candidate", "Collective", "Communication", "Memory",
           "ModelDescription", "Plan", "Recommendation", "Report", "Setup", "StateBytes",
           "activation_bytes", "all_gather_bytes", "boundary_activation_bytes", "bubble_fraction",
           "candidate", "gb", "korthikanti_layer_bytes", "layer_activation_bytes", "model_states",
           "Inputs", "WillNotFit", "check",
           "choose", "largest_micro_batch", "plan_all", "plan_candidate", "plan_dict", "planned_candidates", "preflight", "rank", "recommend",
           "reduce_scatter_bytes", "report_dict", "ring_all_reduce_bytes", "state_bytes",
           "transfer_seconds"]
