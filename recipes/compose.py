"""Composition: the typed schemas stored in Hydra's ConfigStore and the OmegaConf resolvers
``conf/`` interpolates (``register``, called by whoever composes or reads a composed config, not
on import), and ``compose``: ``conf/train.yaml`` with CLI-style overrides, as train.py would,
without running. Torch-free."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.conf import CONF_DIR

if TYPE_CHECKING:
    from recipes.model_config import ModelConfig
    from recipes.origin import Origin

def run_name(nodes: Any, launcher: Any, endpoint: Any = None) -> str:
    """A run directory's name under outputs/: the same on every process of one job. Each process
    of a job composes its own config, so a clock time differs between nodes (and srun tasks)
    started a second apart: a multi-node torchrun job is named by its rendezvous endpoint, a Slurm
    srun step by its job id (the same after a requeue: the next attempt finds the checkpoints),
    the ranks of an outside torchrun by its job (``torchrun_name``); anything else by the date
    and time."""
    import datetime
    import os

    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_STEP_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    if launcher == "torchrun" and int(nodes) > 1 and endpoint:
        return "torchrun-" + _safe(endpoint)
    return torchrun_name(os.environ) or datetime.datetime.now().strftime(CLOCK)


CLOCK = "%Y-%m-%d/%H-%M-%S"


def _safe(name: Any) -> str:
    return "".join(c if c.isalnum() or c in "-." else "-" for c in str(name))


def torchrun_name(env: Any) -> str | None:
    """Under an outside torchrun (or ``accelerate launch``), where every rank composes at its own
    moment: on several nodes, ``torchrun-<run id>`` (``--rdzv-id``), else ``torchrun-<the
    rendezvous every rank meets at>`` (MASTER_ADDR, MASTER_PORT); on one node, the moment its
    launcher -- the ranks' parent -- started, which every rank reads alike, a restart keeps, and
    the next launch does not. None outside torchrun."""
    import datetime
    import os

    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    world = int(env.get("WORLD_SIZE") or 1)
    if world > int(env.get("LOCAL_WORLD_SIZE") or world):
        run = env["TORCHELASTIC_RUN_ID"]
        job = run if run not in ("", "none") else f"{env.get('MASTER_ADDR', '')}-{env.get('MASTER_PORT', '')}"
        return f"torchrun-{_safe(job)}"
    started = process_started(os.getppid())
    return None if started is None else datetime.datetime.fromtimestamp(started).strftime(CLOCK)


def process_started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, from /proc); None where unknown."""
    import os
    from pathlib import Path

    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def register() -> None:
    """Store the root and opt-in group schemas in Hydra's ConfigStore and register the resolvers
    ``conf/`` uses; idempotent and cheap, so every entry that composes (``compose_chosen``;
    ``recipes.cli.run``, before train.py's ``@hydra.main`` does) or resolves a composed config
    (``recipes.job``'s validation and report, a sweep's row, a rank that was handed a Job) calls
    it first."""
    if getattr(register, "done", False):
        return
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from recipes.cluster_config import implied
    from recipes.config import ExportConfig, LoggerConfig, TrainConfig
    from recipes.hardware import instance, launched, local
    from recipes.hf_config import resolve, tokenizer_default

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="logger_schema", node=LoggerConfig)  # opt-in groups: typed per file
    cs.store(name="export_schema", node=ExportConfig)
    for name, resolver, cached in (
            ("hf", resolve, False),  # model=hf: shape fields from the model's config.json
            ("hf_dir", tokenizer_default, False),  # conf/data/*.yaml: data.tokenizer from model.path
            ("implied", implied, False),  # conf/trainer/default.yaml: what the cluster implies
            ("instance", instance, False),  # conf/cluster/sagemaker_*.yaml: an instance's numbers
            ("launched", launched, False),  # conf/cluster/local.yaml: torchrun's / srun's world
            ("local", local, False),  # conf/cluster/local.yaml: this machine's GPUs, no torch
            ("run_name", run_name, True)):  # conf/hydra/default.yaml: hydra.run.dir
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver, use_cache=cached)
    register.done = True


