"""What the memory observer reads of its process and the allocator it leaves behind: the peak
RSS is the process's own, and the observer sets glibc's thresholds for its exact steps and must
hand back an allocator at least as good as glibc's own (issue 43)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY

_GLIBC = r"""
import ctypes, ctypes.util, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(k, ctypes.c_size_t) for k in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.mallinfo2.restype = [ctypes.c_void_p], MallInfo2
"""
"""glibc's malloc, free and mallinfo2 through ctypes, for the scripts below."""

_STEP = r"""
for _ in range(2):  # (a step's k tensors of n bytes, twice: glibc's dynamic rule adapts on the first free)
    blocks = [libc.malloc(n) for _ in range(k)]
    for block in blocks: ctypes.memset(block, 1, n)
    a = libc.mallinfo2()
    for block in blocks: libc.free(block)
    b = libc.mallinfo2()
print(((a.hblkhd - b.hblkhd) + (a.arena - b.arena)) / (n * k))
"""
"""A step as the allocator sees it (``n``, ``k`` set before): the fraction of its bytes a free
hands back to the kernel (mallinfo2: heap and mmapped)."""

_RETURNED = _GLIBC + r"""
from observers.memory import allocate_exactly
mode, n, k = sys.argv[1], int(sys.argv[2]) << 20, int(sys.argv[3])
if mode == "observed":
    allocate_exactly(True); allocate_exactly(False)
elif mode == "regression":  # the mmap threshold set, the trim threshold left at 128 KiB
    libc.mallopt(-3, 32 << 20)
elif mode == "trim64":  # the steady state before: mmap threshold 32 MiB, trim threshold 64 MiB
    libc.mallopt(-3, 32 << 20); libc.mallopt(-1, 64 << 20)
""" + _STEP


def _fraction(script: str, *args: str) -> float:
    """What ``script`` prints in a fresh process (glibc's state is per process)."""
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(proc.stdout.split()[-1])


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_after_the_exact_steps_a_freed_step_stays_in_the_process_as_under_glibcs_defaults():
    """The memory observer's first steps allocate exactly (mallopt), then hand the allocator back.
    Issue 43's regression: the trim threshold stayed at 128 KiB, so every step handed its freed
    heap back to the kernel and faulted it in again (3.7x glibc's page faults per step). Asked
    of glibc itself (mallinfo2: the bytes a free hands back, heap and mmapped), in a fresh process
    per case: a step-sized block freed the second time is kept under glibc's defaults and after
    the exact steps, and handed back under the regression's settings. (The per-step page-fault
    count this test compared before moves 6x between identical processes at this size.)"""
    returned = {mode: _fraction(_RETURNED, mode, "8", "1") for mode in ("default", "observed", "regression")}
    assert returned["default"] == 0 and returned["observed"] == 0, returned
    assert returned["regression"] >= 0.99, returned  # the test can fail: the old settings hand it back


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_large_step_stays_in_the_process_where_glibcs_defaults_hand_it_back():
    """A ZeRO-3 step frees its gathered parameters, gradients and reduce-scatter buffer together:
    on 2 CPU ranks (7.3M parameters, fp32) glibc's defaults handed that back and faulted it in
    again, 14,000 pages a step, and the steady state before (trim threshold 64 MiB) 5,000: 1.2-1.5
    of the plan's step where DDP read 1.0-1.1 (docs/PLANNER.md). Asked of glibc: a step of four
    24 MiB tensors (each under the 32 MiB mmap ceiling, together over any fixed trim threshold)
    is handed back under glibc's defaults and the old settings, and kept in the rank's steady
    state."""
    returned = {mode: _fraction(_RETURNED, mode, "24", "4") for mode in ("default", "trim64", "observed")}
    assert returned["default"] >= 0.99 and returned["trim64"] >= 0.99, returned  # (the premise)
    assert returned["observed"] == 0, returned


