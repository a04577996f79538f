"""What train.py and plan.py share at the command line: every configuration error, whether Hydra
finds it while composing or validation finds it after, ends the same way -- one message, no
traceback, exit code 2 -- and the README's spelling ``group=null`` switches an opt-in group off
(Hydra's own spelling is ``~group``).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
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
    in its nearest existing ancestor when it does not exist yet, with a byte in it then (a full
    disk; an existing directory may be a resume, which prunes first) -- nothing is left behind. With
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
    probe = None
    try:
        fd, probe = tempfile.mkstemp(prefix=".stratagem-probe-", dir=here)
        with os.fdopen(fd, "wb") as f:
            if here != path:  # a new directory: a byte written (an empty file fits on a full disk); an
                f.write(b"\0")  # existing one may be a resume whose start prunes (trainer.keep_last)
                f.flush()
                os.fsync(f.fileno())
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        where = (f"create it in {here}" if here != path else "write there" if file is None
                 else f"write in {here}")
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = f"free space there, or point {key} at a disk with room"
        return f"{key}={value}: cannot {where}: {why}; {fix}"
    finally:
        if probe is not None:
            Path(probe).unlink(missing_ok=True)
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


def query(argv: list[str], doc: str, script: str, implied: tuple[str, ...] = ()
          ) -> tuple[object, set[str], list[str], object] | None:
    """The start of a script that queries the config instead of running a job (plan.py,
    export.py): ``--help`` prints ``doc``, the groups and the keys of the options it chooses
    (None); a sweep is one line and exit 2
    (``one_point``); otherwise the composed config (of ``argv`` and the overrides the script
    adds, ``implied``), the groups it chose rather than took by default (``compose_chosen``),
    the normalized overrides and what Hydra recorded (``recipes.origin.Origin``, for ``validate``),
    or the composition error and exit 2."""
    if {"-h", "--help"} & set(argv):
        from recipes.cli_help import groups_help
        from recipes.key_help import option_keys

        print("\n".join([doc, groups_help(argv), "", *option_keys(argv, script)]))
        return None
    if (sweep := one_point(argv, script)) is not None:
        print(sweep, file=sys.stderr)
        sys.exit(CONFIG_ERROR)
    from recipes.compose import compose_chosen

    argv = normalize([*argv, *implied])
    cfg, chosen, origin = or_exit(lambda: compose_chosen(argv), argv)
    return cfg, chosen, argv, origin


def origin() -> object:
    """What Hydra recorded of the running app's composition (``recipes.origin.Origin``): train.py's
    for ``validate``, as plan.py's comes from ``compose_chosen``."""
    from hydra.core.hydra_config import HydraConfig

    from recipes.origin import Origin

    return Origin.of(HydraConfig.get())


SWEEP_FLAGS = ("-m", "--multirun")
_ONE_POINT = {"plan.py": ("plans", "plan"), "export.py": ("writes the files of", "export"),
              "launch.py": ("submits", "submit")}


def one_point(argv: list[str], script: str) -> str | None:
    """Why ``script`` (plan.py, export.py, launch.py: one composition, one job) cannot take this command
    line, in one line with the fix; None when it can. A sweep -- ``-m``/``--multirun``, a comma
    list (``strategy=ddp,fsdp2``) or Hydra's ``range``/``choice``/``glob`` -- reached Hydra's
    "Ambiguous value ... add --multirun" advice, then its lexer error on ``-m``. The fix: a command
    per value; plan.py: the ranking of every preset, and ``train.py -m ... --dry-run``, which
    plans every point of a sweep, but as jobs started on this machine (launchers/dry_run.py)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from recipes.compose import search_args

    flag = next((a for a in argv if a in SWEEP_FLAGS), None)
    search, rest = search_args([a for a in argv if a not in SWEEP_FLAGS])  # (--config-dir: no override)
    try:
        parsed = OverridesParser.create().parse_overrides(rest)
    except Exception:  # noqa: BLE001  (a malformed override: composing it says what is wrong)
        parsed = []
    does, verb = _ONE_POINT[script]
    at = next((i for i, o in enumerate(parsed) if o.is_sweep_override()), None)
    if at is None:
        return None if flag is None else (f"{flag}: {script} {does} one point and takes no {flag}: "
                                           f"python {script} {' '.join([*search, *rest])}".rstrip())
    key, _, text = rest[at].partition("=")
    try:
        values = [str(v) for v in parsed[at].sweep_string_iterator()]
    except Exception:  # noqa: BLE001  (interval(), glob(): not enumerable here)
        values = []
    name = key.lstrip("+~")
    first = " ".join([script, *search, *rest[:at], f"{key}={values[0] if values else '<one value>'}", *rest[at + 1:]])
    then = ", ".join(f"{name}={v}" for v in values[1:])
    line = (f"{rest[at]}: {script} {does} one point, and this sweeps {name} over {', '.join(values) or text}; "
            f"{verb} each value in a command of its own: python {first}" + (f" (then {then})" if then else ""))
    if script == "plan.py" and name == "strategy":
        line += "; or leave strategy out: plan.py ranks every preset"
    if script == "plan.py" and values:
        line += (f"; python train.py -m {' '.join([*search, *rest])} --dry-run plans every point too, as jobs "
                 "started on this machine (checked against its cores and GPUs)")
    return line


def run(main: Callable[[], None], doc: str = "", ready: Callable[[], None] | None = None) -> None:
    """Run a ``@hydra.main`` app, with the schemas and resolvers registered (``recipes.compose.
    register``). ``-h``/``--help`` prints our page (``help_page``), not Hydra's.
    Hydra reports a config that fails to compose (an unknown option or key, a wrong type) and
    exits 1; before the task function started, that is a configuration error like any other, so
    it exits 2, after the likely spelling of a mistyped key (``suggestions``)."""
    if {"-h", "--help"} & set(sys.argv[1:]):
        from recipes.cli_help import help_page

        print(help_page(doc, sys.argv[1:]))
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
            from recipes.cli_help import suggestions

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

    from recipes.cli_help import composition_problems

    if lines := composition_problems(error, argv):
        print("\n".join(lines), file=sys.stderr)
    elif isinstance(error, (HydraException, OmegaConfBaseException)):
        cause = f"\n{error.__cause__}" if isinstance(error.__cause__, OmegaConfBaseException) else ""
        print(f"{error}{cause}", file=sys.stderr)
    elif isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):  # (Hydra's own writes)
        print(f"{os.strerror(error.errno)} while Hydra wrote the run directory's files (.hydra/, the log): "
              "free space there, or point hydra.run.dir at a disk with room", file=sys.stderr)
        sys.exit(1)
    else:  # not a configuration error: a fault of ours or a library's, with its traceback
        traceback.print_exception(error)
        sys.exit(1)
    sys.exit(CONFIG_ERROR)