def describe(model: Any) -> ModelConfig:
    """The torch-free description of a composed ``cfg.model`` that the planner reads; a value
    that cannot be read (a ``${hf:...}`` shape of a ``model.path`` that holds no model, a missing
    mandatory value) is a ``ConfigError`` in the resolver's own words, as validation says it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not OmegaConf.is_config(model):
        return model
    register()  # (${hf:...})
    try:
        return OmegaConf.to_object(model)
    except OmegaConfBaseException as e:
        from core.errors import ConfigError

        raise ConfigError(f"model: {unreadable(e)}") from None


def unreadable(error: Exception) -> str:
    """Why a config node could not be read, in the words of whoever raised it (a resolver's
    message without OmegaConf's preamble and key listing)."""
    import re

    return re.sub(r"^\w+ raised while resolving interpolation: ", "", str(error).splitlines()[0])


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Compose ``conf/train.yaml`` with CLI-style overrides, as train.py would, without running."""
    return compose_chosen(overrides)[0]


CONFIG_DIR_FLAGS = ("-cd", "--config-dir")
CONFIG_NAME_FLAGS = ("-cn", "--config-name")
SEARCHPATH = "hydra.searchpath"


def search_args(argv: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """A command line split into (where it says configs are found beyond conf/ and which top config
    to compose, the rest): the one place that reads a user's own config directory off a command
    line, for every composition outside train.py's ``@hydra.main`` (plan.py, export.py, launch.py,
    ``--dry-run``, a sweep's preflight, the error lines). ``--config-dir DIR`` (``-cd DIR``,
    ``--config-dir=DIR``; Hydra's argparse keeps the last) becomes ``--config-dir=<DIR made
    absolute>``, ``--config-name NAME`` (``-cn``) ``--config-name=NAME`` (a top config of the user's
    in place of conf/train.yaml), and ``hydra.searchpath=[...]`` stays as typed; ``compose_chosen``
    takes all three among its overrides."""
    import os

    found, rest, flags, i = [], [], {}, 0
    while i < len(argv):
        arg, flag = argv[i], argv[i].split("=", 1)[0]
        if flag in CONFIG_DIR_FLAGS + CONFIG_NAME_FLAGS:
            value = arg.split("=", 1)[1] if "=" in arg else argv[i + 1] if i + 1 < len(argv) else ""
            if flag in CONFIG_DIR_FLAGS:
                flags["--config-dir"] = os.path.abspath(value)
            else:
                flags["--config-name"] = value
            i += 1 if "=" in arg else 2
            continue
        (found if arg.lstrip("+").startswith(f"{SEARCHPATH}=") else rest).append(arg)
        i += 1
    return [f"{flag}={value}" for flag, value in sorted(flags.items())] + found, rest


def _flag(search: list[str], flag: str) -> str | None:
    """The value ``search_args`` gave ``flag`` (``--config-dir``, ``--config-name``), or None."""
    return next((a.split("=", 1)[1] for a in search if a.startswith(f"{flag}=")), None)


def search_of(config: Any) -> list[str]:
    """``search_args``'s first half for a running app's config (a sweep driver's: its preflight
    composes every point as its jobs will), or for its Hydra node (``HydraConfig.get()``, a
    composition's ``hydra``): Hydra's ``--config-dir`` and ``hydra.searchpath``."""
    hydra = config.hydra if "hydra" in config else config
    sources = hydra.runtime.get("config_sources") or []
    mine = [f"--config-dir={s.path.removeprefix('file://')}" for s in sources if s.provider == "command-line"]
    name = hydra.job.get("config_name") or "train"
    entries = list(hydra.get("searchpath") or [])
    return (mine[-1:] + ([f"--config-name={name}"] if name != "train" else [])
            + ([f"{SEARCHPATH}=[{','.join(entries)}]"] if entries else []))


def search_dirs(argv: list[str] | tuple[str, ...]) -> list[Path]:
    """The directories a command line's composition finds config groups in, in Hydra's order:
    conf/, the ``--config-dir``, then each ``hydra.searchpath`` entry (``file://``, ``pkg://`` or a
    path); an entry that names no directory is left out (Hydra warns of it)."""
    import importlib.util

    from hydra.core.override_parser.overrides_parser import OverridesParser

    search, _ = search_args(argv)
    dirs = [CONF_DIR] + [Path(a.split("=", 1)[1]) for a in search if a.startswith("--config-dir=")]
    for arg in (a for a in search if not a.startswith("-")):
        try:
            entries = OverridesParser.create().parse_overrides([arg.lstrip("+")])[0].value()
        except Exception:  # noqa: BLE001  (malformed: composing it says what is wrong)
            continue
        for entry in entries if isinstance(entries, list) else []:
            scheme, _, where = str(entry).rpartition("://")
            if scheme == "pkg":
                try:
                    spec = importlib.util.find_spec(where.replace("/", "."))
                except (ImportError, ValueError):
                    spec = None
                where = next(iter(spec.submodule_search_locations or []), "") if spec else ""
            dirs += [Path(where)] if where and Path(where).is_dir() else []
    return dirs


def compose_chosen(overrides: list[str] | tuple[str, ...] = ()) -> tuple[Any, set[str], Origin]:
    """``compose``, the config groups the composition chose rather than took by default (an
    override of the group, as Hydra parses it, or a choice that differs from conf/train.yaml's
    default: an ``experiment=`` that sets it), and what Hydra recorded of it (``Origin``: the
    options chosen, the user's directories; ``recipes.job.validate(origin=...)`` reads it as
    train.py's ``HydraConfig``). A user's config directory and top config among the overrides
    (``--config-dir``, ``--config-name``, ``hydra.searchpath``: ``search_args``) are searched and
    composed as train.py's are."""
    import hydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    import strategies  # noqa: F401  (family schemas)
    from recipes.cli import normalize
    from recipes.origin import Origin
    from strategies.presets import hydra_context

    register()
    search, overrides = search_args(normalize(list(overrides)))
    config_dir = _flag(search, "--config-dir")
    with hydra_context([config_dir] if config_dir else []):
        cfg = hydra.compose(config_name=_flag(search, "--config-name") or "train",
                            overrides=[*(a for a in search if not a.startswith("-")), *overrides],
                            return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    named = {o.key_or_group.split("@")[0] for o in OverridesParser.create().parse_overrides(overrides)}
    defaults = _default_choices()
    chosen = {g for g, c in choices.items() if g in named or (g in defaults and c != defaults[g])}
    origin = Origin.of(cfg.hydra)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, chosen, origin


def _default_choices() -> dict[str, str]:
    """conf/train.yaml's defaults list: group -> its default option."""
    import yaml

    out = {}
    for entry in yaml.safe_load((CONF_DIR / "train.yaml").read_text()).get("defaults", []):
        if isinstance(entry, dict):
            out |= {str(g): str(o) for g, o in entry.items() if not str(g).startswith(("optional", "override"))}
    return out
