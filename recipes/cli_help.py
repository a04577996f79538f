"""What a user can type and what they mistyped: the ``--help`` page (the config groups, the keys
most runs change, examples), and the likely spelling of a key or an option the config does not
have (``suggestions``), for ``recipes.cli``'s one way of ending on a configuration error."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from core.conf import CONF_DIR
from recipes.cli import normalize


def groups_help(argv: list[str] | tuple[str, ...] = ()) -> str:
    """The config groups a user picks from and their options, as files of conf/ and of the config
    directories ``argv`` adds (``--config-dir``, ``hydra.searchpath``) (what ``--help`` lists): the
    groups of the root schema, not the internal one (``strategy_model``: applied by itself). ``*``
    marks conf/train.yaml's default."""
    from dataclasses import fields

    from recipes.compose import _default_choices, search_dirs
    from recipes.config import TrainConfig

    defaults, dirs = _default_choices(), search_dirs(argv)
    lines = ["config groups (group=option; * the default; group=null switches an opt-in group off):"]
    public = {f.name for f in fields(TrainConfig)}
    groups = sorted((p for p in CONF_DIR.iterdir() if p.is_dir() and p.name in public),
                    key=lambda p: (GROUP_ORDER.index(p.name) if p.name in GROUP_ORDER else len(GROUP_ORDER), p.name))
    width = max(len(g.name) for g in groups) + 4
    for group in groups:
        options = [o + ("*" if defaults.get(group.name) == o else "") for o in _options(group.name, dirs)]
        off = [] if defaults.get(group.name, "None") not in ("None", "null") else ["(off unless chosen)"]
        lines += textwrap.wrap(" ".join([f"{o}," for o in options[:-1]] + options[-1:] + off), 100,
                               initial_indent=f"  {group.name + ':':<{width - 2}}",
                               subsequent_indent=" " * width, break_on_hyphens=False)
    return "\n".join(lines)


# The order --help lists the groups in: what a run is, then how it runs, then the rest.
GROUP_ORDER = ("model", "strategy", "cluster", "backend", "data", "trainer", "objective", "callbacks",
               "logger", "planner", "experiment", "export", "paths")

# The keys most runs set, with what each means (``--help``); tests/test_console.py keeps every one
# a key of the composed config.
COMMON_KEYS: tuple[tuple[str, str], ...] = (
    ("trainer.max_steps", "optimizer steps"),
    ("trainer.global_batch_size", "samples per optimizer step (= micro x data-parallel x accumulation)"),
    ("trainer.micro_batch_size", "samples per forward pass, per rank (accumulation is derived)"),
    ("trainer.lr", "peak learning rate (trainer.optimizer=adamw | sgd, trainer.scheduler)"),
    ("trainer.precision", "32 | bf16-mixed | 16-mixed; a GPU cluster implies its own (cluster.trainer)"),
    ("trainer.val_every", "validate every N steps (0: at the end), given a validation split"),
    ("trainer.checkpoint_every", "save a checkpoint every N steps (the last one is saved anyway)"),
    ("trainer.keep_best", "also keep the checkpoint of the lowest validation loss (val_every > 0)"),
    ("trainer.early_stopping.patience", "stop after N validations without improvement (0: never)"),
    ("trainer.gradient_checkpointing", "recompute activations in backward (= strategy.activation_checkpointing)"),
    ("trainer.resume_from", "auto (newest checkpoint in the run dir) | a checkpoint dir | null"),
    ("cluster.devices", "processes per node (null: 1, or what torchrun / srun started)"),
    ("cluster.nodes", "nodes (null: 1, or the launcher's; torchrun, Slurm, SageMaker start them)"),
    ("cluster.accelerator", "auto | cpu | gpu"),
    ("data.path", "your own data: a file, directory or glob (data=text | jsonl | parquet | chat | tokens)"),
    ("data.val_fraction", "hold out this fraction of the windows for validation"),
    ("model.path", "a Hugging Face model directory (model=hf)"),
    ("callbacks.progress_bar", "the progress bar on rank 0 (when stdout is a terminal)"),
    ("callbacks.log_every", "otherwise a progress line every N steps and every 60 s (0: none)"),
    ("callbacks.samples.prompts", "at each validation, greedy completions of these prompts (a file, or '[a,b]')"),
    ("planner.enforce", "refuse a run predicted not to fit"),
)

