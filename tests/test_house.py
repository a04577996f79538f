"""The house: the import arrows docs/ARCHITECTURE.md draws (anywhere in a file, functions
included), engine-neutral packages that import no engine (AST and grep), answers before imports
(plan.py and ``--cfg job`` load no engine), Lightning registration in either import order, what
a change touches (a throwaway family, preset, backend, observer, logger and launcher in a copy
of the tree), and the package data a regular install needs."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY, engines_loaded, product_files

OURS = ("core", "parallel", "strategies", "planner", "recipes", "observers", "checkpoints", "backends", "launchers")
NEUTRAL = ("core", "parallel", "strategies", "planner", "recipes", "observers")  # no engine, at any level
ENGINE_LIBS = ("lightning", "accelerate", "deepspeed")


def _rules() -> dict[str, set[str]]:
    """package -> the packages of ours it may import, from ARCHITECTURE.md's import table."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("<!-- import-rules -->")[1].split("<!-- /import-rules -->")[0]
    rules = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        package = re.fullmatch(r"`(\w+)/`", cells[0])
        if package:
            rules[package.group(1)] = set(re.findall(r"`(\w+)`", cells[-1]))
    return rules


def _imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, anywhere in the file (functions and
    classes too), and every module named to ``importlib.import_module`` / ``__import__``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) in ("__import__", "import_module"))):
            out.add(node.args[0].value.split(".")[0])
    return out


# A grep-level check beside the AST one: any line that imports an engine, however spelled.
_GREP = re.compile(r"^\s*(import|from)\s+(%s)\b|import_module\(\s*[\"'](%s)\b|__import__\(\s*[\"'](%s)\b"
                   % (("|".join(ENGINE_LIBS),) * 3), re.MULTILINE)


def _grep_engines(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
            for i, line in enumerate(path.read_text().splitlines(), 1) if _GREP.search(line)]


@pytest.mark.unit
def test_the_table_covers_every_package():
    assert set(_rules()) == set(OURS)


@pytest.mark.unit
@pytest.mark.parametrize("package", OURS)
def test_imports_follow_the_architecture(package):
    allowed = _rules()[package] | {package}
    for path in sorted((ROOT / package).rglob("*.py")):
        wrong = (_imports(path) & set(OURS)) - allowed
        assert not wrong, (f"{path.relative_to(ROOT)} imports {sorted(wrong)}; docs/ARCHITECTURE.md "
                           f"allows {package}/ only {sorted(allowed - {package})}")


@pytest.mark.unit
@pytest.mark.parametrize("package", NEUTRAL)
def test_engine_neutral_packages_import_no_engine(package):
    files = sorted((ROOT / package).rglob("*.py"))
    by_ast = {str(p.relative_to(ROOT)): sorted(_imports(p) & set(ENGINE_LIBS)) for p in files}
    assert not {k: v for k, v in by_ast.items() if v}, by_ast
    by_grep = [hit for p in files for hit in _grep_engines(p)]
    assert not by_grep, by_grep


@pytest.mark.unit
def test_the_rules_see_a_hidden_arrow(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from recipes.gpt import GPT\n    import importlib\n"
                   "    importlib.import_module('deepspeed.zero')\n    import lightning as L\n")
    assert {"recipes", "deepspeed", "lightning"} <= _imports(bad)
    assert "recipes" not in _rules()["strategies"]
    hits = [h for h in _GREP.finditer(bad.read_text())]
    assert len(hits) == 2  # import_module('deepspeed...') and import lightning


@pytest.mark.unit
def test_strategies_name_a_backend_only_for_lightnings_registry():
    """The one reference from strategies/ to a backend: the deferred registration hook."""
    hits = [(str(p.relative_to(ROOT)), line.strip()) for p in sorted((ROOT / "strategies").rglob("*.py"))
            for line in p.read_text().splitlines() if re.search(r"[\"']backends\.", line)]
    assert hits == [("strategies/__init__.py", 'after_import("lightning.pytorch.strategies", '
                                              'then="backends.lightning.registry:register")')], hits


