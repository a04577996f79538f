"""Host memory of offload, item by item, as the engines allocate it (DeepSpeed 0.19.8's
stage_1_and_2.py / stage3.py / partition_parameters.py / swap_tensor, torch FSDP's CPUOffload,
torch's optimizers). ``plans[].memory.host_items``: one integer per item, per device; the plan's
``memory.host`` is their sum less ``process`` (what the run adds above the process before the
model was built, as the memory observer measures it), and the node's host-memory check adds the
process base back. Table and sources: docs/PLANNER.md, "Host memory of offload". Also the
node's check of its host memory (``node_host_need``, ``host_problems``: on CPU the device is
the host).

Page-locked (pinned) buffers exist only on CUDA: torch's caching host allocator rounds each one
up to a power of two (``CachingHostAllocator``: ``c10::llvm::PowerOf2Ceil``) and keeps freed
blocks cached, so on a GPU the rounding is booked as its own item (``pinned_rounding``) and
ZeRO-3's ``zero.Init`` partitions, freed once copied into the flat buffer, stay (``init_partitions``).
torch offers no exact-size pinning (``pinned_use_cuda_host_register`` rounds the same way), so
the planner plans the rounding rather than a preset that avoids it."""

from __future__ import annotations

import math
from typing import Any

from planner.states import gb, gb_apart
from strategies.footprint import CPU, HOST_STATES, NVME, SHARDED, STEP_ONLY, cpu_peak

GB = 10**9
PROCESS_BYTES = {"cpu": int(0.55 * GB), "gpu": int(3.0 * GB)}
"""The process before the model is built: torch, Lightning/Accelerate and DeepSpeed imported
(cpu: measured here, RSS before the model of a train.py run, 0.53-0.56 GB per rank); on a GPU
also the CUDA context, cuBLAS/NCCL workspaces (3 GB: an estimate, not measured here)."""
ENGINE_RUNTIME_BYTES = int(85e6)
"""What the engine adds to the host above the process before the model was built, whatever
the model's size: DeepSpeed's engine, its process group and optimizer wrapper (measured here,
CPU, bf16-mixed, ZeRO-2/3 offload: 68-93 MB over models of 7M and 29M parameters)."""
STATES = HOST_STATES
STEP_TEMPORARIES = {"for-loop": 2, "foreach": 1, "fused": 0}
"""torch AdamW's fp32 temporaries per stepped element, in partitions (measured on a flat CPU
tensor: the for-loop's ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` holds two at once,
foreach's in-place ``_foreach_sqrt``/``_foreach_div_`` one, fused none); SGD: none."""


def pow2(nbytes: float) -> int:
    """What torch's caching host allocator takes for a pinned block of ``nbytes``."""
    return 0 if nbytes <= 0 else 1 << math.ceil(math.log2(math.ceil(nbytes)))


def tensors(model: Any, params: float, *, trainable: bool = False) -> list[float]:
    """The model's parameter tensors (elements), as its description lists them
    (``ModelConfig.tensor_sizes``: each block's, a MoE block's stacked experts, the norms, the
    embeddings, LoRA's adapters); ``trainable``: only those the optimizer steps (with LoRA, the
    adapters). Without a shape (``planner.params``): one tensor."""
    sizes = getattr(model, "tensor_sizes", None)
    if sizes is None:
        return [params]
    adapters = trainable and bool(getattr(model, "lora_params", lambda: 0)())
    return [float(t) for t, count in sizes(adapters=adapters).items() for _ in range(count)]


def step_temporaries(optimizer: str, impl: str) -> int:
    """fp32 copies of the stepped partition torch's optimizer makes during its step."""
    return 0 if optimizer == "sgd" else STEP_TEMPORARIES.get(impl, 1)


def host_items(fp: Any, n: Any, moved: dict[str, int], *, gpu: bool, optimizer: str, impl: str,
               accumulation: int) -> dict[str, int]:
    """Per-device host bytes of what ``fp`` offloads (``moved``: the states it moves to the
    host, by name: params, grads, master, optimizer), each allocation its own item; {} when
    nothing is offloaded."""
    if not fp.offloaded:
        return {}
    if hasattr(fp, "stage"):
        items = _deepspeed(fp, n, moved, gpu=gpu, optimizer=optimizer, impl=impl,
                           accumulation=accumulation)
    else:
        items = _torch(fp, n, moved, gpu=gpu, optimizer=optimizer, impl=impl)
    if hasattr(fp, "stage"):  # (measured for DeepSpeed's engine; FSDP's is not)
        items["engine_runtime"] = ENGINE_RUNTIME_BYTES
    items = {k: int(v) for k, v in items.items() if v}
    items["process"] = PROCESS_BYTES["gpu" if gpu else "cpu"]
    return items


