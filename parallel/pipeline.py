"""Cutting a model into pipeline stages, engine-neutral: which blocks each stage holds (balanced by
parameter count, or as ``strategy.split`` says), which stages a pipeline rank runs under each of
torch's schedules, and a stage as a view of the model that keeps the full model's parameter
names. The model declares how it is cut (``pp_plan``: its ModuleDict of blocks, and the modules
only the first or last stage runs). A backend's pipeline runner gives these stages to
``torch.distributed.pipelining`` (backends/lightning/pipeline.py).

Also, torch-free, for the planner and the run's report: the order in which each of torch's
schedules runs its forward and backward chunks on each rank (``actions``, checked against
torch's own ``pipeline_order`` by a test), and what follows from it -- the idle (bubble)
fraction a schedule has when every chunk takes its usual time (``simulate``), the micro-batch
chunks a rank holds at once (``peak_live``), and the activations and gradients it sends across
stage boundaries (``sends_per_microbatch``).
"""

from __future__ import annotations

import functools
from typing import Any

# schedule name -> (torch class, virtual stages it needs: 1 or >= 2, stage placement)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", 2, "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
}


F, B, I, W = "F", "B", "I", "W"
"""Chunk kinds: forward, full backward, backward for the input only, backward for the weights
(the zero-bubble schedules split B into I and W)."""
Action = tuple[int, str, int]
"""(stage, kind, micro-batch)."""


def balanced_split(costs: list[float], first: float, last: float, stages: int) -> list[int]:
    """Blocks per stage, contiguous, minimising the largest stage's parameter count; the first
    stage also carries ``first`` (embedding), the last ``last`` (norm and head)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    @functools.cache
    def best(i: int, s: int) -> tuple[float, tuple[int, ...]]:
        """Blocks i.. over stages s.. : (largest stage, sizes)."""
        if s == stages - 1:
            return prefix[n] - prefix[i] + last + (first if s == 0 else 0), (n - i,)
        out = (float("inf"), ())
        for j in range(i + 1, n - (stages - 1 - s) + 1):
            here = prefix[j] - prefix[i] + (first if s == 0 else 0)
            rest, sizes = best(j, s + 1)
            cand = (max(here, rest), (j - i, *sizes))
            out = min(out, cand)
        return out

    return list(best(0, 0)[1])


def stage_ids(schedule: str, pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages a pipeline rank holds: r, r + P, ... (looped), or r and 2P-1-r (a V)."""
    if SCHEDULES[schedule][2] == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def stage_owner(schedule: str, stage: int, pp: int, virtual: int) -> int:
    """The pipeline rank that holds ``stage``."""
    for r in range(pp):
        if stage in stage_ids(schedule, r, pp, virtual):
            return r
    raise ValueError(f"stage {stage} is held by no pipeline rank of {pp}")


def build_stage(full: Any, layer_ids: list[int], first: bool, last: bool) -> Any:
    """A view of the model that runs only ``layer_ids``: it shares the kept blocks and modules
    with ``full`` (no copy) and has the others deleted (set to None), so what stays keeps its
    names. Several views of one model share their parameters and buffers (its own ones too:
    the views' one dict of them, so storage given to one view's, as a meta build's rotary table
    is by ``materialize``, is every view's)."""
    import copy

    import torch

    plan = type(full).pp_plan
    stage = copy.copy(full)  # a new module object over the same children
    stage._modules = dict(full._modules)  # (its own: the deleted ones are set to None in it)
    blocks = getattr(full, plan["blocks"])
    setattr(stage, plan["blocks"], torch.nn.ModuleDict({str(i): blocks[str(i)] for i in layer_ids}))
    for name in plan["first"] if not first else ():
        setattr(stage, name, None)
    for name in plan["last"] if not last else ():
        setattr(stage, name, None)
    return stage


def split_model(full: Any, stages: int, sizes: list[int] | None = None) -> list[list[int]]:
    """Layer indices per stage: ``sizes`` (blocks per stage) or balanced by parameter count."""
    plan = type(full).pp_plan
    blocks = getattr(full, plan["blocks"])
    if sizes is None:
        count = lambda mods: float(sum(p.numel() for m in mods if m is not None  # noqa: E731
                                       for p in m.parameters()))
        costs = [count([b]) for b in blocks.values()]
        sizes = balanced_split(costs, count([getattr(full, n) for n in plan["first"]]),
                               count([getattr(full, n) for n in plan["last"]]), stages)
    out, i = [], 0
    for s in sizes:
        out.append(list(range(i, i + s)))
        i += s
    return out