_BUILD = _GLIBC + r"""
from observers.memory import MemoryProfile
big = libc.malloc(24 << 20); libc.free(big)  # glibc's dynamic rule: the mmap threshold is now 24 MiB
if sys.argv[1].startswith("observed"):
    MemoryProfile()  # (as every rank makes it, before the backend builds the model)
if sys.argv[1].endswith("strategy"):  # then the preset's strategy sets up (a user's script: alone)
    from observers.memory import allocate_steadily
    allocate_steadily()
n = 8 << 20  # a buffer the build makes, which a measured step will free
a = libc.mallinfo2(); block = libc.malloc(n); ctypes.memset(block, 1, n); b = libc.mallinfo2()
print((b.hblkhd - a.hblkhd) / n)
"""


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_what_the_model_build_allocates_gets_pages_of_its_own():
    """A buffer the build leaves in glibc's heap and a measured step frees stays resident beside
    its replacement's fresh pages: RSS counted both (zero3_offload on 2 ranks read 1.06-1.12 of the
    plan, 0.99 once exact from the build; docs/PLANNER.md). So the observer allocates exactly from
    its construction: an 8 MiB block made after it is mmapped (mallinfo2's hblkhd), where glibc's
    dynamic threshold, raised by an earlier free, puts it in the heap. The preset's strategy,
    which sets the steady state up for a user's own script, leaves the observer's choice as it is
    (it sets up after the observer exists, before the build), and alone gives the steady heap."""
    modes = ("default", "observed", "observed-strategy", "strategy")
    mmapped = {mode: _fraction(_BUILD, mode) for mode in modes}
    assert mmapped["default"] == 0 and mmapped["strategy"] == 0, mmapped  # (without the observer: the heap)
    assert mmapped["observed"] >= 1.0 and mmapped["observed-strategy"] >= 1.0, mmapped


