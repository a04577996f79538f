"""What both backends run for the ddp family's communication-efficient presets (engine-neutral
torch; each backend registers it its way): the DDP communication hooks (``comm_hook``) and the
post-step parameter synchronization of relaxed presets (``sync``).

- ``topk`` (ours: torch has no sparsification hook): each bucket, plus what the previous steps
  did not send (error feedback), sends its ``k = max(1, int(ratio x numel))`` largest-magnitude
  entries as (fp32 value, int32 index) pairs in one ``all_gather_into_tensor``; every rank adds
  all ranks' pairs into a dense bucket and divides by the world size. What is not sent stays in
  this rank's residual, so sent + retained equals the gradient plus the old residual, exactly
  (``topk_split``). ``start_step`` steps of torch's plain all-reduce first (as PowerSGD's).
- ``int8``: torch's per-tensor affine quantization (``MinMaxObserver``'s scale and zero point
  per bucket, the rounding of its ``quantization_pertensor_hook``) with error feedback: the
  residual is added to the bucket before it is quantized, and what rounding drops is kept for
  the next step. One all-gather per bucket of the uint8 codes with the scale and zero point.
- ``local_sgd``: torch's ``post_localSGD_hook`` (plain all-reduce for ``start_step`` steps, then
  no gradient traffic) and ``PeriodicModelAverager`` (parameters averaged every ``sync_every``
  steps after each optimizer step); with several nodes ``HierarchicalModelAverager`` (every step
  within each node, the whole world every ``sync_every`` steps).
- ``diloco`` (Douillard et al. 2023): the same hook; every ``sync_every`` steps the parameters
  are averaged (torch's ``average_parameters``: one fp32 all-reduce), and an outer SGD with
  Nesterov momentum steps the outer copy along the averaged delta (outer - average), which the
  replicas then take.

Residuals are kept per parameter, not per bucket: DDP rebuilds its buckets after the first step.

``RankState`` is what each rank of these presets holds beyond the model and optimizer a
checkpoint saves from rank 0 -- residuals, PowerSGD's factors, the hooks' step counters, and for
local SGD and DiLoCo the rank's own replica, optimizer and averager (DiLoCo's outer copy and
momentum) -- by parameter name; checkpoints/state.py writes one file per rank beside the
checkpoint and reads it back, so these presets resume exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist


def _world(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


class _Feedback:
    """Per-parameter error-feedback residuals, gathered into and scattered out of a bucket."""

    def __init__(self, start_step: int, process_group: Any = None):
        self.process_group, self.start_step = process_group, start_step
        self.iter = 0
        self.residuals: dict[int, torch.Tensor] = {}
        self.layout: dict[int, list[int]] = {}
        """Bucket index -> its parameters (ids), as the compressed steps saw them."""
        self.expected: list[list[int]] | None = None
        """The buckets of the run a resume continues (``groups``)."""

    def warm(self, bucket: Any) -> bool:
        """True while plain all-reduce runs (counts optimizer steps on the last bucket)."""
        warm = self.iter < self.start_step
        if bucket.is_last():
            self.iter += 1
        return warm

    def residual(self, bucket: Any) -> torch.Tensor:
        params = bucket.parameters()
        buf = bucket.buffer()
        if sum(p.numel() for p in params) != buf.numel():  # padded buckets: not handled
            raise RuntimeError("DDP bucket layout with padding: error feedback cannot map it")
        parts = [self.residuals.get(id(p)) for p in params]
        if all(r is None for r in parts):
            return torch.zeros_like(buf)
        return torch.cat([torch.zeros(p.numel(), dtype=buf.dtype, device=buf.device) if r is None else r
                          for p, r in zip(params, parts)])

    def keep(self, bucket: Any, retained: torch.Tensor) -> None:
        offset = 0
        for p in bucket.parameters():
            self.residuals[id(p)] = retained[offset:offset + p.numel()]
            offset += p.numel()

    def groups(self, bucket: Any) -> list[list[int]]:
        """The parameters (their places in ``bucket``) compressed together: the bucket, except on
        the first step after a resume, which DDP runs in one bucket of every parameter before it
        rebuilds them by size: there each of the buckets the checkpoint was written in
        (``expected``), so the step picks (top-k) and scales (int8) as the uninterrupted run did."""
        ids = [id(p) for p in bucket.parameters()]
        self.layout[bucket.index()] = ids
        expected = self.expected
        if bucket.is_last():  # (one step: DDP then rebuilds the layout the checkpoint was written in)
            self.expected = None
        if not expected or ids in expected:
            return [list(range(len(ids)))]
        where = {pid: i for i, pid in enumerate(ids)}
        groups = [[where[pid] for pid in g] for g in expected if all(pid in where for pid in g)]
        return groups if sum(map(len, groups)) == len(ids) else [list(range(len(ids)))]


def _compress(state: _Feedback, bucket: Any, encode: Any, decode: Any) -> Any:
    """Error-feedback compression of ``bucket`` (``state.groups``, each on its own): ``encode(acc)``
    -> (parts to send, their (numel, dtype) layout, what stays here); one all-gather of every
    group's parts; ``decode(rows, numel)`` -> a group's average from every rank's parts."""
    group = _world(state.process_group)
    buf, n = bucket.buffer(), group.size()
    acc = buf + state.residual(bucket)
    starts = [0]
    for p in bucket.parameters():
        starts.append(starts[-1] + p.numel())
    groups = state.groups(bucket)
    if groups == [list(range(len(starts) - 1))]:  # the bucket as it is (every step but one)
        sent, shape, kept = encode(acc)
        state.keep(bucket, kept)
        spans, parts, layout = None, sent, [shape]
    else:  # each saved bucket cut out of DDP's one, what stays here put back in its order
        spans = [[(starts[i], starts[i + 1]) for i in g] for g in groups]
        parts, layout, retained = [], [], torch.empty_like(acc)
        for sp in spans:
            sent, shape, kept = encode(torch.cat([acc[a:b] for a, b in sp]))
            parts, layout = parts + sent, layout + [shape]
            _scatter(retained, sp, kept)
        state.keep(bucket, retained)
    packed = pack(*parts)
    out = packed.new_empty(n * packed.numel())
    fut = dist.all_gather_into_tensor(out, packed, group=group, async_op=True).get_future()

    def average(_fut: Any) -> torch.Tensor:
        rows = unpack(out, n, *[x for shape in layout for x in shape])
        if spans is None:
            return decode(rows, buf.numel())
        dense, at = torch.empty_like(buf), 0
        for sp, shape in zip(spans, layout):
            _scatter(dense, sp, decode(rows[at:at + len(shape)], sum(b - a for a, b in sp)))
            at += len(shape)
        return dense

    return fut.then(average)


