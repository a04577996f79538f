"""What train.py and plan.py share at the command line: every configuration error, whether Hydra
finds it while composing or validation finds it after, ends the same way -- one message, no
traceback, exit code 2 -- and the README's spelling ``group=null`` switches an opt-in group off
(Hydra's own spelling is ``~group``).
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from hydra.experimental.callback import Callback

from core.conf import CONF_DIR

T = TypeVar("T")

CONFIG_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

_started = False
_RAISES = "STRATAGEM_HYDRA_RAISES"  # set beside HYDRA_FULL_ERROR when ``run`` set that (a submitit
# job inherits both: its ``started`` takes them back too)


def normalize(argv: list[str]) -> list[str]:
    """``logger=null`` -> ``~logger`` for every config group (a folder of conf/); the issue's
    ``+preflight=false`` -> ``preflight=false`` (a key of the root schema, which Hydra's ``+``
    would refuse to add again)."""
    out = []
    for arg in argv:
        if arg.startswith("+preflight="):
            arg = arg[1:]
        group, _, value = arg.partition("=")
        if value == "null" and "." not in group and (CONF_DIR / group).is_dir():
            arg = f"~{group}"
        out.append(arg)
    return out


class BelowWarning(logging.Filter):
    """Hydra's console handler keeps stdout for records below WARNING (conf/hydra/default.yaml:
    warnings and errors have a stderr handler of their own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def rank_aware_logging() -> None:
    """Rank 0 logs at INFO; other ranks only warnings and errors, prefixed with their rank.
    (Launchers start ranks > 0 with RANK or LOCAL_RANK set.) The root's handlers take the level
    too: libraries that set their own loggers' level (Lightning: INFO) still propagate to them."""
    rank = int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0)
    if rank == 0:
        return
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    for handler in root.handlers:
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))


def started() -> None:
    """Called first thing in the task function: composition succeeded. From here on an error is
    the run's, printed by Hydra as usual (``run`` had Hydra raise composition errors to it)."""
    global _started
    _started = True
    if os.environ.pop(_RAISES, None):
        os.environ.pop("HYDRA_FULL_ERROR", None)


def fail(error: Exception, log: logging.Logger) -> None:
    """A configuration error found after composition: log it and exit 2. Under an outside launcher
    every rank finds the same error; rank 0 says it, the others exit quietly. Found before the job
    launched, the run directory Hydra made for it goes again (``_discard_made``)."""
    if int(os.environ.get("RANK") or 0) != 0:
        sys.exit(CONFIG_ERROR)
    log.error("%s", error)
    _discard_made()
    sys.exit(CONFIG_ERROR)


_made: list[Path] = []  # the run directory, then its ancestors, that Hydra makes for this job (not
# under an outside launcher: its ranks share it), until the job launches (OutputDirectory, keep_run_dir)


def keep_run_dir() -> None:
    """The job launches (launchers.run): its run directory is the run's, whatever happens next."""
    _made.clear()


def _discard_made() -> None:
    """A job refused before it launched leaves no run directory that looks like a run: the one Hydra
    made, holding only what Hydra and the run lock wrote, goes, then its ancestors made with it while
    empty. Anything else in it keeps it whole; a directory that existed before is never touched."""
    if not _made:
        return
    import shutil

    from hydra.core.hydra_config import HydraConfig

    own = {".hydra", ".lock", ".owner.json", f"{HydraConfig.get().job.name}.log"}
    try:
        if {p.name for p in _made[0].iterdir()} - own:
            return
        shutil.rmtree(_made[0])
        for ancestor in _made[1:]:
            ancestor.rmdir()  # (OSError when not empty: another job's, kept)
    except OSError:
        pass
    _made.clear()


