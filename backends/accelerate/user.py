"""A user's own Accelerate script on a preset, with one line: the Accelerator it builds.

    from backends.accelerate import stratagem_accelerator

    accelerator = stratagem_accelerator("fsdp2")          # instead of Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    python export.py strategy=fsdp2 cluster.devices=2 export=accelerate [export.wrap=MyBlock]
    accelerate launch --config_file fsdp2-local.accelerate.yaml my_script.py

The Accelerator is built by the code train.py's Accelerate backend uses (the preset's builder,
``families/``, its kwargs, then ``state.accelerator``), so FSDP1/FSDP2, ZeRO-1/2/3 and their
offload run for real on GPU and on CPU (gloo), where Accelerate alone drops the plugin and trains
DDP or lone processes without a word (state.py). Once the model and optimizer are prepared it
does what train.py's loop does around them (``_repair``): the builder's ``repair`` (the ddp
family's int8, top-k, PowerSGD, local SGD and DiLoCo hooks, which Accelerate's kwargs cannot
name) and its ``before_step`` / ``after_step`` on the optimizer's step (local SGD and DiLoCo's
averaging). Its process allocates as train.py's ranks do: glibc's heap kept between steps, and
what ``prepare`` and ``load_state`` freed handed back once (``observers.memory``). What it
refuses, with a ``ConfigError``:

* a launcher's config for another engine than the preset's (``ACCELERATE_USE_FSDP`` /
  ``ACCELERATE_USE_DEEPSPEED`` from the exported YAML), before any process group;
* a state that is not the preset's engine, or a process count other than the launcher's
  ``WORLD_SIZE`` (lone processes), once built (``state.accelerator``);
* a prepared model that is not the preset's engine (an FSDP2 module, FSDP1's wrapper, a
  ``DeepSpeedEngine``, DDP), at ``prepare``;
* ``load_state`` under a ddp-family preset that keeps state of its own on each rank (PowerSGD's,
  top-k's and int8's error feedback, local SGD's replicas, DiLoCo's outer step: ``unsaved_state``)
  from a directory without that state: the hook's ``save_state`` writes it beside Accelerate's
  files, one ``stratagem_rank_state/rank<r>.pt`` a rank (as train.py's checkpoints do), and
  ``load_state`` restores it after Accelerate's model and optimizer (rank 0's), so the run
  continues exactly;
* under ZeRO, ``clip_grad_norm_`` at a max_norm other than the hook's ``grad_clip``: DeepSpeed
  clips inside its step at its config's ``gradient_clipping`` and Accelerate only returns the
  norm, so the script's clip would silently not happen (``grad_clip=`` outside ZeRO is refused).

The hook builds a ZeRO preset's DeepSpeed config from its arguments alone, never from the JSON an
exported YAML names (export.py prints the call that builds that JSON: the preset's keys,
``precision``, ``grad_clip``, ``gradient_accumulation_steps``; the micro batch is the script's
DataLoader's). When the JSON the launcher's config names differs, rank 0 logs one warning naming
each key that differs and the argument that gives the file's value (``_say_unlike_the_export``).

Under ZeRO-3, a ``backward`` that fails on a parameter used outside any module's forward (an L2
penalty added after ``model(x)``: autograd's "returned an invalid gradient at index 0 - got [0]")
is re-raised with what it means and the fixes (backends/common/partitioned.py).

Under ZeRO, an LR scheduler prepared in a call without the model (Accelerate's DeepSpeed path
returns it bare) is wrapped and registered as on DDP (``prepare_scheduler``). Under local_sgd and
diloco, ``with accelerator.rank0_replica():`` scores rank 0's replica on every rank, and an eval's
gather outside it while the replicas differ is told once (user_loop.py).

A script without this line (``Accelerator()``, with or without ``cpu=True``) runs none of our
code. Under a CPU export it stops at ``Accelerator()``, which builds the plugin the launcher's
variables name before it picks a device: an FSDP preset's ``fsdp_auto_wrap_policy`` and a ZeRO
preset's ``deepspeed_config_file`` are ``HOOK_REQUIRED`` text, which Accelerate refuses by name
(``Invalid auto wrap policy: STRATAGEM_HOOK_REQUIRED: ...``; ``Expected a string path to an
existing deepspeed config ... Received: STRATAGEM_HOOK_REQUIRED: ...``). A GPU export on GPUs is
Accelerate's own FSDP or DeepSpeed from the YAML: the preset's engine, without the check at
``prepare``. Not caught (``unhooked``): a GPU export run with ``Accelerator(cpu=True)`` or on a
machine without GPUs (DDP on CPU, or lone processes; Accelerate reads the same plugin values on
the run that is right, and nothing of a config runs at ``prepare`` once it dropped the plugin).

The wrap policy (FSDP): ``wrap=`` (a class name of the model, several with commas; an int: by
size, that many parameters a unit), else what the launcher's config says (``export.wrap``), else
the root alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from backends.accelerate.user_loop import AloneSchedules, Rank0Replica
from core.errors import ConfigError

PRECISIONS = {"no": "32", "bf16": "bf16-mixed", "fp16": "16-mixed"}
"""Accelerate's ``mixed_precision`` -> ours."""