# ----------------------------------------------------------------------------- schedules
def actions(schedule: str, pp: int, virtual: int, m: int) -> list[list[Action]]:
    """Per pipeline rank, the compute chunks in the order torch's ``schedule`` runs them (its
    ``_step_microbatches`` for gpipe and 1f1b, its ``pipeline_order`` without the idle slots for
    the others): ``pp`` ranks, ``virtual`` stages each, ``m`` micro-batches per schedule run."""
    if schedule in ("gpipe", "1f1b"):
        return [_single(schedule, r, pp, m) for r in range(pp)]
    if schedule == "looped_bfs":
        return [_looped_bfs(r, pp, virtual, m) for r in range(pp)]
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        return [_interleaved(r, pp, virtual, m, zero_bubble=schedule == "interleaved_zb") for r in range(pp)]
    if schedule == "zbv":
        return [_zbv(r, pp, m) for r in range(pp)]
    raise ValueError(f"strategy.schedule={schedule!r}: one of {', '.join(SCHEDULES)}")


def _single(schedule: str, r: int, pp: int, m: int) -> list[Action]:
    if schedule == "gpipe":  # every forward, then every backward
        return [(r, F, i) for i in range(m)] + [(r, B, i) for i in range(m)]
    warmup = min(m, pp - r)  # 1F1B: the last stage one forward ahead, the first pp
    out: list[Action] = [(r, F, i) for i in range(warmup)]
    f, b = warmup, 0
    while True:
        out.append((r, B, b))
        b += 1
        if f == m:
            break
        out.append((r, F, f))
        f += 1
    return out + [(r, B, i) for i in range(b, m)]


def _looped_bfs(r: int, pp: int, v: int, m: int) -> list[Action]:
    stages = range(r, pp * v, pp)
    return ([(s, F, i) for s in stages for i in range(m)]
            + [(s, B, i) for s in reversed(stages) for i in reversed(range(m))])


