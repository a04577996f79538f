"""What every Lightning builder shares: a strategy that carries its preset and takes everything else
from Lightning at setup.

One strategy, whichever way it is reached: a family's builder (``families/<family>.py``) is a
Lightning ``Strategy`` subclass with ``PresetStrategy`` first in its bases. Built by train.py
(``of(preset, run)``) it keeps the run's facts it is given; reached through Lightning's registry
(``Trainer(strategy="<preset>")``) it learns nodes and devices from the Trainer and precision
from its precision plugin, and derives the facts once with the same ``strategies.derive``
train.py uses -- so both build the same object, and both check the preset's problems against
the world Lightning runs (``check``).
"""

from __future__ import annotations

from dataclasses import asdict
import types
from typing import Any

from backends.common import torch as torch_common
from core.precision import from_lightning
from core import knobs
from strategies import ConfigError, StrategyConfig
from core.run import Run, derive


class PresetStrategy:
    """Mixin for a Lightning strategy built from a preset: put it first in the bases."""

    preset: StrategyConfig
    _run: Run | None = None
    """The run's facts: given by train.py (``of``), or derived once from Lightning's world."""

    @classmethod
    def of(cls, preset: StrategyConfig, run: Run | None = None) -> Any:
        """The strategy for ``preset``; ``run``: the run's facts when the caller knows them
        (train.py), kept as they are (and for engines that fix their device when first
        imported: DeepSpeed)."""
        return cls(preset).keep(run)

    def keep(self, run: Run | None) -> Any:
        """This strategy, holding ``run`` as its run's facts (None: derive them from Lightning)."""
        self._run = run
        return self

    def run(self) -> Run:
        """The run's facts: those train.py gave (``of``), or -- reached through Lightning's
        registry -- derived from the world Lightning set up (nodes x processes per node, its
        accelerator and precision plugin; no ``trainer.compile``: a user's script compiles
        itself if it wants to), once that world is known (an accelerator attached)."""
        if self._run is not None:
            return self._run
        from lightning.pytorch.accelerators import CPUAccelerator

        on_cpu = self.accelerator is None or isinstance(self.accelerator, CPUAccelerator)
        flag = str(getattr(self.precision_plugin, "precision", "32-true"))
        run = derive(self.preset, nodes=getattr(self, "num_nodes", 1) or 1,
                     devices=getattr(self, "num_processes", 1) or 1,
                     accelerator="cpu" if on_cpu else "gpu", precision=from_lightning(flag))
        if self.accelerator is not None:
            self._run = run
        return run

    def check(self) -> None:
        """The preset's problems on the world Lightning runs: the same sentences train.py
        prints before launch, raised here for a strategy reached through the registry."""
        run = self.run()
        problems = (knobs.problems(self.preset, "strategy") + run.mesh.problems()
                    or self.preset.problems(run))
        if problems:
            raise ConfigError(problems)
        if _built(self.lightning_module):
            self.check_model()

    def check_model(self) -> None:
        """What the preset needs the user's model to declare (``tp_plan``, ``attention_core``,
        ...; ``parallel.parallelize.undeclared``), refused before any process group, collective
        or op build: from ``check`` when the module built its layers in ``__init__``, else at
        the start of ``setup`` (after ``configure_model``) by the families that need it."""
        from parallel.parallelize import undeclared

        problems = undeclared(self.lightning_module, self.preset)
        if problems:
            raise ConfigError(problems)

    def begin(self) -> None:
        """What every rank does first in ``setup_environment`` (a family that replaces Lightning's
        calls it too): glibc's steady allocator, which train.py's ranks get in ``backends.run``
        and a user's own script gets here (``observers.memory.allocate_steadily``), then ``check``;
        then every process group made after the default one waits as long as it for a lost peer
        (``backends.common.torch.bound_new_groups``: DeepSpeed's and DeviceMesh's groups)."""
        from observers.memory import allocate_steadily

        allocate_steadily()
        self.check()
        timeout = getattr(self, "_timeout", None)  # (the default group's: cluster.collective_timeout)
        torch_common.bound_new_groups(None if timeout is None else timeout.total_seconds())

    def setup_environment(self) -> None:
        self.begin()
        super().setup_environment()

    def on_train_start(self) -> None:
        """Training starts: the build and a checkpoint's restore are done (Lightning calls this
        after every callback's ``on_fit_start`` and ``on_train_start``), so what they freed for
        good goes back to the kernel now, once (``observers.memory.release_freed``)."""
        from observers.memory import release_freed

        release_freed()
        super().on_train_start()

    def describe(self) -> dict[str, Any]:
        """What this strategy applies, as plain data (logged once; compared in tests)."""
        return {"class": type(self).__name__, "preset": asdict(self.preset),
                **{k: stable(v) for k, v in self.engine_settings().items()}}

    def engine_settings(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ the step
    _grad_norm: Any = None

    def clip_grad_norm(self, optimizer: Any, max_norm: float) -> None:
        """Measure the global gradient norm, then clip to ``max_norm`` (> 0), from the module's
        ``configure_gradient_clipping``: over the optimizer's parameters as the engine holds them
        (a family whose gradients are sharded or staged overrides it)."""
        from parallel.clip import clip_global_

        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._grad_norm = clip_global_(params, max_norm)

    def grad_norm(self) -> float | None:
        """The last optimizer step's global gradient norm, before clipping."""
        return None if self._grad_norm is None else float(self._grad_norm)

    # ------------------------------------------------------------------ measurement and export
    def held_bytes(self, what: str) -> int:
        """Bytes of params | grads | optimizer this rank holds right now (local shards)."""
        return torch_common.held_bytes(self.model, list(self.optimizers), what)

    def full_state_dict(self, prefix: str = "") -> dict[str, Any]:
        """The full parameters, fp32 on CPU, keyed as the plain model; every rank calls it
        after fit (gathering may be collective)."""
        return torch_common.full_state_dict(self.model, prefix)


def _built(module: Any) -> bool:
    """The module's layers exist: it has parameters, or builds none in ``configure_model``."""
    if module is None:
        return False
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return next(module.parameters(), None) is not None or not is_overridden("configure_model", module)


def stable(value: Any) -> Any:
    """``value`` as plain data that reads the same in every process: wrap policies by the module
    classes they wrap, other objects by their repr without memory addresses."""
    import re

    if isinstance(value, dict):
        return {str(k): stable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [stable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    classes = getattr(value, "_module_classes", None)  # torch's ModuleWrapPolicy
    if classes is not None:
        return f"{type(value).__name__}({', '.join(sorted(c.__name__ for c in classes))})"
    return re.sub(r" object at 0x[0-9a-f]+", "", repr(value))


def set_timeout(strategy: Any, seconds: float) -> None:
    """How long the strategy's process group lets a collective wait for a lost peer
    (``cluster.collective_timeout``). Lightning's strategies take ``timeout`` only at construction,
    which for our presets happens before the cluster is known (the registry path), so it is set
    here, on the attribute their ``setup_distributed`` hands to ``init_process_group`` (DDP, FSDP,
    ModelParallel) and ``deepspeed.init_distributed``. A strategy without a process group
    (single device) has no such attribute and is left alone."""
    from datetime import timedelta

    if hasattr(strategy, "_timeout"):
        strategy._timeout = timedelta(seconds=seconds)


def sharded(module: Any) -> bool:
    """The module (or one of its submodules) went through ``fully_shard`` -- ours in an earlier
    trainer call, or the user's own ``configure_model`` -- or holds DTensors (the user's TP). Not
    "its parameters are DTensors": after an evaluation's forward FSDP2 leaves the root unsharded,
    plain tensors, and a second ``fully_shard`` is an error (fit, test, test)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return (any(isinstance(m, FSDPModule) for m in module.modules())
            or any(isinstance(p, DTensor) for p in module.parameters()))


def _sharded_by_the_strategy(self: Any) -> None:
    """Stands for ``configure_model`` on a module that has none: the preset's strategy sharded it."""


def sharded_here(module: Any) -> None:
    """Lightning's ModelParallelStrategy refuses a module that does not override
    ``configure_model`` ("apply parallelization there"): it expects the module to shard itself.
    Ours shards it in ``setup``, so a module written for DDP (Lightning's own examples) has
    nothing to apply: it gets a no-op ``configure_model`` of its own, which Lightning sees as
    overridden (docs/ARCHITECTURE.md, the Lightning workarounds)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("configure_model", module):
        module.configure_model = types.MethodType(_sharded_by_the_strategy, module)
