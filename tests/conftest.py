"""Shared test harness: run the real CLI in a subprocess (bounded by a timeout), read what it
wrote, and compare runs. Hygiene: Hydra's global state and env vars are restored per test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.zygote import Zygote

ROOT = Path(__file__).resolve().parents[1]
_SESSION_ENV = dict(os.environ)  # (as the session started: no test's changes)


def product_files() -> list[Path]:
    """Every Python file of the product: the tree but tests/, bench/ and what runs leave. Hidden
    folders (.git, CI's .venv-torch211) are pruned, not walked: a venv holds ~100k files."""
    skip = {"tests", "bench", "outputs", "build", "dist"}
    files = []
    for folder, subs, names in os.walk(ROOT):
        subs[:] = sorted(d for d in subs if not (d in skip or d.startswith(".") or d.endswith(".egg-info")))
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files)


GLOO_ABORT = "terminate called without an active exception"
# Small, fast, deterministic: the tiny model in fp32 with dropout off.
# (No plots: drawing loss, memory and communication PNGs is ~2 s of a tiny run's end; the tests
# that look at them, and every run without TINY, draw them.)
TINY = ("model=gpt_nano", "model.dropout=0", "trainer.precision=32", "cluster.accelerator=cpu",
        "callbacks.progress_bar=false", "trainer.warmup_steps=0", "planner.enforce=false",
        "callbacks.plots=false")


# The equivalence setting: every strategy test compares with one single-process run of this.
EQUIV = ("trainer.max_steps=6", "trainer.global_batch_size=8", "trainer.lr=1e-3",
         "trainer.grad_clip=1.0", "trainer.export_params=true")
# ... with each optimizer. AdamW divides a constant gradient scale out of its update, so every
# equivalence test also runs plain SGD without clipping: its update is lr x gradient, and a
# gradient-scale error (a missing or doubled 1/accumulation, a sum instead of a mean over ranks)
# moves the losses by percents (tests/test_equivalence_power.py shows it).
OPTIMIZERS = {
    "adamw": (),
    "sgd": ("trainer.optimizer=sgd", "trainer.lr=0.5", "trainer.grad_clip=0"),
}


def by_optimizer(names, slow_adamw=()) -> list:
    """(name, optimizer) for an equivalence matrix, ids ``name-optimizer``. SGD always runs in the
    CI tier (it sees any gradient-scale error); AdamW does too, except for the names in
    ``slow_adamw``: variants whose AdamW run adds nothing their SGD run and the family's base
    AdamW run do not already show, kept in the slow tier (``pytest -m slow``)."""
    return [pytest.param(n, o, id=f"{n}-{o}", marks=[pytest.mark.slow] if o == "adamw" and n in slow_adamw else [])
            for n in names for o in OPTIMIZERS]


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    out: Path

    @property
    def log(self) -> str:
        return self.proc.stdout + self.proc.stderr

    @property
    def report(self) -> dict:
        return json.loads((self.out / "report.json").read_text())

    @property
    def losses(self) -> list[float]:
        return self.report["losses"]

    def params(self) -> dict:
        import torch

        return torch.load(self.out / "params.pt", map_location="cpu")


def typed(cfg):
    """A composed config as the typed Job the planner reads (validated as plan.py validates:
    what the config says, ``strategy=auto`` left unchosen)."""
    from recipes.job import CONFIG, validate

    return validate(cfg, depth=CONFIG)


RUN_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
_zygote: Zygote | None = None


def _forked(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    """The run forked from tests/zygote.py's pre-imported interpreter (None: start a plain one)."""
    global _zygote
    if os.environ.get("STRATAGEM_TEST_ZYGOTE", "1") == "0":
        return None
    if _zygote is None:
        _zygote = Zygote(Path(tempfile.mkdtemp(prefix="zygote")), {**_SESSION_ENV, **RUN_ENV})
    return _zygote.run(cmd, env, ROOT, timeout)


def pytest_sessionfinish(session, exitstatus):
    if _zygote is not None:
        _zygote.close()


def run_cli(script: str, *overrides: str, out: Path, timeout: float = 240, check: bool = True,
            env: dict[str, str] | None = None, fresh: bool = False) -> Run:
    """``python <script> overrides... hydra.run.dir=<out>`` in a subprocess, with a hard timeout:
    forked from tests/zygote.py's pre-imported interpreter unless ``fresh`` (a run whose start-up
    is measured) or its environment changes what the libraries read at import."""
    cmd = [sys.executable, str(ROOT / script), *overrides, f"hydra.run.dir={out}"]
    full_env = {**os.environ, **RUN_ENV, **(env or {})}
    try:
        proc = None if fresh else _forked(cmd, full_env, timeout)
        if proc is None:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                                  env=full_env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out after {timeout}s (deadlock?): {' '.join(cmd)}\n"
                    f"{(e.stdout or b'')[-3000:]!r}\n{(e.stderr or b'')[-3000:]!r}")
    run = Run(proc, out)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{run.log[-6000:]}"
        # Under Lightning's launcher a rank-1 abort at exit does not change the exit code.
        assert GLOO_ABORT not in run.log, f"a rank aborted at exit:\n{run.log[-3000:]}"
    return run


@pytest.fixture
def train(tmp_path):
    """train(*overrides, name=...) -> Run: a tiny CPU run of train.py in its own directory."""
    counter = iter(range(1000))

    def _train(*overrides: str, name: str | None = None, check: bool = True, timeout: float = 240,
               env: dict[str, str] | None = None) -> Run:
        out = tmp_path / (name or f"run{next(counter)}")
        return run_cli("train.py", *TINY, *overrides, out=out, check=check, timeout=timeout, env=env)

    return _train