def _deepspeed(fp: Any, n: Any, moved: dict[str, int], *, gpu: bool, optimizer: str, impl: str,
               accumulation: int) -> dict[str, float]:
    """DeepSpeed ZeRO-1/2 (stage_1_and_2.py) and ZeRO-3 (stage3.py) with the optimizer (and
    ZeRO-3's parameters) on the host or NVMe."""
    sb, part = n.bytes, n.trainable / n.shard
    pinned = gpu if fp.pin_memory is None else fp.pin_memory and gpu  # (CPU: never)
    opt_cpu, par_cpu = fp.optimizer_offload == CPU, fp.params_offload == CPU
    grads = moved.get("grads", 0)
    items: dict[str, float] = {
        "params_16bit": moved.get("params", 0),  # stage3 _create_param_groups_fp16_flat_cpu_memory
        "fp32_master": moved.get("master", 0),
        "fp32_grads": min(grads, math.ceil(part * 4)) if opt_cpu else 0,
        "grads_16bit": max(0, grads - math.ceil(part * 4)) if opt_cpu else 0,
        "optimizer_moments": moved.get("optimizer", 0),
    }
    sub = min(part, fp.sub_group) if fp.stage >= 3 else part  # stage3 steps one sub-group at a time
    if opt_cpu:
        items["step_temporaries"] = sub * 4 * step_temporaries(optimizer, impl)
    shapes, stepped = tensors(n.model, n.total_params), tensors(n.model, n.total_params, trainable=True)
    if fp.stage < 3 and opt_cpu:
        # __init__: temp_buffer_bit16, the 16-bit copy of the partition the step writes into
        items["staging_16bit"] = part * sb.params
        # __init__: temp_grad_buffer_for_cpu_offload, the largest parameter's gradient
        items["largest_grad_buffer"] = max(stepped) / n.mp * sb.grads
        if accumulation > 1:  # async_accumulate_grad_in_cpu_via_gpu: each parameter's own buffer
            items["accumulation"] = part * sb.grads
    if fp.stage >= 3 and par_cpu and pinned:
        # partition_parameters.py Init._partition_param: each parameter's pinned ds_tensor,
        # copied into the flat buffer and freed -- cached by the host allocator, not returned
        items["init_partitions"] = sum(pow2(t / n.mp / n.shard * sb.params) for t in shapes)
    if NVME in (fp.optimizer_offload, fp.params_offload):
        items |= _nvme(fp, n, sub)
    if pinned:
        items["pinned_rounding"] = _deepspeed_rounding(fp, items, sub)
        if items.get("accumulation"):  # one pinned buffer per parameter (its share of them)
            items["pinned_rounding"] += sum(pow2(t / n.mp * sb.grads) - t / n.mp * sb.grads
                                            for t in stepped) / n.shard
    return items


def _deepspeed_rounding(fp: Any, items: dict[str, float], sub: float) -> float:
    """What the pinned blocks take beyond their bytes: each buffer DeepSpeed pins, rounded."""
    blocks = [items.get(k, 0) for k in ("params_16bit", "grads_16bit", "largest_grad_buffer")]
    if fp.stage < 3:  # __init__ pins the fp32 partition and the staging copy;
        # initialize_optimizer_states the fp32 gradient partition (one block each per group)
        blocks += [items.get(k, 0) for k in ("fp32_master", "staging_16bit", "fp32_grads")]
    else:  # initialize_optimizer_states: one pinned fp32 gradient buffer per sub-group
        grads = items.get("fp32_grads", 0)
        whole, rest = divmod(grads, sub * 4) if grads else (0, 0)
        blocks += [sub * 4] * int(whole) + ([rest] if rest else [])
    blocks += [items.get(k, 0) for k in ("nvme_param_buffers", "nvme_optimizer_buffers")]
    return sum(pow2(b) - b for b in blocks if b)


