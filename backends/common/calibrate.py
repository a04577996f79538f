"""The machine benchmark that ``planner.calibrate=true`` runs, with the engines: what
observers/machine.py measures (matmul, a block, AdamW, tensor parallelism, the collectives),
then, on every rank of the same process group, the engines' own work: DeepSpeed's per ZeRO
stage, with and without the optimizer offloaded, and torch FSDP2's.

    python -m backends.common.calibrate --world 2 --precision 32 --accelerator cpu --out machine.json

DeepSpeed's ZeRO-2 and ZeRO-3 engines (``zero2``, ``zero3``, and ``zero2_offload``,
``zero3_offload`` with the optimizer -- and ZeRO-3's parameters -- on the host) and FSDP2 run
against torch DDP on the same 2-block GPT (the reference block's shape), the same batch and
every process: a whole step each (forward, backward, clipping, AdamW), interleaved round by
round so that a slow moment of the machine slows every engine alike. What an engine adds beyond
what the planner prices is its own work -- its Python hooks, bucket and flattening copies:
``engine_ns_per_param_<engine>``, per parameter per micro-batch (measured with one). Priced and
taken out: the collectives an engine sends beyond DDP's, as ZeroFootprint prices them at the
presets' defaults (ZeRO-2 adds the post-step all-gather; ZeRO-3 reduce-scatters and gathers
once, in forward -- stage3_max_live_parameters keeps the parameters through backward -- instead
of DDP's all-reduce; FSDP2 gathers in forward, the blocks again in backward, and reduce-scatters
in fp32), at the bandwidths just measured; the moments a sharded optimizer does not step; and
for the offloaded engines the host's optimizer step (torch AdamW, as our presets hand DeepSpeed
the recipe's optimizer) and the host<->device copies, at the rates just measured. ZeRO-2 and
ZeRO-3 unoffloaded and FSDP2 are measured over several processes only (over one the plan
prices no engine for them). Each engine is built as its preset builds it, at its defaults
(``ZeroConfig.deepspeed_json``, ``FSDP2Config.plan``); one its preset or the run refuses here
(16-mixed on CPU) is not measured.

On CPU every step runs one short row (``SHORT``): an engine's own work is per parameter and
module, not per token, and on CPU nothing of it hides under the compute, so the compute only
adds noise. With the reference batch, a 0.6 s step on 2 processes of a 2-core VM jittered
+-100 ms round to round, so ZeRO-2's figure (the difference of two such medians, ~40 ms) read
2.8-20.7 ns per parameter over seven calibrations; on one short row it read 8.3-9.4 over five
(and ZeRO-3 18-23, FSDP2 13.5-15.9). On a GPU the reference batch stays: there the engine's
host work runs beside the kernels, and only what the batch does not hide is the step's.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable

from observers import machine

SHORT = (1, 32)
"""The rows and tokens of the batch every engine steps on CPU (the module says why)."""


def engines(accelerator: str, precision: str, world: int, rank: int, device: Any, sync: Any, barrier: Any,
            measured: dict[str, float], collectives: dict[str, dict[str, float]]) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from backends.common import deepspeed as ds
    from backends.common import quiet

    quiet.install()  # (a failed calibration shows its error's tail, not the engines' notices)
    from recipes.config import ModelConfig
    from recipes.gpt import GPT
    from core.run import derive

    dim, heads, ffn, seq, micro = machine.REFERENCE[accelerator]
    shape = ModelConfig(name="reference", dim=dim, n_layers=2, n_heads=heads, n_kv_heads=heads,
                        vocab_size=256, seq_len=seq, ffn_dim=ffn)
    tokens = torch.randint(0, 256, (micro, seq), device=device)
    dtype = machine.compute_dtype(precision, accelerator)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32
                else torch.autocast(device.type, enabled=False))

    def loss(model: Any, x: Any = tokens) -> Any:
        with autocast:
            logits = model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), x.flatten())

    def short(model: Any) -> Any:
        """One short row (``SHORT``): on CPU what an engine adds per parameter does not depend on
        the tokens, and the reference batch's compute would bury it in the machine's noise."""
        return loss(model, tokens[:SHORT[0], :SHORT[1]])

    step_loss = short if accelerator == "cpu" else loss

    def run_of(strategy: Any) -> Any:
        """The run a preset's builders would see here: one micro-batch per rank, clipping at 1."""
        return derive(strategy, nodes=1, devices=world, accelerator=accelerator, precision=precision,
                      global_batch=micro * world, micro_batch=micro, grad_clip=1.0)

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(GPT(shape).to(device))
    params = sum(p.numel() for p in ddp.parameters())
    blocks = sum(p.numel() for p in ddp.module.layers.parameters())
    # Each engine as its preset builds it, at its defaults; one its preset or the run refuses
    # here (16-mixed on CPU) is not measured (0: not priced).
    steps = {"ddp": _ddp_step(ddp, step_loss)}
    if world > 1:
        steps |= _fsdp2_step(lambda: GPT(shape).to(device), world, device, precision, step_loss, run_of)
    steps |= _zero_steps(lambda: GPT(shape).to(device), rank, world, step_loss, run_of, ds)
    t = _median_seconds(steps, sync, barrier)
    elem = 4 if dtype == torch.float32 else 2
    priced = _priced(params, blocks, world, elem, collectives, t) if world > 1 else {}
    priced |= _offload_priced(params, world, elem, measured, t, priced)
    unstepped = measured["optimizer_ns_per_param"] * 1e-9 * params * (1 - 1 / world)
    if rank == 0 and os.environ.get("STRATAGEM_CALIBRATION_DEBUG"):
        print("step ms", {k: round(v * 1e3, 1) for k, v in t.items()}, "priced ms",
              {k: round(v * 1e3, 1) for k, v in priced.items()}, "unstepped ms", round(unstepped * 1e3, 1),
              flush=True)
    return {f"engine_ns_per_param_{k}": max(0.0, (t[k] - t["ddp"] - priced[k] + unstepped) / params * 1e9)
            for k in priced}