HOOK_REQUIRED = "STRATAGEM_HOOK_REQUIRED"
"""What a CPU export writes as its ``fsdp_auto_wrap_policy`` (FSDP) or ``deepspeed_config_file``
(ZeRO): Accelerate's own ``Accelerator()`` refuses it by name when it builds the plugin from the
launcher's variables, on CPU too (where it would then drop the plugin and train DDP or lone
processes), so an unhooked script stops at its first line; the hook passes its own plugin (FSDP:
the wrap from the class names or the size; ZeRO: the preset's DeepSpeed config)."""

LAUNCHED = {"FSDP": "ACCELERATE_USE_FSDP", "DEEPSPEED": "ACCELERATE_USE_DEEPSPEED"}
"""The engine a launcher's config names -> the variable ``accelerate launch`` sets for it."""


def _launched_engine() -> str | None:
    return next((t for t, var in LAUNCHED.items() if os.environ.get(var, "").lower() == "true"), None)


def _wrap(wrap: str | int | None) -> str | int | None:
    """``wrap``, else the launcher's (the exported YAML's ``fsdp_auto_wrap_policy``)."""
    if wrap is not None:
        return wrap
    policy = os.environ.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").upper()
    ours = policy.startswith(HOOK_REQUIRED)  # (a CPU export: the class names, else the size)
    if (ours or policy == "TRANSFORMER_BASED_WRAP") and os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        return os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"]
    if ours or policy == "SIZE_BASED_WRAP":
        from backends.accelerate.families.fsdp import SIZE_WRAP_PARAMS

        return int(os.environ.get("FSDP_MIN_NUM_PARAMS", SIZE_WRAP_PARAMS))
    return None


UNHOOKED = ("refused", "preset", "ddp", "lone")
"""What a script without the hook trains under an exported config (``unhooked``)."""


def unhooked(config: dict[str, Any], *, cuda: bool, cpu: bool) -> str:
    """What a script that builds its own ``Accelerator(cpu=cpu)`` (no hook) trains under the
    exported launcher config ``config`` (export.py's ``accelerate_config``) on a machine with or
    without CUDA GPUs, as Accelerate 1.15 decides it (state.py's notes), one of ``UNHOOKED``:
    ``refused`` (a CPU export's plugin value is ``HOOK_REQUIRED``: it stops at ``Accelerator()``),
    ``preset`` (Accelerate's own FSDP or DeepSpeed from the YAML, on GPUs), ``ddp`` (the plugin
    dropped for ``cpu=True``: DDP on gloo, without a word; a DDP preset's YAML is plain DDP
    without the preset's hooks), ``lone`` (no GPU and no ``cpu=True``: every rank trains alone
    -- FSDP: ``DistributedType.NO``; DeepSpeed: one process per Accelerate state).

    Only ``refused`` is enforced: a GPU export's values are read the same way on the run that
    is right (``preset``) and on the others, and once Accelerate dropped the plugin nothing of
    the config runs at ``prepare`` -- the hook checks there (``_checked_class``)."""
    kind = config["distributed_type"]
    read = {"FSDP": config.get("fsdp_config", {}).get("fsdp_auto_wrap_policy"),  # (what Accelerator()
            "DEEPSPEED": config.get("deepspeed_config", {}).get("deepspeed_config_file")}.get(kind)  # reads)
    if str(read).startswith(HOOK_REQUIRED):
        return "refused"
    if config["num_processes"] == 1 or kind == "NO":
        return "preset"  # (one process: nothing to distribute, nothing dropped)
    if kind not in LAUNCHED:
        return "ddp" if cpu or cuda else "lone"
    if cpu:
        return "ddp"
    return "preset" if cuda else "lone"