EXAMPLES = (
    ("python train.py model=gpt_nano trainer.max_steps=20", "a small run on this machine"),
    ("python train.py strategy=ddp cluster.devices=2", "two processes, DDP"),
    ("python train.py strategy=zero3 cluster.devices=2 model=gpt_nano", "DeepSpeed ZeRO-3"),
    ("python train.py data.val_fraction=0.05 trainer.val_every=20", "with validation"),
    ("python train.py -m strategy=ddp,fsdp,zero2 cluster.devices=2", "a sweep, compared in a report"),
    ("python train.py --cfg job strategy=fsdp", "print the composed config, run nothing"),
    ("python plan.py model=llama_7b cluster=node_8x_a100_80g", "will it fit, before any run"),
)


def _key_defaults() -> dict[str, object]:
    """Each common key's value in the default composition, read from conf/'s YAML (no Hydra
    composition, no torch: ``--help`` answers at once)."""
    from omegaconf import OmegaConf

    from recipes.cluster_config import IMPLIED
    from recipes.compose import _default_choices

    choices, out = _default_choices(), {}
    for key, _ in COMMON_KEYS:
        group, _, rest = key.partition(".")
        path = CONF_DIR / group / f"{choices.get(group)}.yaml"
        if not path.is_file():
            continue
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        for part in rest.split("."):
            node = node.get(part, "") if isinstance(node, dict) else ""
        if isinstance(node, str) and node.startswith(IMPLIED):  # (the cluster's, else this default)
            node = node[len(IMPLIED):-1].split(",", 1)[1].strip("'\"")
        if node != "" and not (isinstance(node, str) and "${" in node):
            out[key] = node
    return out


def help_page(doc: str, argv: list[str] | tuple[str, ...] = ()) -> str:
    """``python train.py --help``: what the script does, the groups and their options (a config
    directory of ``argv``'s too), the common keys with their defaults, every key of each option
    ``argv`` chooses (``--help strategy=fsdp2``: recipes/key_help.py), examples, and where the rest
    is written down."""
    from recipes.key_help import option_keys

    defaults = _key_defaults()
    usage = doc.strip().splitlines()[0]
    def shown(value: object) -> str:
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    keys = [f"{key}={shown(defaults.get(key))}" for key, _ in COMMON_KEYS]
    width = max(map(len, keys)) + 2
    lines = ["usage: python train.py [group=option ...] [key=value ...] [-m] [--cfg job]", "",
             usage, "", groups_help(argv), "",
             "common keys (key=value, shown with their default; any key of `python train.py --cfg job` works):"]
    lines += [f"  {k:<{width}}{what}" for k, (_, what) in zip(keys, COMMON_KEYS)]
    lines += ["", *option_keys(argv)]
    lines += ["", "examples:"]
    width = max(len(cmd) for cmd, _ in EXAMPLES) + 2
    lines += [f"  {cmd:<{width}}# {what}" for cmd, what in EXAMPLES]
    readme = CONF_DIR.parent / "README.md"
    lines += ["", f"more: README.md ({readme if readme.is_file() else 'in the repository'}): the groups and "
              "their main keys, the report's fields; docs/ARCHITECTURE.md; "
              "Hydra's own flags: --hydra-help"]
    return "\n".join(lines)


def _flat_keys(node: object, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return []
    out = []
    for k, v in node.items():
        key = f"{prefix}{k}"
        out += [key, *_flat_keys(v, key + ".")]
    return out


def _has_key(node: object, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def suggestions(argv: list[str]) -> list[str]:
    """For each override whose key the config does not have (``trainer.max_step=3``), one line:
    the override, that the key does not exist, the closest key that does (``did you mean
    trainer.max_steps?``) and the override to write instead, or, with none close, the keys there
    are -- from the config composed with the same group choices; nothing when the groups
    themselves do not compose (Hydra's message says why). An option is one of conf/'s or of the
    config directories the command line adds (``--config-dir``, ``hydra.searchpath``)."""
    from omegaconf import OmegaConf

    from recipes.compose import compose, search_args, search_dirs

    search, argv = search_args(argv)
    dirs = search_dirs(search)
    if malformed := [line for arg in argv if not arg.startswith("-") and (line := _malformed(arg, dirs))]:
        return malformed
    groups, keys, options = [], [], []
    for arg in normalize([a for a in argv if not a.startswith("-")]):
        key, eq, value = arg.partition("=")
        key = key.lstrip("+~")
        if not eq or key.startswith("hydra"):
            continue
        if _is_group(key, dirs):
            groups.append(arg)
            options += [line for v in value.split(",") if (line := _no_such_option(key, v.strip(), dirs))]
        else:
            keys.append((key, value))
    if options or not keys:
        return options
    try:
        cfg = OmegaConf.to_container(compose([*search, *groups]), resolve=False)
    except Exception:  # the groups themselves are the error: Hydra said so
        return []
    return [_no_such_key(cfg, key, value, dirs) for key, value in keys if not _has_key(cfg, key)]


def _options(group: str, dirs: list[Path]) -> list[str]:
    """The options of ``group``: its files in conf/ and in each config directory ``dirs`` adds."""
    return sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})


