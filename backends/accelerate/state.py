"""The one place where Accelerate is made to run what its plugins say on CPU (gloo). Nothing here patches torch or Accelerate's code; it
builds Accelerate's own state in the order Accelerate would on a GPU, and checks the result.

Accelerate 1.15 on CPU, read in its source and measured (2 gloo ranks, every family against a
single-process reference):

1. Without ``cpu=True`` a CPU rank never joins the process group (``DistributedType.NO``, one
   process each). With ``cpu=True`` it is ``MULTI_CPU`` on gloo -- but ``AcceleratorState``
   chooses FSDP only for GPU-like distributed types and DeepSpeed only ``and not cpu``, so both
   plugins are dropped without a word and ``prepare()`` builds DDP (state.py).
2. ``MULTI_CPU`` puts every rank on device ``cpu:0``, which FSDP1 refuses as its ``device_id``
   against parameters on ``cpu``; ``ACCELERATE_TORCH_DEVICE=cpu`` (read by ``PartialState``) pins
   plain ``cpu``.
3. ``DeepSpeedPlugin.select()`` imports ``transformers`` (for its ``from_pretrained`` ZeRO-3 hook)
   even when it is not installed; the plugin (``families/deepspeed.py``) skips that hook without it.

``accelerator()`` (the loop's, with the kwargs of the preset's builder, ``families/``) therefore: creates ``PartialState(cpu=True)`` first (gloo group, ranks from
the launcher's environment); for DeepSpeed, builds ``Accelerator(cpu=False, ...)`` on that
state, so DeepSpeed is chosen by Accelerate's own code; for FSDP, builds ``Accelerator(cpu=True,
...)`` and then sets what the skipped branch of ``AcceleratorState`` would have set (the plugin,
its mixed precision, ``distributed_type=FSDP`` on the shared state) -- on more than one process,
or on one that ``accelerate launch`` started under an FSDP config (``fsdp_alone``). Then it
asserts the distributed type on every view of the state, and the number of processes, so a silent fallback
to DDP fails loudly. On a GPU none of this runs: ``Accelerator(**kwargs)`` as usual. On either, FSDP with
accumulation reduces every micro-batch (``sharded_accumulation``).
"""

from __future__ import annotations

import os
from typing import Any

from core.errors import ConfigError


def sharded_accumulation(more: dict[str, Any]) -> dict[str, Any]:
    """FSDP reduce-scatters every micro-batch's gradients (``sync_each_batch``), as the Lightning
    backend and DeepSpeed's ZeRO-2/3 do and the planner books: Accelerate's default no_sync
    would keep the whole model's unsharded gradients on every rank until the accumulation
    boundary (gpt_small, 4 micro-batches: the step's memory 1.15-1.32x the plan)."""
    from accelerate.utils import GradientAccumulationPlugin

    more = dict(more)
    steps = more.pop("gradient_accumulation_steps")
    return more | {"gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=steps,
                                                                              sync_each_batch=True)}


def fsdp_alone(kwargs: dict[str, Any], world_size: int) -> bool:
    """One process that ``accelerate launch`` started under an FSDP config (export.py at
    cluster.devices=1): its launcher starts it through torchrun (``LOCAL_RANK``), and Accelerate
    then runs FSDP in one process on a GPU, so the preset's FSDP runs there on CPU too -- and a
    state that ``save_state`` sharded on N ranks loads on one through Accelerate's FSDP load.
    Without that config one process wraps nothing (``NO``), as ``Accelerator(fsdp_plugin=...)``
    does under ``python script.py``."""
    return (world_size == 1 and "fsdp_plugin" in kwargs and "LOCAL_RANK" in os.environ
            and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true")


def expected_type(kwargs: dict[str, Any], world_size: int, on_cpu: bool) -> str:
    """The ``DistributedType`` name these Accelerator kwargs must produce (DeepSpeed's engine
    runs in one process too: ZeRO-Offload on one GPU; FSDP under the launcher's FSDP config,
    ``fsdp_alone``; the others wrap nothing there)."""
    if "deepspeed_plugin" in kwargs:
        return "DEEPSPEED"
    if world_size == 1:
        return "FSDP" if fsdp_alone(kwargs, world_size) else "NO"
    if "fsdp_plugin" in kwargs:
        return "FSDP"
    return "MULTI_CPU" if on_cpu else "MULTI_GPU"


def lone_group_env() -> None:
    """torch's env:// variables for a process group of one, where no launcher set them:
    DeepSpeed's engine joins a group even alone (ZeRO-Offload on one GPU), and without them
    looks for MPI ("No module named 'mpi4py'"). Lightning's DeepSpeed strategy does the same."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def accelerator(kwargs: dict[str, Any], *, on_cpu: bool, world_size: int,
                timeout: float | None = None, cls: Any = None, **more: Any) -> Any:
    """An ``accelerate.Accelerator`` that runs ``kwargs`` (a builder's ``kwargs()``) for real,
    checked; ``timeout``: seconds a collective waits for a lost peer (the process group's
    timeout, gloo or NCCL); ``cls``: a subclass of ``Accelerator`` to build (a user's script:
    backends/accelerate/user.py); ``more``: mixed precision, gradient accumulation steps."""
    from datetime import timedelta

    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    from backends.common.torch import bound_new_groups

    from accelerate import Accelerator as default

    Accelerator = cls or default  # noqa: N806
    group = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    bound_new_groups(timeout)  # (DeepSpeed's and DeviceMesh's groups too, not only the default one)
    if "deepspeed_plugin" in kwargs and world_size == 1 and "RANK" not in os.environ:
        lone_group_env()
    if "fsdp_plugin" in kwargs and more.get("gradient_accumulation_steps", 1) > 1:
        more = sharded_accumulation(more)
    if not on_cpu:
        if group:
            kwargs = {**kwargs, "kwargs_handlers": [*kwargs.get("kwargs_handlers", []),
                                                    InitProcessGroupKwargs(**group)]}
        acc = Accelerator(**kwargs, **more)
    else:
        os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"  # (2)
        os.environ.pop("ACCELERATE_USE_CPU", None)  # would force cpu=True, dropping DeepSpeed again
        state = PartialState(cpu=True, **group)  # (1) the gloo group and MULTI_CPU
        if "deepspeed_plugin" in kwargs:
            acc = Accelerator(cpu=False, **kwargs, **more)
        else:
            acc = Accelerator(cpu=True, **kwargs, **more)
            plugin = kwargs.get("fsdp_plugin")
            if plugin is not None and (state.num_processes > 1 or fsdp_alone(kwargs, world_size)):
                if acc.state.mixed_precision != "no":
                    plugin.set_mixed_precision(acc.state.mixed_precision)
                acc.state.fsdp_plugin = plugin
                acc.state.distributed_type = DistributedType.FSDP
                PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    want = expected_type(kwargs, world_size, on_cpu)
    seen = {str(v.name) for v in (acc.distributed_type, AcceleratorState().distributed_type,
                                  PartialState().distributed_type)}
    if seen != {want} or acc.num_processes != world_size:
        raise ConfigError(f"Accelerate built {sorted(seen)} on {acc.num_processes} process(es), "
                          f"but the preset needs {want} on {world_size}: if you started it with "
                          "`accelerate launch`, its config must match the preset (export one with "
                          "python export.py ... export=accelerate)")
    return acc
