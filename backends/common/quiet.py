"""The one place where third-party console noise is filtered: what Lightning, DeepSpeed, torch and
Accelerate print on every run that tells the user nothing they can act on.

``install()`` is called by ``backends.run`` in every process that trains (each rank, whichever
launcher started it, and the single process of a one-process run) before the engine builds
anything. Every entry is scoped -- a warning by its exact message (and, where the engine
attributes it to its own module, that module), a log record by its logger and text, a logger by
its name -- and says why it is noise (``NO_DEVICE_RECORDS`` only on a host with no CUDA device). Nothing else is touched: there is no global warnings filter
(``warnings.simplefilter("ignore")``), so a new warning still shows. ``STRATAGEM_QUIET=0`` in the
environment turns all of this off (everything the engines print comes back).

Besides the filters, one cause is fixed here: Lightning's top package adds its own console handler
to the ``lightning`` logger while its subpackages' records also propagate to the root logger, where
Hydra's console and ``train.log`` handlers are; every Lightning INFO line was printed twice. Its
handler is removed when the root has handlers, so each line is printed once, in Hydra's format, and
lands in ``train.log``.

One thread's traceback is not printed: TensorBoard's event writer's, on an OSError the training
thread raises again at its next write and logger=tensorboard says in one line (``tensorboard_writer``).

Ranks other than 0 log warnings and errors only (``recipes.cli.rank_aware_logging``). A few
warnings our own code provokes around one call are silenced there, around that call
(``observers/comm.py``: re-registering its counting kernels; ``checkpoints/state.py``: reading a
checkpoint without a process group, and DeepSpeed's zero_to_fp32 progress prints around its call).
Noise we provoked ourselves is removed at its cause instead (the Accelerate FSDP2 builder passes no
``sync_module_states``, which Accelerate would call obsolete on every rank).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
import sys
import threading
import warnings
from dataclasses import dataclass

from core.hooks import after_import


@dataclass(frozen=True)
class Noise:
    """A warning to ignore: ``message`` matches the start of its text (a regular expression, as
    ``warnings.filterwarnings`` takes it); ``module``, when given, the module it is attributed to."""

    message: str
    why: str
    module: str = ""
    category: type[Warning] = Warning


WARNINGS: tuple[Noise, ...] = (
    Noise(r"`isinstance\(treespec, LeafSpec\)` is deprecated",
          "torch 2.13 deprecates LeafSpec; Lightning 2.6's own pytree helper still uses it "
          "(once per rank, per run)", module=r"lightning\."),
    Noise(r"The `srun` command is available on your system but is not used",
          "Lightning's Slurm hint, printed per Trainer whenever srun is on the PATH; the launch is "
          "ours (cluster.launcher), and a run under srun is recognised without it"),
    Noise(r"You defined a `validation_step` but have no `val_dataloader`",
          "validation is the observers' bridge, not Lightning's loop (limit_val_batches=0)"),
    Noise(r"Since DeepSpeed handles gradient clipping internally",
          "our module routes clipping to the strategy, which has DeepSpeed clip in its own step "
          "(the config's gradient_clipping); nothing is skipped"),
    Noise(r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
          "DeepSpeed's ZeRO calls these torch collectives on every step", category=FutureWarning),
    Noise(r"Please use DTensor instead and we are deprecating ShardedTensor",
          "torch's FSDP1 state dicts use ShardedTensor internally (saved and loaded through DCP)",
          module=r"torch\.distributed\.(fsdp|checkpoint|_state_dict_utils)\b"),
    Noise(r"`_get_pg_default_device` will be deprecated",
          "torch's FSDP1 calls its own deprecated helper", module=r"torch\.distributed\.fsdp\."),
    Noise(r"Multiple backends are registered with this ProcessGroup",
          "the same helper, on a gloo process group on CPU", module=r"torch\.distributed\.fsdp\."),
    Noise(r"FSDP2-wrapped module \(FSDPGPT\) returned a view tensor",
          "torch's FSDP2 on a 2-D mesh (tp, fsdp_tp, fsdp_ep) when our GPT's root returns the logits "
          "as a view of the gathered output, per rank: it warns of an in-place op on that view, and "
          "our loss never writes into the logits (runs equal the single process); a user's own "
          "model class is not named here, so its warning still shows",
          module=r"torch\.distributed\.fsdp\.", category=UserWarning),
    Noise(r"OMP_NUM_THREADS/MKL_NUM_THREADS unset, we set it at 1",
          "Accelerate's note on its CPU state, per rank"),
    Noise(r"`is_gradient_checkpointing` is deprecated",
          "peft reads transformers' deprecated alias (getattr(model, 'is_gradient_checkpointing')) "
          "each time it wraps or saves a LoRA model: per rank at build, per checkpoint, at save_hf",
          module=r"transformers\.modeling_utils", category=FutureWarning),
)

# logger -> a regular expression searched in the message: those records are dropped.
RECORDS: dict[str, tuple[str, str]] = {
    "lightning.pytorch.utilities.rank_zero": (
        r"💡 Tip: .*(litlogger|litmodels)", "Lightning's adverts for its cloud logger and model registry"),
    "DeepSpeed": (
        r"Setting accelerator to CPU", "DeepSpeed's notice that it found no GPU when imported on a "
        "CPU run (or for a checkpoint export): the accelerator is cluster.accelerator's"),
    "accelerate.utils.dataclasses": (
        r"sharding_strategy is deprecated in favor of reshard_after_forward",
        "Accelerate's FSDP plugin with fsdp_version=1 (FSDP1 presets) still reads sharding_strategy"),
    "torch.distributed.tensor._redistribute": (
        r"^While redistributing from \(_StridedShard\(dim=0, sf=\d+\), Shard\(dim=0\)\) to "
        r"\(Replicate\(\), Replicate\(\)\), 2 sequential all_gather operations will be performed",
        "torch's DTensor on a 2-D mesh (fsdp_tp, fsdp_ep), once per rank: full parameters (export, "
        "checkpoints) gathered in two steps; every rank gathers in the same order and the runs equal "
        "the single process, so 'inconsistent results' does not apply; other placements (and the "
        "gradient norm's _NormPartial, which parallel/clip.py no longer reduces through DTensor) "
        "still show"),
    "torch.distributed.elastic.multiprocessing.api": (
        r"^failed \(exitcode: (130|138|143)\)",
        "torch's agent reports, with a traceback of its own, a rank that ended with 128 + SIGINT, "
        "SIGUSR1 or SIGTERM: our ranks exit so only after every rank saved on a stop signal "
        "(launchers/local.py), and the launcher says so, with the command that resumes"),
}

# The same, only on a host with no CUDA device: a GPU user must still see it should it apply to them.
NO_DEVICE_RECORDS: dict[str, tuple[str, str]] = {
    "torch.utils.cpp_extension": (
        r"^No CUDA runtime is found, using CUDA_HOME=",
        "torch's CUDA wheel (2.11+cu130, the CI leg's) on a host without a GPU says so once per rank "
        "when DeepSpeed or torch.compile imports cpp_extension; a CPU run cannot act on it"),
}


def cuda_device() -> bool:
    """This host has a CUDA device: one the driver lists (``/dev/nvidia<N>``) or torch sees."""
    import glob

    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


# logger -> the lowest level shown.
LEVELS: dict[str, tuple[int, str]] = {
    "compilers": (logging.WARNING, "distutils' compiler (setuptools), with which DeepSpeed's op builders "
                                   "probe for libaio and friends: every gcc command line at INFO"),
}

# A line printed (``print``) by DeepSpeed when its CPU shared-memory collective op has loaded.
DEEPSPEED_BUILT = re.compile(r"^DeepSpeed \S+ built successfully\n?$")


def enabled() -> bool:
    return os.environ.get("STRATAGEM_QUIET", "1") != "0"


class _Drop(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def install(device: bool | None = None) -> None:
    """Apply every filter above in this process (idempotent; ``NO_DEVICE_RECORDS`` only where
    ``device``, by default ``cuda_device()``, is false); fix Lightning's second handler once
    Lightning is imported, DeepSpeed's print once its communication backend is."""
    if not enabled():
        return
    for n in WARNINGS:
        warnings.filterwarnings("ignore", message=n.message, category=n.category, module=n.module)
    device = cuda_device() if device is None else device
    for name, (pattern, _) in (RECORDS | ({} if device else NO_DEVICE_RECORDS)).items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_Drop(pattern))
    for name, (level, _) in LEVELS.items():
        logging.getLogger(name).setLevel(level)
    after_import("lightning", then="backends.common.quiet:lightning_once")
    after_import("deepspeed.comm.torch", then="backends.common.quiet:deepspeed_prints")
    after_import("transformers", then="backends.common.quiet:transformers_bars")
    after_import("tensorboard.summary.writer.event_file_writer", then="backends.common.quiet:tensorboard_writer")


