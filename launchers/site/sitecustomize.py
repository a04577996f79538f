"""Put on a Slurm job's PYTHONPATH by our sbatch script (launchers/slurm.py ``request``), so it runs
as every Python process of the job starts -- before submitit's ``_submit`` imports anything or
unpickles the job, ~2-3 s in which Slurm's SIGUSR1 (``cluster.slurm.requeue_signal_s``, or a
``scancel --signal=USR1``) would end the rank by its default action and leave the job failed.

It only holds the signal: the handler records it in this process's environment, where the task
function's ``checkpoints.interrupt.hold`` takes it over (the run then stops after step 1, saves and
requeues, as for a signal during the engine's build). Standard library only; then the
sitecustomize this one shadows, if the interpreter has one (Debian's, a conda environment's), runs
as it would have.
"""

import os
import signal
import sys

HELD = "STRATAGEM_HELD_SIGNAL"


def _held(signum, frame):
    os.environ[HELD] = str(signum)


signal.signal(signal.SIGUSR1, _held)


def _next_sitecustomize():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_next_sitecustomize()
