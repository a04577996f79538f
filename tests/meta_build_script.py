"""Run by tests/test_meta_build.py under ``torchrun --nproc_per_node 2``: a GPT built on the meta
device, sharded, then materialized (what fsdp2 and the tp / pipeline presets do) against the
whole build from the same seed. Prints one JSON line per rank: the build's peak resident growth
over the whole model's bytes, and which layouts equal the whole build bitwise."""

import json
import resource
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from backends import teardown
from parallel.parallelize import FSDP2Plan, ParallelPlan, materialize, parallelize
from recipes import training
from recipes.model_config import ModelConfig


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def high_water() -> int:
    """This process's own peak RSS (``VmHWM``; ``ru_maxrss`` carries the parent's across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def built(shape: ModelConfig, plan: ParallelPlan, **meshes) -> torch.nn.Module:
    holder = torch.nn.Module()  # (parallelize finds the model inside a module)
    holder.model = training.build_model(shape, 7, meta=True)
    assert all(p.is_meta for p in holder.model.parameters())
    parallelize(holder, plan, **meshes)
    materialize(holder, torch.device("cpu"))
    return holder.model


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


dist.init_process_group("gloo")
out = {"rank": dist.get_rank()}
tied = sys.argv[1] == "tied"
small = ModelConfig(name="small", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                    seq_len=32, ffn_dim=64, tie_embeddings=tied)
built(small, ParallelPlan(fsdp=FSDP2Plan()), dp_mesh=init_device_mesh("cpu", (2,)))  # (the code
# a first meta build loads -- meta kernels, DTensor's ops -- is not the model's memory)
big = ModelConfig(name="big", dim=512, n_layers=16, n_heads=8, n_kv_heads=8, vocab_size=256,
                  seq_len=64, ffn_dim=1408)
before = rss()
model = built(big, ParallelPlan(fsdp=FSDP2Plan()), dp_mesh=init_device_mesh("cpu", (2,)))
peak = high_water()
out["growth"] = (peak - before) / (4 * big.num_params())
del model

ref = training.build_model(small, 7).state_dict()
mesh2d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
layouts = {"fsdp2": (ParallelPlan(fsdp=FSDP2Plan()), {"dp_mesh": init_device_mesh("cpu", (2,))}),
           "tp": (ParallelPlan(tp=2), {"tp_mesh": init_device_mesh("cpu", (2,))}),
           "fsdp_tp": (ParallelPlan(tp=2, fsdp=FSDP2Plan()), {"tp_mesh": mesh2d["tp"], "dp_mesh": mesh2d["dp"]})}
out["equal"] = []
for name, (plan, meshes) in layouts.items():
    got = whole(built(small, plan, **meshes))
    if got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref):
        out["equal"].append(name)
print(json.dumps(out), flush=True)
teardown(ok=True)  # (garbage collected here, then barrier and destroy: gloo aborts at exit otherwise)