def _engine(kwargs: dict[str, Any], world: int) -> str:
    """What a prepared model must be: fsdp2 | fsdp1 | deepspeed | ddp | plain."""
    from backends.accelerate.state import fsdp_alone

    plugin = kwargs.get("fsdp_plugin")
    if "deepspeed_plugin" in kwargs:  # (DeepSpeed's engine even in one process: ZeRO-Offload)
        return "deepspeed"
    if world == 1 and not fsdp_alone(kwargs, world):
        return "plain"  # (Accelerate wraps nothing else in one process: DistributedType.NO)
    if plugin is not None:
        return f"fsdp{plugin.fsdp_version}"
    return "ddp" if world > 1 else "plain"


def is_engine(model: Any, engine: str) -> bool:
    """Whether ``model`` (as ``prepare`` returned it) is wrapped by ``engine`` (``_engine``)."""
    if engine == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        return isinstance(model, FSDPModule)
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return isinstance(model, FullyShardedDataParallel)
    if engine == "deepspeed":
        from deepspeed import DeepSpeedEngine

        return isinstance(model, DeepSpeedEngine)
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return isinstance(model, DistributedDataParallel)
    return True


class _Zero3Backward:
    """The hook's ``backward`` under ZeRO-3: a backward that failed on a parameter used outside any
    module's forward (autograd's shape error) is re-raised saying so and how to fix it
    (backends/common/partitioned.py)."""

    stratagem: tuple[str, str]
    zero3 = False

    def backward(self, loss: Any, **kw: Any) -> Any:
        try:
            return super().backward(loss, **kw)  # (Accelerator's, next in the hook class's bases)
        except RuntimeError as e:
            if self.zero3:
                from backends.common.partitioned import explain_use_outside_forward

                model = getattr(self, "_parts", {}).get("model")  # (the DeepSpeedEngine)
                explain_use_outside_forward(e, self.stratagem[0], getattr(model, "module", None))
            raise