def _is_group(name: str, dirs: list[Path]) -> bool:
    return bool(name) and "." not in name and "/" not in name and any((d / name).is_dir() for d in dirs)


def _malformed(arg: str, dirs: list[Path]) -> str | None:
    """An override that names no key (``=foo``), no option (``strategy=``), removes a key of the
    schema (``~trainer.lr``), switches off a group a run needs (``strategy=null``, which
    ``normalize`` made ``~strategy``) or adds a group the defaults list has already
    (``+experiment=x``, Hydra's "Multiple values for experiment"): its line; None for any other."""
    from recipes.compose import _default_choices

    key, eq, value = arg.partition("=")
    name = key.lstrip("+~")
    if eq and not name:
        return (f"{arg}: an override is key=value, and this one has no key; e.g. trainer.max_steps={value} "
                f"(python {_script()} --help lists the keys)")
    group = _is_group(name, dirs)
    options = ", ".join(_options(name, dirs)) if group else ""
    if group and eq and not value:
        return f"{name}=: no {name} named; the options: {options}"
    if group and eq and key.startswith("+") and not key.startswith("++") and name in _default_choices() \
            and value in _options(name, dirs):
        return (f"{arg}: {name} is already in the defaults list (conf/train.yaml); write {name}={value} "
                f"(no +), which chooses it")
    if not key.startswith("~") or name.startswith("hydra"):
        return None
    if not group:
        return (f"{arg}: a key of the config cannot be removed; set it instead ({name}=<value>; "
                f"python {_script()} --help lists the common keys and their defaults)")
    choices = _default_choices()
    default = choices.get(name, "None")
    if default in ("None", "null"):
        return None  # (an opt-in group: off is its default)
    opt_in = sorted(g for g, o in choices.items() if o in ("None", "null"))
    return (f"{name}=null: {name} cannot be switched off; choose one of {options} ({name}={default} is the "
            f"default); group=null switches off only the opt-in groups: {', '.join(opt_in)}")


def _no_such_option(group: str, value: str, dirs: list[Path]) -> str | None:
    """``strategy=zero33: no such strategy; did you mean zero3? (strategy=zero3); the options:
    ...``; None when conf/<group>/ or a config directory of the command line (``dirs``) has it
    (or it is null): then what fails is inside the option, and Hydra's message says what."""
    from core.errors import no_such_option

    names = _options(group, dirs)
    if not names or value in names or value in ("null", ""):
        return None
    return no_such_option(group, value, names)


def _wrong_type(error: Exception) -> str | None:
    """``cluster.devices=two: could not be converted to Integer; ...``: a value OmegaConf cannot
    take for its key's type, as one line (Hydra's is four, naming the schema's class)."""
    from omegaconf.errors import ValidationError

    cause, text = error.__cause__, str(error)
    if not isinstance(cause, ValidationError) or not text.startswith("Error merging override "):
        return None
    override = text.removeprefix("Error merging override ").splitlines()[0]
    why = str(getattr(cause, "msg", cause)).splitlines()[0]
    kind = _kind(why)
    return (f"{override}: {cause.full_key} takes {kind}" if kind else f"{override}: {_why(why)}") + \
        f"; python {_script()} --help lists the keys with their defaults"


def _why(why: str) -> str:
    return why.split(" could not be converted to ")[-1] if " could not be converted to " in why else why