_PEAK = r"""
import resource, subprocess, sys
if sys.argv[1] == "parent":  # a parent that peaked at 600 MB (a notebook, a test runner) ...
    block = bytearray(b"\x01") * (600 << 20)  # (written: resident)
    del block
    sys.exit(subprocess.run([sys.executable, "-c", sys.argv[2], "child"]).returncode)  # ... starts this
from observers.memory import peak_rss, reset_peak_rss
MB = 1 << 20
start, inherited = peak_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
block = bytearray(b"\x01") * (200 << 20)
grown = peak_rss(); del block
assert reset_peak_rss()
print(start // MB, inherited // MB, grown // MB, peak_rss() // MB)
"""


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_the_peak_rss_is_the_processs_own_not_its_parents():
    """Linux carries a parent's peak across fork and exec into the child's ``ru_maxrss``, and
    ``clear_refs`` does not reset it: a 1-rank run started by a test runner that had grown to
    several hundred MB measured that as its step's peak (#37's in-suite offload RSS cases, 375 MB for ZeRO-2
    and ZeRO-3 alike). The observer reads ``VmHWM``: the child's own peak, which grows with what
    it allocates and which the reset lowers."""
    proc = subprocess.run([sys.executable, "-c", _PEAK, "parent", _PEAK], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    start, inherited, grown, after_reset = map(int, proc.stdout.split())
    assert inherited >= 590, proc.stdout  # the kernel's behaviour this guards against, seen here
    assert start < 100 and grown >= start + 195 and after_reset < grown - 150, proc.stdout


@pytest.mark.unit
def test_each_job_measures_its_own_peak_or_states_the_processs(monkeypatch, caplog):
    """A sweep runs one-process jobs one after another in its own process, so the process's peak
    was the largest job's so far (gpt_nano after gpt_small: 749 MiB, 379 alone). A job resets it
    (``clear_refs``; the sweep test in tests/test_launch.py sees each job's own); where the
    kernel cannot, the job states the process's peak when it began (``peak_rss_before``), and a
    process's second job says so."""
    from observers import memory

    if sys.platform.startswith("linux"):
        assert memory.job_peak_start() is None  # (reset: this job's own)
    monkeypatch.setattr(memory, "reset_peak_rss", lambda: False)
    monkeypatch.setattr(memory, "_jobs", 0)
    with caplog.at_level("WARNING", logger="observers.memory"):
        first = memory.job_peak_start()
        assert first and first >= memory.current_rss() and not caplog.records  # (the process's first job)
        second = memory.job_peak_start()
    assert second >= first, (first, second)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "cannot reset a process's peak RSS" in said and "memory.ranks[].peak_rss_before" in said, said


_RELEASED = _GLIBC + r"""
from observers.memory import allocate_exactly, current_rss, release_freed
allocate_exactly(False)  # (a rank's steady state)
n, k = 8 << 20, 4
blocks = [libc.malloc(n) for _ in range(k)]  # a restored state's tensors, each under 32 MiB ...
for block in blocks: ctypes.memset(block, 1, n)
pin = libc.malloc(1024)  # ... below something that lives on (the heap cannot shrink from its top)
a = current_rss()
for block in blocks: libc.free(block)
b = current_rss()
release_freed()
print((a - b) / (n * k), (a - current_rss()) / (n * k))
"""


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_what_the_build_and_restore_freed_goes_back_once_training_starts():
    """A heap that never trims by itself would keep what a restore freed for good (a checkpoint's
    tensors under 32 MiB) resident through the run: each backend hands it back once, before the
    first step (``release_freed``). Asked of the kernel (RSS): four freed 8 MiB blocks under a
    live one stay resident in the steady state and go back on ``release_freed``."""
    proc = subprocess.run([sys.executable, "-c", _RELEASED], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    freed, released = map(float, proc.stdout.split())
    assert freed < 0.05, proc.stdout  # kept: the steady state's premise
    assert released > 0.95, proc.stdout


_CLIENT = _GLIBC + r"""
import torch
from torch.utils.data import DataLoader, TensorDataset

import strategies  # noqa: F401  (the presets join Lightning's registry)

kind, name = sys.argv[1], sys.argv[2]
data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
if kind == "lightning":  # a user's own module, as Lightning's docs write one
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    L.Trainer(strategy=name, accelerator="cpu", devices=1, max_steps=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(Tiny(), DataLoader(data, batch_size=4))
elif kind == "train":  # train.py's rank: backends.run (a 1-process job runs in train.py's process)
    import tempfile
    from pathlib import Path

    import backends
    from recipes.compose import compose
    from recipes.job import validate

    backends.run(validate(compose(sys.argv[3:])), Path(tempfile.mkdtemp()))
else:  # a user's own Accelerate loop, with the hook's one line
    from backends.accelerate import stratagem_accelerator

    acc = stratagem_accelerator(name)
    model = torch.nn.Linear(4, 1)
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     DataLoader(data, batch_size=4))
    for x, y in loader:
        acc.backward(torch.nn.functional.mse_loss(model(x), y)); opt.step(); opt.zero_grad()
n, k = 24 << 20, 4  # then a step as test_a_large_step_... makes it
""" + _STEP


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("kind,name,kept", [("lightning", "auto", False),
                                            pytest.param("lightning", "single", True, marks=pytest.mark.slow),
                                            ("lightning", "zero2", True), ("accelerate", "single", True),
                                            ("train", "single", True)])
def test_a_users_own_script_on_a_preset_allocates_as_train_pys_ranks(kind, name, kept):
    """train.py's ranks set the steady allocator in ``backends.run`` (a 1-process job, in-process:
    the "train" case); a user's own Lightning script (``Trainer(strategy=<preset>)``) gets it from
    the preset's strategy at ``setup_environment`` (``PresetStrategy.begin``: DeepSpeed's replaces
    Lightning's, so zero2 is a case of its own), and an Accelerate script from
    ``stratagem_accelerator``. Asked of glibc after a 1-process fit, as above: a step of four 24
    MiB tensors is kept; under Lightning's own strategy (none of ours ran) it is handed back."""
    job = (*TINY, f"strategy={name}", "trainer.max_steps=2", "callbacks=none", "data.num_workers=0")
    returned = _fraction(_CLIENT, kind, name, *(job if kind == "train" else ()))
    assert (returned == 0) if kept else (returned >= 0.99), (kind, name, returned)
