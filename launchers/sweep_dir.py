"""A sweep directory used again: an earlier sweep's job results a new job must not take for its
own, and how a local sweep stopped by a signal continues.

Hydra names a basic sweep's job directories by job number (``<hydra.sweep.dir>/<N>``,
``hydra.sweep.subdir``), so a new sweep into a directory an earlier sweep used gives ``<N>`` to
whatever job has that number now. A job directory holds its run's results: checkpoints, which
``trainer.resume_from=auto`` continues (or calls "already finished"), and ``report.json``, which
the sweep report reads. A job whose overrides differ from those of the earlier job there would
take that job's results as its own -- resume another strategy's checkpoint, report another
configuration's numbers under its overrides -- so ``conflicts`` refuses the sweep before any job
starts (``SweepReport``, ``--dry-run``). The same sweep again (every job's overrides as they
were: a Ctrl-C'd sweep finished, a requeue) resumes; so does one that only raises what our
"already finished" line says to raise (``CONTINUES``). Lowering one of those is refused like any
other change: a job at step 300 asked for ``trainer.max_steps=100`` is "already finished" and
would be reported, 300 steps' numbers, under the new value.

``stopped``: Ctrl-C (or SIGTERM) in a local sweep stops the sweep once the running job saved its
checkpoint; it says so as a single run does (the checkpoint, the command that resumes that job),
writes the sweep report of the jobs that ran and prints the command that finishes the sweep: the
same ``-m`` command line with ``hydra.sweep.dir`` pinned, which resumes the stopped job (the same
overrides: no conflict) and runs the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

log = logging.getLogger("launchers.sweep")

BY_NUMBER = "${hydra.job.num}"
"""conf/hydra/default.yaml's ``hydra.sweep.subdir``: job directories named by job number."""
CONTINUES = ("trainer.max_steps", "trainer.early_stopping.patience")
"""Keys a new sweep may raise (or keep) and still continue the earlier jobs: what
checkpoints.Finished says to raise. Lowered, they are a changed override (``_lowered``)."""
NEVER = {"trainer.early_stopping.patience": 0}
"""A ``CONTINUES`` value that means "no limit" (patience 0: never stop early): above any other."""
NOT_THE_JOB = ("preflight",)
"""Keys that say how the sweep starts, not what a job trains (``+preflight=false``)."""


def _keyed(overrides: Sequence[str], skip: tuple[str, ...] = CONTINUES + NOT_THE_JOB) -> dict[str, str]:
    """An override list as key -> value (the order on the command line is not the job's
    configuration), without the keys in ``skip`` (by default ``CONTINUES`` and ``NOT_THE_JOB``)."""
    out = {}
    for o in overrides:
        key, _, value = str(o).partition("=")
        if key.lstrip("+") not in skip:
            out[key.lstrip("+")] = value
    return out


def _results(job: Path) -> list[str]:
    """What a job directory holds that a new job there would take as its own."""
    found = ["a checkpoint"] if any((job / "checkpoints").glob("step*")) else []
    return found + (["report.json"] if (job / "report.json").exists() else [])


def _shown(overrides: dict[str, str], keys: list[str]) -> str:
    return " ".join(f"`{k}={overrides[k]}`" if k in overrides else f"`{k}` unset" for k in keys)


def _number(key: str, value: Any) -> float | None:
    """A ``CONTINUES`` value as a number to compare (``NEVER``'s: infinity); None: not one."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return float("inf") if NEVER.get(key) == number else number


def _lowered(old: Sequence[str], new: Sequence[str], old_config: Any, new_config: Any) -> list[str]:
    """The ``CONTINUES`` keys this job lowers from the earlier job's: "<old> there, <new> in this
    sweep's job". A key neither overrides has the value both compose to (the other overrides are
    the same); one side's default is read from its composed config (a loader: the earlier job's
    ``.hydra/config.yaml``, this point composed), only then."""
    out = []
    for key in CONTINUES:
        given = {"there": _keyed(old, skip=()).get(key), "here": _keyed(new, skip=()).get(key)}
        if given["there"] is None and given["here"] is None:
            continue
        shown = {}
        for side, config in (("there", old_config), ("here", new_config)):
            if given[side] is None:
                try:
                    loaded = config()
                    given[side] = None if loaded is None else OmegaConf.select(loaded, key, default=None)
                except Exception:  # noqa: BLE001  (unreadable: this key is not compared)
                    given[side] = None
                shown[side] = f"`{key}={given[side]}` (its default)"
            else:
                shown[side] = f"`{key}={given[side]}`"
        was, now = _number(key, given["there"]), _number(key, given["here"])
        if was is not None and now is not None and now < was:
            out.append(f"{shown['there']} there, {shown['here']} in this sweep's job")
    return out


def _composed(point: Sequence[str], search: Sequence[str] = ()) -> Any:
    """A loader of the point's composed config (None when it does not compose: preflight says why)."""
    cache: list[Any] = []

    def load() -> Any:
        if not cache:
            from recipes.compose import compose

            try:
                cache.append(compose([*search, *point]))
            except Exception:  # noqa: BLE001  (an invalid point: preflight names its problem)
                cache.append(None)
        return cache[0]
    return load