def _scatter(into: torch.Tensor, spans: list[tuple[int, int]], flat: torch.Tensor) -> None:
    """``flat``'s pieces, in order, into ``into``'s ``spans``."""
    at = 0
    for a, b in spans:
        into[a:b] = flat[at:at + b - a]
        at += b - a


def pack(*parts: torch.Tensor) -> torch.Tensor:
    """One byte tensor of ``parts`` (any dtypes, any lengths) for one all-gather: no part needs
    the others' sizes to be a multiple of its element size."""
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


def unpack(gathered: torch.Tensor, ranks: int, *layout: tuple[int, torch.dtype]) -> list[torch.Tensor]:
    """Each rank's parts of ``pack``'s bytes, gathered from ``ranks`` ranks: one (ranks, numel)
    tensor per ``(numel, dtype)`` of ``layout``, copied out of the byte rows so that each starts
    aligned for its dtype."""
    rows, out, at = gathered.view(ranks, -1), [], 0
    for numel, dtype in layout:
        nbytes = numel * dtype.itemsize
        out.append(rows[:, at:at + nbytes].clone().view(dtype))
        at += nbytes
    return out


def topk_split(acc: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, indices, retained) of ``acc``'s ``k`` largest magnitudes: ``retained`` is ``acc``
    with the sent entries zeroed, so dense(values, indices) + retained == acc bit for bit."""
    _, idx = acc.abs().topk(k, sorted=False)
    values = acc[idx]
    retained = acc.clone()
    retained[idx] = 0
    return values, idx, retained


class TopKState(_Feedback):
    def __init__(self, ratio: float, start_step: int, process_group: Any = None):
        super().__init__(start_step, process_group)
        self.ratio = ratio
        self.check: list[float] = []
        """With ``record`` on: per bucket and step, max |sent + retained - (gradient + old
        residual)| (0 by construction; tests read it)."""
        self.record = False


def topk_hook(state, bucket):  # no annotations: torch checks them against dist.GradBucket
    """Top-k sparsified gradient averaging with error feedback (module docstring)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if state.warm(bucket):
        return default_hooks.allreduce_hook(_world(state.process_group), bucket)
    n = _world(state.process_group).size()

    def encode(acc: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple[int, torch.dtype]], torch.Tensor]:
        k = max(1, int(state.ratio * acc.numel()))
        values, idx, retained = topk_split(acc, k)
        if state.record:
            sent = torch.zeros_like(acc)
            sent[idx] = values
            state.check.append(float((sent + retained - acc).abs().max()))
        return [values, idx.to(torch.int32)], [(k, values.dtype), (k, torch.int32)], retained

    def decode(rows: list[torch.Tensor], numel: int) -> torch.Tensor:
        vals, ids = rows[0].reshape(-1), rows[1].reshape(-1)
        dense = torch.zeros(numel, dtype=vals.dtype, device=vals.device)
        dense.index_put_((ids.long(),), vals, accumulate=True)
        return dense.div_(n)

    return _compress(state, bucket, encode, decode)


