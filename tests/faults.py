"""Run train.py with a fault injected -- test-only code, nothing in the product reads it.

    python tests/faults.py [--kill-at STEP --rank R [--once FILE]] [--signal-at STEP --signum NAME]
                           [--slow-save STEP --seconds S] [--pause-at STEP --rank R --seconds S]
                           [--hang-at STEP --rank R --seconds S] [--slow-end --seconds S]
                           [--note FILE] -- <train.py overrides>

--kill-at: rank R SIGKILLs itself right after optimizer step STEP (with --once, only if FILE does
not exist yet, which it then creates: under torchrun's restarts the fault happens once).
--signal-at: rank R sends itself signal NAME (USR1, TERM) right after optimizer step STEP; the
other ranks get none.
--slow-save: the save of STEP sleeps S seconds after the payload is written, before the commit.
--pause-at: rank R, right after optimizer step STEP, notes "pause<R>" and waits up to S seconds
for a stop signal to reach it (checkpoints/interrupt.py's flag): a test signals the job then, and
the run stops after that known step.
--hang-at: rank R, as its optimizer's STEP-th step begins (torch's global step pre-hook: inside
DeepSpeed's ZeRO step too, whose peers then wait in its own groups), notes "hang<R>" and sleeps S
seconds, a stop signal notwithstanding: a rank stuck in its step.
--slow-end: rank 0's own writes at the end of a run each take S seconds longer, after the real
write: its plots (observers/plots.py's ``on_report``; notes "plots0") and params.pt
(``observers.files.atomic_torch_save``; notes "export0") -- a slow disk, or a 70B model's ~280 GB.
--note: where to write "<event> <unix time>" lines (kill, saving), for the test to watch.
The patches are made before train.py runs, so ranks forked by our launcher inherit them; under
torchrun every rank runs this file.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _note(path: str | None, event: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(f"{event} {time.time()}\n")
            f.flush()
            os.fsync(f.fileno())


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser()
    p.add_argument("--kill-at", type=int)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--once")
    p.add_argument("--signal-at", type=int)
    p.add_argument("--signum", default="USR1")
    p.add_argument("--slow-save", type=int)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--pause-at", type=int)
    p.add_argument("--hang-at", type=int)
    p.add_argument("--slow-end", action="store_true")
    p.add_argument("--note")
    args = p.parse_args(argv[:split])
    sys.path.insert(0, str(ROOT))

    if args.kill_at is not None:
        from observers.base import Observers

        step_end = Observers.step_end

        def killing_step_end(self, engine, step, loss):
            step_end(self, engine, step, loss)
            if step == args.kill_at and engine.rank == args.rank:
                if args.once and os.path.exists(args.once):
                    return
                if args.once:
                    Path(args.once).write_text("killed")
                _note(args.note, f"kill{engine.rank}")
                os.kill(os.getpid(), signal.SIGKILL)

        Observers.step_end = killing_step_end

    if args.signal_at is not None:
        from observers.base import Observers

        signalled_step_end = Observers.step_end

        def signalling_step_end(self, engine, step, loss):
            signalled_step_end(self, engine, step, loss)
            if step == args.signal_at and engine.rank == args.rank:
                _note(args.note, f"signal{engine.rank}")
                os.kill(os.getpid(), getattr(signal, f"SIG{args.signum}"))

        Observers.step_end = signalling_step_end

    if args.pause_at is not None:
        from checkpoints.interrupt import current
        from observers.base import Observers

        paused_step_end = Observers.step_end

        def pausing_step_end(self, engine, step, loss):
            paused_step_end(self, engine, step, loss)
            if step == args.pause_at and engine.rank == args.rank:
                _note(args.note, f"pause{engine.rank}")
                deadline = time.time() + args.seconds
                while not current().signum and time.time() < deadline:
                    time.sleep(0.02)

        Observers.step_end = pausing_step_end

    if args.hang_at is not None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        steps = [0]

        def hang(optimizer, *_):
            steps[0] += 1
            if steps[0] == args.hang_at and int(os.environ.get("RANK", "0")) == args.rank:
                _note(args.note, f"hang{args.rank}")
                deadline = time.time() + args.seconds
                while time.time() < deadline:
                    time.sleep(0.1)

        register_optimizer_step_pre_hook(hang)

    if args.slow_save is not None:
        from checkpoints import state

        save = state.save

        def slow_save(h, temp):
            save(h, temp)
            if temp.name.endswith(f"step{args.slow_save}"):
                _note(args.note, f"saving{h.rank}")
                time.sleep(args.seconds)

        state.save = slow_save

    if args.slow_end:
        _slow_end(args.seconds, args.note)

    sys.argv = [str(ROOT / "train.py"), *argv[split + 1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


def _slow_end(seconds: float, note: str | None) -> None:
    """--slow-end (patched before any backend imports the writer by name)."""
    from observers import files, plots

    torch_save, on_report = files.atomic_torch_save, plots.Plots.on_report

    def slow_torch_save(obj, path):
        torch_save(obj, path)
        if Path(path).name == "params.pt":
            _note(note, "export0")
            time.sleep(seconds)

    def slow_on_report(self, engine, report):
        on_report(self, engine, report)
        if engine.rank == 0:
            _note(note, "plots0")
            time.sleep(seconds)

    files.atomic_torch_save, plots.Plots.on_report = slow_torch_save, slow_on_report


if __name__ == "__main__":
    main()