def _recorded(job: Path) -> Any:
    """A loader of the config the earlier job ran (``.hydra/config.yaml``; None without one)."""
    path = job / ".hydra" / "config.yaml"
    return lambda: OmegaConf.load(path) if path.is_file() else None


def conflicts(sweep: str | Path, points: Sequence[Sequence[str]], subdir: str = BY_NUMBER,
              search: Sequence[str] = ()) -> list[str]:
    """One sentence per job of this sweep (``points``, in job order) whose directory in ``sweep``
    holds an earlier job's results under other overrides, naming both and the fix; [] when every
    job may run there (a new directory, the same sweep again, job directories named otherwise)."""
    sweep = Path(sweep).absolute()
    if subdir != BY_NUMBER or not sweep.is_dir():
        return []
    out = []
    for num, point in enumerate(points):
        job = sweep / str(num)
        recorded = job / ".hydra" / "overrides.yaml"
        held = _results(job) if recorded.is_file() else []
        if not held:
            continue
        listed = OmegaConf.to_container(OmegaConf.load(recorded)) or []
        old, new = _keyed(listed), _keyed(point)
        differ = [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
        if differ:
            out.append(f"hydra.sweep.dir={sweep}: job {num}'s directory {job} holds {' and '.join(held)} "
                       f"of an earlier sweep's job with other overrides ({_shown(old, differ)} there, "
                       f"{_shown(new, differ)} in this sweep's job {num}): this job would resume or "
                       "report that run as its own; set hydra.sweep.dir to a new directory, or remove "
                       f"{job} (the earlier sweep's command, run again, resumes it)")
        elif lowered := _lowered(listed, point, _recorded(job), _composed(point, search)):
            out.append(f"hydra.sweep.dir={sweep}: job {num}'s directory {job} holds {' and '.join(held)} "
                       f"of an earlier sweep's job run to a later end ({'; '.join(lowered)} {num}): a lower "
                       "value does not continue that run -- this job would call it finished and report "
                       "its numbers under this sweep's value; only the same value or a raised one "
                       f"continues it. Set hydra.sweep.dir to a new directory, or remove {job}")
    return out


def refuse(config: Any, points: Sequence[Sequence[str]]) -> None:
    """``SweepReport``'s first check: exit 2 naming every job whose directory holds another
    configuration's results, before anything starts or is queued."""
    import sys

    from recipes import cli

    subdir = OmegaConf.to_container(config.hydra.sweep).get("subdir")  # (unresolved: ${hydra.job.num})
    from recipes.compose import search_of

    found = conflicts(str(config.hydra.sweep.dir), points, str(subdir), search_of(config))
    if found:
        log.error("the sweep directory holds an earlier sweep's jobs; nothing was started:\n%s",
                  "\n".join(f"  - {x}" for x in found))
        sys.exit(cli.CONFIG_ERROR)


def stopped(error: Exception, earlier: dict[Path, int] | None) -> None:
    """A local sweep stopped by a signal (``error``: ``launchers.Stopped``, naming the checkpoint
    and the command that resumes this job): said, the report of the jobs that ran written, and
    the command that finishes the sweep printed."""
    from hydra.core.hydra_config import HydraConfig

    from launchers import resume, sweep as report

    hydra = HydraConfig.get()
    sweep = Path(str(hydra.sweep.dir))
    log.error("%s", error)
    try:
        report.write(sweep, earlier)
        written = f"the report of the jobs that ran: {sweep / 'sweep_report.md'}"
    except Exception as e:  # noqa: BLE001  (the stop is the news: a report that fails only says so)
        written = f"no sweep report ({type(e).__name__}: {e})"
    log.error("the sweep stopped in job %s (%s); to finish it (job %s resumes from its checkpoint, "
              "the jobs after it start): %s", hydra.job.num, written, hydra.job.num,
              resume.sweep_command(sweep))