def _checked_class(strategy: str, engine: str, builder: Any, grad_clip: float = 0.0) -> type:
    """``Accelerator`` whose ``prepare`` refuses a model the preset's engine did not wrap, whose
    ``clip_grad_norm_`` refuses a max_norm DeepSpeed does not clip at, and which counts the bytes a
    rank holds as train.py's report does (``held_bytes``)."""
    import torch
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    from observers.memory import release_freed

    class StratagemAccelerator(_Zero3Backward, AloneSchedules, Rank0Replica, Accelerator):
        _repaired = False

        def prepare(self, *args: Any, **kw: Any) -> Any:
            out = super().prepare(*args, **kw)
            self._parts = getattr(self, "_parts", {})
            for obj in out if isinstance(out, tuple) else (out,):
                if isinstance(obj, torch.nn.Module) and not is_engine(obj, engine):
                    raise ConfigError(f"strategy={strategy} needs its model wrapped by {engine}, but "
                                      f"prepare() returned {type(obj).__name__} "
                                      f"({self.distributed_type.name}): nothing trains in its place")
                if isinstance(obj, torch.nn.Module) and self._parts.get("model") not in (None, obj):
                    _second_model(strategy, builder)
                if isinstance(obj, (torch.nn.Module, AcceleratedOptimizer)):
                    self._parts["model" if isinstance(obj, torch.nn.Module) else "opt"] = obj
            if len(self._parts) == 2 and not self._repaired:  # (model and optimizer: one call or two)
                self._rank_state = _repair(builder, engine, **self._parts)
                self._repaired = True
                release_freed()  # (the build's one-off buffers, as train.py's loop: observers/memory.py)
            return out

        def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            if engine == "deepspeed" and float(max_norm) != float(grad_clip):
                raise ConfigError(
                    f"clip_grad_norm_(max_norm={max_norm}) under strategy={strategy}: DeepSpeed clips "
                    f"inside its step, at the config's gradient_clipping ({grad_clip or 'off'}), and "
                    f"Accelerate only returns the norm here, so nothing would clip at {max_norm}: build "
                    f"the Accelerator with stratagem_accelerator('{strategy}', grad_clip={max_norm})")
            return super().clip_grad_norm_(parameters, max_norm, norm_type)

        def save_state(self, output_dir: Any = None, *args: Any, **kw: Any) -> Any:
            where = super().save_state(output_dir, *args, **kw)
            _save_rank_state(self, strategy, where)
            return where

        def load_state(self, input_dir: Any = None, *args: Any, **kw: Any) -> Any:
            held: dict[str, Any] = {}
            own = getattr(self, "_rank_state", None)
            check = own is not None and self.register_load_state_pre_hook(  # (before DDP's model loads)
                lambda _models, where: held.update(_read_rank_state(self, strategy, builder.preset, where)))
            try:
                out = super().load_state(input_dir, *args, **kw)
            finally:
                check and check.remove()
            if own is not None:
                own.load_state_dict(held["state"])
            release_freed()  # (the restore's)
            return out

        def get_state_dict(self, model: Any, unwrap: bool = True) -> Any:
            if engine == "fsdp1" and self.device.type == "cpu":
                # Accelerate gathers FSDP1 with offload_to_cpu=True, whose move to the CPU is a
                # no-op on a CPU device: torch then frees the gathered parameters it is about to
                # clone, and rank 0 segfaults (save_model too). torch's own full gather instead,
                # the one train.py's checkpoints use (every rank gets it; Accelerate: rank 0).
                from backends.common.torch import gathered_state_dict

                return gathered_state_dict(model)
            return super().get_state_dict(model, unwrap)

        def held_bytes(self, model: Any, optimizer: Any = None, what: str = "params") -> int:
            """Bytes of ``what`` (params | grads | optimizer) this rank holds (local shards)."""
            opt = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper -> torch's
            if engine == "deepspeed":
                opt = model.optimizer
            return builder.held_bytes(model, [opt] if opt is not None else [], what)

    StratagemAccelerator.stratagem, StratagemAccelerator.stratagem_builder = (strategy, engine), builder
    StratagemAccelerator.zero3 = engine == "deepspeed" and getattr(builder.preset, "stage", 0) == 3
    return StratagemAccelerator


def _second_model(strategy: str, builder: Any) -> None:
    """A second model prepared under a preset whose hook is one model's (the ddp family's comm
    hooks and synchronizers) is refused: it would train plain DDP without a word."""
    if (own := getattr(builder.preset, "unsaved_state", lambda: None)()) is not None:
        raise ConfigError(f"prepare() of a second model under strategy={strategy}: its hook and {own} "
                          "belong to one model and its optimizer, and the other would train without them; "
                          "prepare one model under this preset, or use strategy=ddp for both")


RANK_STATE = "stratagem_rank_state"
"""<save_state's directory>/stratagem_rank_state/rank<r>.pt: what a rank of a ddp-family preset keeps
beyond Accelerate's model and optimizer (rank 0's), as train.py's checkpoints write it."""


def _rank_file(where: Any, rank: int) -> Any:
    from pathlib import Path

    return Path(where) / RANK_STATE / f"rank{rank}.pt"