def _nvme(fp: Any, n: Any, sub: float) -> dict[str, float]:
    """ZeRO-Infinity's host side: the pinned swap buffers (swap_tensor/
    partitioned_param_swapper.py: ``buffer_count x buffer_size`` 16-bit elements in one block;
    optimizer_utils.py: ``buffer_count`` buffers of the largest sub-group, fp32)."""
    out: dict[str, float] = {}
    if fp.params_offload == NVME:
        out["nvme_param_buffers"] = fp.swap_buffers[0] * n.bytes.params
    if fp.optimizer_offload == NVME:
        out["nvme_optimizer_buffers"] = fp.swap_buffers[1] * sub * 4
    return out


def _torch(fp: Any, n: Any, moved: dict[str, int], *, gpu: bool, optimizer: str,
           impl: str) -> dict[str, float]:
    """torch FSDP's CPUOffload: each unit's sharded fp32 parameters and gradients pinned on the
    host, torch's optimizer stepping there (its moments beside them)."""
    part = n.trainable / n.shard
    items: dict[str, float] = {"fp32_master": moved.get("params", 0), "fp32_grads": moved.get("grads", 0),
                               "optimizer_moments": moved.get("optimizer", 0) + moved.get("master", 0),
                               "step_temporaries": part * 4 * step_temporaries(optimizer, impl)}
    if gpu and fp.params == SHARDED:  # one pinned shard per unit (parameters, gradients)
        units = max(1, round(n.units))
        each = [items["fp32_master"] / units, items["fp32_grads"] / units]
        items["pinned_rounding"] = units * sum(pow2(b) - b for b in each if b)
    return items


def moved_states(fp: Any, n: Any) -> dict[str, int]:
    """The states ``fp`` moves to the host, by name, at the bytes it holds there."""
    held = fp.held(n)
    return {k: held[k] for k, place in fp.placement().items() if place == CPU}


def node_host_need(mem: Any, su: Any) -> tuple[int, int]:
    """The node's host memory need (bytes) and each rank's share of it. On a GPU: what each
    process offloads and its own base (``process``; nothing for a preset that offloads nothing).
    On CPU there is one memory: ``cluster.device_memory_GB`` is a share of the host's RAM
    (recipes/hardware.py ``local``), so each rank's device bytes are host memory too, beside what
    it offloads and its process base -- for every preset, at the busier phase (``cpu_peak``).
    The one place that says so; the verdict (``host_problems``) and the spare it reports
    (``Plan.host_margin``) both read it."""
    cpu = su.cluster.accelerator != "gpu"
    process = mem.host_items.get("process", PROCESS_BYTES["cpu"] if cpu else 0)
    rank = (cpu_peak(mem.total, mem.step, mem.host, mem.host_items) if cpu else mem.host) + process
    return rank * su.cluster.devices, rank


def _cpu_rank(mem: Any, rank: int) -> str:
    """What a CPU rank's host need is made of, at its busier phase (``cpu_peak``)."""
    only = sum(mem.host_items.get(k, 0) for k in STEP_ONLY)
    process = f" + {gb(rank - cpu_peak(mem.total, mem.step, mem.host, mem.host_items))} process"
    if only and mem.step + only > mem.total:  # the optimizer step is the busier phase
        return (f"per rank {gb(mem.step)} device at the optimizer step + {gb(mem.host)} offloaded, "
                f"its temporaries included (more than backward's peak){process}")
    step = f" (the step's {gb(only)} temporaries come once the activations are gone)" if only else ""
    offloaded = f" + {gb(mem.host - only)} offloaded{step}" if mem.host else ""
    return f"per rank {gb(mem.total)} device peak{offloaded}{process}"


def host_problems(mem: Any, su: Any) -> list[str]:
    """Host memory and NVMe the node lacks for what its processes hold there
    (``node_host_need``; on CPU each line says the device is the host)."""
    cl, out = su.cluster, []
    host, rank = node_host_need(mem, su)
    if host > su.host_bytes:
        need, has = gb_apart(host, su.host_bytes)
        cpu = "" if cl.accelerator == "gpu" else f" (on CPU the device is the host: {_cpu_rank(mem, rank)})"
        out.append(f"host memory: needs {need} per node{cpu}, has {su.host_has(has)}")
    if mem.nvme * cl.devices > su.nvme_bytes:
        out.append("NVMe: needs {} per node, has {}".format(*gb_apart(mem.nvme * cl.devices, su.nvme_bytes)))
    return out