class Int8State(_Feedback):
    def __init__(self, start_step: int, process_group: Any = None):
        super().__init__(start_step, process_group)
        self.max_scale = 0.0
        """The largest quantization step (scale) this rank used: the averaged gradient is off by
        at most the mean of the ranks' scales / 2 per element, before error feedback."""


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, [scale, zero point] as fp32) of ``x``: torch's per-tensor affine
    quantization as its ``quantization_pertensor_hook`` does it (``MinMaxObserver``'s qparams,
    its ``_quantize_per_tensor_backend``)."""
    q = int8_kernels()
    obs = torch.ao.quantization.MinMaxObserver().to(x.device)
    obs(x)
    s, z = obs.calculate_qparams()
    sz = torch.cat([s.reshape(1).float(), z.reshape(1).float()]).to(x.device)
    return q._quantize_per_tensor_backend(x, sz[0], sz[1]), sz


def int8_dequantize(codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    return int8_kernels()._dequantize_per_tensor_backend(codes, sz[0], sz[1])


INT8_KERNELS = ("_quantize_per_tensor_backend", "_dequantize_per_tensor_backend")


def int8_kernels(hooks: Any = None) -> Any:
    """torch's ``quantization_hooks`` module (or ``hooks``, a stand-in), which ``ddp_int8`` leans
    on for its private per-tensor (de)quantization; a torch without them is one clear error,
    raised when the hook is made (``comm_hook``, at setup), not at the first compressed step."""
    from core.internals import PROVEN, require

    if hooks is None:
        from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as hooks
    return require(hooks, INT8_KERNELS, feature="strategy.comm_hook=int8 (ddp_int8)",
                   where="torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks",
                   fix=f"use strategy.comm_hook=topk or powersgd, or torch {PROVEN} (the versions CI runs)")


def int8_hook(state, bucket):  # no annotations: torch checks them against dist.GradBucket
    """8-bit per-bucket quantized averaging with error feedback (module docstring). torch's
    ``quantization_pertensor_hook`` would fit but fails in torch 2.13 (it indexes the all-gather
    future's first tensor as the list of every rank's scale and zero point), so this is its
    quantization with one all-gather per bucket: the codes and the 8 bytes of scale and zero
    point packed together."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if state.warm(bucket):
        return default_hooks.allreduce_hook(_world(state.process_group), bucket)
    n, dtype = _world(state.process_group).size(), bucket.buffer().dtype

    def encode(acc: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple[int, torch.dtype]], torch.Tensor]:
        codes, sz = int8_quantize(acc)
        state.max_scale = max(state.max_scale, float(sz[0]))
        return [codes, sz], [(codes.numel(), codes.dtype), (2, torch.float32)], acc - int8_dequantize(codes, sz)

    def decode(rows: list[torch.Tensor], numel: int) -> torch.Tensor:
        total = torch.zeros(numel, dtype=dtype, device=rows[1].device)
        for r in range(n):
            total += int8_dequantize(rows[0][r], rows[1][r])
        return total.div_(n)

    return _compress(state, bucket, encode, decode)


def comm_hook(preset: Any) -> tuple[Any, Any]:
    """The hook and state for the ddp family's compressing and relaxed settings (PowerSGD,
    top-k, int8, local SGD, DiLoCo), or (None, None) (fp16 and bf16 are each backend's own)."""
    if preset.sync != "every_step":
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pl

        # no gradient traffic after start_step (the subgroup is unused without the local all-reduce)
        state = pl.PostLocalSGDState(process_group=None, subgroup=dist.group.WORLD,
                                     start_localSGD_iter=preset.start_step,
                                     post_local_gradient_allreduce=False)
        return pl.post_localSGD_hook, state
    if preset.comm_hook == "powersgd":
        from backends.common.powersgd import powersgd

        return powersgd(preset.powersgd_rank, preset.powersgd_warmup_steps)
    if preset.comm_hook == "topk":
        return topk_hook, TopKState(preset.topk_ratio, preset.start_step)
    if preset.comm_hook == "int8":
        int8_kernels()  # (asked now, at setup)
        return int8_hook, Int8State(preset.start_step)
    return None, None


