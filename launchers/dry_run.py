"""``python train.py ... --dry-run``: what the command would start, checked as its job will be
(composed, ``strategy=auto`` chosen, validated -- at LAUNCH depth, this machine's cores, GPUs
and files, for a ``cluster.launcher=local`` job, which starts here; else at RUN depth, the run,
not this machine -- and planned), printed, and nothing started or written: exit 0, or 2 with
every problem. A multirun (``-m``) is expanded as Hydra's basic sweeper expands it and every
point is checked (the sweep's preflight, launchers/sweep.py). Hydra's own overrides (``hydra.run.dir=``,
``hydra/launcher=submitit_slurm``) are the launch's, not the job's: shown, not composed.
``launch.py --dry-run`` is the same for the launchers with a submission step (SageMaker,
Kubernetes)."""

from __future__ import annotations

import sys
from typing import Any

FLAG = "--dry-run"
SWEEP_FLAGS = ("-m", "--multirun")


def _split(argv: list[str]) -> tuple[bool, list[str], list[str]]:
    """(a multirun, Hydra's overrides, the job's overrides) of a command line; Hydra's begin with
    where the command line finds configs beyond conf/ (``--config-dir``, ``hydra.searchpath``:
    recipes/compose.py's ``search_args``, ``_search``), with which every job composes."""
    search, args = _search(argv), _search(argv, rest=True)
    sweep = any(a in SWEEP_FLAGS for a in args)
    hydra_own = search + [a for a in args if a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    job = [a for a in args if a not in hydra_own and not a.startswith("-")]
    return sweep, hydra_own, job


def _search(argv: list[str], rest: bool = False) -> list[str]:
    from recipes.compose import search_args

    return search_args([a for a in argv if a != FLAG])[rest]


def points(argv: list[str]) -> list[list[str]]:
    """The jobs the command line starts, as override lists (one without ``-m``)."""
    from recipes.cli import normalize

    sweep, _, job = _split(argv)
    job = normalize(job)
    if not sweep:
        return [job]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(job)
    return [list(p) for batch in BasicSweeper.split_arguments(parsed, None) for p in batch]


def _launch(job: Any, run_dir: str | None = None) -> str:
    """How the job's ranks would start (a multi-node torchrun job: the same command on every node,
    into the run directory its rendezvous names)."""
    from recipes.compose import run_name

    c, size = job.cluster, job.mesh.size
    shape = f"{c.nodes} node(s) x {c.devices} rank(s) on {job.run.accelerator} ({size} in all)"
    nodes = ""
    if c.launcher == "torchrun" and c.nodes > 1:
        nodes = (f"; run this same command on each of the {c.nodes} nodes (node ranks come from the "
                 f"rendezvous at {c.rdzv_endpoint}), into "
                 f"{run_dir or 'outputs/' + run_name(c.nodes, c.launcher, c.rdzv_endpoint)} on a file "
                 "system they share")
    return f"cluster={c.name} (cluster.launcher={c.launcher}): {shape}{nodes}"


def main(argv: list[str]) -> int:
    """Check and print every job of the command line; the exit code (0, or 2: a job cannot run)."""
    import planner
    from launchers import sweep
    from recipes.cli import CONFIG_ERROR
    from recipes.compose import compose_chosen
    from recipes.data_size import held_out_notes
    from recipes.job import validate
    from strategies import ConfigError

    multirun, hydra_own, _ = _split(argv)
    jobs = points(argv)
    submitit = any(a.startswith("hydra/launcher=submitit") for a in hydra_own)
    search = _search(argv)
    checked = sweep.preflight(jobs, local=not submitit, search=search)  # (a submission's jobs run elsewhere)
    if multirun:
        print(checked.message("started or queued"))
    else:
        print(f"--dry-run: the job {'cannot run' if checked.bad else 'composes, validates and plans'}:")
        print(checked.table())
    if hydra_own:
        print(f"Hydra's overrides (the launch's): {' '.join(hydra_own)}")
    if checked.bad:
        return CONFIG_ERROR
    if launch := _launch_problems(multirun, hydra_own, argv, jobs, submitit):
        print("\n".join(f"cannot start: {problem}" for problem in launch))
        print("--dry-run: nothing was started")
        return CONFIG_ERROR
    code = 0
    run_dir = next((a.split("=", 1)[1] for a in hydra_own if a.startswith("hydra.run.dir=")), None)
    for i, overrides in enumerate(jobs):
        try:
            cfg, _, origin = compose_chosen([*search, *overrides])
            job = validate(cfg, depth=sweep.depth(cfg, not submitit), auto=planner.choose, origin=origin,
                           extra=[lambda j: _launcher_problems(j, submitit)])
        except ConfigError as e:
            print(f"cannot start {' '.join(overrides) or '(the base config)'}:\n{e}")
            code = CONFIG_ERROR
            continue
        print(f"would start{f' job {i}' if multirun else ''}: {_launch(job, run_dir)}")
        notes = [*job.implied, *job.strategy.notes(job.run), *held_out_notes(job.data, job.model)]
        print("".join(f"note: {line}\n" for line in notes), end="")
        if (resume := _resume(job, cfg, submitit)) is not None:
            print(resume)
    print("--dry-run: nothing was started")
    return code


def _resume(job: Any, cfg: Any, submitit: bool) -> str | None:
    """What a ``trainer.resume_from`` path loads, as the launch logs it (checkpoints
    ``resume_line``: the model only, and why, where its optimizer state does not carry over),
    and what the launch warns of, each a ``note:`` (checkpoints/resume_settings.py ``notes``);
    preflight checked the checkpoint where the job starts here (``auto``: the run directory's,
    not there yet)."""
    import checkpoints
    from checkpoints.resume_settings import notes
    from launchers import sweep
    from recipes.job import LAUNCH

    path = job.trainer.resume_from
    if path in (None, checkpoints.AUTO) or sweep.depth(cfg, not submitit) != LAUNCH:
        return None
    ckpt = checkpoints.resolve(path, ".", cleanup=False)
    return "\n".join([checkpoints.resume_line(ckpt, job), *(f"note: {line}" for line in notes(ckpt, job))])


def _launch_problems(multirun: bool, hydra_own: list[str], argv: list[str], jobs: list[list[str]],
                     submitit: bool) -> list[str]:
    """What the launch itself refuses before any job: an output directory that cannot be written
    (recipes/cli.py's ``OutputDirectory``), a sweep directory whose job directories hold an
    earlier sweep's results of other overrides (launchers/sweep_dir.py), and a Slurm submission's
    own checks of the config (SlurmSubmission's, not those that ask Slurm)."""
    from recipes.cli import unwritable

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    where = next((a.split("=", 1)[1] for a in hydra_own if a.startswith(f"{key}=")),
                 "multirun" if multirun else "outputs")
    found = [why] if (why := unwritable(key, where)) else []
    given = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in hydra_own if "=" in a}
    if multirun and not found and "hydra.sweep.dir" in given:  # (a default one is new: named by the clock)
        from launchers import sweep_dir

        found = sweep_dir.conflicts(where, jobs, given.get("hydra.sweep.subdir", sweep_dir.BY_NUMBER),
                                    _search(argv))
    if submitit and not found:
        from launchers import slurm
        from recipes.compose import compose

        # (not the Slurm client nor its partitions: a dry run may preview a submission from elsewhere)
        found = slurm.problems(compose([*_search(argv), *jobs[0]]), task=_split(argv)[2], ask=False)
    return found


def _launcher_problems(job: Any, submitit: bool) -> list[str]:
    """What the chosen launcher refuses (cluster.launcher=k8s: use launch.py; ray: not installed, a
    malformed address; torchrun: the rendezvous); a Slurm job's ranks submitted by submitit are
    its tasks, as they should be."""
    from launchers import registry

    if submitit and job.cluster.launcher == "slurm":
        return []
    return registry.get(job.cluster.launcher).problems(job)


def exit_if_asked(argv: list[str] | None = None) -> None:
    """train.py's first step: with ``--dry-run`` on the command line, check, print and exit."""
    argv = sys.argv[1:] if argv is None else argv
    if FLAG in argv and not {"-h", "--help"} & set(argv):
        sys.exit(main(argv))