def unwritable(key: str, directory: str | Path, file: str | None = None) -> str | None:
    """Why this process cannot write the output directory ``directory`` (the value of ``key``),
    in one sentence with the fix; None when it can. Probed for real, not by permission bits (root
    ignores those, a read-only mount does not): a file is created and removed in the directory, or
    in its nearest existing ancestor when it does not exist yet -- nothing is left behind. With
    ``file``: ``key``'s value is that file, to be created in ``directory`` (export.py's output)."""
    import tempfile

    path = Path(directory).expanduser().absolute()
    value = directory if file is None else file
    target = ("a directory", "/path/to/runs/name") if file is None else ("a file in a directory",
                                                                          f"/path/to/{Path(file).name}")
    fix = f"point {key} at {target[0]} this user can write ({key}={target[1]})"
    if not Path(value).expanduser().is_absolute():
        fix += f", or run from one: {value} is relative to {Path.cwd()}"
    here = path
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        return f"{key}={value}: {here} is a file, not a directory; {fix}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".stratagem-probe-", dir=here)
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        where = (f"create it in {here}" if here != path else "write there" if file is None
                 else f"write in {here}")
        return f"{key}={value}: cannot {where}: {why}; {fix}"
    os.close(fd)
    os.unlink(probe)
    return None


class OutputDirectory(Callback):
    """Hydra callback (conf/hydra/default.yaml): the run's (or the sweep's) output directory is
    one this process can write, or one line saying why not and exit 2 -- before Hydra creates it,
    which would end in its traceback (a read-only mount, a path through a file, no permission).
    Under a launcher every rank finds the same; rank 0 says it."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")

    @staticmethod
    def _check(config: Any, key: str) -> None:
        from omegaconf import OmegaConf

        try:
            directory = OmegaConf.select(config, key, throw_on_resolution_failure=True)
        except Exception:  # noqa: BLE001  (Hydra resolves it itself next, and says what is wrong)
            return
        if directory is None or (problem := unwritable(key, str(directory))) is None:
            if directory is not None and key == "hydra.run.dir" and not {"RANK", "LOCAL_RANK"} & set(os.environ):
                path = Path(str(directory)).expanduser().absolute()
                _made[:] = [p for p in (path, *path.parents) if not p.exists()]
            return
        if int(os.environ.get("RANK") or 0) == 0:
            print(problem, file=sys.stderr)
        sys.exit(CONFIG_ERROR)


def or_exit(step: Callable[[], T], argv: list[str] | None = None) -> T:
    """Run a composition or validation step outside a Hydra app (plan.py): a configuration
    error is printed as Hydra would print it, without a traceback, and exits 2; with the
    overrides composed (``argv``), a mistyped key gets its likely spelling."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from core.errors import ConfigError

    try:
        return step()
    except (HydraException, OmegaConfBaseException) as e:
        composition_error(e, argv or [])
    except ConfigError as e:
        print(e, file=sys.stderr)
        sys.exit(CONFIG_ERROR)


def query(argv: list[str], doc: str) -> tuple[object, set[str], list[str]] | None:
    """The start of a script that queries the config instead of running a job (plan.py,
    export.py): ``--help`` prints ``doc`` and the groups (None); otherwise the composed config,
    the groups it chose rather than took by default (``compose_chosen``) and the normalized
    overrides, or the composition error and exit 2."""
    if {"-h", "--help"} & set(argv):
        print(doc + "\n" + groups_help())
        return None
    from recipes.compose import compose_chosen

    argv = normalize(argv)
    cfg, chosen = or_exit(lambda: compose_chosen(argv), argv)
    return cfg, chosen, argv


def groups_help() -> str:
    """The config groups a user picks from and their options, as files of conf/ (what ``--help``
    lists): the groups of the root schema, not the internal ones (``strategy_model``,
    ``cluster_trainer``: applied by themselves). ``*`` marks conf/train.yaml's default."""
    from dataclasses import fields

    from recipes.compose import _default_choices
    from recipes.config import TrainConfig

    defaults = _default_choices()
    lines = ["config groups (group=option; * the default; group=null switches an opt-in group off):"]
    public = {f.name for f in fields(TrainConfig)}
    groups = sorted((p for p in CONF_DIR.iterdir() if p.is_dir() and p.name in public),
                    key=lambda p: (GROUP_ORDER.index(p.name) if p.name in GROUP_ORDER else len(GROUP_ORDER), p.name))
    width = max(len(g.name) for g in groups) + 4
    for group in groups:
        options = [f.stem + ("*" if defaults.get(group.name) == f.stem else "")
                   for f in sorted(group.glob("*.yaml"))]
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
    ("trainer.precision", "32 | bf16-mixed | 16-mixed"),
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
        if node != "" and not (isinstance(node, str) and "${" in node):
            out[key] = node
    return out


