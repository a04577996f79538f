"""Communication profile: every collective a rank issues in an optimizer step -- kind, process
group, payload bytes, and time where the backend gives it -- whoever issues it.

Mechanism (one, for every strategy and both backends): Python kernels registered through
``torch.library`` on torch's collective ops -- the ``c10d::*`` ops (what ``torch.distributed``
and DDP's C++ reducer call) at their Autograd dispatch key, the ``_c10d_functional::*`` ops (what
DTensor, FSDP2, tensor parallelism and compiled code call) at their CPU and CUDA keys, below
torch's own autograd formulas for them (``torch.library.register_autograd``, which a kernel of
ours at the Autograd key would replace: torch 2.11 refuses that, 2.13 silently drops the
formula). Each kernel calls the real one and, while a step is being recorded, notes the op. So
DDP's bucketed all-reduce (and its compression hooks), FSDP1/FSDP2, DeepSpeed's torch backend,
TP and pipeline send/recv, calls made below autograd (inside a DTensor op handler: torch's ring
attention) and inference-mode ones are all seen, and only collectives pay (measured ~+50 us per
collective while recording, ~+15 us installed but idle). Alternatives measured and why not:
torch.profiler (no process group on gloo; reading events costs 0.1-2 s per step), a
TorchDispatchMode such as CommDebugMode (every op pays: up to 4x step time on deep models), the
flight recorder (no pipeline send/recv; gloo reports its reduce-scatter as all-reduce), wrapping
``torch.distributed`` functions (misses DDP's reducer, FSDP2 and DTensor). With the observer off
(``callbacks.communication=false``) nothing is registered: no collective is intercepted.

Which ops exist and where torch keeps its own kernels is asked of the running torch
(``_install``), not read off its version; an op that cannot be observed without replacing one
of torch's kernels is listed in the report (``unobserved``). The kernels stay registered for the
life of the process once installed, inert outside a recorded step.

Bytes: ``bytes`` is the payload -- the logical buffer, as nccl-tests counts it: all-reduce and
broadcast the tensor, all-gather its output (world x input), reduce-scatter its input, send/recv
the tensor. ``wire_bytes`` is what this rank sends on a ring (all-reduce 2(n-1)/n, all-gather
and reduce-scatter (n-1)/n, send 1, recv 0): the planner's unit.

Groups are named by role: a DeviceMesh dimension by its axis (``core.mesh.Axis.role``: ``shard``
-> data-shard, ``replicate`` -> data-replicate, ``tensor_parallel`` -> tensor,
``pipeline_parallel`` -> pipeline, ``context_parallel`` -> cp: ring attention's K/V send/recv;
other libraries' spellings, ``tp``, ``dp_shard``, ..., through ``ALIASES``), a group created with
an axis as its description likewise (``sp``:
Ulysses' all-to-all, backends/common/deepspeed.py), DeepSpeed's MoE groups by its own registry
(``ep``, ``ep_replicate``: zero2_ep's expert-data-parallel gradient reduction), the world group by
what the strategy does on it (data-shard when it shards, else data-replicate).

Report key ``communication``: ``per_step[kind] -> {count, bytes, wire_bytes, seconds}`` (rank 0,
averaged over optimizer steps, the first excluded when there are others: engines set up in it;
and the steps of the preset's warm-up -- ``strategy.powersgd_warmup_steps``, the ``start_step``
of top-k, int8, local SGD and DiLoCo: plain all-reduce -- excluded, and under local SGD and
DiLoCo whole ``sync_every`` periods ending at the last step, so the average is the steady state
the planner prices: observers/comm_steps.py; ``seconds`` null where the backend timed none of
that kind), ``by_group[group][kind]`` the same per group, ``ranks`` (every rank's per-step
totals), ``steps`` (how many were recorded), ``averaged_steps`` (how many the averages cover),
``warmup_steps`` (the preset's warm-up, 0: none), ``sync_every`` (local SGD's and DiLoCo's
period, where there is one), ``steady_state`` (false: the averages are not the steady state),
``averaged_of`` (what they are: ``steady state``; ``warm-up``, every step but the first was in
the warm-up; ``part of a sync period``, fewer steps after the warm-up than one period),
``mechanism`` and ``unobserved``; and ``unavailable``, only where this torch lacks a private
name the kernels lean on (``dispatch_problem``, asked once before anything is registered: one
warning, nothing recorded, training goes on).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from core.mesh import Axis
from observers.base import Engine, Observer, Selection, observer
from observers.comm_steps import STEADY, Recorded, summarize, totals

log = logging.getLogger(__name__)

MECHANISM = ("torch.library kernels on the Autograd key of the c10d collective ops and the "
             "CPU/CUDA keys of the _c10d_functional ones (see observers/comm.py)")

# c10d ops: (kind, arg index of the input tensors, of the output tensors, of the process group)
_C10D = {
    "allreduce_": ("all_reduce", 0, 0, 1), "allreduce_coalesced_": ("all_reduce", 0, 0, 1),
    "allgather_": ("all_gather", 1, 0, 2), "_allgather_base_": ("all_gather", 1, 0, 2),
    "allgather_coalesced_": ("all_gather", 1, 0, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 1, 0, 2),
    "reduce_scatter_": ("reduce_scatter", 1, 0, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 0, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 0, 2),
    "broadcast_": ("broadcast", 0, 0, 1), "send": ("send", 0, 0, 1), "recv_": ("recv", 0, 0, 1),
    "recv_any_source_": ("recv", 0, 0, 1), "alltoall_": ("all_to_all", 1, 0, 2),
    "alltoall_base_": ("all_to_all", 1, 0, 2), "reduce_": ("reduce", 0, 0, 1),
}
# functional collectives: (kind, arg index of the group name)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 2), "all_reduce_": ("all_reduce", 2),
    "all_reduce_coalesced": ("all_reduce", 2), "all_reduce_coalesced_": ("all_reduce", 2),
    "all_gather_into_tensor": ("all_gather", 2), "all_gather_into_tensor_out": ("all_gather", 2),
    "all_gather_into_tensor_coalesced": ("all_gather", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 3), "reduce_scatter_tensor_out": ("reduce_scatter", 3),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 3),
    "all_to_all_single": ("all_to_all", 3), "broadcast": ("broadcast", 2),
    "broadcast_": ("broadcast", 2), "isend": ("send", 3), "irecv": ("recv", 3),
}
_WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
         "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send": lambda n: 1.0,
         "recv": lambda n: 0.0}
# Other libraries' names for the same axes (torchtitan's and Accelerate's ParallelismConfig mesh
# dimensions), read here when a mesh someone else built carries them.
ALIASES = {"dp_shard": Axis.SHARD, "dp_replicate": Axis.REPLICATE, "dp": Axis.DATA, "tp": Axis.TENSOR,
           "pp": Axis.PIPELINE, "cp": Axis.CONTEXT}
# mesh dimension or group description -> the group's name in the report (``Axis.role``)
ROLES = {**{axis.value: axis.role for axis in Axis}, **{name: axis.role for name, axis in ALIASES.items()}}

_recorder: Recorder | None = None
_unavailable: str | None = None
"""Why this torch cannot be observed (``dispatch_problem``), once asked."""
_install_lock = threading.Lock()


def _flat(x: Any) -> list:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _flat(y)]
    return []


def _nbytes(tensors: list) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _process_group(obj: Any) -> Any:
    import torch

    c10d = torch._C._distributed_c10d
    if isinstance(obj, c10d.ProcessGroup):
        return obj
    try:
        return c10d._resolve_process_group(obj) if isinstance(obj, str) else c10d.ProcessGroup.unbox(obj)
    except Exception:  # noqa: BLE001  (an argument we cannot read: counted under "?")
        return None


def _deepspeed_axis(pg: Any) -> Axis | None:
    """The axis of a group DeepSpeed created for its MoE (zero2_ep), which carries no description:
    found in DeepSpeed's own registry of them (``deepspeed.utils.groups``), when it is loaded."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    for axis, registry in ((Axis.EP, "_EXPERT_PARALLEL_GROUP"), (Axis.EP_REPLICATE, "_EXPERT_DATA_PARALLEL_GROUP")):
        if any(g is pg for g in (getattr(groups, registry, None) or {}).values()):
            return axis
    return None