def normalized(overrides) -> tuple[str, ...]:
    """Overrides as Hydra applies them (a later value of a key wins), in a canonical order."""
    merged: dict[str, str] = {}
    for o in overrides:
        key, _, value = o.partition("=")
        merged[key] = value
    return tuple(f"{k}={v}" for k, v in sorted(merged.items()))


@pytest.fixture(scope="session")
def cached(tmp_path_factory):
    """cached(*overrides) -> the Run of train.py with TINY + overrides, once per session: the
    Lightning tests and the Accelerate tests ask for the same runs (the same preset, data and
    steps on each backend) and each is trained once."""
    done: dict[tuple[str, ...], Run] = {}

    def get(*overrides: str, timeout: float = 300) -> Run:
        key = normalized((*TINY, "backend=lightning", *overrides))
        if key not in done:
            out = tmp_path_factory.mktemp("cached") / "run"
            done[key] = run_cli("train.py", *key, out=out, timeout=timeout)
        return done[key]

    return get


@pytest.fixture(scope="session")
def reference(cached):
    """reference(optimizer) -> the single-process run of EQUIV with that optimizer (the whole
    global batch in one micro-batch), run once per session."""

    def get(optimizer: str = "adamw") -> Run:
        return cached(*EQUIV, *OPTIMIZERS[optimizer], "strategy=single", "trainer.micro_batch_size=8")

    return get


@pytest.fixture(scope="session")
def single_reference(reference) -> Run:
    """The AdamW reference (tests that compare one optimizer only)."""
    return reference("adamw")


def assert_losses_close(ref: list[float], other: list[float], rtol: float) -> None:
    assert len(ref) == len(other) > 0, (ref, other)
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, other))
    assert worst <= rtol, f"losses differ by {worst:.2e} (relative) > {rtol:g}:\n{ref}\n{other}"


def bf16_valued(state: dict) -> list[str]:
    """The tensors of ``state`` whose every value a bfloat16 holds exactly (a 16-bit copy's)."""
    import torch

    return sorted(k for k, v in state.items() if torch.equal(v, v.bfloat16().float()))


def assert_moe_close(want: dict, got: dict) -> None:
    """Two reports' ``moe`` blocks agree (tokens per expert exactly: the same routing)."""
    assert got["tokens_per_expert"] == want["tokens_per_expert"], (want, got)
    rest = {k: v for k, v in want.items() if k != "tokens_per_expert"}
    assert {k: got[k] for k in got if k != "tokens_per_expert"} == pytest.approx(rest, rel=1e-6), (want, got)


def assert_params_close(ref: dict, other: dict, rtol: float) -> None:
    """Every tensor agrees to ``rtol`` relative to its own largest magnitude."""
    assert ref.keys() == other.keys(), sorted(set(ref) ^ set(other))
    for k in ref:
        a, b = ref[k].float(), other[k].float()
        assert a.shape == b.shape, (k, a.shape, b.shape)
        err = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-12)
        assert err <= rtol, f"parameter {k} differs by {err:.2e} (relative to its max) > {rtol:g}"


# --------------------------------------------------------------------- tiers
TIERS = ("unit", "subprocess", "multiprocess")


def tiers(item) -> list[str]:
    return sorted({m.name for m in item.iter_markers() if m.name in TIERS})


def pytest_collection_modifyitems(config, items):
    """Every test is in exactly one tier (pyproject's markers say what each means), so ``-m unit``
    and friends select exactly what they name. A module whose tests are all of one tier says so
    in ``pytestmark``; a module that mixes tiers marks each test."""
    wrong = [f"{item.nodeid}: {tiers(item) or 'no tier'}" for item in items if len(tiers(item)) != 1]
    if wrong:
        raise pytest.UsageError("tests need exactly one tier marker of " + ", ".join(TIERS) + ":\n"
                                + "\n".join(wrong[:40]))


@pytest.fixture(autouse=True)
def _unit_starts_no_process(request, monkeypatch):
    """A unit test that starts a process fails: the tier means it."""
    if tiers(request.node) != ["unit"]:
        yield
        return

    popen = subprocess.Popen

    def refuse(*args, **kwargs):
        command = args[0] if args else kwargs.get("args")
        if isinstance(command, (list, tuple)) and command and str(command[0]).endswith("/ldconfig"):
            return popen(*args, **kwargs)  # (ctypes.util.find_library: a CUDA torch's first import)
        raise AssertionError(f"{request.node.nodeid} is marked unit but starts a process: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    yield


# --------------------------------------------------------------------- engines imported
ENGINES = ("torch", "lightning", "accelerate", "deepspeed", "transformers", "wandb", "ray", "kubernetes")
_PROBE = """
import atexit, runpy, sys
def _report():
    loaded = sorted({m.split('.')[0] for m in sys.modules} & set(%r))
    sys.stderr.write('ENGINES=' + ','.join(loaded) + '\\n')
atexit.register(_report)
sys.argv = %r
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def engines_loaded(*argv: str, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 120
                   ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``python argv...`` and say which heavy libraries it imported."""
    proc = subprocess.run([sys.executable, "-c", _PROBE % (ENGINES, list(argv))], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    line = next((x for x in proc.stderr.splitlines() if x.startswith("ENGINES=")), "ENGINES=?")
    return proc, [m for m in line.removeprefix("ENGINES=").split(",") if m]


@pytest.fixture(autouse=True)
def _hygiene():
    """Restore env vars and Hydra's global state around every test."""
    env = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(env)
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer (vocab 512, EOS ``<|endoftext|>``) trained on the bundled
    corpus, saved with ``save_pretrained``: its directory (AutoTokenizer loads it; no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(ROOT / "recipes" / "assets" / "corpus.txt")], trainer)
    out = tmp_path_factory.mktemp("hf_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(out))
    return out