def help_page(doc: str) -> str:
    """``python train.py --help``: what the script does, the groups and their options, the common
    keys with their defaults, examples, and where the rest is written down."""
    defaults = _key_defaults()
    usage = doc.strip().splitlines()[0]
    def shown(value: object) -> str:
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    keys = [f"{key}={shown(defaults.get(key))}" for key, _ in COMMON_KEYS]
    width = max(map(len, keys)) + 2
    lines = ["usage: python train.py [group=option ...] [key=value ...] [-m] [--cfg job]", "",
             usage, "", groups_help(), "",
             "common keys (key=value, shown with their default; any key of `python train.py --cfg job` works):"]
    lines += [f"  {k:<{width}}{what}" for k, (_, what) in zip(keys, COMMON_KEYS)]
    lines += ["", "examples:"]
    width = max(len(cmd) for cmd, _ in EXAMPLES) + 2
    lines += [f"  {cmd:<{width}}# {what}" for cmd, what in EXAMPLES]
    readme = CONF_DIR.parent / "README.md"
    lines += ["", f"more: README.md ({readme if readme.is_file() else 'in the repository'}): every group, "
              "key and report field; docs/ARCHITECTURE.md; Hydra's own flags: --hydra-help"]
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
    themselves do not compose (Hydra's message says why)."""
    from omegaconf import OmegaConf

    from recipes.compose import compose

    groups, keys, options = [], [], []
    for arg in normalize([a for a in argv if not a.startswith("-")]):
        key, eq, value = arg.partition("=")
        key = key.lstrip("+~")
        if not eq or key.startswith("hydra"):
            continue
        if "." not in key and (CONF_DIR / key).is_dir():
            groups.append(arg)
            options += [line for v in value.split(",") if (line := _no_such_option(key, v.strip()))]
        else:
            keys.append((key, value))
    if options or not keys:
        return options
    try:
        cfg = OmegaConf.to_container(compose(groups), resolve=False)
    except Exception:  # the groups themselves are the error: Hydra said so
        return []
    return [_no_such_key(cfg, key, value) for key, value in keys if not _has_key(cfg, key)]


def _no_such_option(group: str, value: str) -> str | None:
    """``strategy=zero33: no such strategy; did you mean zero3? (strategy=zero3); the options:
    ...``; None when conf/<group>/ has it (or it is null)."""
    import difflib

    names = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    if not names or value in names or value in ("null", ""):
        return None
    close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
    guess = f"did you mean {close[0]}? ({group}={close[0]}); " if close else ""
    return f"{group}={value}: no such {group}; {guess}the options: {', '.join(names)}"


def _wrong_type(error: Exception) -> str | None:
    """``cluster.devices=two: could not be converted to Integer; ...``: a value OmegaConf cannot
    take for its key's type, as one line (Hydra's is four, naming the schema's class)."""
    from omegaconf.errors import ValidationError

    cause, text = error.__cause__, str(error)
    if not isinstance(cause, ValidationError) or not text.startswith("Error merging override "):
        return None
    override = text.removeprefix("Error merging override ").splitlines()[0]
    why = str(getattr(cause, "msg", cause)).splitlines()[0]
    why = why.split(" could not be converted to ")[-1] if " could not be converted to " in why else why
    kind = {"Integer": "an integer", "Float": "a number"}.get(why) or (
        "true or false" if "is not a valid bool" in why else
        "a list ([a,b])" if "is not a ListConfig" in why else None)
    return (f"{override}: {cause.full_key} takes {kind}" if kind else f"{override}: {why}") + \
        f"; python {_script()} --help lists the keys with their defaults"


def _script() -> str:
    """The script the user ran (train.py, plan.py, export.py, ...), for a hint that names it."""
    name = Path(sys.argv[0]).name
    return name if name in ("plan.py", "export.py", "launch.py") else "train.py"


def _no_such_key(cfg: dict, key: str, value: str) -> str:
    """``trainer.max_stepz=3: no such key; did you mean trainer.max_steps? (trainer.max_steps=3)``."""
    import difflib

    parent, _, leaf = key.rpartition(".")
    if not parent:  # a group or a top-level key
        names = sorted({p.name for p in CONF_DIR.iterdir() if p.is_dir()} | set(cfg))
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    elif _has_key(cfg, parent):  # a key of a node that exists: among its keys
        node = cfg
        for part in parent.split("."):
            node = node[part]
        names = sorted(node) if isinstance(node, dict) else []
        close = [f"{parent}.{k}" for k in difflib.get_close_matches(leaf, names, n=1, cutoff=0.6)]
    else:  # the node itself is mistyped: among every key
        names = []
        close = difflib.get_close_matches(key, _flat_keys(cfg), n=1, cutoff=0.6)
    if close:
        return f"{key}={value}: no such key; did you mean {close[0]}? ({close[0]}={value})"
    where = f"the keys of {parent or 'the config'}: {', '.join(names)}" if names else \
        "every key: python train.py --cfg job"
    return f"{key}={value}: no such key; {where}"


def run(main: Callable[[], None], doc: str = "", ready: Callable[[], None] | None = None) -> None:
    """Run a ``@hydra.main`` app, with the schemas and resolvers registered (``recipes.compose.
    register``). ``-h``/``--help`` prints our page (``help_page``), not Hydra's.
    Hydra reports a config that fails to compose (an unknown option or key, a wrong type) and
    exits 1; before the task function started, that is a configuration error like any other, so
    it exits 2, after the likely spelling of a mistyped key (``suggestions``)."""
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(help_page(doc))
        return
    sys.argv[1:] = normalize(sys.argv[1:])
    from recipes.compose import register

    register()  # the typed schemas and the resolvers, before Hydra composes
    if ready is not None:  # the script's imports are done; Hydra composes next (train.py: startup)
        ready()
    ours = "HYDRA_FULL_ERROR" not in os.environ
    if ours:  # Hydra's composition error reaches us, not its printer (see ``composition_error``)
        os.environ["HYDRA_FULL_ERROR"] = os.environ[_RAISES] = "1"
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not _started:
            for line in suggestions(sys.argv[1:]):
                print(line, file=sys.stderr)
            sys.exit(CONFIG_ERROR)
        raise
    except KeyboardInterrupt:  # Ctrl-C before a run takes it (checkpoints/interrupt.py), or after
        print("stopped by Ctrl-C", file=sys.stderr)
        sys.exit(INTERRUPTED)
    except Exception as e:
        if _started or not ours:
            raise
        composition_error(e, sys.argv[1:])


def composition_problems(error: Exception, argv: list[str]) -> list[str]:
    """Our lines for a composition error: each key the config does not have (``suggestions``), or
    a value of the wrong type (``_wrong_type``); [] for any other (Hydra's message says it)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    lines = suggestions(argv) if isinstance(error, (HydraException, OmegaConfBaseException)) else []
    return lines or [line for line in [_wrong_type(error)] if line]


def composition_error(error: Exception, argv: list[str]) -> NoReturn:
    """The one place Hydra's composition errors are told (train.py through ``run``; plan.py and
    export.py through ``or_exit``). ``run`` sets ``HYDRA_FULL_ERROR`` until the task function
    starts (``started`` takes it back), so an error while Hydra composes is raised to us instead of
    printed by Hydra -- whose advice for an unknown key is to append it with ``+``, which
    validation then refuses. An override of a key the config does not have is our line
    (``suggestions``: the override, the key we think was meant, the override to write); any other
    error is Hydra's message as Hydra prints it, without its traceback; exit 2 either way."""
    import traceback

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if lines := composition_problems(error, argv):
        print("\n".join(lines), file=sys.stderr)
    elif isinstance(error, (HydraException, OmegaConfBaseException)):
        cause = f"\n{error.__cause__}" if isinstance(error.__cause__, OmegaConfBaseException) else ""
        print(f"{error}{cause}", file=sys.stderr)
    else:  # not a configuration error: a fault of ours or a library's, with its traceback
        traceback.print_exception(error)
        sys.exit(1)
    sys.exit(CONFIG_ERROR)