def _save_rank_state(acc: Any, strategy: str, where: Any) -> None:
    if (own := getattr(acc, "_rank_state", None)) is not None:
        from observers.files import atomic_torch_save

        held = {"strategy": strategy, "world": acc.num_processes, "state": own.state_dict()}
        atomic_torch_save(held, _rank_file(where, acc.process_index))
        acc.wait_for_everyone()  # (every rank's file is there once save_state returns)


def _read_rank_state(acc: Any, strategy: str, preset: Any, where: Any) -> dict[str, Any]:
    """This rank's saved state, once every rank found its own (one ``ConfigError`` on every rank
    otherwise, before anything loads: a rank alone refusing would leave the others waiting)."""
    import torch
    import torch.distributed as dist

    path, problem, held = _rank_file(where, acc.process_index), None, {}
    if path.is_file():
        held = torch.load(path, map_location="cpu", weights_only=False)
        if (held["strategy"], held["world"]) != (strategy, acc.num_processes):
            problem = (f"it was saved by strategy={held['strategy']} on {held['world']} processes, not "
                       f"strategy={strategy} on {acc.num_processes}")
    else:
        problem = f"it has no {RANK_STATE}/rank{acc.process_index}.pt (saved without stratagem_accelerator)"
    problems = [problem] * acc.num_processes
    if dist.is_initialized():
        dist.all_gather_object(problems, problem)
    if (problem := next((p for p in problems if p), None)) is not None:
        raise ConfigError(f"accelerator.load_state({str(where)!r}) under strategy={strategy}: {problem}, "
                          f"so it does not hold {preset.unsaved_state()} and the run would not continue "
                          f"exactly; load a state saved by stratagem_accelerator('{strategy}') on "
                          f"{acc.num_processes} processes, or start again without load_state")
    return held


def _repair(builder: Any, engine: str, model: Any, opt: Any) -> Any:
    """What train.py's loop does around ``prepare`` and each optimizer step (loop.py), for a
    user's loop: the builder's ``repair`` (the ddp family's comm hook -- int8, top-k, PowerSGD,
    local SGD, DiLoCo -- which Accelerate's kwargs cannot name; DeepSpeed's swapper fix), and its
    ``before_step`` / ``after_step`` as hooks on the optimizer's step (local SGD / DiLoCo's
    parameter synchronization), which Accelerate calls only on a step that syncs gradients."""
    raw = opt.optimizer  # (Accelerate's AcceleratedOptimizer -> torch's; DeepSpeed: its ZeRO one)
    builder.repair(model, model.optimizer if engine == "deepspeed" else raw)
    if engine != "deepspeed":  # (a ZeRO optimizer has no step hooks, and nothing to run there)
        raw.register_step_pre_hook(lambda *_: builder.before_step(model))
        raw.register_step_post_hook(lambda *_: builder.after_step(model))
    return getattr(builder, "rank_state", lambda *_: None)(model, raw)  # (what save_state adds: RankState)


