"""Validate a composed config into a ``Job``: every problem collected into one ``ConfigError``,
before any process starts. Downstream code holds the Job's typed objects, never raw strings.

Three depths: ``CONFIG`` checks what the config says (every field's declared range, the model's
shape) and imports nothing heavy (plan.py); ``RUN`` also checks the run it describes: the mesh
and batch arithmetic and the preset on that world, on the configured accelerator (export.py);
``LAUNCH`` (train.py) also checks this machine: cores, GPUs, ``auto`` resolved (imports torch).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from recipes import dpo_checks, float8_checks, mixture, packing, samples, stopping
from recipes.cluster_config import ClusterConfig, implied_note, implied_problems
from recipes.compose import register, unreadable
from recipes.job_checks import (logger_problems, lora_problems, loss_chunk_problems, save_hf_problems,
                                trainer_problems, wandb_online_problems)
from recipes.config import (GROUP_SCHEMAS, CallbacksConfig, ExportConfig, LoggerConfig, PathsConfig,
                            PlannerConfig, TrainConfig)
from recipes.model_config import ModelConfig
from recipes.trainer_config import DataConfig, ObjectiveConfig, TrainerConfig
from core import knobs
from strategies import ConfigError, Run, StrategyConfig, as_config
from recipes.origin import Origin, identity_problems, named, warn
from strategies.presets import AUTO
from core.run import settle

@dataclass(frozen=True)
class Job:
    """The validated run, as typed objects: after ``validate`` the only thing that flows (the
    planner, the launchers, the backends, export.py and launch.py read these fields)."""

    cfg: DictConfig
    """The composed config, as given: what the report stores (resolved, ``meta``); nothing
    downstream reads it."""
    model: ModelConfig
    trainer: TrainerConfig
    data: DataConfig
    cluster: ClusterConfig
    callbacks: CallbacksConfig
    logger: LoggerConfig | None
    strategy: StrategyConfig
    """The preset as it runs: ``preset`` with what it derives from the batch and the model
    filled in (``core.run.settle``)."""
    run: Run
    """The run's facts (mesh, batch, precision, checkpoint format), derived once, with
    ``strategy``."""
    backend: str
    preset: StrategyConfig
    """The preset as composed, or as ``strategy=auto`` chose it: what the planner prices
    (DeepSpeed's "auto" sizes still "auto", so the plan says how they are filled)."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    objective: ObjectiveConfig | None = None
    """What the loss trains (objective=lm | dpo); None: a config without the group (lm)."""
    export: ExportConfig | None = None
    """export.py's group (``export=null``: None)."""
    paths: PathsConfig | None = None
    """The run's root and output directories; None outside a Hydra run (a composed config in a
    test, plan.py), where they cannot be resolved."""
    auto: str | None = None
    """Why ``strategy=auto`` chose ``preset`` (the planner's reason); None when the config
    named the preset."""
    sweep: str | None = None
    """The Hydra sweep this job belongs to (its directory), None for a single run."""
    name: str | None = None
    """The job's command-line overrides as Hydra joins them (``hydra.job.override_dirname``:
    ``strategy=ddp,trainer.max_steps=50``), None without any: what tells a sweep's jobs apart
    (the W&B run's name)."""
    layout_problems: Callable[[StrategyConfig, Run], list[str]] | None = field(
        default=None, repr=False, compare=False)
    """What the job asks of any preset beyond its own checks (LoRA, packing, DPO, samples): the
    planner asks it of every preset it ranks, so it never recommends one validation refuses."""
    options: dict[str, str | None] = field(default_factory=dict)
    """Group -> the option Hydra composed it from (``recipes.origin.Origin.choices``): a file of
    conf/ or of the user's own config directory; empty where no composition recorded one."""

    @property
    def strategy_option(self) -> str:
        """The strategy option that trains: the file chosen (``strategy=my_fsdp``, whose ``name`` is
        the built-in ``fsdp2`` it derives from); ``strategy=auto``'s pick; the preset's name where
        no composition recorded the choice."""
        option = self.options.get("strategy")
        return self.strategy.name if option in (None, AUTO) or self.auto is not None else option

    @property
    def label(self) -> str:
        """The preset as the plan line and the log name it (``strategies.presets.label``)."""
        from strategies.presets import label

        return label(self.preset, self.strategy_option)

    def option(self, group: str) -> str | None:
        """The option ``group`` was composed from; without a record, the group's ``name``."""
        if group in self.options:
            return self.options[group]
        return getattr(getattr(self, group, None), "name", None)

    @property
    def chosen_by(self) -> str | None:
        """``strategy=auto``'s choice in a sentence (logged, and the report's ``chosen_by``)."""
        return None if self.auto is None else f"strategy=auto chose {self.preset.name}: {self.auto}"

    @property
    def implied(self) -> list[str]:
        """The trainer values the cluster implied (``cluster.trainer``), none of the user's set:
        a note the plan and the dry run print ([] when none)."""
        return [note] if (note := implied_note(self.cfg)) else []

    @property
    def mesh(self):
        return self.run.mesh

    @property
    def batch(self):
        return self.run.batch

    @property
    def tokens_per_step(self) -> int:
        return self.batch.global_size * self.model.seq_len

    def meta(self) -> dict[str, Any]:
        """The report's identifying keys."""
        return {"strategy": self.strategy.name, "strategy_option": self.strategy_option,
                "model_option": self.option("model"), "cluster_option": self.option("cluster"),
                "experiment_option": self.option("experiment"), "backend": self.backend, "world_size": self.mesh.size,
                "global_batch_size": self.batch.global_size, "micro_batch_size": self.batch.micro_size,
                "accumulation": self.batch.accumulation, "config": self.config()}

    def config(self) -> dict[str, Any]:
        """The composed config as plain data, interpolations resolved, with the preset
        ``strategy=auto`` chose in place of ``auto``."""
        out = _resolved(self.cfg)
        if self.auto is not None:
            out["strategy"] = OmegaConf.to_container(OmegaConf.structured(self.preset), resolve=True)
        return out


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain data, interpolations resolved (outside a Hydra run -- a composed
    config in a test -- Hydra's own ``${hydra:...}`` paths stay as written)."""
    from omegaconf.errors import InterpolationResolutionError

    register()  # (a rank handed the Job resolves it: ${launched:...})
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError:
        return OmegaConf.to_container(cfg, resolve=False)


def resolve_accelerator(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def _device_problems(accelerator: str, world: Any, oversubscribe: bool) -> list[str]:
    if accelerator == "gpu":
        import torch

        have = torch.cuda.device_count()
        if have == 0:
            return ["cluster.accelerator=gpu but no CUDA device is visible: "
                    "use cluster.accelerator=cpu (gloo) or auto"]
        if world.devices > have:
            return [f"cluster.devices={world.devices} but this node has {have} GPU(s): "
                    f"set cluster.devices<={have}"]
        return []
    have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if world.devices > have and not oversubscribe:
        return [f"cluster.devices={world.devices} CPU processes but this machine has {have} core(s) "
                f"available: set cluster.devices<={have}, or cluster.oversubscribe=true to run "
                "more processes than cores (slower, but correct)"]
    return []


def _objects(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Each group as its schema's dataclass, and each group's problems with its declared fields;
    a group every run needs switched off is a ConfigError at once."""
    if off := switched_off(cfg):
        raise ConfigError(off)
    register()  # the resolvers its interpolations name (a config not composed here: a sweep job's)
    objs, problems = {}, {}
    for group, schema in GROUP_SCHEMAS.items():
        node = cfg.get(group)
        if node is None:
            objs[group] = None
            continue
        problems[group] = _unknown_keys(node, schema, group)
        try:
            obj = OmegaConf.to_object(node)
        except Exception as e:  # noqa: BLE001  (a missing mandatory value, say)
            problems[group].append(f"{group}: {unreadable(e)}")
            continue
        if not isinstance(obj, schema):
            obj = schema(**obj)
        objs[group] = obj
        problems[group] += knobs.problems(obj, group)
    problems["trainer"] = implied_problems(problems.get("trainer", []), cfg)  # (the cluster's value)
    path = OmegaConf.select(cfg, "model.path", default=None)  # (the tokenizer's default: said once)
    if path and any("model.path=" in p for p in problems.get("model", [])):
        problems["data"] = [p for p in problems.get("data", []) if not p.startswith(f"data.tokenizer={path!r}")]
    return objs, problems


def _unknown_keys(node: Any, schema: type, prefix: str) -> list[str]:
    """Keys added with ``+group.key=value`` (or ``+group.sub.key=value`` under a nested group such
    as trainer.early_stopping or model.lora), which the schema does not have: one line each, with
    the closest key when one is close, and the fix."""
    import typing
    from dataclasses import is_dataclass

    from core.errors import closest

    known = sorted(f.name for f in fields(schema))
    out = []
    for k in sorted(set(node) - set(known)):
        if close := closest(k, known):
            out.append(f"{prefix}.{k}: not a key of {prefix}; did you mean {prefix}.{close}? "
                       f"remove +{prefix}.{k}={_as_override(node, k)} and write "
                       f"{prefix}.{close}={_as_override(node, k)}")
        else:
            out.append(f"{prefix}.{k}: not a key of {prefix} (known: {', '.join(known)}); "
                       f"remove +{prefix}.{k}={_as_override(node, k)}")
    try:
        hints = typing.get_type_hints(schema)
    except Exception:  # noqa: BLE001  (a schema annotated with names only a type checker sees)
        hints = {}
    for f in fields(schema):
        hint = hints.get(f.name)
        sub = next((t for t in (hint, *typing.get_args(hint)) if is_dataclass(t)), None)
        if sub is not None and isinstance(node.get(f.name), DictConfig):
            out += _unknown_keys(node[f.name], sub, f"{prefix}.{f.name}")
    return out


def _as_override(node: Any, key: str) -> str:
    """``node[key]`` as a command line writes it (a container: ``...``)."""
    value = OmegaConf.select(node, key, throw_on_resolution_failure=False)
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value) if isinstance(value, (int, float, str)) else "..."


def data_problems(data: DataConfig, model: ModelConfig | None) -> list[str]:
    """What the data keys name, read cheaply (recipes/tokens.py's ``data_problems``): the inputs
    (a file, directory, glob or save_to_disk directory), the record fields, the tokenizer's EOS,
    vocabulary and chat template, the largest id of pre-tokenized shards (cached per shard)."""
    from recipes.tokens import data_problems as problems

    if data.name == "preference":
        from recipes.dpo_checks import data_problems as pair_problems

        return pair_problems(data, model)
    return problems(data, model)


def _data_checks(objs: dict[str, Any], bad: dict[str, list[str]]) -> list[str]:
    """``data_problems`` of the one source; or each ``data.mixture`` source completed from its
    group's defaults and checked (recipes/mixture.py ``settle``, which replaces ``objs["data"]``)."""
    if bad["data"]:
        return []
    model = None if bad["model"] else objs["model"]
    if not objs["data"].mixture:
        return data_problems(objs["data"], model)
    objs["data"], out = mixture.settle(objs["data"], model)
    return out


CONFIG, RUN, LAUNCH = 0, 1, 2


def _paths(cfg: DictConfig) -> PathsConfig | None:
    """``cfg.paths`` as its dataclass; None where Hydra's ``${hydra:...}`` cannot be resolved
    (outside a Hydra run)."""
    node = cfg.get("paths")
    if node is None:
        return None
    try:
        obj = OmegaConf.to_object(node)
    except Exception:  # noqa: BLE001  (InterpolationResolutionError outside a Hydra run)
        return None
    return obj if isinstance(obj, PathsConfig) else PathsConfig(**obj)


def switched_off(cfg: DictConfig) -> list[str]:
    """A group every run needs switched off (``~data``, ``callbacks=null``; Hydra composes them,
    leaving the schema's ``???``): the line ``~model`` gets at compose time, one per group."""
    from core.conf import CONF_DIR
    from recipes.cli_help import _malformed

    needed = [f.name for f in fields(TrainConfig) if f.default == "???" and f.name != "paths"]
    return [_malformed(f"~{g}", [CONF_DIR]) or f"{g}=null: {g} cannot be switched off; choose one of its options"
            for g in needed if OmegaConf.is_missing(cfg, g) or cfg.get(g) is None]


def _strategy(cfg: DictConfig, bad: dict[str, list[str]]) -> StrategyConfig:
    """``cfg.strategy`` as its family's dataclass; a user's preset without its family's schema
    (``as_config``'s ConfigError) is refused with the groups' problems found so far."""
    try:
        return as_config(cfg.strategy)
    except ConfigError as e:
        raise ConfigError([p for group in bad.values() for p in group] + e.problems) from None


def _root_problems(cfg: DictConfig, origin: Origin | None) -> list[str]:
    """Keys the root schema does not have (``+key=value`` adds them), and a user's file that a
    built-in option hides where that option is the one composed (``Origin.problems``; where it is
    not, a warning, logged here)."""
    known = [f.name for f in fields(TrainConfig)]
    out = [f"{k}: not a config key (known: {', '.join(known)}); remove +{k}=..." for k in sorted(set(cfg) - set(known))]
    warn(origin)
    return out + (origin.problems() if origin is not None else [])


Choose = Callable[[Job], "tuple[StrategyConfig, str]"]
"""``strategy=auto``'s step (``planner.choose``): the preset for a Job's typed groups, and why."""


def _strategy_problems(cfg: DictConfig, strategy: StrategyConfig, model: Any, depth: int,
                       origin: Origin | None) -> list[str]:
    """The strategy group's own problems: unknown keys, knob ranges, its values, its
    checkpointing against the model (when readable), an overridden family or name."""
    out = (_unknown_keys(cfg.strategy, type(strategy), "strategy")
           + knobs.problems(strategy, "strategy", launch=depth >= LAUNCH) + strategy.value_problems())
    if not out:
        out += strategy.checkpointing_problems(model)
    return out + identity_problems(strategy, origin)  # (the hooks' presets.load says the same)


def validate(cfg: DictConfig, *, depth: int = LAUNCH, extra: Iterable[Callable[[Job], list[str]]] = (),
             auto: Choose | None = None, origin: Origin | None = None) -> Job:
    """Check everything that can be checked before a process starts; raise one ConfigError
    listing every problem. A check that divides by a field runs only when that field is valid
    (a zero n_heads is reported once, not again as a division by zero). ``extra``: more checks
    of the built Job (the chosen backend's, from train.py). ``auto``: how ``strategy=auto``
    chooses (``planner.choose``), a step over the typed groups: the chosen preset is then checked
    and derived as if the config had named it. Without it (or with a group the planner reads
    unreadable) ``auto`` stays a placeholder preset. ``origin``: what Hydra recorded of the
    composition (``recipes.origin``), which the Job is named by and checks (``_root_problems``)."""
    cfg, aliased = stopping.gradient_checkpointing(cfg)  # (one switch: the strategy's key)
    objs, bad = _objects(cfg)
    bad["trainer"] = bad.get("trainer", []) + aliased
    bad["root"] = _root_problems(cfg, origin)
    strategy = named(_strategy(cfg, bad), origin)
    bad["strategy"] = _strategy_problems(cfg, strategy, None if bad.get("model") else objs.get("model"), depth,
                                         origin)
    problems = [p for group in bad.values() for p in group]
    if any(g not in objs or objs[g] is None for g in ("model", "trainer", "cluster", "data")):
        raise ConfigError(problems)  # a group could not even be read
    model, t, c = objs["model"], objs["trainer"], objs["cluster"]
    shape = [] if bad["model"] else model.problems()
    if not bad["model"]:
        problems += shape
        if objs["data"].name == "text" and not objs["data"].tokenized and model.vocab_size < 256 \
                and not objs["data"].mixture:  # (a mixture's byte text: recipes/mixture.py)
            problems.append(f"model.vocab_size={model.vocab_size}: byte tokens of data=text need "
                            ">= 256; set model.vocab_size=256 or use data=synthetic")
    preset, why = strategy, None
    if (strategy.name == AUTO and auto is not None and not shape
            and not any(bad.get(g) for g in ("model", "trainer", "cluster", "planner", "strategy"))):
        # (the planner derives each candidate's run itself: this one is the placeholder's)
        preset, why = auto(_job(cfg, objs, bad, strategy, *settle(strategy, c, t, accelerator="cpu")))
    strategy = preset
    problems += logger_problems(objs["logger"]) + _unread_problems(objs, bad)
    if not bad["trainer"] and not bad["strategy"]:
        problems += trainer_problems(t, strategy)
    problems += _data_checks(objs, bad)
    if not bad["trainer"] and not bad["data"]:
        problems += stopping.problems(t, d := objs["data"]) + dpo_checks.problems(objs.get("objective"), d, t)
    world_ok = c.nodes >= 1 and c.devices >= 1
    accelerator = "cpu" if c.accelerator not in ("auto", "cpu", "gpu") else c.accelerator
    if not bad["model"] and model.is_hf:  # (plan.py plans a shape alone; model=hf's is config.json's)
        from recipes.hf_config import launch_problems, override_problems

        problems += override_problems(model) + (launch_problems(model, depth >= LAUNCH) if depth >= RUN else [])
    if depth >= LAUNCH:
        accelerator = resolve_accelerator(accelerator)
        lg = objs["logger"]
        if lg is not None and lg.name == "wandb" and lg.mode == "online" and not logger_problems(lg):
            problems += wandb_online_problems()
    strategy, run = settle(preset, c, t, accelerator=accelerator,
                           hidden=model.dim if not bad["model"] and not bad["strategy"] else None)
    # auto left unchosen (a group it reads has problems, reported): no preset to check yet
    world_ok = world_ok and not run.mesh.problems() and preset.name != AUTO
    if not bad["trainer"]:  # optimizer_impl checked (compile: resolved in the run)
        t, why_not = _engine_trainer(t, strategy, run, depth)
        objs["trainer"], problems = t, problems + why_not
    if depth >= RUN:  # (the planner reports each layout's world and batch arithmetic itself)
        problems += run.problems()
    if depth >= LAUNCH and world_ok:
        problems += _device_problems(run.accelerator, run.mesh, c.oversubscribe)
        problems += strategy.launch_problems(run)
    if depth >= RUN and preset.name != AUTO:  # (the planner reports each preset's problems itself)
        problems += _preset_problems(strategy, run, objs, bad, world_ok)
    if not bad["model"] and not bad["data"] and (eos := packing.document_eos(objs["data"])) is not None:
        objs["model"] = replace(model, document_eos=eos)  # (the model masks documents at it)
    if not bad["model"] and not bad["trainer"]:
        problems += save_hf_problems(t, model) + loss_chunk_problems(t, model, run, strategy.name)
    if not bad["trainer"] and not bad["strategy"] and preset.name != AUTO:
        problems += float8_checks.problems(t, strategy, run, None if bad["model"] else model,
                                           accelerator=c.accelerator, launch=depth >= LAUNCH)
    job = replace(_job(cfg, objs, bad, preset, strategy, run), auto=why,
                  options=dict(origin.choices) if origin is not None else {})
    sound = world_ok and not bad["cluster"]  # (a launcher's checks read cluster.launcher: a known one)
    for check in [c for c in extra if not problems or (sound and getattr(c, "world_only", False))]:
        problems += check(job)  # (a backend's checks assume a sound job; a launcher's, a sound world)
    if problems:
        raise ConfigError(problems)
    return job


def _unread_problems(objs: dict[str, Any], bad: dict[str, list[str]]) -> list[str]:
    """Objective and data keys set that the chosen objective / data kind does not read
    (recipes/dpo_checks.py ``unread_problems``), of the groups that read."""
    return dpo_checks.unread_problems(None if bad.get("objective") else objs.get("objective"),
                                      None if bad["data"] else objs["data"])


def _engine_trainer(t: TrainerConfig, strategy: StrategyConfig, run: Run, depth: int
                    ) -> tuple[TrainerConfig, list[str]]:
    """At ``LAUNCH`` depth: an explicit ``trainer.optimizer_impl`` the running torch cannot do
    on the device the optimizer steps on (``optimizer_device``) is a problem; ``auto`` stays for
    the recipe to decide with the parameters in hand (``recipes.training.resolve_impl``).
    ``trainer.compile`` stays the user's intent, which the planner re-derives for each candidate
    preset; what runs is ``run.compile``, the bool ``core.run.compile_on`` resolved for this
    preset and accelerator."""
    if depth < LAUNCH or strategy.name == AUTO or t.optimizer_impl == "auto":
        return t, []
    from recipes.training import optimizer_impl

    return t, optimizer_impl(t, optimizer_device(strategy, run))[1]


def optimizer_device(strategy: StrategyConfig, run: Run) -> str:
    """Where the optimizer steps: cuda on a GPU run, the host (cpu) on CPU or under an offloaded
    optimizer (DeepSpeed's offload, FSDP1's CPUOffload: the footprint's ``optimizer_offload``)."""
    offload = getattr(strategy.footprint(), "optimizer_offload", "device") != "device"
    return "cuda" if run.accelerator == "gpu" and not offload else "cpu"


def _preset_problems(strategy: StrategyConfig, run: Run, objs: dict[str, Any],
                     bad: dict[str, list[str]], world_ok: bool) -> list[str]:
    """The preset on this run (``RUN`` depth): its own problems, with the model, with the data's
    packing, and callbacks.samples with both (recipes/samples.py); with a world that is not
    sound, only the model's shape against the preset. (Masked data trains on every layout: the
    loss is token-true, recipes/data.py ``CountedShare``.)"""
    model = objs["model"]
    if not world_ok:
        return [] if bad["model"] else strategy.model_problems(model)
    out = strategy.problems(run)
    if not bad["model"]:
        out += strategy.model_problems(model) + run.mesh.model_problems(model, strategy.name)
    return out + _layout_problems(strategy, run, objs, bad)


def _layout_problems(strategy: StrategyConfig, run: Run, objs: dict[str, Any],
                     bad: dict[str, list[str]]) -> list[str]:
    """What the job's other groups ask of a preset (``Job.layout_problems``, the planner's)."""
    model, out = objs["model"], []
    if not bad["model"]:
        out += lora_problems(strategy, model)
    if not bad["data"]:
        out += packing.problems(objs["data"], None if bad["model"] else model, run.mesh, strategy.name)
    if not bad.get("objective"):
        out += dpo_checks.layout_problems(objs.get("objective"), run.mesh, strategy.name)
    if objs.get("callbacks") is not None and not bad.get("callbacks") and not bad["data"]:
        out += samples.problems(objs["callbacks"].samples, objs["data"], None if bad["model"] else model,
                                run.mesh, strategy.name)
    return out


def _job(cfg: DictConfig, objs: dict[str, Any], bad: dict[str, list[str]], preset: StrategyConfig,
         strategy: StrategyConfig, run: Run) -> Job:
    """The Job of the typed groups with ``preset``, settled as ``strategy`` with its ``run``."""
    return Job(cfg=cfg, model=objs["model"], trainer=objs["trainer"], data=objs["data"],
               cluster=objs["cluster"], callbacks=objs["callbacks"], logger=objs["logger"],
               strategy=strategy, run=run, backend=objs["backend"].name, preset=preset,
               planner=objs.get("planner") or PlannerConfig(), objective=objs.get("objective"),
               export=objs.get("export"), paths=_paths(cfg),
               layout_problems=functools.partial(_layout_problems, objs=objs, bad=bad))