class Recorder:
    """Collects collectives between ``start()`` and ``stop()`` (installs the kernels once)."""

    def __init__(self, world_role: str):
        self.world_role = world_role
        self.active = False
        self.records: list[dict[str, Any]] = []
        self._labels: dict[str, str] = {}
        self._lock = threading.Lock()
        self.unobserved: list[str] = []
        """Collective ops of this torch that cannot be observed without replacing its own kernel."""

    def label(self, pg: Any) -> str:
        if pg is None:
            return "?"
        name = pg.group_name
        if name not in self._labels:
            desc = getattr(pg, "group_desc", "") or ""
            if desc.startswith("mesh_"):
                dim = desc[len("mesh_"):]
                self._labels[name] = ROLES.get(dim, dim)
            elif desc in ROLES:  # a group we create with its role as description (Ulysses' sp)
                self._labels[name] = ROLES[desc]
            elif name == "0" or desc == "default_pg":
                self._labels[name] = self.world_role
            elif (axis := _deepspeed_axis(pg)) is not None:
                self._labels[name] = axis.role
            else:
                import torch.distributed as dist

                size = dist.get_world_size() if dist.is_initialized() else 1
                # DeepSpeed's groups carry no description: its data-parallel group is the world
                self._labels[name] = self.world_role if pg.size() == size else f"group{name}"
        return self._labels[name]

    def record(self, kind: str, pg: Any, inputs: list, outputs: list, work: Any = None,
               sent: float | None = None) -> None:
        """``sent``: the fraction of the payload this rank sends to others, where the call says
        (an all-to-all's split sizes); else the ring's (``_WIRE``)."""
        n = pg.size() if pg is not None else 1
        if kind == "all_gather":
            payload = _nbytes(outputs) or _nbytes(inputs) * n
        elif kind == "reduce_scatter":
            payload = _nbytes(inputs) or _nbytes(outputs) * n
        else:
            payload = max(_nbytes(inputs), _nbytes(outputs))
        wire = payload * (sent if sent is not None else _WIRE.get(kind, lambda n: 1.0)(n))
        rec = {"kind": kind, "group": self.label(pg), "bytes": payload,
               "wire_bytes": wire, "seconds": None}
        with self._lock:
            self.records.append(rec)
        if work is not None:  # gloo completes futures for some collectives: time those
            self._time(rec, work)

    def _time(self, rec: dict[str, Any], work: Any) -> None:
        import torch

        c10d = torch._C._distributed_c10d
        t0 = time.perf_counter()
        try:
            w = work if isinstance(work, c10d.Work) else c10d.Work.unbox(work)
            w.get_future().add_done_callback(lambda _f: rec.__setitem__("seconds", time.perf_counter() - t0))
        except Exception:  # noqa: BLE001  (no future for this backend and op: untimed)
            pass

    def on_c10d(self, name: str, args: tuple, out: Any) -> None:
        kind, i, o, g = _C10D[name]
        pg = _process_group(args[g]) if len(args) > g else None
        inputs = _flat(args[i])
        outputs = [] if (o == i or kind in ("all_reduce", "broadcast", "reduce", "send", "recv")) \
            else _flat(args[o])
        self.record(kind, pg, inputs, outputs, out[-1] if isinstance(out, tuple) else out)

    def on_functional(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        kind, g = _FUNCTIONAL[name]
        pg = _process_group(args[g] if len(args) > g else kwargs.get("group_name"))
        outputs = [] if kind in ("all_reduce", "broadcast", "send", "recv") else _flat(out)
        sent = None
        if name == "all_to_all_single" and pg is not None and len(args) > 2 and args[2]:
            # uneven splits (a ring's permute sends everything to one peer): the rows not kept
            splits = [int(x) for x in args[2]]
            sent = 1 - splits[pg.rank()] / max(1, sum(splits))
        self.record(kind, pg, _flat(args[0]), outputs, sent=sent)

    def start(self) -> None:
        with self._lock:
            self.records = []
        self.active = True

    def stop(self) -> list[dict[str, Any]]:
        self.active = False
        with self._lock:
            return list(self.records)


def _op(namespace: str, name: str) -> Any:
    """The running torch's op ``namespace::name``, or None where this torch has no such op
    (torch 2.11 has no functional isend/irecv)."""
    import torch

    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def _taken(namespace: str, name: str, key: str) -> bool:
    """Whether the running torch has its own kernel for the op at ``key``: a kernel of ours there
    would replace it (torch registers the functional collectives' autograd formulas from Python,
    ``torch.library.register_autograd``; torch 2.11 refuses to override them, 2.13 would drop
    them), so the op is observed elsewhere or not at all."""
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{name}", key)


def _install() -> dict[str, str]:
    """Register the kernels once per process; they forward to ``_recorder`` while it records.
    Where each op is observed is asked of the running torch, not read off its version: the c10d
    ops at the Autograd key (their real kernels are the backend keys'), the functional ones at
    the CPU and CUDA keys below their real CompositeExplicitAutograd kernel (torch's own autograd
    formulas stay in place above). Returns op -> where it is seen, or why not."""
    import torch

    after = torch._C._after_autograd_keyset
    depth = threading.local()

    def counted(call: Any, note: Any, args: tuple, kwargs: dict) -> Any:
        level = getattr(depth, "n", 0)
        depth.n = level + 1  # a functional collective calls a c10d one inside: count once
        try:
            out = call()
        finally:
            depth.n = level
        rec = _recorder
        if level == 0 and rec is not None and rec.active:
            note(rec, args, kwargs, out)
        return out

    def above(op: Any, note) -> Any:
        def run(keyset, *args, **kwargs):
            return counted(lambda: op.redispatch(keyset & after, *args, **kwargs), note, args, kwargs)

        return run

    composite = torch._C.DispatchKey.CompositeExplicitAutograd

    def below(op: Any, note) -> Any:
        # Every call reaches a backend key: through torch's autograd formula, from inside a
        # DTensor op handler (torch's ring attention), in inference mode.
        def run(*args, **kwargs):
            return counted(lambda: op._op_dk(composite, *args, **kwargs), note, args, kwargs)

        return run

    import warnings

    seen: dict[str, str] = {}
    libs = [torch.library.Library("c10d", "IMPL"), torch.library.Library("_c10d_functional", "IMPL")]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for name in _C10D:
            op = _op("c10d", name)
            if op is None or _taken("c10d", name, "Autograd"):
                seen[f"c10d::{name}"] = "not in this torch" if op is None else "not observed (torch's own Autograd kernel)"
                continue
            libs[0].impl(name, above(op, lambda r, a, k, o, name=name: r.on_c10d(name, a, o)),
                         "Autograd", with_keyset=True)
            seen[f"c10d::{name}"] = "Autograd"
        for name in _FUNCTIONAL:
            op = _op("_c10d_functional", name)
            if op is None or not _taken("_c10d_functional", name, "CompositeExplicitAutograd"):
                seen[f"_c10d_functional::{name}"] = ("not in this torch" if op is None else
                                                     "not observed (no CompositeExplicitAutograd kernel)")
                continue
            note = lambda r, a, k, o, name=name: r.on_functional(name, a, k, o)  # noqa: E731
            keys = [key for key in ("CPU", "CUDA") if not _taken("_c10d_functional", name, key)]
            for key in keys:
                libs[1].impl(name, below(op, note), key)
            seen[f"_c10d_functional::{name}"] = "+".join(keys) or "not observed (torch's own backend kernels)"
    _install.libs = libs  # keep the registrations alive
    return seen


DISPATCH = ("_after_autograd_keyset", "_dispatch_has_kernel_for_dispatch_key")
OVERLOAD = ("_op_dk", "redispatch")


def dispatch_problem(C: Any = None, op: Any = None) -> str | None:
    """What ``_install`` leans on and this torch lacks, in one sentence; None where it has it all:
    ``C`` (``torch._C``) with ``DISPATCH``, ``op`` (an ``OpOverload``: c10d's allreduce_) with
    ``OVERLOAD``. Stand-ins can be handed in."""
    from core.internals import lacking, lacks_message

    if C is None:
        import torch

        C, op = torch._C, _op("c10d", "allreduce_")
    for owner, where, names in ((C, "torch._C", DISPATCH), (op, "torch._ops.OpOverload", OVERLOAD)):
        missing = lacking(owner, names)
        if missing:
            return lacks_message("the communication observer (callbacks.communication)", where, missing,
                                 "report.json's communication is unavailable on this torch and training "
                                 "goes on; set callbacks.communication=false to run without it and this "
                                 "warning")
    return None


def recorder(world_role: str) -> Recorder | None:
    """The process's recorder (installing the kernels on first use); None, said once, where this
    torch lacks what the kernels lean on (``dispatch_problem``)."""
    global _recorder, _unavailable
    with _install_lock:
        if _recorder is None and _unavailable is None:
            _unavailable = dispatch_problem()
            if _unavailable is None:
                seen = _install()
                _recorder = Recorder(world_role)
                _recorder.unobserved = sorted(op for op, where in seen.items() if where.startswith("not observed"))
        if _recorder is None:
            from core.internals import warn_once

            warn_once(log, "comm-dispatch", str(_unavailable))
            return None
        _recorder.world_role = world_role
    return _recorder


class CommunicationProfile(Observer):
    """Records every optimizer step; reports rank 0's average per step."""

    def __init__(self, world_role: str, warmup: tuple[int, str] = (0, ""), period: tuple[int, str] = (1, "")):
        """``warmup``: the preset's steps before its steady-state traffic, and their key
        (``StrategyConfig.traffic_warmup``); ``period``: the steps its steady traffic repeats
        over, and their key (``traffic_period``)."""
        self.world_role = world_role
        self.warmup, self.warmup_key = warmup
        self.period, self.period_key = period
        self.steps = Recorded(self.warmup, self.period)
        """The recorded steps (0-based indices counted over the whole run: a resumed run's first
        is its checkpoint's step), summed as they come (observers/comm_steps.py)."""
        self.ranks: list[Any] = []
        self._rec: Recorder | None = None
        self._index = 0
        self.unavailable: str | None = None
        """Why this torch cannot be observed (``dispatch_problem``): the report says so."""

    def on_train_start(self, engine: Engine, step: int) -> None:
        self._rec = recorder(self.world_role)
        self.unavailable = _unavailable

    def on_step_start(self, engine: Engine, step: int) -> None:
        self._index = step
        if self._rec is not None:
            self._rec.start()

    def on_step_work_end(self, engine: Engine, step: int) -> None:
        if self._rec is None:  # (this torch cannot be observed: nothing recorded)
            return
        # before the backend reduces the step's loss for the report: not training traffic
        self.steps.add(self._index, summarize(self._rec.stop()))

    def averaged(self) -> tuple[int, str]:
        """How many recorded steps the averages cover, and what they are (observers/comm_steps.py
        ``Recorded.covered``: the steady state, the warm-up's, or part of one sync period)."""
        sums, what = self.steps.covered()
        return sums.n, what

    def on_train_end(self, engine: Engine) -> None:
        from observers.memory import all_gather

        if self._rec is not None:
            self._rec.stop()
        self.ranks = all_gather({"rank": engine.rank, **_totals(self.per_step())})

    def by_group(self) -> dict[str, dict[str, dict[str, float | None]]]:
        """group -> kind -> averages over the steps ``averaged`` names."""
        return self.steps.covered()[0].average()

    def per_step(self) -> dict[str, dict[str, float | None]]:
        return totals(self.by_group())

    def report(self) -> dict[str, Any]:
        averaged, what = self.averaged()
        return {"communication": {"per_step": self.per_step(), "by_group": self.by_group(),
                                  "ranks": self.ranks, "steps": self.steps.count,
                                  "averaged_steps": averaged, "warmup_steps": self.warmup,
                                  **({"sync_every": self.period} if self.period > 1 else {}),
                                  "steady_state": what == STEADY, "averaged_of": what,
                                  "mechanism": MECHANISM,
                                  "unobserved": self._rec.unobserved if self._rec else [],
                                  **({"unavailable": self.unavailable} if self.unavailable else {})}}


def _totals(per_step: dict[str, dict[str, float | None]]) -> dict[str, float]:
    return {"bytes": sum(v["bytes"] for v in per_step.values()),
            "wire_bytes": sum(v["wire_bytes"] for v in per_step.values())}


@dataclass
class CommunicationKnobs:
    communication: bool = True
    """Every collective per optimizer step (kind, group, bytes); off: nothing is intercepted."""


@observer("communication", order=40, knobs=CommunicationKnobs)
def _selected(s: Selection) -> Observer | None:
    """``callbacks.communication`` (off: nothing is intercepted)."""
    if not s.job.callbacks.communication:
        return None
    strategy = s.job.strategy
    return CommunicationProfile(strategy.world_role(s.job.mesh), strategy.traffic_warmup(), strategy.traffic_period())
