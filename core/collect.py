"""Garbage collected in the calling thread before a process group goes: the rule every process
that trained follows at its end (``backends.teardown``, ``backends.teardown_at_exit``, the machine
calibration's ranks). Cyclic garbage holding torch tensors (a module, a DDP wrapper, an optimizer)
left to interpreter finalization is freed there by whatever thread collects, finalization kills
that thread on its way back, and the unwind through torch's C++ frames aborts the process
("terminate called without an active exception", SIGABRT). Standard library only.
"""

from __future__ import annotations


def collect_here(wait_s: float = 10.0) -> None:
    """``gc.collect()`` in the calling thread. While another thread is collecting, ``gc.collect()``
    returns at once without collecting; then wait (up to ``wait_s``) for that collection to end --
    it may be freeing the run's tensors -- and collect here."""
    import gc
    import threading
    import time

    me, ran = threading.get_ident(), []

    def started(phase: str, info: dict) -> None:
        if phase == "start" and threading.get_ident() == me:
            ran.append(True)

    gc.callbacks.append(started)
    try:
        deadline = time.monotonic() + wait_s
        gc.collect()
        while not ran and time.monotonic() < deadline:
            time.sleep(0.005)  # the GIL to the collecting thread
            gc.collect()
    finally:
        gc.callbacks.remove(started)