def stratagem_accelerator(strategy: str, *overrides: str, wrap: str | int | None = None,
                          precision: str | None = None,
                          gradient_accumulation_steps: int = 1, grad_clip: float = 0.0,
                          timeout: float | None = None, **accelerator_kwargs: Any) -> Any:
    """An ``accelerate.Accelerator`` that runs preset ``strategy`` for real, in the processes
    ``accelerate launch`` (or torchrun) started; see the module docstring. ``overrides``: the
    preset's keys as on train.py's command line and export.py's (``"strategy.sync_every=2"``;
    export.py prints the whole call of an export). ``precision``:
    Accelerate's (no | bf16 | fp16), else the launcher's config's. ``gradient_accumulation_steps``:
    Accelerate's own (the script steps under ``accelerator.accumulate(model)``; a ZeRO preset's
    DeepSpeed config gets it too); the micro batch is the script's DataLoader's ``batch_size``.
    ``grad_clip``: a ZeRO preset's
    ``gradient_clipping`` (DeepSpeed clips inside its step; Accelerate's ``clip_grad_norm_`` only
    returns the norm there, and is refused for any other max_norm); other engines clip where the
    script calls ``clip_grad_norm_``. ``accelerator_kwargs``: the script's other ``Accelerator``
    arguments (``project_dir``, ``project_config``, ``log_with``, ``dataloader_config``, its own
    ``kwargs_handlers``, ...), as it passed them to ``Accelerator()``; those the preset decides
    are refused with the argument to use (``_yours``)."""
    import atexit

    from backends import teardown_at_exit
    from backends.accelerate.state import accelerator
    from observers.memory import allocate_steadily

    allocate_steadily()  # (every rank's steady allocator, as train.py's: observers/memory.py)
    # a script that ends without destroying its process group (no end_training) leaves gloo and
    # the run's garbage to interpreter finalization: SIGABRT at exit, now and then (as a Lightning
    # user's script would: backends/lightning/registry.py registers the same)
    atexit.unregister(teardown_at_exit)
    atexit.register(teardown_at_exit)
    s = settle(strategy, wrap=wrap, precision=precision, accumulation=gradient_accumulation_steps,
               grad_clip=grad_clip, overrides=overrides)
    kwargs, yours, timeout = _yours(strategy, s.kwargs, accelerator_kwargs, timeout)
    cls = _checked_class(strategy, _engine(s.kwargs, s.world), s.builder, grad_clip)
    return accelerator(kwargs, on_cpu=s.on_cpu, world_size=s.world, timeout=timeout, cls=cls,
                       mixed_precision=s.mixed, gradient_accumulation_steps=gradient_accumulation_steps, **yours)


PRESET_DECIDES = {"mixed_precision": "precision=", "gradient_accumulation_steps": None,
                  "gradient_accumulation_plugin": "gradient_accumulation_steps=", "cpu": None,
                  "fsdp_plugin": None, "deepspeed_plugin": None, "deepspeed_plugins": None,
                  "torch_tp_plugin": None, "megatron_lm_plugin": None, "parallelism_config": None}
"""The Accelerator arguments the preset (and the launcher's config) decide -> the hook's own
argument for them, where it has one."""


def _yours(strategy: str, kwargs: dict[str, Any], yours: dict[str, Any], timeout: float | None
           ) -> tuple[dict[str, Any], dict[str, Any], float | None]:
    """The preset's Accelerator kwargs with the script's own arguments: its ``kwargs_handlers``
    beside the preset's (one of a class the preset sets is refused; ``InitProcessGroupKwargs``
    gives its timeout), the rest passed through; a ``ConfigError`` for what the preset decides."""
    if taken := sorted(set(yours) & set(PRESET_DECIDES)):
        fix = {k: PRESET_DECIDES[k] for k in taken if PRESET_DECIDES[k]}
        raise ConfigError(f"stratagem_accelerator('{strategy}', {', '.join(f'{k}=...' for k in taken)}): "
                          f"strategy={strategy} and the launcher's config decide {', '.join(taken)}; leave "
                          f"{'it' if len(taken) == 1 else 'them'} out" +
                          "".join(f" (pass {v} for {k})" for k, v in fix.items()))
    yours = dict(yours)
    handlers = list(yours.pop("kwargs_handlers", None) or [])
    ours = {type(h): h for h in kwargs.get("kwargs_handlers", [])}
    for h in list(handlers):
        if type(h).__name__ == "InitProcessGroupKwargs":  # (the hook builds the process group)
            handlers.remove(h)
            timeout = h.timeout.total_seconds() if timeout is None and h.timeout is not None else timeout
        elif type(h) in ours:
            raise ConfigError(f"kwargs_handlers=[{type(h).__name__}(...)] under strategy={strategy}: the preset "
                              f"sets its own ({ours[type(h)]}); leave it out and set the preset's keys "
                              f"instead, e.g. stratagem_accelerator('{strategy}', "
                              f"'strategy.find_unused_parameters=true') (python train.py strategy={strategy} "
                              "--cfg job lists them)")
    if handlers:
        kwargs = {**kwargs, "kwargs_handlers": [*kwargs.get("kwargs_handlers", []), *handlers]}
    return kwargs, yours, timeout