def _kind(why: str) -> str | None:
    """What a key takes, from OmegaConf's "Value 'two' of type 'str' could not be converted to
    Integer" (None: not a type error it words so)."""
    why = _why(why)
    return {"Integer": "an integer", "Float": "a number"}.get(why) or (
        "true or false" if "is not a valid bool" in why else
        "a list ([a,b])" if "is not a ListConfig" in why else None)


def _in_file(error: Exception, argv: list[str]) -> str | None:
    """An error inside an option's own YAML (Hydra's "In 'strategy/typo_zero3': ConfigKeyError
    raised while composing config: Key 'reduce_bucket_sise' not in 'ZeroConfig'", four lines
    naming neither the file nor the family) as one line: the file, the key, its value or the
    closest key (``.../strategy/typo_zero3.yaml: reduce_bucket_sise is not a key of the deepspeed
    family (ZeroConfig); did you mean reduce_bucket_size?``); None for any other error."""
    import re

    from core.errors import closest
    from recipes.compose import search_dirs

    found = re.match(r"In '([^']+)': (\w+) raised while composing config:\n(.*)", str(error), re.S)
    if found is None:
        return None
    where, kind, body = found.groups()
    path = next((d / f"{where}.yaml" for d in search_dirs(argv) if (d / f"{where}.yaml").is_file()),
                f"{where}.yaml")
    first = body.splitlines()[0]
    full_key = (re.search(r"full_key: (\S+)", body) or [None, None])[1]
    bad_key = re.fullmatch(r"Key '([^']+)' not in '(\w+)'", first)
    if kind in ("ConfigKeyError", "ConfigAttributeError") and bad_key:
        leaf, schema = bad_key.groups()
        family, keys = _schema_keys(schema)
        close = closest(leaf, keys)
        of = f"the {family} family ({schema})" if family else schema
        hint = f"did you mean {close}?" if close else f"its keys: {', '.join(keys)}" if keys else ""
        return f"{path}: {leaf} is not a key of {of}" + (f"; {hint}" if hint else "")
    value = re.match(r"Value '([^']*)'", first)
    if kind == "ValidationError" and full_key and (takes := _kind(first)):
        return f"{path}: {full_key.rpartition('.')[2]}: {value[1] if value else '?'} -- {full_key} takes {takes}"
    return f"{path}: {first}" + (f" ({full_key})" if full_key else "")


def _schema_keys(name: str) -> tuple[str | None, list[str]]:
    """(the strategy family whose schema class is ``name``, or None; the schema's keys)."""
    import dataclasses

    import recipes.config
    import strategies  # noqa: F401  (every family's schema)
    from strategies.base import families

    family = next((f for f, cls in families().items() if cls.__name__ == name), None)
    cls = families()[family] if family else getattr(recipes.config, name, None)
    keys = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
    return family, keys


def _script() -> str:
    """The script the user ran (train.py, plan.py, export.py, ...), for a hint that names it."""
    name = Path(sys.argv[0]).name
    return name if name in ("plan.py", "export.py", "launch.py") else "train.py"


def _no_such_key(cfg: dict, key: str, value: str, dirs: list[Path]) -> str:
    """``trainer.max_stepz=3: no such key; did you mean trainer.max_steps? (trainer.max_steps=3)``."""
    from core.errors import no_such_key

    parent = key.rpartition(".")[0]
    if not parent:  # a group or a top-level key
        return no_such_key(key, value, sorted({p.name for d in dirs for p in d.iterdir() if p.is_dir()} | set(cfg)))
    if not _has_key(cfg, parent):  # the node itself is mistyped: among every key
        return no_such_key(key, value, None, _flat_keys(cfg))
    node = cfg  # a key of a node that exists: among its keys
    for part in parent.split("."):
        node = node[part]
    return no_such_key(key, value, sorted(node) if isinstance(node, dict) else [])


def composition_problems(error: Exception, argv: list[str]) -> list[str]:
    """Our lines for a composition error: each key the config does not have (``suggestions``), a
    value of the wrong type (``_wrong_type``), or what is wrong inside an option's YAML (a user's
    own, ``_in_file``); [] for any other (Hydra's message says it)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    lines = suggestions(argv) if isinstance(error, (HydraException, OmegaConfBaseException)) else []
    return lines or [line for line in [_wrong_type(error) or _in_file(error, argv)] if line]
