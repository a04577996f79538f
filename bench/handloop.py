"""The baseline for ``python -m bench overhead``: a training loop written by hand against the raw
libraries, the way one would without this project. Run under torchrun:

    torchrun --standalone --nproc_per_node 2 bench/handloop.py --family ddp --model gpt_small

Families: ``ddp`` (torch DistributedDataParallel), ``fsdp2`` (``fully_shard`` per block, then
the model), ``zero2`` / ``zero3`` (``deepspeed.initialize`` with the equivalent JSON written out
here, not taken from strategies/). The same model (``recipes.training.build_model``), data order
(``recipes.data``: synthetic tokens, the global-batch sampler), AdamW, global-norm clipping and
per-step loss all-reduce (what any loop that logs its loss does) as ``train.py``.

Timing matches the throughput observer's: a step runs from having its first micro-batch in
hand to the loss reduced (median over steps, the first excluded); ``loop_seconds`` is the whole
loop (first step included, data loading included) over the steps, like report.json's
``wall_seconds``. It allocates as our ranks do (glibc's heap kept between steps:
``observers.memory.allocate_exactly``) unless ``--glibc-defaults``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

SEED = 1234


def model_shape(name: str):
    from omegaconf import OmegaConf

    from recipes.config import ModelConfig

    raw = OmegaConf.to_container(OmegaConf.load(Path(__file__).resolve().parents[1] / "conf/model" / f"{name}.yaml"))
    raw = {k: v for k, v in raw.items() if k != "defaults"}
    return ModelConfig(**raw)


def deepspeed_config(stage: int, micro: int, accumulation: int, clip: float) -> dict:
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 200_000_000, "sub_group_size": 1_000_000_000}
    if stage < 3:
        zero |= {"allgather_partitions": True, "allgather_bucket_size": 200_000_000, "reduce_scatter": True}
    else:
        zero |= {"stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
                 "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000}
    return {"zero_optimization": zero, "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False, "steps_per_print": 2**31 - 1,
            "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": clip}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", choices=["ddp", "fsdp2", "zero2", "zero3"], required=True)
    p.add_argument("--model", default="gpt_small")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", required=True)
    p.add_argument("--glibc-defaults", action="store_true",
                   help="leave glibc's allocator as it is (what a hand loop gets without this line)")
    a = p.parse_args()
    if not a.glibc_defaults:
        # Our ranks' allocator (observers/memory.py), so the ratio is of the layer, not of glibc's
        # settings: under glibc's defaults the same loop pays a page fault per freed page a step.
        from observers.memory import allocate_exactly

        allocate_exactly(False)

    from recipes.data import GlobalBatchSampler, SyntheticDataset
    from recipes.gpt import GPT

    shape = model_shape(a.model)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    accumulation = a.global_batch // (a.micro_batch * world)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = GPT(shape)

    if a.family.startswith("zero"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
        cfg = deepspeed_config(int(a.family[-1]), a.micro_batch, accumulation, a.grad_clip)
        if cfg["zero_optimization"]["stage"] == 3:
            # ZeRO-3 partitions at construction; rebuild the same weights under zero.Init.
            with deepspeed.zero.Init(config_dict_or_path=cfg), torch.random.fork_rng(devices=[]):
                torch.manual_seed(SEED)
                model = GPT(shape)
            opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        model = engine
    else:
        dist.init_process_group("gloo")
        if a.family == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model.modules():
                if isinstance(block, GPT.block_cls):
                    fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8)

    data = SyntheticDataset(4096, shape.seq_len, shape.vocab_size, SEED)
    sampler = GlobalBatchSampler(len(data), global_batch=a.global_batch, micro_batch=a.micro_batch,
                                 dp_rank=rank, dp_size=world, seed=SEED, steps=a.steps)
    batches = iter(DataLoader(data, batch_sampler=sampler))
    seconds, cpu, losses = [], [], []
    dist.barrier()
    t_loop = time.perf_counter()
    for _ in range(a.steps):
        micro = []
        t0 = c0 = None
        for k in range(accumulation):
            tokens, targets = next(batches)
            t0, c0 = t0 or time.perf_counter(), c0 or time.process_time()
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            micro.append(loss.detach())
            if a.family.startswith("zero"):
                model.backward(loss)
                model.step()
            elif a.family == "ddp" and k < accumulation - 1:
                with model.no_sync():
                    (loss / accumulation).backward()
            else:
                (loss / accumulation).backward()
        if not a.family.startswith("zero"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
            opt.step()
            opt.zero_grad()
        mean = torch.stack(micro).mean()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    loop = time.perf_counter() - t_loop
    if rank == 0:
        timed = seconds[1:] or seconds
        Path(a.out).write_text(json.dumps({
            "family": a.family, "world_size": world, "steps": a.steps, "losses": losses,
            "step_seconds": statistics.median(timed), "loop_seconds": loop / a.steps,
            "step_cpu_seconds": statistics.median(cpu[1:] or cpu),
            "seconds": seconds}))
    # gloo processes abort at exit unless torn down in this order (PLATFORM.md).
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