def one_bucket_at_a_time(hook: Any) -> Any:
    """``hook`` with each bucket's collectives issued only after the previous bucket's are done,
    on gloo. PowerSGD issues its second and third all-reduce of a bucket from its futures'
    callbacks, which gloo runs on its own threads: with several buckets (gpt_small: 2) the
    buckets' chains interleave in a different order on each rank -- a collective mismatch ("Received
    data size doesn't match expected size", SIGABRT) at its first compressed step. NCCL orders them
    on its stream; gloo gets the order DDP launches the buckets in, the same on every rank."""
    pending: list[Any] = []

    def ordered(state, bucket):  # no annotations: torch checks them against dist.GradBucket
        if pending and dist.get_backend(state.process_group) == "gloo":
            pending[0].wait()
        fut = hook(state, bucket)
        pending[:] = [fut]
        return fut

    ordered.__name__ = ordered.__qualname__ = getattr(hook, "__name__", "hook")
    return ordered


class DiLoCo:
    """The outer loop: every ``sync_every`` local steps, average the replicas and take an outer
    SGD step (Nesterov momentum) along outer - average; the replicas continue from the result."""

    def __init__(self, sync_every: int, start_step: int, lr: float, momentum: float,
                 process_group: Any = None):
        self.sync_every, self.start_step, self.group = sync_every, start_step, process_group
        self.lr, self.momentum = lr, momentum
        self.step = 0
        self.outer: list[torch.Tensor] | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def before_step(self, params: list[torch.nn.Parameter]) -> None:
        if self.outer is None and self.step >= self.start_step:  # replicas still equal here
            self.outer = [p.detach().clone().float() for p in params]
            self.optimizer = torch.optim.SGD(self.outer, lr=self.lr, momentum=self.momentum,
                                             nesterov=self.momentum > 0)

    def after_step(self, params: list[torch.nn.Parameter]) -> None:
        from torch.distributed.algorithms.model_averaging.utils import average_parameters

        self.step += 1
        if self.outer is None or (self.step - self.start_step) % self.sync_every:
            return
        in_own_storage(params, lambda ps: average_parameters(ps, _world(self.group)))
        with torch.no_grad():
            for o, p in zip(self.outer, params):
                o.grad = o - p.float()
            self.optimizer.step()
            for o, p in zip(self.outer, params):
                p.copy_(o)


class Synchronizer:
    """Post-optimizer-step parameter synchronization of ``sync=local_sgd|diloco``; a no-op for
    every other setting. Engines call ``before_step`` / ``after_step`` around each optimizer step."""

    def __init__(self, preset: Any, nodes: int = 1, devices: int = 1):
        self.preset, self.nodes, self.devices = preset, nodes, devices
        self._impl: Any = None

    @property
    def active(self) -> bool:
        return getattr(self.preset, "sync", "every_step") != "every_step" and dist.is_initialized() \
            and dist.get_world_size() > 1

    def _make(self) -> Any:
        p = self.preset
        if p.sync == "diloco":
            return DiLoCo(p.sync_every, p.start_step, p.outer_lr, p.outer_momentum)
        from torch.distributed.algorithms.model_averaging import averagers
        from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
            HierarchicalModelAverager,
        )

        # (torch's two averagers count differently: the periodic one averages when (step -
        # start_step) % H == 0, the hierarchical one when step % H == 0 -- the same steps when
        # start_step is a multiple of H, which the presets' defaults (10 and 8) are not)
        if self.nodes > 1 and p.sync_every > 1:
            periods = OrderedDict([(1, self.devices), (p.sync_every, dist.get_world_size())])
            return HierarchicalModelAverager(periods, warmup_steps=p.start_step)
        return averagers.PeriodicModelAverager(period=p.sync_every, warmup_steps=p.start_step)

    def before_step(self, model: Any) -> None:
        if not self.active:
            return
        if self._impl is None:
            self._impl = self._make()
        if isinstance(self._impl, DiLoCo):
            self._impl.before_step(_trainable(model))

    def after_step(self, model: Any) -> None:
        if not self.active:
            return
        if isinstance(self._impl, DiLoCo):
            self._impl.after_step(_trainable(model))
        else:
            in_own_storage(_trainable(model), self._impl.average_parameters)


