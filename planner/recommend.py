"""Which layout to use: the planned-only TP / PP / 3D candidates, and the deep-dive's ladder
(replicate, shard, TP inside a node, PP across nodes, offload) walked over the plans."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

from planner.inputs import Candidate, Setup
from planner.plan import plan_candidate
from planner.results import Plan, Recommendation
from planner.states import gb, gb_apart
from strategies.families.megatron import MegatronConfig

TOLERANCE = 0.05  # steps within 5% of the fastest count as equally fast
MOVE_UP = 1.2     # a heavier rung of the ladder must be this much faster to be recommended
LOSSY_WIN = 1.2   # lossy gradient compression must be this much faster than the best exact layout
RUNGS = ("replicated", "sharded data parallel", "tensor or sequence parallel", "pipeline / 3D", "offload")


# ----------------------------------------------------------------------------- candidates
def planned_candidates(su: Setup, tp: int = 1, pp: int = 1) -> list[Candidate]:
    """TP inside a node and PP across nodes, with ZeRO-1 (Megatron's distributed optimizer)
    over the data-parallel rest: planned only (the runnable tp / 3d presets shard data parallel
    with FSDP2 instead). Degrees: ``planner.tp``/``planner.pp``, or derived."""
    devices, shape, out = su.cluster.devices, su.shape, []
    heads = math.gcd(shape.n_heads, shape.n_kv_heads) if shape else devices
    t = tp if tp > 1 else max((d for d in range(1, devices + 1)
                               if devices % d == 0 and heads % d == 0), default=1)
    if t > 1:
        out.append(_megatron("megatron_tp", t, 1, f"TP={t} inside a node x ZeRO-1 data parallel"))
    if pp > 1 or su.cluster.nodes > 1:
        for name, t_ in (("megatron_pp", 1), ("megatron_3d", t)):
            if name == "megatron_3d" and t_ <= 1:
                continue
            p = pp if pp > 1 else _fitting_pp(su, t_)
            out.append(_megatron(name, t_, p, f"TP={t_} x PP={p} x ZeRO-1 data parallel"))
    return out


def _megatron(name: str, tp: int, pp: int, description: str) -> Candidate:
    return Candidate(name, MegatronConfig(name=name, tp=tp, pp=pp), description)


def _fitting_pp(su: Setup, tp: int) -> int:
    """The smallest pipeline degree (dividing the nodes, at least 2) whose plan fits."""
    nodes = su.cluster.nodes
    options = [p for p in range(2, nodes + 1) if nodes % p == 0]
    for p in options:
        if plan_candidate(_megatron("pp", tp, p, ""), su).fits:
            return p
    return options[-1] if options else 2


# ----------------------------------------------------------------------------- ranking
def recommend(plans: list[Plan], roomy: bool = False) -> Recommendation:
    """Walk the ladder over the exact layouts (``_ladder``); a lossy one (gradient compression)
    only when it is LOSSY_WIN times faster than that choice, or when no exact layout fits.
    ``roomy``: only layouts that fit with margin (not tight)."""
    ok = [p for p in plans if _ok(p, roomy)]
    if not ok:
        return Recommendation(None, nothing_fits(plans))
    exact = _ladder([p for p in plans if not p.lossy], roomy)
    lossy = _ladder([p for p in plans if p.lossy], roomy)
    if lossy.strategy is None:
        return exact
    step = {p.strategy: p.step_seconds for p in ok}
    if exact.strategy is None:
        lossy.reason += "; lossy gradient compression: no exact layout fits"
        return lossy
    if step[lossy.strategy] * LOSSY_WIN < step[exact.strategy]:
        lossy.reason += (f"; lossy gradient compression, {step[exact.strategy] / step[lossy.strategy]:.2f}x "
                         f"faster than the exact {exact.strategy} (it must win by {LOSSY_WIN:g}x)")
        return lossy
    return exact


def nothing_fits(plans: list[Plan]) -> str:
    """Why nothing can be recommended: the memory, or (when some layout's memory fits) what
    stops the layouts that fit from running here (the batch arithmetic, the mesh)."""
    if not plans:
        return "nothing to plan"
    roomy = [p for p in plans if p.memory_fits and p.blocking and p.mesh_fits]
    if roomy and not any(p.memory_fits and not p.blocking for p in plans):
        # the problem most of them share (the batch, say: named by its key), then the smallest
        keys = Counter(p.blocking[0].split(" ")[0] for p in roomy)
        first = min(roomy, key=lambda p: (-keys[p.blocking[0].split(" ")[0]], p.memory.total))
        more = keys[first.blocking[0].split(" ")[0]] - 1
        return (f"nothing can run here: the layouts that fit in memory cannot run "
                f"({first.strategy}{f' and {more} more' if more else ''}: {first.blocking[0]})")
    stalled = [p for p in plans if p.fits and not p.problems and p.stalled]
    if stalled:
        first = min(stalled, key=lambda p: p.memory.total)
        return f"nothing can be timed here: every layout that fits needs a 0 GB/s link ({first.stalled[0]})"
    # (a layout that cannot run here has no need to name: its numbers may be on an impossible mesh)
    need = min([p for p in plans if not p.blocking] or plans, key=lambda p: p.memory.total)
    if need.memory.total <= need.device_bytes and need.overflows:  # the device has room
        return (f"nothing fits; the smallest need is {need.strategy}'s {gb(need.memory.total)} per "
                f"device, which the device has, but {'; '.join(need.overflows)}")
    total, has = gb_apart(need.memory.total, need.device_bytes)
    return f"nothing fits; the smallest need is {need.strategy}'s {total} per device, has {has}"


def _ok(p: Plan, roomy: bool = False) -> bool:
    return p.fits and not p.problems and not p.stalled and not (roomy and p.tight)


def _ladder(plans: list[Plan], roomy: bool = False) -> Recommendation:
    """The lowest rung with a fitting layout, unless a heavier rung (short of offload) is MOVE_UP
    times faster -- or as fast (within TOLERANCE) while the lower one is tight. Within a rung:
    the fastest, and among layouts within TOLERANCE of it, the one leaving the most memory free,
    then the one moving fewest bytes."""
    ok = [p for p in plans if _ok(p, roomy)]
    if not ok:
        return Recommendation(None, "nothing fits")
    best, why = None, ""
    for rung in range(4):
        top = best_of([p for p in ok if p.rung == rung])
        if top is None:
            continue
        if best is None:
            best, why = top, _why_first(top, plans)
        elif top.step_seconds * MOVE_UP < best.step_seconds:
            why = (f"{top.strategy} ({RUNGS[rung]}) is {best.step_seconds / top.step_seconds:.2f}x "
                   f"faster than {best.strategy} (step ~ {top.step_seconds:.3g} s vs "
                   f"{best.step_seconds:.3g} s)")
            best = top
        elif best.tight and not top.tight and top.step_seconds <= best.step_seconds * (1 + TOLERANCE):
            why = (f"{best.strategy} would leave only {gb(best.margin)} free (under the "
                   f"{gb(best.reserve)} reserve); {top.strategy} ({RUNGS[rung]}) is as fast (step ~ "
                   f"{top.step_seconds:.3g} s vs {best.step_seconds:.3g} s) with "
                   f"{gb(top.margin)} free")
            best = top
    if best is None:
        best = best_of([p for p in ok if p.rung == 4])
        moved = best.memory.host + best.memory.nvme
        why = (f"nothing fits in device memory without offload; {best.strategy} moves "
               f"{gb(moved)} per device to host/NVMe (step ~ {best.step_seconds:.3g} s)")
    if best.tight:
        why += (f"; tight: {gb(best.margin)} free, under planner.reserve_GB ({gb(best.reserve)}) "
                "for the CUDA context, NCCL and fragmentation")
    if best.planned_only:
        why += "; planned only: needs a TP/PP implementation"
    return Recommendation(best.strategy, why, tight=best.tight)


def best_of(plans: list[Plan]) -> Plan | None:
    if not plans:
        return None
    fastest = min(p.step_seconds for p in plans)
    near = [p for p in plans if p.step_seconds <= fastest * (1 + TOLERANCE)]
    # (a tie on one device: single, with no wrapper, before ddp)
    return min(near, key=lambda p: (p.tight, p.memory.total, p.communication.bytes_per_step,
                                    p.strategy != "single", p.strategy))


def _why_first(top: Plan, plans: list[Plan]) -> str:
    if top.rung == 0:
        return (f"the replicated state fits ({gb(top.memory.total)} of {gb(top.device_bytes)} "
                f"per device): no sharding needed; {top.strategy} is the fastest "
                f"(step ~ {top.step_seconds:.3g} s)")
    rep = [p for p in plans if p.rung == 0 and not p.problems]
    need = gb(min(p.memory.total for p in rep)) if rep else ""
    tight = [p for p in rep if p.tight]
    if tight:
        lead = (f"replicated fits only tightly ({tight[0].strategy}: {gb(tight[0].margin)} free, under "
                f"the {gb(tight[0].reserve)} reserve)")
    elif rep and top.rung >= 2:  # tensor / pipeline parallel: the model itself is split
        lead = (f"replicated needs {need} per device, has {gb(top.device_bytes)}, so the model must "
                f"be split")
    elif rep and top.shard <= 1:  # nothing is sharded over one rank: the engine holds less
        lead = (f"replicated needs {need} per device, has {gb(top.device_bytes)}; with one "
                f"data-parallel rank nothing is sharded, but {top.strategy}'s engine holds the "
                f"same model in less ({gb(top.memory.total)}: {_held_less(top, rep)})")
    elif rep:
        lead = f"replicated needs {need} per device, has {gb(top.device_bytes)}, so the state must be sharded"
    else:
        lead = "no replicated layout runs here"
    kind = f"{RUNGS[top.rung]} " if top.rung != 1 or top.shard > 1 else ""  # one rank shards nothing
    return (f"{lead}; {top.strategy} is the fastest {kind}layout that fits "
            f"(step ~ {top.step_seconds:.3g} s, {gb(top.memory.total)} per device, "
            f"{gb(top.communication.bytes_per_step)} moved per step)")


def _held_less(top: Plan, rep: list[Plan]) -> str:
    """Why ``top``'s engine holds less than the replicated layouts on one data-parallel rank, its
    own reason read from the plans: DeepSpeed's (a master copy) or a 16-bit unit at a time
    (FSDP's mixed precision) against torch AMP's 16-bit copy of every weight, kept for backward."""
    low = min(rep, key=lambda p: p.memory.total)
    if top.memory.master:  # (DeepSpeed's layout keeps the fp32 master)
        return ("DeepSpeed's 16-bit parameters are the working weights, beside an fp32 master, where "
                "torch AMP keeps fp32 parameters and gradients and a 16-bit copy of every weight")
    if top.memory.buffers < low.memory.buffers:
        return (f"its mixed precision makes one unit's 16-bit weights at a time ({gb(top.memory.buffers)} "
                f"of buffers), where torch AMP keeps a 16-bit copy of every weight for backward "
                f"({low.strategy}: {gb(low.memory.buffers)})")
    return f"{gb(low.memory.total - top.memory.total)} less than {low.strategy} in the engine's own buffers"


def rank(plans: list[Plan], rec: Recommendation) -> list[Plan]:
    """Recommended first, then runnable fitting layouts by step time (tight ones after), then the
    planned-only ones that fit, apart; then the rest by memory (what cannot run here last)."""
    def group(p: Plan) -> int:
        if p.strategy == rec.strategy:
            return 0
        if p.fits and not p.problems:
            return 3 if p.planned_only else 2 if p.tight else 1
        return 4 if not p.blocking else 5
    return sorted(plans, key=lambda p: (group(p), p.step_seconds if p.fits else p.memory.total, p.strategy))


# ----------------------------------------------------------------------------- micro batch
def largest_micro_batch(c: Candidate, su: Setup) -> int | None:
    """The largest micro batch above the trainer's with which ``c`` still fits, not tight, and
    the batch arithmetic holds (it divides global / (dp x the pipeline's chunks)); None if the
    trainer's is already the largest. Fewer accumulation steps: larger, more efficient kernels."""
    t = su.trainer
    base = plan_candidate(c, su)
    per_rank = t.global_batch_size // (base.dp * c.run(su).batch.chunks)
    options = [m for m in range(per_rank, t.micro_batch_size, -1) if per_rank % m == 0]
    for m in options:  # largest first; memory grows with the micro batch
        p = plan_candidate(c, dataclasses.replace(su, trainer=dataclasses.replace(t, micro_batch_size=m)))
        if p.fits and not p.problems and p.margin >= p.reserve:
            return m
    return None
