"""Measure this machine for the planner's step time (``planner.calibrate=true``), in a process
of its own so that plan.py never imports torch:

    python -m observers.machine --world 2 --precision 32 --accelerator cpu --out machine.json

``world`` processes (gloo on CPU, NCCL on GPU), each with the thread count a run's rank gets
(``core.run.cpu_threads``), measure together -- as a run's ranks compute together:

- ``matmul_tflops``: dense matmul throughput in the run's dtype (fp32 for precision 32, bf16
  for the mixed precisions) on the GEMMs of a reference transformer block (its d x d, d x ffn and
  ffn x d projections over its tokens);
- ``block_tflops`` and ``efficiency``: one block of recipes/gpt.py, forward and backward, at that
  reference shape (CPU: dim 384, seq 128, micro batch 8, gpt_small's; GPU: dim 2048, seq 2048,
  llama_1b's), in model FLOPs (6 per matmul parameter and token, 12 x seq x dim for attention)
  per second, and that over ``matmul_tflops``: what norms, attention and elementwise work leave of
  the matmul rate (the planner's MFU for this machine), its runs in three bursts spread over the
  calibration (a VM's speed drifts within a minute);
- ``optimizer_ns_per_param``: AdamW's step with gradient clipping, per fp32 parameter;
- ``host_optimizer_ns_per_param``, ``host_copy_GBps``: what an offloading run adds on the host
  -- the optimizer it really runs there (torch AdamW over DeepSpeed's or FSDP's fp32 host
  partitions, as our presets build it: not DeepSpeedCPUAdam) and the host<->device copy rate
  (pinned on CUDA; a memcpy on CPU, where the device is the host);
- ``floor_seconds``, ``layer_floor_seconds``: a step of a GPT too small to compute anything,
  per step and per block: the launch and Python overhead under which no step goes;
- ``tp_speedup`` (world > 1 dividing the reference heads and ffn; else absent): a 2-block model's forward and backward, whole on every process
  against tensor-parallel over all of them (``apply_tp``): what tensor parallelism over the
  world really divides a rank's time by -- its all-reduces, DTensor's dispatch and the norms and
  residuals TP does not split included (ideal: world);
- ``collectives``: per operation (all_reduce, all_gather, reduce_scatter, send), the latency of
  one step of it (a small message's time over the steps the planner's alpha-beta model counts:
  2 log2 N for an all-reduce, N - 1 for a ring all-gather / reduce-scatter, 1 for a send) and
  the bandwidth of the bytes each rank puts on the wire for a large one (the planner's unit).

The JSON is what planner/machine.py reads (``Machine``); the planner keys it by host, device,
world and precision under the user's cache directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import time
from typing import Any

from core.precision import dtype, find, of

SMALL = 1024  # bytes: a message whose time is latency
LARGE = {"cpu": 16 * 2**20, "gpu": 256 * 2**20}
# The reference block: (dim, heads, ffn, seq, micro batch)
REFERENCE = {"cpu": (384, 6, 1024, 128, 8), "gpu": (2048, 16, 5632, 2048, 2)}


def _samples(fn: Any, *, repeats: int, sync: Any, together: Any = None) -> list[float]:
    """Seconds of ``fn`` in each of ``repeats`` runs, after one warm-up; ``together``: a barrier
    every process passes before each run, so that each run overlaps the other processes' as a
    run's lockstep steps do (one barrier before the loop lets a process that finished first leave
    the machine to the others)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        if together is not None:
            together()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _timed(fn: Any, *, repeats: int, sync: Any, together: Any = None) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (``_samples``)."""
    return statistics.median(_samples(fn, repeats=repeats, sync=sync, together=together))


def compute_dtype(precision: str, accelerator: str) -> Any:
    """The dtype the matmuls are timed in (``Precision.measured``)."""
    p = find(precision) or of(precision)
    return dtype(p.measured(accelerator))


class _Block:
    """One block of recipes/gpt.py, forward and backward at the reference shape, timed in bursts
    (``burst``) spread over the calibration: ``tflops`` is its model FLOP/s over all of them. A
    VM's speed drifts within a minute (2 CPU processes, six 4-s measurements in a row: 0.034-0.045
    TFLOP/s), and the plan should price the machine's usual speed, not one moment of it."""

    BURST = 5
    """Runs per burst; three bursts (the start, after the collectives, the end): 15 runs, as one
    burst was before (5 runs: +-12% run to run)."""

    def __init__(self, accelerator: str, precision: str, device: Any, sync: Any, barrier: Any) -> None:
        import torch

        from recipes.config import ModelConfig
        from recipes.gpt import Block, rope_table

        dim, heads, ffn, seq, micro = REFERENCE[accelerator]
        dtype = compute_dtype(precision, accelerator)
        shape = ModelConfig(name="reference", dim=dim, n_layers=1, n_heads=heads, n_kv_heads=heads,
                            vocab_size=256, seq_len=seq, ffn_dim=ffn)
        block = Block(shape).to(device)
        rope = rope_table(shape.head_dim, seq, shape.rope_theta).to(device)
        x = torch.randn(micro, seq, dim, device=device, requires_grad=True)
        autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32
                    else torch.autocast(device.type, enabled=False))

        def step() -> None:
            with autocast:
                y = block(x, rope)
            y.float().sum().backward()

        self.step, self.sync, self.barrier = step, sync, barrier
        self.flops = (6 * (shape.block_params() - 2 * dim) + 12 * seq * dim) * seq * micro
        self.times: list[float] = []

    def burst(self) -> None:
        self.barrier()
        self.times += _samples(self.step, repeats=self.BURST, sync=self.sync, together=self.barrier)

    @property
    def tflops(self) -> float:
        return self.flops / statistics.median(self.times) / 1e12