def _say_unlike_the_export(call: str, builder: Any) -> None:
    """One warning (rank 0's) when the DeepSpeed JSON the launcher's config names is not the config
    ``call`` builds (export.py's ``unlike_the_export``): the hook never reads that file."""
    import logging

    from backends.accelerate.export import unlike_the_export

    told = unlike_the_export(call, builder.preset.deepspeed_json(builder.run))
    if told and os.environ.get("RANK", "0") == "0":
        logging.getLogger(__name__).warning(told)


@dataclass(frozen=True)
class Settled:
    """What the hook decides before any process group: the preset's builder and Accelerate kwargs."""
    builder: Any
    kwargs: dict[str, Any]
    world: int
    on_cpu: bool
    mixed: str


def settle(strategy: str, *, wrap: str | int | None = None, precision: str | None = None,
           accumulation: int = 1, grad_clip: float = 0.0, overrides: tuple[str, ...] = ()) -> Settled:
    """The run ``stratagem_accelerator`` builds, from the launcher's variables and its arguments;
    every refusal that needs no process group (a bad precision, the preset's problems, grad_clip
    outside DeepSpeed, a launcher's config for another engine)."""
    import torch

    from backends.accelerate import families
    from backends.accelerate.state import expected_type
    from core.run import derive
    from strategies.presets import load

    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_WORLD_SIZE", world))
    on_cpu = not torch.cuda.is_available() or env.get("ACCELERATE_USE_CPU", "").lower() == "true"
    mixed = precision or env.get("ACCELERATE_MIXED_PRECISION", "no")
    if mixed not in PRECISIONS:
        raise ConfigError(f"precision={mixed!r}: choose one of {sorted(PRECISIONS)}")
    preset = load(strategy, overrides)
    dp = preset.mesh(max(1, world // local), local).dp
    run = derive(preset, nodes=max(1, world // local), devices=local, accelerator="cpu" if on_cpu else "gpu",
                 precision=PRECISIONS[mixed], global_batch=accumulation * dp, grad_clip=grad_clip)
    if problems := families.problems(preset, run):
        raise ConfigError("; ".join(problems))
    builder = families.builder(preset, run)
    kwargs = builder.kwargs(_wrap(wrap))
    if (plugin := kwargs.get("deepspeed_plugin")) is not None:
        # the script builds its model after the Accelerator: at ZeRO-3 its from_pretrained builds
        # it partitioned (transformers' hook), as Accelerate's zero3_init_flag does
        plugin.zero3_init_flag = plugin.hf_ds_config.is_zero3()
    if grad_clip and "deepspeed_plugin" not in kwargs:
        raise ConfigError(f"grad_clip={grad_clip} is DeepSpeed's gradient_clipping, but strategy={strategy} "
                          f"is not a ZeRO preset: clip in the loop, accelerator.clip_grad_norm_(model.parameters(), "
                          f"{grad_clip}), and leave grad_clip out")
    want, named = expected_type(kwargs, world, on_cpu), _launched_engine()
    if named is not None and named != want:
        raise ConfigError(f"the launcher's config runs {named} ({LAUNCHED[named]}=true), but "
                          f"strategy={strategy} runs {want}: export this preset's config "
                          f"(python export.py strategy={strategy} export=accelerate) or name its preset")
    if "deepspeed_plugin" in kwargs:
        given = [*map(repr, (strategy, *overrides)), *([f"precision={precision!r}"] if precision else []),
                 *([f"grad_clip={grad_clip!r}"] if grad_clip else []),
                 *([f"gradient_accumulation_steps={accumulation}"] if accumulation != 1 else [])]
        _say_unlike_the_export(f"stratagem_accelerator({', '.join(given)})", builder)
    return Settled(builder, kwargs, world, on_cpu, mixed)
