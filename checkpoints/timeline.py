"""Which of a run directory's checkpoints are this run's, decided once as it starts
(``checkpoints.for_launch``, in the process that cleans up), and pruning to ``trainer.keep_last``.

``store.prune`` keeps the highest steps in ``<run>/checkpoints``, whoever wrote them, and
``auto`` resumes the highest. So a step<N> of another timeline -- what a rewind leaves, what an
earlier run left before a fresh start (``resume_from=null``) or a resume from another directory's
checkpoint -- would outrank this run's own checkpoints: pruned as soon as they were saved, and
not what ``auto`` resumes. Those move to ``checkpoints/superseded-<time>/`` (nothing is lost).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoints.store import Checkpoint, complete, directory, prune

if TYPE_CHECKING:
    from recipes.job import Job

log = logging.getLogger("checkpoints")


def _step(p: Path) -> int:
    return int(p.name[len("step"):])


def set_aside(ckpt: Checkpoint | None, run_dir: str | Path) -> list[Path]:
    """Move every complete step<N> of ``run_dir`` that is not the timeline this run continues
    (``ckpt``, the checkpoint it resumes; None: a fresh start) to ``superseded-<time>/``: after an
    older checkpoint of this directory (a rewind), its newer ones; else all of them. Returns
    where they went (empty: none moved)."""
    own = directory(run_dir)
    ours = ckpt is not None and ckpt.path.resolve().parent == own.resolve()
    others = [p for p in complete(run_dir) if not ours or _step(p) > ckpt.step]
    if not others:
        return []
    stamp, n = time.strftime("%Y%m%dT%H%M%S"), 1
    aside = own / f"superseded-{stamp}"
    while aside.exists():  # (twice in one second)
        n += 1
        aside = own / f"superseded-{stamp}-{n}"
    aside.mkdir()
    for p in others:
        p.rename(aside / p.name)
    names = ", ".join(p.name for p in others)
    if ours:
        log.warning("resume: %s is older than this run directory's %s: that timeline moved to %s, so "
                    "trainer.resume_from=auto continues this one", ckpt.path.name, names, aside)
    else:
        start = (f"the run starts from {ckpt.path}, another directory's checkpoint" if ckpt else
                 "the run starts fresh (trainer.resume_from=null)")
        log.warning("resume: %s: this run directory's %s (an earlier run's) moved to %s, so this run's "
                    "checkpoints are the ones trainer.keep_last keeps and trainer.resume_from=auto "
                    "continues", start, names, aside)
    return [aside / p.name for p in others]


def best(job: Job, history: dict[str, Any] | None) -> int | None:
    """trainer.keep_best: the step of the best validation so far, whose checkpoint pruning spares."""
    if not job.trainer.keep_best:
        return None
    from recipes.stopping import judge

    found = judge((history or {}).get("validation", [])).best
    return None if found is None else int(found["step"])


def pruned(job: Job, run_dir: str | Path, keep: int, history: dict[str, Any] | None) -> list[Path]:
    """Prune ``run_dir`` to ``trainer.keep_last``, never the checkpoint of step ``keep`` (the one
    just saved, or the one this run resumes) nor keep_best's; log each removed."""
    for p in (gone := prune(run_dir, job.trainer.keep_last, spare=(keep, best(job, history)))):
        log.info("removed checkpoint %s (trainer.keep_last=%d)", p, job.trainer.keep_last)
    return gone


def at_start(job: Job, ckpt: Checkpoint | None, run_dir: str | Path) -> None:
    """As the run starts (the launcher, once the checkpoint to resume is chosen): set aside the
    checkpoints of other timelines (``set_aside``; not under ``auto``, whose choice is the newest),
    then prune to ``trainer.keep_last`` now, not after the next save -- a run resumed with a lower
    keep_last after a full disk frees that space before it writes again."""
    if job.trainer.resume_from != "auto":
        set_aside(ckpt, run_dir)
    if ckpt is not None:
        pruned(job, run_dir, ckpt.step, ckpt.history())