def _compute(accelerator: str, precision: str, device: Any, sync: Any, barrier: Any) -> dict[str, float]:
    """The matmul rate and the optimizer's step (the block's rate: ``_Block``)."""
    import torch

    dim, _, ffn, seq, micro = REFERENCE[accelerator]
    tokens, dtype = seq * micro, compute_dtype(precision, accelerator)
    gemms = [(dim, dim), (dim, ffn), (ffn, dim)]
    mats = [(torch.randn(tokens, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
            for k, n in gemms]
    flops = sum(2 * tokens * k * n for k, n in gemms)
    barrier()
    matmul = flops / _timed(lambda: [a @ b for a, b in mats], repeats=5, sync=sync, together=barrier) / 1e12

    params = [torch.nn.Parameter(torch.randn(2**20, device=device)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    barrier()
    optimizer = _timed(update, repeats=5, sync=sync, together=barrier) / sum(p.numel() for p in params) * 1e9
    return {"matmul_tflops": matmul, "optimizer_ns_per_param": optimizer}


def _host(accelerator: str, device: Any, sync: Any, barrier: Any) -> dict[str, float]:
    """What an offloading run does on the host, and a step's floor (see the module):
    ``host_optimizer_ns_per_param`` (torch AdamW as an offloaded ZeRO or FSDP optimizer steps
    on the host -- fused where the run is on CUDA, as ``trainer.optimizer_impl=auto`` builds it
    there, foreach on a CPU run -- its gradient norm and clip included, per fp32 parameter, at
    this process's threads), ``host_copy_GBps`` (bytes per second of a host<->device copy, both
    ways averaged: pinned host memory on CUDA; on CPU the device is the host and a copy is a
    memcpy), and ``floor_seconds`` / ``layer_floor_seconds`` (a step of a 1- and a 2-block GPT
    of width 32: the launch and Python overhead no FLOP count sees, per step and per block)."""
    import torch

    params = [torch.nn.Parameter(torch.randn(2**20)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    from recipes.training import fused_missing

    fused = accelerator == "gpu" and fused_missing("adamw", "cpu") is None
    opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if fused else {"foreach": True}))

    def update() -> None:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        torch._foreach_mul_([p.grad for p in params], float(1.0 / max(1.0, norm.item())))
        opt.step()

    barrier()
    host_opt = _timed(update, repeats=5, sync=lambda: None, together=barrier) / sum(p.numel() for p in params) * 1e9
    n = 2**24  # 64 MiB of fp32
    host = torch.empty(n, pin_memory=accelerator == "gpu")
    there = torch.empty(n, device=device)
    barrier()
    down = _timed(lambda: there.copy_(host, non_blocking=True), repeats=5, sync=sync)
    up = _timed(lambda: host.copy_(there, non_blocking=True), repeats=5, sync=sync)
    floors = [_tiny_step(layers, device, sync, barrier) for layers in (1, 2)]
    per_layer = max(0.0, floors[1] - floors[0])
    return {"host_optimizer_ns_per_param": host_opt, "host_copy_GBps": 2 * n * 4 / (down + up) / 1e9,
            "floor_seconds": max(0.0, floors[0] - per_layer), "layer_floor_seconds": per_layer}


def _tiny_step(layers: int, device: Any, sync: Any, barrier: Any) -> float:
    """Median seconds of a whole training step (forward, backward, clip, AdamW) of a GPT too
    small to compute anything: what launching its kernels from Python costs."""
    import torch
    import torch.nn.functional as F

    from recipes.config import ModelConfig
    from recipes.gpt import GPT

    shape = ModelConfig(name="floor", dim=32, n_layers=layers, n_heads=4, n_kv_heads=4,
                        vocab_size=256, seq_len=32, ffn_dim=64)
    model = GPT(shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (2, 32), device=device)

    def step() -> None:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    barrier()
    return _timed(step, repeats=10, sync=sync, together=barrier)


def _tensor_parallel(accelerator: str, precision: str, world: int, device: Any, sync: Any,
                     barrier: Any) -> float:
    """How much faster a rank runs our model's forward and backward with tensor parallelism over
    every process (parallel.parallelize.apply_tp: its all-reduces, DTensor's dispatch and the
    parts TP does not split included) than the whole model alone, all processes busy at once:
    the ideal is ``world``. A 2-block GPT at the reference block's shape."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from recipes.config import ModelConfig
    from recipes.gpt import GPT
    from parallel.parallelize import apply_tp

    dim, heads, ffn, seq, micro = REFERENCE[accelerator]
    shape = ModelConfig(name="reference", dim=dim, n_layers=2, n_heads=heads, n_kv_heads=heads,
                        vocab_size=256, seq_len=seq, ffn_dim=ffn)
    dtype = compute_dtype(precision, accelerator)
    tokens = torch.randint(0, 256, (micro, seq), device=device)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32
                else torch.autocast(device.type, enabled=False))

    def timed(model: Any) -> float:
        def step() -> None:
            with autocast:
                logits = model(tokens)
            F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()

        barrier()
        return _timed(step, repeats=10, sync=sync, together=barrier)

    torch.manual_seed(0)
    whole = timed(GPT(shape).to(device))
    split = apply_tp(GPT(shape).to(device), init_device_mesh(device.type, (world,)))
    return whole / timed(split)


def _steps(op: str, n: int) -> int:
    """As planner/communication.py's ``latency_steps``."""
    return {"all_reduce": 2 * math.ceil(math.log2(n)), "all_gather": n - 1, "reduce_scatter": n - 1}.get(op, 1)


def _collectives(accelerator: str, rank: int, world: int, device: Any, sync: Any,
                 barrier: Any) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    # (torch 2.13 renamed the tensor forms; the GPU machines' 2.11 has the old names only)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def run(op: str, nbytes: int) -> Any:
        n = max(world, nbytes // 4 // world * world)  # fp32 elements, divisible by the world
        full = torch.ones(n, device=device)
        part = torch.ones(n // world, device=device)
        if op == "all_reduce":
            return lambda: dist.all_reduce(full)
        if op == "all_gather":
            return lambda: gather(full, part)
        if op == "reduce_scatter":
            return lambda: scatter(part, full)
        # send: rank 0 to rank 1, the others wait at the barrier
        if rank == 0:
            return lambda: dist.send(full, 1)
        if rank == 1:
            return lambda: dist.recv(full, 0)
        return lambda: None

    wire = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world,
            "reduce_scatter": (world - 1) / world, "send": 1.0}
    out = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send"):
        times = {}
        for size in (SMALL, LARGE[accelerator]):
            fn = run(op, size)
            barrier()
            times[size] = _timed(fn, repeats=20 if size == SMALL else 11, sync=sync)
        small, large = times[SMALL], times[LARGE[accelerator]]
        out[op] = {"latency_us": small / _steps(op, world) * 1e6,
                   "GBps": wire[op] * LARGE[accelerator] / max(large - small, 1e-9) / 1e9}
    return out


def _rank(rank: int, world: int, port: int, accelerator: str, precision: str, threads: int,
          out: str, engines: Any = None) -> None:
    import torch
    import torch.distributed as dist

    from core.collect import collect_here
    from observers.memory import allocate_exactly

    allocate_exactly(False)  # (as every rank of a run allocates: backends.run)
    if accelerator == "cpu":
        torch.set_num_threads(threads)
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    sync = torch.cuda.synchronize if accelerator == "gpu" else (lambda: None)
    grouped = world > 1
    if grouped or engines is not None:  # (one process too: the offloaded engines need a group)
        # (as torchrun would set them: DeepSpeed's engine reads them)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if accelerator == "gpu" else "gloo", rank=rank, world_size=world,
                                init_method=f"tcp://127.0.0.1:{port}")
    barrier = dist.barrier if grouped else (lambda: None)
    try:
        block = _Block(accelerator, precision, device, sync, barrier)
        mine = _compute(accelerator, precision, device, sync, barrier)
        block.burst()  # (three bursts: here, after the collectives, at the end)
        mine |= _host(accelerator, device, sync, barrier)
        heads, ffn = REFERENCE[accelerator][1:3]
        if grouped and heads % world == 0 and ffn % world == 0:  # (else: not measured, 0)
            mine["tp_speedup"] = _tensor_parallel(accelerator, precision, world, device, sync, barrier)
        collectives = _collectives(accelerator, rank, world, device, sync, barrier) if grouped else {}
        block.burst()
        if engines is not None:  # (backends/common/calibrate.py: DeepSpeed's own work)
            mine |= engines(accelerator, precision, world, rank, device, sync, barrier, mine, collectives)
        block.burst()
        mine |= {"block_tflops": block.tflops, "efficiency": block.tflops / mine["matmul_tflops"]}
        every = [None] * world
        if grouped:
            dist.all_gather_object(every, mine)
        else:
            every = [mine]
        if rank == 0:
            result = {k: statistics.median(r[k] for r in every) for k in mine}
            result |= {"collectives": collectives, "threads": threads, "torch": torch.__version__,
                       "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname()}
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
        if grouped:
            barrier()
    finally:
        if dist.is_initialized():
            collect_here()  # (the measured models' cyclic garbage, here, not in finalization)
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None, engines: Any = None) -> None:
    """``engines``: a top-level function measuring the engines on every rank (after the
    collectives), its keys added to the JSON (backends/common/calibrate.py)."""
    prog = f"python -m {engines.__module__ if engines else 'observers.machine'}"
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--precision", default="32")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="threads per process on CPU (default: what a run's rank gets)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from core.run import cpu_threads

    threads = a.threads or cpu_threads(a.world)
    if a.world == 1:
        _rank(0, 1, _free_port(), a.accelerator, a.precision, threads, a.out, engines)
        return
    import torch.multiprocessing as mp

    mp.start_processes(_rank,
                       args=(a.world, _free_port(), a.accelerator, a.precision, threads, a.out, engines),
                       nprocs=a.world, join=True, start_method="spawn")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