def in_own_storage(params: list[torch.nn.Parameter], average: Any) -> None:
    """``average(iter(params))`` -- torch's averaging, which rebinds each parameter's ``.data`` to a
    slice of one flat all-reduced buffer -- with each parameter left in its own storage: every
    parameter sharing one storage is what a safetensors save drops (Accelerate's ``save_state``
    kept one tensor of the model and warned "Removed shared tensor") or refuses. The averaged
    values are copied back (one copy of the parameters per average)."""
    own = [p.data for p in params]
    average(iter(params))
    with torch.no_grad():
        for p, mine in zip(params, own):
            if p.data.data_ptr() != mine.data_ptr():
                mine.copy_(p.data)
                p.data = mine


def _trainable(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class RankState:
    """A rank's own state under a relaxed or compressing ddp preset (module docstring), as a
    plain dict by parameter name: ``state_dict`` on save, ``load_state_dict`` after the
    checkpoint's model and optimizer (rank 0's) are restored."""

    def __init__(self, model: Any, optimizer: Any, hook_state: Any, sync: Synchronizer | None,
                 prefix: str = ""):
        self.model, self.optimizer, self.hook_state, self.sync = model, optimizer, hook_state, sync
        self.prefix = prefix
        """Where the plain model sits in the wrapped one's names (Lightning: "model.")."""

    @property
    def replicas_differ(self) -> bool:
        """Whether the ranks train replicas of their own between averagings (local SGD, DiLoCo)."""
        return self.sync is not None and self.sync._impl is not None

    def _names(self) -> dict[int, str]:
        """id -> the plain model's name (DDP's "module.", the backend's prefix, wrappers dropped)."""
        from core.keys import plain_key

        return {id(p): plain_key(n.removeprefix("module.").removeprefix(self.prefix))
                for n, p in self.model.named_parameters()}

    def state_dict(self) -> dict[str, Any]:
        names, h, out = self._names(), self.hook_state, {}
        if isinstance(h, _Feedback):
            out["hook"] = {"iter": h.iter, "residuals": {names[i]: r.detach().cpu().clone()
                                                         for i, r in h.residuals.items()},
                           "buckets": [[names[i] for i in ids] for _, ids in sorted(h.layout.items())]}
        elif h is not None and hasattr(h, "p_memory_dict"):
            from backends.common.powersgd import rank_state

            out["hook"] = rank_state(h, names)
        elif h is not None:  # local SGD's hook: only its step counter
            out["hook"] = {"iter": h.iter}
        impl = self.sync._impl if self.sync is not None else None
        if impl is not None:  # the replica, optimizer and averager this rank trains alone
            out["replica"] = {names[id(p)]: p.detach().cpu().clone() for p in _trainable(self.model)}
            out["optimizer"] = self.optimizer.state_dict()
            out["sync"] = {"step": impl.step} if not isinstance(impl, DiLoCo) else {
                "step": impl.step, "outer": None if impl.outer is None else [o.cpu().clone() for o in impl.outer],
                "optimizer": None if impl.optimizer is None else impl.optimizer.state_dict()}
        return out

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        ids, h = {n: i for i, n in self._names().items()}, self.hook_state
        params = {id(p): p for p in self.model.parameters()}
        if isinstance(h, _Feedback):
            h.iter = saved["hook"]["iter"]
            h.residuals = {ids[n]: r.to(params[ids[n]].device) for n, r in saved["hook"]["residuals"].items()}
            h.expected = [[ids[n] for n in names] for names in saved["hook"].get("buckets", [])]
        elif h is not None and hasattr(h, "p_memory_dict"):
            from backends.common.powersgd import load_rank_state

            load_rank_state(h, saved["hook"], ids)
        elif h is not None:
            h.iter = saved["hook"]["iter"]
        if "sync" not in saved or self.sync is None:
            return
        with torch.no_grad():
            for name, value in saved["replica"].items():
                params[ids[name]].copy_(value)
        self.optimizer.load_state_dict(saved["optimizer"])
        impl = self.sync._impl = self.sync._make()
        impl.step = saved["sync"]["step"]
        if isinstance(impl, DiLoCo) and saved["sync"]["outer"] is not None:
            impl.outer = [o.to(p.device) for o, p in zip(saved["sync"]["outer"], _trainable(self.model))]
            impl.optimizer = torch.optim.SGD(impl.outer, lr=impl.lr, momentum=impl.momentum,
                                             nesterov=impl.momentum > 0)
            impl.optimizer.load_state_dict(saved["sync"]["optimizer"])