def lightning_once() -> None:
    """Drop the console handler ``lightning/__init__.py`` adds to the ``lightning`` logger when
    the root logger has handlers (Hydra's): Lightning's records propagate there already."""
    lightning = logging.getLogger("lightning")
    if not logging.getLogger().handlers:
        return
    for handler in list(lightning.handlers):
        if type(handler) is logging.StreamHandler:
            lightning.removeHandler(handler)


def tensorboard_writer() -> None:
    """TensorBoard's event writer thread re-raises the OSError it could not write with (a full
    disk, a read-only one), which Python prints as "Exception in thread ..." and its traceback;
    the writer raises the same error in the training thread at its next write or flush, and
    logger=tensorboard says it in one line (observers/loggers.py ``cannot_write``). That thread's
    OSError is not printed; any other exception of any thread is, by the hook there was before."""
    from tensorboard.summary.writer import event_file_writer

    before = threading.excepthook
    if getattr(before, "_quiet", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (isinstance(args.thread, event_file_writer._AsyncWriterThread)
                and isinstance(args.exc_value, OSError)):
            before(args)

    hook._quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def transformers_bars() -> None:
    """transformers' tqdm bars ("Loading weights", "Writing model shards") for a model of a few
    shards, drawn per rank into the log: off, through transformers' own switch."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def deepspeed_prints() -> None:
    """DeepSpeed's torch backend prints ``DeepSpeed <op> built successfully`` on every rank when it
    loads its shared-memory op: that line is dropped, anything else it prints passes."""
    import importlib

    # (not ``import deepspeed.comm.torch as ...``: that reads the attribute ``torch`` of
    # deepspeed.comm, which is the torch package itself once deepspeed.comm's star import ran)
    ds_torch = importlib.import_module("deepspeed.comm.torch")

    build = ds_torch.build_shm_op
    if getattr(build, "_quiet", False):
        return

    @functools.wraps(build)
    def quiet_build():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            op = build()
        sys.stdout.write("".join(line for line in printed.getvalue().splitlines(keepends=True)
                                 if not DEEPSPEED_BUILT.match(line)))
        return op

    quiet_build._quiet = True
    ds_torch.build_shm_op = quiet_build