# --------------------------------------------------------------------- answers before imports
@pytest.mark.subprocess
@pytest.mark.parametrize("argv", [
    ("plan.py", "model=llama_70b", "cluster=slurm_8x8_h100"),
    ("plan.py", "model=llama_7b", "cluster=node_8x_a100_80g", "strategy=zero3", "planner.format=json"),
    ("train.py", "--cfg", "job", "strategy=zero3", "model=llama_1b"),
    ("train.py", "--help", "strategy=fsdp2"),  # (with an option: its keys, composed)
], ids=["plan-all", "plan-one", "cfg-job", "help"])
def test_no_engine_is_imported_to_answer(argv, tmp_path):
    proc, loaded = engines_loaded(*argv, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert loaded == [], f"{' '.join(argv)} imported {loaded}"


@pytest.mark.subprocess
def test_help_lists_only_real_options():
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    groups = proc.stdout.split("config groups")[1].split("common keys")[0]
    assert "_schema" not in groups, groups
    assert re.search(r"strategy:\s+3d, auto, ddp,", groups) and re.search(r"logger:\s+csv, tensorboard, wandb", groups)


@pytest.mark.subprocess
def test_the_lightning_backend_defers_the_transformers_torchmetrics_imports():
    """torchmetrics imports transformers when installed (~2 s a process) and scipy.signal (~1.5 s):
    the Lightning backend defers those names (backends/lightning/torchmetrics_imports.py); used, they are the real ones."""
    pytest.importorskip("transformers")
    code = ("import sys\n"
            "import backends.lightning.trainer\n"
            "assert 'lightning' in sys.modules and 'transformers' not in sys.modules\n"
            "assert 'scipy.signal' not in sys.modules and 'scipy.stats' not in sys.modules\n"
            "import scipy.signal\n"
            "assert scipy.signal.windows.hamming(4).shape == (4,)\n"
            "from torchmetrics.functional.text import bert\n"
            "import transformers\n"
            "assert transformers.AutoModel.__module__.startswith('transformers.')\n"
            "assert bert.AutoTokenizer.from_pretrained == transformers.AutoTokenizer.from_pretrained\n"
            "from backends.lightning.torchmetrics_imports import _Deferred\n"
            "assert isinstance(transformers.PretrainedConfig(), _Deferred('PretrainedConfig'))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


# --------------------------------------------------------------------- Lightning's registry
ORDERS = {"strategies first": ("strategies", "lightning"), "lightning first": ("lightning", "strategies"),
          # (what train.py and an Accelerate user's `from backends.accelerate import ...` import:
          # `backends` imports `strategies`, whose registration then ran inside it and failed)
          "lightning, then backends": ("lightning", "backends")}


@pytest.mark.subprocess
@pytest.mark.parametrize("order", ORDERS)
def test_presets_register_in_either_import_order(order):
    first, second = ORDERS[order]
    code = (f"import {first}, {second}\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "import strategies as s\n"
            "missing = [n for n in s.names() if f'stratagem_{n}' not in StrategyRegistry]\n"
            "assert not missing, missing\n"
            "print(type(StrategyRegistry.get('zero3')).__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "CPUCapableDeepSpeedStrategy"


# --------------------------------------------------------------------- what a change touches
def _touches() -> dict[str, list[str]]:
    """change -> the paths docs/ARCHITECTURE.md says it touches."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("<!-- change-touches -->")[1].split("<!-- /change-touches -->")[0]
    out = {}
    for line in table.strip().splitlines()[2:]:
        change, files = (c.strip() for c in line.strip().strip("|").split("|")[:2])
        out[change] = re.findall(r"`([^`]+)`", files)
    return out


_FAMILY = '''
"""A throwaway family: one process, with a footprint and a plan of its own."""
from dataclasses import dataclass

from core.knobs import knob
from strategies.base import StrategyConfig, family
from strategies.footprint import Footprint


@dataclass(frozen=True)
class MineFootprint(Footprint):
    def notes(self, n):
        return ["mine: one process, every block checkpointed"]


@family("mine")
@dataclass
class MineConfig(StrategyConfig):
    """One process with every block checkpointed, as a new family would start."""

    flavour: int = knob(1, min=1)
    """A knob only this family has."""

    def problems(self, run):
        return [] if run.mesh.size == 1 else [f"strategy=mine runs one process, not {run.mesh.size}"]

    def footprint(self):
        return MineFootprint()

    def plan(self, mesh):
        from parallel.parallelize import ParallelPlan

        return ParallelPlan(activation_checkpointing=True)
'''
_PRESET = "defaults:\n  - /mine_schema@_here_\n  - _self_\nname: mine\nflavour: 3\n"
_BUILDER = '''
"""The throwaway family on Lightning: single's builder, which applies the family's plan."""
from backends.lightning.families import builds
from backends.lightning.families.single import PresetSingleDeviceStrategy
from strategies.families.mine import MineConfig


@builds(MineConfig)
class Mine(PresetSingleDeviceStrategy):
    pass
'''
_BACKEND = '''
"""A throwaway backend: strategy=single in a plain torch loop over the recipe (recipes/training.py,
the same data order), feeding the observers as every backend does."""
from dataclasses import dataclass


def problems(job):
    return [] if job.strategy.name == "single" else ["backend=mine runs strategy=single only"]


@dataclass
class Engine:
    model: object
    opt: object
    rank: int = 0
    world_size: int = 1
    norm: float | None = None

    @property
    def optimizers(self):
        return [self.opt]

    def grad_norm(self):
        return self.norm

    def held_bytes(self, what):
        return 0


def build(job, out, observers):
    from recipes import training

    model = training.build_model(job.model, job.trainer.seed)
    names = ([n for n, _ in model.named_parameters()], training.no_decay_names(model))
    opt = training.build_optimizer(training.param_groups(model.named_parameters(), job.trainer, *names),
                                   job.trainer)
    return job, Engine(model, opt), observers


def fit(built):
    import torch
    from torch.utils.data import DataLoader

    from backends import Outcome
    from recipes import training
    from recipes.data import GlobalBatchSampler, build_datasets

    job, engine, observers = built
    t = job.trainer
    data, _ = build_datasets(job.data, job.model, t.seed)
    sampler = GlobalBatchSampler(len(data), global_batch=job.batch.global_size, micro_batch=job.batch.per_step,
                                 dp_rank=0, dp_size=1, seed=t.seed, steps=t.max_steps)
    batches, sched = iter(DataLoader(data, batch_sampler=sampler)), training.build_scheduler(engine.opt, t)
    observers.train_start(engine, 0)
    for step in range(t.max_steps):
        micro = []
        for _ in range(job.batch.accumulation):
            loss = training.loss(engine.model, next(batches))
            (loss / job.batch.accumulation).backward()
            micro.append(loss.item())
        engine.norm = float(torch.nn.utils.clip_grad_norm_(engine.model.parameters(), t.grad_clip or float("inf")))
        engine.opt.step()
        engine.opt.zero_grad()
        sched.step()
        observers.step_end(engine, step + 1, sum(micro) / len(micro))
    return Outcome(rank=0, report=observers.train_end(engine))
'''
_CHECK = '''
import json, subprocess, sys
import strategies
from backends import check
from recipes.config import compose
from recipes.job import CONFIG, RUN, validate
from planner import plan_all

job = validate(compose(["strategy=mine", "model=gpt_nano"]), depth=RUN)
assert type(job.strategy).__name__ == "MineConfig" and job.strategy.flavour == 3, job.strategy
assert job.run.mesh.size == 1 and check(job) == []
plans = {p.strategy: p for p in plan_all(validate(compose(["model=gpt_nano"]), depth=CONFIG)).plans}
assert "mine: one process, every block checkpointed" in plans["mine"].notes, plans["mine"].notes
from lightning.pytorch.strategies import StrategyRegistry
assert type(StrategyRegistry.get("mine")).__name__ == "Mine"
bad = validate(compose(["backend=mine", "strategy=ddp", "model=gpt_nano", "cluster.devices=2"]), depth=RUN)
assert check(bad) == ["backend=mine runs strategy=single only"], check(bad)

def losses(name, *overrides):
    run = subprocess.run([sys.executable, "train.py", *TINY, "callbacks=none", "trainer.max_steps=3",
                          "trainer.optimizer=sgd", f"hydra.run.dir=runs/{name}", *overrides],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.load(open(f"runs/{name}/report.json"))["losses"]

reference = losses("single", "strategy=single")
family = losses("family", "strategy=mine")  # (its plan checkpoints every block: the same losses)
backend = losses("backend", "backend=mine", "strategy=single")
for other in (family, backend):
    assert len(other) == len(reference) == 3, (reference, other)
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(reference, other)), (reference, other)
print("ok")
'''



@pytest.mark.subprocess
def test_a_new_family_preset_and_backend_touch_only_what_the_architecture_says(tmp_path):
    """In a copy of the tree, write exactly the files docs/ARCHITECTURE.md lists for a new
    family (with its own footprint, plan and Lightning builder), a new preset and a new backend
    (a plain torch loop over the recipe); nothing else changes: they compose, validate and plan
    (the footprint's note in the plan), and both train 3 SGD steps with the single-process run's
    losses (the family on Lightning, single on the new backend)."""
    touches = _touches()
    assert touches["a preset of an existing family"] == ["conf/strategy/<preset>.yaml"]
    assert touches["a strategy family"] == ["strategies/families/<family>.py", "conf/strategy/<preset>.yaml",
                                            "backends/<backend>/families/<family>.py"]
    assert touches["a backend"] == ["backends/<backend>/__init__.py", "conf/backend/<backend>.yaml"]
    tree = tmp_path / "tree"
    for part in (*OURS, "conf"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    files = {"strategies/families/mine.py": _FAMILY, "conf/strategy/mine.yaml": _PRESET,
             "backends/lightning/families/mine.py": _BUILDER,
             "backends/mine/__init__.py": _BACKEND, "conf/backend/mine.yaml": "name: mine\n"}
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(textwrap.dedent(text).lstrip())
    shutil.copy(ROOT / "train.py", tree / "train.py")
    shutil.copytree(ROOT / "hydra_plugins", tree / "hydra_plugins", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-c", f"TINY = {TINY!r}\n" + _CHECK], cwd=tree, capture_output=True,
                          text=True, timeout=600, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree),
                                                       "HOME": str(tmp_path)})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


_OBSERVER = '''
"""A throwaway observer: counts every ``callbacks.mine.every``-th optimizer step into the report,
on when callbacks.mine.enabled is. Its keys are declared here, beside its factory."""
from dataclasses import dataclass, field

from core.knobs import knob
from observers.base import Observer, Selection, observer


@dataclass
class MineConfig:
    enabled: bool = False
    """The throwaway observer (off unless a callbacks YAML turns it on)."""
    every: int = knob(1, min=1)
    """Count every this many optimizer steps."""


@dataclass
class MineKnobs:
    mine: MineConfig = field(default_factory=MineConfig)


class Mine(Observer):
    def __init__(self, every):
        self.every, self.steps = every, 0

    def on_step_end(self, engine, step, loss):
        self.steps += step % self.every == 0

    def report(self):
        return {"mine": {"steps": self.steps, "every": self.every}}


@observer("mine", order=75, knobs=MineKnobs)  # after compare (70), before plots (80)
def _selected(s: Selection):
    cfg = s.job.callbacks.mine
    return Mine(cfg.every) if cfg.enabled else None
'''
_LOGGER = '''
"""A throwaway logger: logger=mine."""
from observers.base import Observer, Selection
from observers.loggers import logger


class MineLog(Observer):
    pass


@logger("mine")
def _mine(s: Selection):
    return MineLog()
'''
_LOGGER_YAML = "defaults:\n  - /logger_schema@_here_\n  - _self_\nname: mine\n"
_OBSERVER_CHECK = '''
import subprocess, sys
from pathlib import Path
from types import SimpleNamespace

import observers
from recipes.config import compose
from recipes.job import RUN, validate
from strategies import ConfigError


def chosen(*overrides):
    job = validate(compose(["model=gpt_nano", *overrides]), depth=RUN)
    return observers.build(job, Path("."), {"memory": {}})


on = chosen()
names = on.meta["observers"]
assert names[names.index("Comparison") + 1:] == ["Mine", "Plots"], names
assert "Mine" not in chosen("callbacks=none").meta["observers"]
assert "Mine" not in chosen("callbacks.mine.enabled=false").meta["observers"]
only = chosen("callbacks=none", "callbacks.mine.enabled=true", "callbacks.mine.every=2")
assert only.meta["observers"] == ["LossLog", "StartupTimes", "Mine"], only.meta["observers"]
hub = observers.Observers([o for o in only.observers if type(o).__name__ == "Mine"])
for step in (1, 2, 3, 4):
    hub.step_end(SimpleNamespace(rank=0), step, 1.0)
assert hub.train_end(SimpleNamespace(rank=0)) == {"resumed_from": None, "mine": {"steps": 2, "every": 2}}
try:  # its knob is declared: a bad value is one sentence at validate
    chosen("callbacks.mine.every=0")
    raise AssertionError("not refused")
except ConfigError as e:
    assert "callbacks.mine.every=0: must be >= 1" in str(e), e
# a typo of its key is the schema's one did-you-mean line; --cfg job shows it, and loads no engine
typo = subprocess.run([sys.executable, "train.py", "model=gpt_nano", "callbacks.mine.evry=2", "--cfg", "job"],
                      capture_output=True, text=True, timeout=120)
assert typo.returncode == 2 and "did you mean callbacks.mine.every?" in typo.stderr, typo.stderr[-2000:]
shown = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv = ['train.py', 'model=gpt_nano', "
                        "'callbacks.mine.every=3', '--cfg', 'job']\\ntry: runpy.run_path('train.py', run_name='__main__')\\n"
                        "except SystemExit: pass\\nprint([m for m in ('torch', 'lightning', 'deepspeed') if m in sys.modules])"],
                       capture_output=True, text=True, timeout=120)
assert "  mine:\\n    enabled: true\\n    every: 3\\n" in shown.stdout, shown.stdout[-2000:] + shown.stderr[-2000:]
assert shown.stdout.strip().endswith("[]"), shown.stdout[-300:]
assert chosen("logger=mine").meta["observers"][-1] == "MineLog"
assert chosen("logger=csv").meta["observers"][-1] == "CSVLog"
print("ok")
'''
# What an observer and a logger touch (docs/ARCHITECTURE.md's rows, when it has them, must say the same).
OBSERVER_TOUCHES = ["observers/<observer>.py", "conf/callbacks/default.yaml"]
LOGGER_TOUCHES = ["observers/<logger>.py", "conf/logger/<logger>.yaml"]


@pytest.mark.subprocess
def test_a_new_observer_and_logger_touch_only_what_the_architecture_says(tmp_path):
    """In a copy of the tree: a new observer is its module (an ``@observer`` factory and the
    dataclass of its ``callbacks`` keys beside it, off by default so ``callbacks=none`` needs no line)
    and its line in ``conf/callbacks/default.yaml``; a new logger is its module (an ``@logger``
    factory) and its YAML. Nothing else changes (no list of observers, loggers, logger names or
    callbacks keys anywhere), and they are selected, ordered and reported; the observer's own knob,
    set on the command line, reaches it, is checked at validate and is in the schema (a typo is
    the one did-you-mean line; ``--cfg job`` shows it and loads no engine)."""
    touches = _touches()
    assert touches.get("an observer", OBSERVER_TOUCHES) == OBSERVER_TOUCHES
    assert touches.get("a logger", LOGGER_TOUCHES) == LOGGER_TOUCHES
    tree = tmp_path / "tree"
    for part in (*OURS, "conf"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "observers/mine.py").write_text(textwrap.dedent(_OBSERVER).lstrip())
    (tree / "observers/minelog.py").write_text(textwrap.dedent(_LOGGER).lstrip())
    (tree / "conf/logger/mine.yaml").write_text(_LOGGER_YAML)
    with (tree / "conf/callbacks/default.yaml").open("a") as f:
        f.write("mine:\n  enabled: true       # the throwaway observer\n")
    shutil.copy(ROOT / "train.py", tree / "train.py")
    shutil.copytree(ROOT / "hydra_plugins", tree / "hydra_plugins", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-c", _OBSERVER_CHECK], cwd=tree, capture_output=True, text=True,
                          timeout=180, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree),
                                            "HOME": str(tmp_path)})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


_LAUNCHER = '''
"""A throwaway launcher: its ranks start somewhere launch.py submits to (here: nowhere)."""
from launchers.registry import launcher


def _submission_problems(job, overrides):
    return [] if job.cluster.nodes <= 4 else [f"cluster.nodes={job.cluster.nodes}: mine has 4 nodes"]


def _client_problems(job):
    return []


def _dry_run(job, overrides):
    return "mine would run: python train.py " + " ".join(overrides), ["(what is said of it: stderr)"]


def _submit(job, overrides):
    return f"submitted to mine: {job.cluster.nodes} node(s)"


def _run(job, out, plan):
    return f"ran by mine in {out}"


@launcher("mine", run=_run, submission_problems=_submission_problems, client_problems=_client_problems,
          dry_run=_dry_run, submit=_submit)
def launch_problems(job):
    return [f"cluster.launcher=mine: submit with python launch.py cluster={job.cluster.name} ..."]
'''
_LAUNCHER_YAML = "defaults:\n  - local\n  - _self_\nname: mine\nlauncher: mine\nnodes: 2\n"
_LAUNCHER_CHECK = '''
import contextlib, io, runpy, sys
from pathlib import Path

import launchers
from launchers import registry
from recipes.config import compose
from recipes.job import RUN, validate
from strategies import ConfigError

assert "mine" in registry.names(), registry.names()
BASE = ["cluster=mine", "model=gpt_nano", "strategy=ddp"]
job = validate(compose(BASE), depth=RUN)
assert job.cluster.launcher == "mine" and job.cluster.nodes == 2
assert launchers.check(job) == ["cluster.launcher=mine: submit with python launch.py cluster=mine ..."]
try:
    validate(compose(BASE), depth=RUN, extra=[launchers.check])
    raise AssertionError("not refused")
except ConfigError as e:
    assert "python launch.py cluster=mine" in str(e), e
assert launchers.run(job, Path("here")) == "ran by mine in here"


def launch(*argv):
    sys.argv = ["launch.py", *argv]
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            runpy.run_path("launch.py", run_name="__main__")
        except SystemExit as e:
            return f"exit {e.code}: {text.getvalue()}"
    return text.getvalue()


assert "mine would run: python train.py " + " ".join(BASE) in launch(*BASE, "--dry-run")
assert "submitted to mine: 2 node(s)" in launch(*BASE)
refused = launch(*BASE, "cluster.nodes=5", "trainer.global_batch_size=40", "--dry-run")
assert refused.startswith("exit 2: ") and "cluster.nodes=5: mine has 4 nodes" in refused, refused
print("ok")
'''
# What a launcher touches: its module and its cluster YAML (docs/ARCHITECTURE.md's row says the same;
# cluster.launcher's choices are the names launchers/ registers, read from the source).
LAUNCHER_TOUCHES = ["launchers/<launcher>.py", "conf/cluster/<cluster>.yaml"]


@pytest.mark.subprocess
def test_a_new_launcher_touches_only_what_the_architecture_says(tmp_path):
    """In a copy of the tree: a new launcher is its module (an ``@launcher`` registration: its
    problems, run, and launch.py's submission step) and its conf/cluster YAML. Nothing else
    names it: ``cluster=<name>`` validates, ``launchers.check`` and ``launchers.run`` route to it,
    and launch.py refuses, dry-runs and submits through it."""
    tree = tmp_path / "tree"
    for part in (*OURS, "conf"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "launch.py", tree / "launch.py")
    files = {"launchers/mine.py": textwrap.dedent(_LAUNCHER).lstrip(), "conf/cluster/mine.yaml": _LAUNCHER_YAML}
    for rel, text in files.items():
        (tree / rel).write_text(text)
    assert len(files) == len(LAUNCHER_TOUCHES)
    assert _touches()["a launcher"] == LAUNCHER_TOUCHES
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER_CHECK], cwd=tree, capture_output=True, text=True,
                          timeout=180, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree),
                                            "HOME": str(tmp_path)})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.mark.unit
def test_launchers_are_registered_not_listed():
    """Every launcher module registers what ``names()`` reads from its source, the config's
    choices are those names, and launch.py and launchers/__init__.py compare no launcher name."""
    from launchers import registry
    from recipes.config import LAUNCHERS

    assert sorted(registry.names()) == sorted(LAUNCHERS)
    assert [chosen.name for chosen in registry.every()] == list(registry.names())
    assert {n for n in registry.names() if registry.get(n).submits} == {"sagemaker", "k8s"}
    for path in (ROOT / "launch.py", ROOT / "launchers" / "__init__.py"):
        compared = [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.Compare)
                    and any(isinstance(c, ast.Constant) and c.value in LAUNCHERS
                            or isinstance(c, ast.Tuple | ast.List | ast.Set)
                            and any(getattr(e, "value", None) in LAUNCHERS for e in c.elts)
                            for c in [node.left, *node.comparators])]
        assert not compared, compared


# --------------------------------------------------------------------- the entry points
@pytest.mark.unit
def test_train_py_is_thin():
    lines = (ROOT / "train.py").read_text().splitlines()
    assert len(lines) < 100, len(lines)


@pytest.mark.unit
def test_every_package_and_its_data_is_in_the_distribution():
    """pyproject.toml lists every package directory (a regular install would miss a new one)
    and the data files they read."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {str(p.parent.relative_to(ROOT)).replace("/", ".") for part in OURS
            for p in (ROOT / part).rglob("__init__.py")}
    assert dirs <= set(project["packages"]), sorted(dirs - set(project["packages"]))
    assert project["package-dir"]["stratagem_conf"] == "conf"
    data = project["package-data"]
    assert "activations.json" in data["planner"] and any(".yaml" in g for g in data["stratagem_conf"])


# --------------------------------------------------------------------- after validate, the Job
_COMPOSED = re.compile(r"\b(OmegaConf|DictConfig|ListConfig|omegaconf)\b")


@pytest.mark.unit
def test_the_planner_reads_no_composed_config():
    """planner/ takes the validated Job's typed objects (``planner.inputs.Inputs``): no
    omegaconf import (AST, functions included) and no OmegaConf/DictConfig name (grep)."""
    files = sorted((ROOT / "planner").rglob("*.py"))
    assert files
    imports = {str(p.relative_to(ROOT)) for p in files if "omegaconf" in _imports(p)}
    named = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
             for i, line in enumerate(p.read_text().splitlines(), 1) if _COMPOSED.search(line)]
    assert not imports and not named, (sorted(imports), named)


@pytest.mark.unit
@pytest.mark.parametrize("script", ["launch.py", "export.py"])
def test_launch_and_export_read_the_job_not_its_config(script):
    """After ``validate`` they read the Job's typed fields: no ``.cfg`` attribute (AST), no
    ``job.cfg`` (grep), and ``planner.enforce``'s rule only through ``planner.check``."""
    path = ROOT / script
    text = path.read_text()
    attrs = [n.lineno for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Attribute) and n.attr == "cfg"]
    assert not attrs and "job.cfg" not in text, attrs
    assert ".enforce" not in text


@pytest.mark.unit
def test_the_enforce_rule_lives_in_the_planner_only():
    """``planner.enforce`` is read (an ``.enforce`` attribute, AST) in one place: planner.check."""
    hits = [str(p.relative_to(ROOT)) for p in product_files()
            if any(isinstance(n, ast.Attribute) and n.attr == "enforce"
                    for n in ast.walk(ast.parse(p.read_text())))]
    assert hits == ["planner/__init__.py"], hits


@pytest.mark.unit
def test_strategy_auto_is_a_step_of_validation_over_typed_objects():
    """validate(..., auto=planner.choose): the Job carries the chosen preset, the reason, the
    settled strategy with its Run, and the groups downstream reads (planner, export, paths)."""
    import planner
    from recipes.config import ExportConfig, PlannerConfig, compose
    from recipes.job import RUN, validate
    from strategies.presets import AUTO

    cfg = compose(["model=gpt_nano", "strategy=auto", "cluster.devices=2", "callbacks=none",
                   "export=deepspeed"])
    seen = []

    def choose(job):
        seen.append(job)
        return planner.choose(job)

    job = validate(cfg, depth=RUN, auto=choose)
    assert len(seen) == 1 and seen[0].preset.name == AUTO and isinstance(seen[0].cluster, object)
    assert job.preset.name not in (AUTO, "single") and job.strategy.name == job.preset.name
    assert job.auto and job.chosen_by.startswith(f"strategy=auto chose {job.preset.name}: ")
    assert job.run.mesh.size == 2 and job.meta()["config"]["strategy"]["name"] == job.preset.name
    assert isinstance(job.planner, PlannerConfig) and isinstance(job.export, ExportConfig)
    assert planner.check(job).strategy == job.preset.name
    named = validate(compose(["model=gpt_nano", "strategy=ddp", "cluster.devices=2", "callbacks=none"]),
                     depth=RUN, auto=choose)
    assert len(seen) == 1 and named.auto is None and named.chosen_by is None and named.export is None


@pytest.mark.unit
def test_mesh_axes_are_one_enum():
    """One vocabulary of mesh axes (``core.mesh.Axis``): families, builders, parallel/ and the
    communication observer spell no axis as a string literal (the degree names ``ep`` and ``sp``
    are strategy keys too, so they are not counted), and the report's group names stay what they
    were."""
    from core.mesh import Axis
    from observers.comm import ROLES

    spelled = {a.value for a in Axis} - {"ep", "sp"} | {f"mesh_{a.value}" for a in Axis}
    found = [f"{p.relative_to(ROOT)}:{n.lineno}: {n.value!r}"
             for package in ("strategies", "parallel", "backends", "observers")
             for p in sorted((ROOT / package).rglob("*.py"))
             for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Constant) and n.value in spelled]
    assert not found, found
    assert {a: a.role for a in Axis} == {
        Axis.REPLICATE: "data-replicate", Axis.SHARD: "data-shard", Axis.DATA: "data", Axis.CONTEXT: "cp",
        Axis.PIPELINE: "pipeline", Axis.TENSOR: "tensor", Axis.DP_CP: "data-shard", Axis.EP: "ep",
        Axis.EP_REPLICATE: "ep_replicate", Axis.SP: "sp"}
    assert (f"mesh_{Axis.EP}", str(Axis.DP_CP), Axis.TENSOR) == ("mesh_ep", "dp_cp", "tensor_parallel")
    assert ROLES["tp"] == ROLES["tensor_parallel"] == "tensor" and ROLES["dp_shard"] == "data-shard"


@pytest.mark.unit
def test_validation_derives_the_mesh_and_batch_once(monkeypatch):
    """The preset's mesh and what it derives from the batch: one derivation (core.run.settle)
    gives the Job its strategy and Run; no second one after it."""
    from recipes.config import compose
    from recipes.job import RUN, validate
    from strategies.families.parallel import ParallelConfig

    calls = {"mesh": 0, "for_batch": 0}
    for name in calls:
        original = getattr(ParallelConfig, name)

        def counted(self, *a, _name=name, _original=original, **k):
            calls[_name] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(ParallelConfig, name, counted)
    job = validate(compose(["model=gpt_nano", "strategy=pipeline", "cluster.devices=2", "callbacks=none",
                            "trainer.global_batch_size=8", "trainer.micro_batch_size=2"]), depth=RUN)
    assert calls == {"mesh": 1, "for_batch": 1}, calls
    assert job.strategy.microbatches and job.run.batch.chunks == job.strategy.microbatches


@pytest.mark.unit
def test_no_product_function_is_over_80_lines():
    """A function longer than 80 lines does more than one job: cut it along them (issue 37)."""
    long = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in product_files() for n in ast.walk(ast.parse(p.read_text(), str(p)))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert not long, long


@pytest.mark.unit
def test_no_product_module_is_over_500_lines():
    """A module longer than 500 lines holds more than one job: split it along them (issue 37)."""
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in product_files()
            if (n := len(p.read_text().splitlines())) > 500]
    assert not long, long


_REGISTER_CHECK = '''
import sys
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

import recipes.config  # the schemas: nothing stored or registered on import
assert not OmegaConf.has_resolver("launched") and "train_schema.yaml" not in ConfigStore.instance().repo
from recipes.config import compose, register  # (compose.py's names, as before)
register()
assert all(OmegaConf.has_resolver(r) for r in ("hf", "instance", "launched", "local", "run_name"))
assert {"train_schema.yaml", "logger_schema.yaml", "export_schema.yaml"} <= set(ConfigStore.instance().repo)
assert compose(["model=gpt_nano"]).cluster.nodes == 1
print([m for m in ("torch", "lightning", "deepspeed") if m in sys.modules])
'''


@pytest.mark.subprocess
def test_the_schemas_and_resolvers_are_registered_by_call_not_on_import():
    """``import recipes.config`` stores and registers nothing (and imports no torch);
    ``recipes.compose.register`` (which compose, ``cli.run`` and validation call) does both."""
    proc = subprocess.run([sys.executable, "-c", _REGISTER_CHECK], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-3000:]
