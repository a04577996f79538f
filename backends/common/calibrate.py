"""The machine benchmark that ``planner.calibrate=true`` runs, with the engines: what
observers/machine.py measures (matmul, a block, AdamW, tensor parallelism, the collectives),
then, on every rank of the same process group, the engines' own work: DeepSpeed's per ZeRO
stage, torch FSDP2's.

    python -m backends.common.calibrate --world 2 --precision 32 --accelerator cpu --out machine.json

DeepSpeed's ZeRO-2 and ZeRO-3 engines and FSDP2 run against torch DDP on the same 2-block GPT (the
reference block's shape), the same batch and every process: a whole step each (forward,
backward, clipping, AdamW), interleaved round by round so that a slow moment of the machine slows
every engine alike. What a stage adds beyond what the planner prices is the engine's own work --
on CPU its Python hooks, bucket and flattening copies: ``engine_ns_per_param_zero2``,
``_zero3`` and ``_fsdp2``, per parameter per micro-batch (measured with one). Priced and taken out: the
collectives a stage sends beyond DDP's, as ZeroFootprint prices them at the presets' defaults
(ZeRO-2 adds the post-step all-gather; ZeRO-3 reduce-scatters and gathers once, in forward --
stage3_max_live_parameters keeps the parameters through backward -- instead of DDP's
all-reduce; FSDP2 gathers in forward, the blocks again in backward, and reduce-scatters in
fp32), at the bandwidths just measured; and the moments a sharded optimizer does not
step. Over one process, ZeRO-2 and ZeRO-3 with the optimizer offloaded (zero2_offload,
zero3_offload) run against a plain step on one short row, where their own work per parameter is
not buried under the batch's compute (over several the plan uses the stage's own figure: measured
the same, 1.00-1.03x, on 2 CPU processes): ``engine_ns_per_param_zero2_offload`` and ``_zero3_offload``, with the
host's optimizer step (torch AdamW, as our presets hand DeepSpeed the recipe's optimizer) and the
host<->device copies taken out at the rates just measured. Each engine is built as its preset builds it, at its defaults (``ZeroConfig.deepspeed_json``,
``FSDP2Config.plan``); one its preset refuses here (16-mixed on CPU) is not measured.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable

from observers import machine


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
        """One short row, over one process: with no collectives, what an offloaded engine adds per
        parameter does not depend on the tokens, and the reference batch's compute would bury it
        in the machine's noise."""
        return loss(model, tokens[:1, :32])

    def run_of(strategy: Any) -> Any:
        """The run a preset's builders would see here: one micro-batch per rank, clipping at 1."""
        return derive(strategy, nodes=1, devices=world, accelerator=accelerator, precision=precision,
                      global_batch=micro * world, micro_batch=micro, grad_clip=1.0)

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(GPT(shape).to(device))
    params = sum(p.numel() for p in ddp.parameters())
    blocks = sum(p.numel() for p in ddp.module.layers.parameters())
    # Each engine as its preset builds it, at its defaults; one its preset refuses here (16-mixed
    # on CPU) is not measured (0: not priced).
    steps = {"ddp": _ddp_step(ddp, loss)} if world > 1 else {"ddp_short": _ddp_step(ddp, short)}
    if world > 1:
        steps |= _fsdp2_step(lambda: GPT(shape).to(device), world, device, precision, loss, run_of)
    steps |= _zero_steps(lambda: GPT(shape).to(device), rank, world, (loss, short), run_of, ds)
    t = _median_seconds(steps, sync, barrier)
    elem = 4 if dtype == torch.float32 else 2
    priced = _priced(params, blocks, world, elem, collectives, t) if world > 1 else {}
    priced |= _offload_priced(params, world, elem, measured, t, priced)
    unstepped = measured["optimizer_ns_per_param"] * 1e-9 * params * (1 - 1 / world)
    if rank == 0 and os.environ.get("STRATAGEM_CALIBRATION_DEBUG"):
        print("step ms", {k: round(v * 1e3, 1) for k, v in t.items()}, "priced ms",
              {k: round(v * 1e3, 1) for k, v in priced.items()}, "unstepped ms", round(unstepped * 1e3, 1),
              flush=True)
    base = {k: t["ddp_short" if world == 1 else "ddp"] for k in priced}
    return {f"engine_ns_per_param_{k}": max(0.0, (t[k] - base[k] - priced[k] + unstepped) / params * 1e9)
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
    from parallel.parallelize import apply_fsdp2, clip_global_

    fsdp2 = FSDP2Config()
    if fsdp2.problems(run_of(fsdp2)):
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


def _zero_steps(model: Callable[[], Any], rank: int, world: int, losses: tuple[Callable[[Any], Any], ...],
                run_of: Callable[[Any], Any], ds: Any) -> dict[str, Callable[[], None]]:
    """{"zero2", "zero3": DeepSpeed's whole step} over several processes, {"zero2_offload",
    "zero3_offload"} over one (their optimizer torch AdamW stepping on the host as the run's
    builders make it, on the short batch: ``losses[1]``), as ZeroConfig builds each, less those
    the preset refuses."""
    import argparse

    import torch

    from recipes.training import auto_impl
    from strategies.families.deepspeed import ZeroConfig

    steps = {}
    for stage, offload in ((2, False), (3, False), (2, True), (3, True)):
        if (world == 1) != offload:  # (sharding over one rank: never priced; offloaded over several:
            continue                 # measured 1.00-1.03x the stage's own, which the plan uses there)
        where = dict(offload_optimizer="cpu", offload_params="cpu" if stage == 3 else "none") if offload else {}
        zero = ZeroConfig(stage=stage, **where)
        run = run_of(zero)
        if zero.problems(run):
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

        def zero_step(engine: Any = engine, loss: Callable[[Any], Any] = losses[offload]) -> None:
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