def _interleaved(r: int, pp: int, v: int, m: int, zero_bubble: bool) -> list[Action]:
    """torch's ``_get_1f1b_rank_ops`` (interleaved 1F1B; with ``zero_bubble`` its ZB1P variant)."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - r), m * v)
    total = m * v + warmup  # warmup forwards, m v - warmup (F, B) pairs, warmup backwards
    kind = I if zero_bubble else B

    def fwd_stage(step: int) -> int:
        return (step // per_round) % v * pp + r

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + r

    counts: dict[tuple[str, int], int] = {}

    def take(k: str, stage: int) -> Action:
        i = counts.get((k, stage), 0)
        counts[k, stage] = i + 1
        return (stage, k, i)

    out: list[Action] = []
    backward_ops: list[int] = []
    weights = 0
    for op in range(total):
        if op < warmup:
            out.append(take(F, fwd_stage(op)))
            continue
        if op < m * v:
            out.append(take(F, fwd_stage(op)))
        out.append(take(kind, bwd_stage(op)))
        backward_ops.append(op)
        if zero_bubble and op - warmup >= r:  # the first r backwards keep their W for later
            out.append(take(W, bwd_stage(backward_ops[weights])))
            weights += 1
    while zero_bubble and weights < len(backward_ops):
        out.append(take(W, bwd_stage(backward_ops[weights])))
        weights += 1
    return out


def _zbv(r: int, pp: int, m: int) -> list[Action]:
    """torch's ``ScheduleZBVZeroBubble``: two stages per rank in a V (r and 2 pp - 1 - r)."""
    n = max(2 * pp - 1, m)
    c0, c1 = r, 2 * pp - 1 - r
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    out += [(c0, F, i) for i in range(2 * (pp - r) - 1)]
    f0 = 2 * (pp - r) - 1
    for _ in range(r):
        out += [(c1, F, f1), (c0, F, f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(pp - r):
        out += [(c1, F, f1), (c1, I, b1), (c1, W, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append((c0, F, f0))
            f0 += 1
        out += [(c0, I, b0), (c0, W, b0), (c1, F, f1), (c1, I, b1), (c1, W, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(r):
        out += [(c0, I, b0), (c1, I, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(pp - r):
        out += [(c0, I, b0), (c0, W, w0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [(c1, W, i) for i in range(w1, b1)] + [(c0, W, i) for i in range(w0, b0)]
    return [a for a in out if a[2] < m]  # the V needs 2 pp - 1 micro-batches; extra ones are idle


def n_stages(schedule: str, pp: int, virtual: int) -> int:
    return pp * (2 if SCHEDULES[schedule][2] == "v" else virtual)


def _owner(schedule: str, pp: int, virtual: int) -> dict[int, int]:
    return {s: r for r in range(pp) for s in stage_ids(schedule, r, pp, virtual)}


COSTS = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}
"""A chunk's time in forwards of that chunk: backward is twice the forward (input and weight
gradients, one matmul each per forward matmul), split evenly by the zero-bubble schedules."""


def simulate(schedule: str, pp: int, virtual: int, m: int, *, recompute: bool = False,
             hop: float = 0.0) -> list[float]:
    """Idle fraction of each rank over one schedule run when every stage takes the same time
    and ranks run their chunks in ``actions`` order, each as soon as its input is there (a
    forward after the previous stage's forward of that micro-batch, a backward after the next
    stage's backward, a weight gradient after its input gradient). ``recompute``: activation
    checkpointing, one more forward inside each backward; ``hop``: the time of one boundary
    transfer between ranks, in forwards of a chunk. Exactly (P-1)/(m+P-1) for gpipe and 1f1b."""
    cost = dict(COSTS, **({B: 3.0, I: 2.0} if recompute else {}))
    order = actions(schedule, pp, virtual, m)
    owner = _owner(schedule, pp, virtual)
    last = n_stages(schedule, pp, virtual) - 1
    done: dict[Action, float] = {}
    free, busy, nxt = [0.0] * pp, [0.0] * pp, [0] * pp

    def ready(a: Action) -> float | None:
        s, k, i = a
        if k == F:
            dep = (s - 1, F, i) if s > 0 else None
        elif k == W:
            dep = (s, I, i)
        elif s == last:
            dep = (s, F, i)
        else:
            dep = next(((s + 1, x, i) for x in (B, I) if (s + 1, x, i) in done), (s + 1, B, i))
        if dep is None:
            return 0.0
        if dep not in done:
            return None
        return done[dep] + (hop if owner[dep[0]] != owner[s] else 0.0)

    pending = sum(len(o) for o in order)
    while pending:
        progressed = False
        for r in range(pp):
            while nxt[r] < len(order[r]) and (t := ready(a := order[r][nxt[r]])) is not None:
                start = max(free[r], t)
                free[r] = done[a] = start + cost[a[1]]
                busy[r] += cost[a[1]]
                nxt[r], pending, progressed = nxt[r] + 1, pending - 1, True
        if not progressed:
            raise RuntimeError(f"{schedule}: pp={pp} virtual={virtual} m={m} deadlocks")
    span = max(free)
    return [1 - b / span for b in busy]


def bubble(schedule: str, pp: int, virtual: int, m: int, *, recompute: bool = False) -> float:
    """The schedule's idle fraction (the busiest rank's wall time not spent computing; ranks are
    equally busy when stages are balanced)."""
    return min(simulate(schedule, pp, virtual, m, recompute=recompute)) if pp > 1 else 0.0


def peak_live(schedule: str, pp: int, virtual: int, m: int, weight: Any = None) -> list[float]:
    """Per rank, the most micro-batch chunks whose activations it holds at once (a chunk lives
    from its forward to its full backward, or to its weight gradient under zero bubble);
    ``weight(stage)``: what one chunk of that stage holds (default 1)."""
    weight = weight or (lambda s: 1.0)
    out = []
    for order in actions(schedule, pp, virtual, m):
        live = peak = 0.0
        for s, k, _ in order:
            live += weight(s) if k == F else -weight(s) if k in (B, W) else 0.0
            peak = max(peak, live)
        out.append(peak)
    return out


def sends_per_microbatch(schedule: str, pp: int, virtual: int) -> list[int]:
    """Per rank, the tensors it sends per micro-batch: each of its stages' output forward and
    input gradient backward, across every boundary whose two stages sit on different ranks (a
    V keeps its turn on one rank)."""
    owner = _owner(schedule, pp, virtual)
    last = n_stages(schedule, pp, virtual) - 1
    out = [0] * pp
    for s, r in owner.items():
        out[r] += (s < last and owner[s + 1] != r) + (s > 0 and owner[s - 1] != r)
    return out


def fsdp_gathers(schedule: str, pp: int, virtual: int, m: int,
                 reshard_after_forward: bool = True) -> list[tuple[float, float]]:
    """Per rank, the all-gathers of a stage's FSDP2 blocks in one schedule run, in forward and
    in backward, per stage it holds. torch's stage keeps what a backward gathered until the end
    of the schedule (``set_reshard_after_backward(False)``) and reduce-scatters the gradients
    once there (``perform_reduce_grad``); a forward reshards after itself (with
    ``reshard_after_forward``). 1F1B and GPipe: m + 1 gathers (each warm-up forward, one
    backward, then each 1F1B pair once)."""
    out = []
    for order in actions(schedule, pp, virtual, m):
        gathered: dict[int, bool] = {}
        fwd = bwd = 0
        for s, k, _ in order:
            if k == W:  # the weight gradient needs no parameters
                continue
            if not gathered.get(s):
                fwd, bwd = (fwd + 1, bwd) if k == F else (fwd, bwd + 1)
                gathered[s] = True
            if k == F and reshard_after_forward:
                gathered[s] = False
        stages = len({s for s, _, _ in order}) or 1
        out.append((fwd / stages, bwd / stages))
    return out


__all__ = [
    "COSTS",
    "SCHEDULES",
    "B",
    "F",
    "I",
    "W",
    "actions",
    "balanced_split",
    "bubble",
    "build_stage",
    "fsdp_gathers",
    "n_stages",
    "peak_live",
    "sends_per_microbatch",
    "simulate",
    "split_model",
    "stage_ids",
    "stage_owner",
]
