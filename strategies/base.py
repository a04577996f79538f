"""The plugin contract: a strategy family is a typed, engine-neutral config.

A family is a dataclass subclassing ``StrategyConfig``, decorated with ``@family("name")``, in one
module of ``strategies/families/`` (found there; nothing else lists it). Its schema is stored in
Hydra's ConfigStore as ``<name>_schema`` (at the root, so ``--help`` lists only presets), so each
preset YAML in ``conf/strategy/`` starts with ``defaults: [/<name>_schema@_here_, _self_]`` and a
typo in a key fails at compose time (a ``dict`` field holds raw engine keys: open to new ones).
Fields declare their allowed values with ``knob`` (core/knobs.py). The family answers, each in
one method, as data:

- ``mesh(nodes, devices)``: its topology -- the model-parallel degrees and shard group;
- ``problems(run)`` / ``model_problems(model)``: every problem, collected, before launch;
- ``footprint()``: what each rank holds and sends (strategies/footprint.py), which the planner
  prices and the communication profile names groups by;
- ``plan(mesh)``: the parallelism applied to the plain model from outside, as data
  (parallel/parallelize.py applies it, in the fixed order TP -> context parallelism ->
  activation checkpointing -> compile -> FSDP2);
- ``capabilities``: what it can do (LoRA, activation checkpointing, its checkpoint format, the
  degrees a planner may choose for it, a native config, planned only).

No engine is imported here or in any family: each backend owns its builders for the families it
runs (``backends/<engine>/families/<family>.py``), found by the config's class.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from strategies.footprint import Footprint
    from parallel.parallelize import ParallelPlan
    from core.run import Run

from core.errors import ConfigError
from core.knobs import knob
from core.mesh import Axis, Mesh

DCP, DEEPSPEED, ZERO_EP = "dcp", "deepspeed", "zero_ep"
SELECTIVE = "selective"
AC_CHOICES = (False, True, SELECTIVE)
BACKENDS = ("lightning", "accelerate")
"""The backends ``Capabilities.backends`` speaks for; one added later (a new backends/<name>/)
answers for itself, with its own ``problems`` before launch."""


@dataclass(frozen=True)
class Capabilities:
    """What a preset can do, declared by its family: read instead of comparing names."""

    checkpoint: str = DCP
    """How its engine writes model and optimizer: dcp (torch distributed checkpoint: loads into
    any torch preset at any world size) | deepspeed (DeepSpeed's own: same world and backend) |
    zero_ep (zero2_ep's: each rank's ZeRO-2 state, and the full model; checkpoints/state.py)."""
    lora: bool = True
    """Trains frozen base weights beside trainable adapters (per-parameter requires_grad)."""
    activation_checkpointing: bool = True
    selective_checkpointing: bool = True
    """Checkpoints through parallel/parallelize.py's wrapper, so ``strategy.activation_checkpointing=
    selective`` and ``strategy.ac_every`` apply (FSDP1's engines checkpoint their own way)."""
    degrees: tuple[str, ...] = ()
    """Model-parallel degrees its fields set, which a planner may choose (``with_degrees``)."""
    backends: tuple[str, ...] = ("lightning", "accelerate")
    """Which of ``BACKENDS`` run it; the others refuse it before launch with their reason
    (backends/*/families), which the planner reads from here (it imports no backend)."""
    sharded_build: tuple[str, ...] = ()
    """Backends on which a rank's build never holds the whole model (built on the meta device
    and sharded, or partitioned under ``zero.Init``); on the others every rank builds the whole
    fp32 model on the host first, which the planner checks against the node's host memory."""
    native_config: str | None = None
    """A native engine config the preset can be exported as (``deepspeed``: its JSON)."""
    planned_only: bool = False
    """The planner prices it; no backend builds it."""
    cuts_model: bool = False
    """It cuts or replaces modules the model must declare (pipeline stages, sequence-parallel
    norms, the attention core): models that declare none (model=hf) are refused."""
    param_groups: bool = True
    """Its optimizer sees each parameter on its own, so parameters can get their own settings
    (no weight decay for norms, biases and embeddings: trainer.no_decay)."""


@dataclass
class StrategyConfig:
    """Keys every strategy preset has. Families subclass this and add their own."""

    name: str = "?"
    """The preset's name: the YAML file's stem under conf/strategy/. A user's file over a built-in
    preset (``defaults: [fsdp2, _self_]``) keeps the built-in's, which the name-keyed behaviour
    follows; the option chosen names the run (``recipes.job.Job.strategy_option``)."""
    family: str = "?"
    """The plugin that builds this preset (set by the family's schema, not by users)."""
    activation_checkpointing: Any = knob(False, choices=AC_CHOICES, fix=(
        "set strategy.activation_checkpointing to false (store every activation), true (recompute "
        "each block whole) or selective (recompute all but matmuls and attention)"))
    """false | true (full: recompute each transformer block in backward, storing only its input)
    | selective (per op, torchtitan's "op" option: each block keeps its matmul and attention
    outputs and recomputes the cheap element-wise ops and norms). ``Any``: OmegaConf has no
    bool-or-string field; the knob's choices are the check."""
    ac_every: int = knob(1, min=1)
    """Checkpoint every n-th block only (blocks n, 2n, ...: torchtitan's int option), in the mode
    activation_checkpointing names; the others keep all their activations. 1: every block. (A
    pipeline stage counts its own blocks.)"""

    FAMILY: ClassVar[str] = "?"
    CAPABILITIES: ClassVar[Capabilities] = Capabilities()
    SELECTIVE_REFUSED: ClassVar[str] = ""
    """Why ``activation_checkpointing=selective`` cannot run under this family ("": it can)."""

    def __post_init__(self) -> None:
        if self.family == "?":
            self.family = self.FAMILY

    @property
    def capabilities(self) -> Capabilities:
        return self.CAPABILITIES

    def mesh(self, nodes: int, devices: int) -> Mesh:
        """The topology on ``nodes`` x ``devices`` processes: degrees and shard group."""
        return Mesh(nodes, devices)

    def with_degrees(self, **degrees: int) -> StrategyConfig:
        """A copy at other model-parallel degrees (those ``capabilities.degrees`` names)."""
        unknown = set(degrees) - set(self.capabilities.degrees)
        if unknown:
            raise ValueError(f"strategy={self.name} has no degree {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **degrees)

    def preset_value(self, key: str) -> Any:
        """``key`` as this preset's YAML sets it (None when ``name`` is no preset): a value that
        differs was set on the command line, and the preset's own is a fix a refusal can name."""
        from strategies.presets import load, names

        return getattr(load(self.name), key, None) if self.name in names() else None

    def pipeline_microbatches(self) -> int | None:
        """Pipeline micro-batches one engine step is cut into; None without a pipeline."""
        return None

    def pipeline_schedule(self) -> tuple[str, int, list[int] | None]:
        """The pipeline's schedule (parallel.pipeline.SCHEDULES), stages per rank and blocks
        per stage (None: balanced) -- what the planner simulates; a layout that names none runs
        1F1B, one stage a rank (Megatron's default)."""
        return "1f1b", 1, None

    def for_batch(self, global_batch: int, micro_batch: int, dp: int) -> StrategyConfig:
        """This preset with what it derives from the trainer's batch filled in (a pipeline's
        micro-batch count); itself when it derives nothing."""
        return self

    def for_model(self, hidden: int) -> StrategyConfig:
        """This preset with what it derives from the model's hidden size filled in (DeepSpeed's
        "auto" bucket sizes); itself when it derives nothing."""
        return self

    def underived(self) -> bool:
        """``for_batch`` found nothing the batch allows (the preset's problems say why)."""
        return False

    def chunks(self) -> int:
        """Micro-batches one engine step's batch is cut into inside the strategy; the data
        loader serves trainer.micro_batch_size x this."""
        return self.pipeline_microbatches() or 1

    def problems(self, run: Run) -> list[str]:
        """Every problem with this preset on this run, as sentences naming key, value and fix."""
        return []

    def notes(self, run: Run) -> list[str]:
        """What a user should know of this preset on this run, which is no problem (it runs as
        asked): one line each, in plan.py's notes and train.py's log."""
        return []

    def launch_problems(self, run: Run) -> list[str]:
        """Problems of this preset with the machine that runs it (a directory, a system
        library): checked at launch by train.py, never when planning (plan.py plans a cluster
        from anywhere)."""
        return []

    def identity_problems(self, preset: str | None = None, option: str | None = None) -> list[str]:
        """``family`` and ``name`` set over what the preset's schema and file make them (train.py's
        command line, a hook's overrides): one line each. The plan line, the report and a hook's
        call read ``name`` as the preset. ``preset``: the name its file gives it, where the caller
        knows it (``presets.load``: the hooks; validation, from the option Hydra recorded, which
        ``option`` names where it is a user's file over a built-in preset); a config composed
        without that record refuses a name that is a built-in preset of another family (a ddp
        run whose plan line said zero3)."""
        from strategies.presets import AUTO, preset_family

        out = []
        if self.family != self.FAMILY:
            out.append(f"strategy.family={self.family!r}: set by the preset's schema ({self.FAMILY}), not a "
                       "knob; remove the override")
        other = preset_family(self.name) if preset is None else None
        if preset is not None and self.name != preset:
            why = f"strategy={option or preset}"
        elif other is not None and other != self.FAMILY:
            why = (f"{AUTO} asks the planner to choose; this one is a {self.FAMILY} preset" if self.name == AUTO
                   else f"{self.name} is a preset of the {other} family, this one of {self.FAMILY}")
        else:
            return out
        return [*out, f"strategy.name={self.name!r}: set by the preset's file ({why}), not a knob; remove the "
                      "override"]

    def value_problems(self) -> list[str]:
        """Values no knob declares a range for (raw engine JSON) that are wrong whatever the run:
        checked at compose with the knobs' own ranges (plan.py and train.py alike)."""
        return []

    def checkpointing_problems(self, model: Any = None) -> list[str]:
        """``activation_checkpointing`` with ``ac_every``, this family and the model's depth
        (after the knobs' own checks pass)."""
        ac, out = self.activation_checkpointing, []
        if not isinstance(ac, bool) and ac != SELECTIVE:  # (1 and 0 pass the knob: 1 == True)
            return [f"strategy.activation_checkpointing={ac!r}: not one of false, true, selective; "
                    "set strategy.activation_checkpointing=true (or false, selective)"]
        n = getattr(model, "n_layers", None)
        if ac is not False and isinstance(n, int) and self.ac_every > n:
            out.append(f"strategy.ac_every={self.ac_every} > model.n_layers={n}: no block would "
                       f"be checkpointed; set strategy.ac_every to 1..{n}")
        if self.ac_every != 1 and ac is False:
            out.append(f"strategy.ac_every={self.ac_every} with strategy.activation_checkpointing="
                       "false: there is nothing to thin out; set strategy.activation_checkpointing="
                       "true or selective, or strategy.ac_every=1")
        if (ac == SELECTIVE or self.ac_every != 1) and not self.capabilities.selective_checkpointing:
            what = ("strategy.activation_checkpointing=selective" if ac == SELECTIVE
                    else f"strategy.ac_every={self.ac_every}")
            out.append(f"{what} with strategy={self.name}: FSDP1's engines checkpoint every block "
                       "their own way (allowed here: activation_checkpointing=false or true with "
                       "ac_every=1); use strategy=fsdp2, or activation_checkpointing=true")
        if ac == SELECTIVE and self.SELECTIVE_REFUSED:
            out.append(f"strategy.activation_checkpointing=selective with strategy={self.name}: "
                       f"{self.SELECTIVE_REFUSED}; use strategy.activation_checkpointing=true "
                       "(with strategy.ac_every to checkpoint fewer blocks)")
        return out

    def model_problems(self, model: Any) -> list[str]:
        """Problems of this preset with the model's shape (``recipes.config.ModelConfig``)."""
        if getattr(model, "is_moe", False) and {"tp", "pp"} & set(self.capabilities.degrees) and (
                getattr(self, "tp", 1) > 1 or getattr(self, "pp", 1) > 1):
            return [f"strategy={self.name} with a mixture-of-experts model (model.n_experts="
                    f"{model.n_experts}): tensor and pipeline parallelism are not built for MoE "
                    "blocks (their tp_plan / pp_plan name a dense MLP); use strategy=fsdp_ep "
                    "(expert parallelism) or a data-parallel preset"]
        if self.capabilities.cuts_model and getattr(model, "is_hf", False):
            if getattr(self, "sequence_parallel", False) and getattr(self, "pp", 1) <= 1 and getattr(
                    self, "cp", 1) <= 1:  # only the sequence-parallel norms stand in the way
                return [f"strategy.sequence_parallel=true with strategy={self.name} and model=hf: it "
                        "replaces the norms the built-in GPT declares, which a Hugging Face model does "
                        "not; set strategy.sequence_parallel=false"]
            return [f"strategy={self.name} with model=hf: it cuts or replaces modules the "
                    "built-in GPT declares (pipeline stages, sequence-parallel norms, the attention core); model=hf "
                    "trains with the data-parallel presets and tensor parallelism (strategy=tp, "
                    "fsdp_tp with strategy.sequence_parallel=false), or use a built-in model"]
        return []

    def footprint(self) -> Footprint:
        """What each rank holds and sends (the planner's input)."""
        from strategies.footprint import Footprint

        return Footprint()

    def traffic_warmup(self) -> tuple[int, str]:
        """Optimizer steps this preset runs before its traffic is the steady state the planner
        prices, and the key that sets them ((0, ""): the steady state from the first step)."""
        return 0, ""

    def traffic_period(self) -> tuple[int, str]:
        """Optimizer steps this preset's steady traffic repeats over, which the planner spreads
        evenly over them, and the key that sets them ((1, ""): every step sends the same)."""
        return 1, ""

    def low_precision_weights(self, mesh: Mesh) -> bool:
        """Under a mixed precision, forward and backward run on 16-bit weights (the activation
        calibration's ``bf16`` regime, not autocast over fp32 weights): an engine keeping an
        fp32 master copy beside 16-bit working weights (DeepSpeed), or FSDP gathering its
        shards in its MixedPrecision ``param_dtype``."""
        from strategies.footprint import SHARDED

        fp = self.footprint()
        return fp.master_weights or fp.params == SHARDED

    def plan(self, mesh: Mesh) -> ParallelPlan:
        """The parallelism applied to the plain model from outside, as data. The default only
        checkpoints blocks; engines that wrap the model themselves (DDP, FSDP1, DeepSpeed) wrap
        after it."""
        from parallel.parallelize import ParallelPlan

        return ParallelPlan(activation_checkpointing=self.activation_checkpointing, ac_every=self.ac_every)

    def world_role(self, mesh: Mesh) -> str:
        """What the whole-world process group carries (the communication profile's group
        names): data-shard when it shards, else data-replicate."""
        return (Axis.SHARD if self.footprint().sharded else Axis.REPLICATE).role


_FAMILIES: dict[str, type[StrategyConfig]] = {}


def family(name: str):
    """Class decorator: register a strategy family under ``name`` and store its schema in Hydra."""

    def register(cls: type[StrategyConfig]) -> type[StrategyConfig]:
        if name in _FAMILIES and _FAMILIES[name] is not cls:
            raise ValueError(f"strategy family {name!r} is registered twice "
                             f"({_FAMILIES[name].__module__} and {cls.__module__}); rename one")
        cls.FAMILY = name
        _FAMILIES[name] = cls
        from hydra.core.config_store import ConfigStore
        from omegaconf import OmegaConf

        node = OmegaConf.structured(cls(family=name))
        for f in dataclasses.fields(cls):  # a raw mapping (ZeRO's deepspeed_config): its keys are the
            if str(f.type).startswith("dict"):  # engine's, set as strategy.<field>.<key>=v (no + needed)
                OmegaConf.set_struct(node[f.name], False)
        ConfigStore.instance().store(name=f"{name}_schema", node=node)
        return cls

    return register


def families() -> dict[str, type[StrategyConfig]]:
    return dict(_FAMILIES)


def family_of(name: str) -> type[StrategyConfig]:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"strategy.family={name!r} is unknown; known families: "
                       f"{', '.join(sorted(_FAMILIES))}") from None


def as_config(node: Any) -> StrategyConfig:
    """Turn a composed ``cfg.strategy`` node into its family's dataclass (plain Python values)."""
    from omegaconf import OmegaConf

    if isinstance(node, StrategyConfig):
        return node
    obj = OmegaConf.to_object(node) if OmegaConf.is_config(node) else node
    if isinstance(obj, StrategyConfig):
        return obj
    if problem := _untyped_problem(obj):
        raise ConfigError(problem)
    return _FAMILIES[obj["family"]](**obj)


def _untyped_problem(obj: Any) -> str | None:
    """A preset written without its family's schema in its defaults list (a user's YAML: Hydra
    checked nothing) that names no family, an unknown one, or a key its family lacks: the one line
    naming the option, the key, what is allowed and the fix; None when it makes a config."""
    from core.errors import closest

    if not isinstance(obj, dict):
        return f"strategy: {obj!r} is not a preset (a mapping of its keys); choose one, e.g. strategy=zero3"
    known = ", ".join(sorted(_FAMILIES))
    where = f"strategy={obj['name']}" if obj.get("name") else "strategy"
    start = ("start the file from a built-in preset (`defaults: [zero3, _self_]`, then only the keys "
             "you change) or from a family's schema (`defaults: [/deepspeed_schema@_here_, _self_]`)")
    if "family" not in obj:
        return f"{where}: the preset names no strategy.family (the families: {known}); {start}"
    if obj["family"] not in _FAMILIES:
        return f"{where}: strategy.family={obj['family']!r} is no family; the families: {known}; {start}"
    cls = _FAMILIES[obj["family"]]
    keys = {f.name for f in dataclasses.fields(cls)}
    for key in sorted(set(obj) - keys):
        close = closest(str(key), sorted(keys))
        guess = f"did you mean {close}? " if close else f"the keys: {', '.join(sorted(keys))}; "
        return (f"{where}: strategy.{key}={obj[key]!r} is not a key of the {obj['family']} family; {guess}"
                f"fix the file (`defaults: [/{obj['family']}_schema@_here_, _self_]` first in it has "
                "Hydra check every key and type)")
    return None


__all__ = ["Capabilities", "DCP", "DEEPSPEED", "ZERO_EP", "StrategyConfig", "as_config", "families", "family",
           "family_of"]