def _ddp_step(ddp: Any, loss: Callable[[Any], Any]) -> Callable[[], None]:
    """torch DDP's whole step, the baseline every engine is measured against."""
    import torch

    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def ddp_step() -> None:
        loss(ddp).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return ddp_step


def _fsdp2_step(model: Callable[[], Any], world: int, device: Any, precision: str,
                loss: Callable[[Any], Any], run_of: Callable[[Any], Any]) -> dict[str, Callable[[], None]]:
    """{"fsdp2": its whole step} as FSDP2Config builds it, or {} where the preset refuses."""
    import torch

    from strategies.families.fsdp2 import FSDP2Config
    from parallel.clip import clip_global_
    from parallel.parallelize import apply_fsdp2

    fsdp2 = FSDP2Config()
    if fsdp2.problems(run := run_of(fsdp2)) or run.problems():
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    sharded = model()
    apply_fsdp2(sharded, init_device_mesh(device.type, (world,)), fsdp2.plan(fsdp2.mesh(1, world)).fsdp,
                precision=str(precision))
    fsdp_opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)

    def fsdp2_step() -> None:
        loss(sharded).backward()
        clip_global_(list(sharded.parameters()), 1.0)
        fsdp_opt.step()
        fsdp_opt.zero_grad()

    return {"fsdp2": fsdp2_step}


def _zero_steps(model: Callable[[], Any], rank: int, world: int, loss: Callable[[Any], Any],
                run_of: Callable[[Any], Any], ds: Any) -> dict[str, Callable[[], None]]:
    """{"zero2", "zero3": DeepSpeed's whole step} over several processes and {"zero2_offload",
    "zero3_offload"} over any (their optimizer torch AdamW stepping on the host as the run's
    builders make it), as ZeroConfig builds each, less those the preset refuses."""
    import argparse

    import torch

    from recipes.training import auto_impl
    from strategies.families.deepspeed import ZeroConfig

    steps = {}
    for stage, offload in ((2, False), (3, False), (2, True), (3, True)):
        if world == 1 and not offload:  # (sharding over one rank: never priced)
            continue
        where = dict(offload_optimizer="cpu", offload_params="cpu" if stage == 3 else "none") if offload else {}
        zero = ZeroConfig(stage=stage, **where)
        run = run_of(zero)
        if zero.problems(run) or run.problems():
            continue
        ds.select_accelerator(run)
        import deepspeed

        torch.manual_seed(0)
        built = model()
        impl = auto_impl("adamw", next(built.parameters()).device.type)  # (as the run builds it)
        opt = torch.optim.AdamW(built.parameters(), lr=1e-4, **{impl: True})
        engine, *_ = deepspeed.initialize(args=argparse.Namespace(device_rank=rank),
                                          config=zero.deepspeed_json(run), model=built,
                                          model_parameters=list(built.parameters()), optimizer=opt,
                                          dist_init_required=False)

        def zero_step(engine: Any = engine) -> None:
            engine.backward(loss(engine))
            engine.step()

        steps[f"zero{stage}" + ("_offload" if offload else "")] = zero_step
    return steps


def _median_seconds(steps: dict[str, Callable[[], None]], sync: Any, barrier: Any) -> dict[str, float]:
    """Each step's median seconds over 10 rounds (after one to warm up), interleaved round by
    round so that a slow moment of the machine slows every engine alike."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for round_ in range(11):
        for name, step in steps.items():
            barrier()
            t0 = time.perf_counter()
            step()
            sync()
            barrier()
            if round_:  # (the first round warms up)
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _priced(params: int, blocks: int, world: int, elem: int, collectives: dict[str, dict[str, float]],
            measured: dict[str, float]) -> dict[str, float]:
    """Seconds of the collectives each measured engine sends beyond DDP's, as the planner prices
    them at the bandwidths just measured."""

    def wire(op: str, elem: int) -> float:
        """Seconds of one collective over the model's gradients or parameters, as priced."""
        share = (2 if op == "all_reduce" else 1) * (world - 1) / world
        return share * params * elem / (collectives[op]["GBps"] * 1e9)

    return {k: v for k, v in {  # (the engines measured here)
            "zero2": wire("all_gather", elem),
            "zero3": wire("reduce_scatter", elem) + wire("all_gather", elem) - wire("all_reduce", 4),
            # gathered in forward, the blocks again in backward, reduce-scattered in fp32
            "fsdp2": (wire("all_gather", elem) * (1 + blocks / params) + wire("reduce_scatter", 4)
                      - wire("all_reduce", 4))}.items() if k in measured}


def _offload_priced(params: int, world: int, elem: int, measured: dict[str, float],
                    t: dict[str, float], wire: dict[str, float]) -> dict[str, float]:
    """Seconds an offloaded ZeRO step adds beyond DDP's that the planner prices itself, at the
    rates just measured: the collectives (``wire``: the stage's own, ``_priced``'s), the host's
    optimizer over this rank's partition and its copies (ZeroFootprint.traffic: gradients down and
    updates up; ZeRO-3's parameter shards fetched twice a micro-batch), less the device's step
    it replaces (``unstepped`` adds back the sharded share)."""
    rate = measured.get("host_copy_GBps", 0.0) * 1e9
    out = {}
    for stage in (2, 3):
        if f"zero{stage}_offload" not in t:
            continue
        moved = 2 * params * elem / world + (2 * params * elem / world if stage == 3 else 0)
        host = measured.get("host_optimizer_ns_per_param", 0.0) * 1e-9 * params / world
        device = measured["optimizer_ns_per_param"] * 1e-9 * params / world
        out[f"zero{stage}_offload"] = (wire.get(f"zero{stage}", 0.0) + host - device
                                       + (moved / rate if rate else 0.0))
    return out


if __name__ == "__main__":
    from backends.common import calibrate  # (the ranks unpickle it by this name, not __main__'s)

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    machine.main(sys.argv[1:], engines=calibrate.engines)
