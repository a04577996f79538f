"""What a user reads: ``--help`` is our page, a mistyped key gets its likely spelling, and a run's
console says each thing once -- no third-party adverts or deprecation noise, the validation loss
when it is computed, and a last line with the validation loss, tokens/s and peak memory.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings
from collections import Counter

import pytest

from tests.conftest import ROOT, run_cli

pytestmark = [pytest.mark.timeout(600)]


# --------------------------------------------------------------------- --help
@pytest.mark.subprocess
def test_help_is_our_page_not_hydras():
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    page = proc.stdout
    assert "powered by Hydra" not in page and "== Config ==" not in page  # Hydra's generic page
    for internal in ("cluster_trainer", "strategy_model", "_schema"):
        assert internal not in page, internal
    # the groups a user picks from, with their options and the default marked
    assert re.search(r"^  model:\s+.*gpt_nano, gpt_small\*", page, re.M), page
    assert re.search(r"^  strategy:\s+3d, auto, ddp,", page, re.M), page
    assert re.search(r"^  logger:\s+csv, tensorboard, wandb \(off unless chosen\)", page, re.M), page
    # the common keys with their defaults, examples, where the rest is
    assert re.search(r"^  trainer\.max_steps=60\s+optimizer steps", page, re.M), page
    assert re.search(r"^  cluster\.devices=null\s+processes per node \(null: 1, or what torchrun", page, re.M), page
    assert "examples:" in page and "python train.py strategy=ddp cluster.devices=2" in page
    assert "README.md" in page


@pytest.mark.unit
def test_every_common_key_of_the_help_is_a_key():
    from omegaconf import OmegaConf

    from recipes.cli_help import COMMON_KEYS
    from recipes.config import compose

    cfg = compose([])
    missing = [k for k, _ in COMMON_KEYS if OmegaConf.select(cfg, k, default="<missing>",
                                                             throw_on_resolution_failure=False) == "<missing>"]
    assert missing == []


def _schemas() -> dict[str, type]:
    import strategies
    from recipes.config import GROUP_SCHEMAS

    return {**GROUP_SCHEMAS, **{f"strategy ({f})": cls for f, cls in strategies.families().items()}}


@pytest.mark.unit
def test_every_key_a_user_can_set_has_a_meaning():
    """Audit docs F6: ~25 settable keys no doc named; ``--help group=option`` lists each key with
    the first sentence of its attribute docstring, so a key without one (a new one) is refused here."""
    from recipes.key_help import meaning, schema_keys

    undocumented = {group: [key for key, doc in schema_keys(cls) if not meaning(doc)]
                    for group, cls in _schemas().items()}
    assert {g: keys for g, keys in undocumented.items() if keys} == {}


def _listed(page: str, group: str, cls: type) -> list[str]:
    """The keys of ``cls`` that ``page`` does not list as ``  group.key=<value>  <its meaning>``."""
    from recipes.key_help import meaning, schema_keys

    return [key for key, doc in schema_keys(cls)
            if not re.search(rf"^  {re.escape(f'{group}.{key}=')}\S*\s+{re.escape(meaning(doc))}$", page, re.M)]


@pytest.mark.unit
def test_help_with_a_preset_of_each_family_lists_its_keys_and_their_meanings():
    """``train.py --help strategy=<preset>``, one preset per family (a sweep's comma list: each
    composed on its own): after the common keys, every key of the family with its value and
    meaning. Before: the page named none of them (README said "per family")."""
    import strategies
    from recipes.cli_help import help_page
    from strategies.presets import preset_family

    one = {}
    for name in strategies.names():
        one.setdefault(preset_family(name), name)
    page = help_page("doc", ["--help", "strategy=" + ",".join(one.values()), "strategy.ac_every=2"])
    families = strategies.families()
    for family, preset in one.items():
        part = page.split(f"\nstrategy={preset} (family {family}):\n")[1].split("\n\n")[0] + "\n"
        assert _listed(part, "strategy", families[family]) == [], (preset, part)
    assert "strategy.ac_every=2 " in page  # (as the command line composes it)
    assert "  strategy.reshard_after_forward=true" in page and "free gathered parameters after each" in page


@pytest.mark.unit
def test_help_lists_the_keys_of_each_group_chosen():
    """``--help model=... cluster=... trainer=... data=...``: each group's keys, nested ones by
    their dotted key (cluster.sagemaker.base_job_name); with none chosen, one line says how."""
    from recipes.cli_help import help_page
    from recipes.config import GROUP_SCHEMAS

    page = help_page("doc", ["--help", "model=gpt_nano", "cluster=sagemaker_p5_2node", "trainer=default", "data=text",
                             "cluster.sagemaker.base_job_name=mine"])
    for group in ("model", "cluster", "trainer", "data"):
        assert _listed(page, group, GROUP_SCHEMAS[group]) == [], group
    assert re.search(r"^  cluster\.sagemaker\.base_job_name=mine\s+the training job's name prefix", page, re.M)
    plain = help_page("doc", ["--help"])
    assert "python train.py --help strategy=<preset>" in plain and "strategy.hybrid" not in plain
    assert "every group, key" not in plain  # (README lists the groups, not every key)


@pytest.mark.unit
def test_plan_and_export_help_list_an_options_keys_too(capsys):
    from recipes.cli import query

    assert query(["--help", "strategy=ddp"], "plan.py: doc", "plan.py") is None
    out = capsys.readouterr().out
    assert re.search(r"^  strategy\.static_graph=\S+\s+\S", out, re.M), out


# --------------------------------------------------------------------- did you mean
@pytest.mark.unit
@pytest.mark.parametrize("argv, expected", [
    (["trainer.max_step=3"], ["trainer.max_step=3: no such key; did you mean trainer.max_steps? (trainer.max_steps=3)"]),
    (["cluster.devise=2", "trainer.max_steps=3"], ["cluster.devise=2: no such key; did you mean cluster.devices? (cluster.devices=2)"]),
    (["stratgy=ddp"], ["stratgy=ddp: no such key; did you mean strategy? (strategy=ddp)"]),
    # the group chosen decides the keys: FSDP's own
    (["strategy=fsdp", "strategy.sharding_strategi=FULL_SHARD"],
     ["strategy.sharding_strategi=FULL_SHARD: no such key; did you mean strategy.sharding_strategy? "
      "(strategy.sharding_strategy=FULL_SHARD)"]),
    (["trainer.max_steps=3", "strategy=ddp", "hydra.run.dir=x"], []),
    (["trainer.zzzzzz=3"], ["trainer.zzzzzz=3: no such key; the keys of trainer: betas, "]),  # nothing close: the keys
], ids=["key", "second-key", "group", "preset-key", "all-fine", "nothing-close"])
def test_suggestions(argv, expected):
    from recipes.cli_help import suggestions

    found = suggestions(argv)
    assert len(found) == len(expected) and all(f.startswith(e) for f, e in zip(found, expected)), found


@pytest.mark.unit
@pytest.mark.parametrize("argv, expected", [
    (["=foo"], "=foo: an override is key=value, and this one has no key"),
    (["strategy="], "strategy=: no strategy named; the options: 3d, auto, ddp"),
    (["~trainer.lr"], "~trainer.lr: a key of the config cannot be removed; set it instead (trainer.lr=<value>"),
    (["~strategy"], "strategy=null: strategy cannot be switched off; choose one of 3d, auto, ddp"),
], ids=["no-key", "no-option", "remove-key", "required-group-off"])
def test_a_malformed_override_is_one_line_with_the_fix(argv, expected):
    """Hydra's own words for these were a search path, a schema's class name, an interpolation
    error, or "no such ; the options: train"."""
    from recipes.cli_help import suggestions

    found = suggestions(argv)
    assert len(found) == 1 and found[0].startswith(expected), found


@pytest.mark.unit
@pytest.mark.parametrize("arg, default", [("~callbacks", "default"), ("callbacks=null", "default"),
                                          ("~data", "text"), ("data=null", "text"),
                                          ("~backend", "lightning"), ("~trainer", "default")])
def test_a_required_group_hydra_composes_without_is_refused_at_validate(arg, default):
    """Audit hydra #5: these compose (the schema's ``???``), so ``~model``'s line, said when Hydra
    fails, never came: ``~callbacks`` passed validation (plan.py printed it as "run it") and crashed
    in the run ('NoneType' object has no attribute 'progress_bar'); ``~data`` and ``~trainer`` said
    "invalid configuration (0 problem(s))" and nothing else; ``~backend`` an AttributeError. Now the
    same line, from validate: train.py, plan.py, --dry-run and a sweep's preflight alike."""
    from recipes.config import compose
    from recipes.job import CONFIG, validate
    from strategies import ConfigError

    group = arg.lstrip("~").split("=")[0]
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=gpt_nano", arg]), depth=CONFIG)
    assert len(e.value.problems) == 1, e.value.problems
    assert e.value.problems[0].startswith(f"{group}=null: {group} cannot be switched off; choose one of "), e.value
    assert f"({group}={default} is the default)" in e.value.problems[0]


@pytest.mark.subprocess
@pytest.mark.parametrize("arg", ["strategy=", "~trainer.lr", "=foo", "strategy=null"])
def test_a_malformed_override_exits_2_with_our_line(tmp_path, arg):
    run = run_cli("train.py", arg, out=tmp_path / "bad", check=False)
    assert run.proc.returncode == 2, run.log
    assert len(run.proc.stderr.strip().splitlines()) == 1 and "Traceback" not in run.log, run.log


# Hydra's configure_log on each logging option as train.py composes it (in a process of its own: the
# options reconfigure the root logger, "disabled" every existing logger)
CONFIGURE_LOG = """
import sys
import hydra
from hydra import initialize_config_dir
from hydra.core.utils import configure_log
import strategies  # (the family schemas)
from core.conf import CONF_DIR
from recipes.compose import register
register()
for override in sys.argv[1:]:
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = hydra.compose(config_name="train", overrides=[override], return_hydra_config=True)
    configure_log(cfg.hydra[override.split("=")[0].split("/")[1]])
    print("configured", override, flush=True)
"""


@pytest.mark.subprocess
def test_hydras_own_logging_options_work():
    """Audit hydra #6: conf/hydra/default.yaml's job_logging / hydra_logging were deltas merged over
    whichever option was chosen, naming handlers (console's filter, errors, file) Hydra's others do
    not define: hydra/job_logging=disabled|none|stdout and hydra/hydra_logging=disabled crashed in
    Hydra's configure_log ("Unable to configure handler 'console'"), exit 1. Ours are whole options
    now (conf/hydra/job_logging/stratagem.yaml, hydra_logging/stratagem.yaml), which these replace."""
    options = ["hydra/job_logging=disabled", "hydra/job_logging=none", "hydra/job_logging=stdout",
               "hydra/hydra_logging=disabled", "hydra/hydra_logging=none", "hydra/hydra_logging=stratagem"]
    proc = subprocess.run([sys.executable, "-c", CONFIGURE_LOG, *options], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:-1] == [f"configured {o}" for o in options], proc.stdout


@pytest.mark.subprocess
@pytest.mark.parametrize("script", ["train.py", "plan.py"])
def test_a_mistyped_key_gets_did_you_mean(tmp_path, script):
    run = run_cli(script, "model=gpt_nano", "trainer.max_step=3", out=tmp_path / "bad", check=False)
    assert run.proc.returncode == 2, run.log
    assert "did you mean trainer.max_steps?" in run.proc.stderr, run.log
    assert "Traceback" not in run.log
    assert not (tmp_path / "bad").exists()


# --------------------------------------------------------------------- the noise filter
@pytest.mark.unit
def test_the_noise_filter_is_scoped(monkeypatch):
    """Every filter names the message it drops; a warning it does not name still shows."""
    from backends.common import quiet

    assert all(n.message and n.why for n in quiet.WARNINGS)
    monkeypatch.setattr(quiet, "after_import", lambda *a, **k: None)  # (no import hooks from a test)
    loggers = {name: logging.getLogger(name) for name in [*quiet.RECORDS, *quiet.NO_DEVICE_RECORDS, *quiet.LEVELS]}
    saved = {name: (list(lg.filters), lg.level) for name, lg in loggers.items()}
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet.install()
            warnings.warn("The `srun` command is available on your system but is not used. HINT: ...")
            warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning)
            warnings.warn("a warning nobody filtered", UserWarning)
            warnings.warn("`torch.distributed.something_else` is deprecated", FutureWarning)
            sharded = "Please use DTensor instead and we are deprecating ShardedTensor."
            for module in ("torch.distributed.fsdp._state_dict_utils", "torch.distributed._state_dict_utils",
                           "torch.distributed.checkpoint.planner_helpers", "my_own_module"):  # (an FSDP1 resume)
                warnings.warn_explicit(sharded, FutureWarning, "x.py", 1, module=module)
        assert [str(w.message) for w in seen] == ["a warning nobody filtered",
                                                  "`torch.distributed.something_else` is deprecated", sharded]
        rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        tip = logging.LogRecord(rank_zero.name, logging.INFO, __file__, 1,
                                "💡 Tip: For seamless cloud logging ... try installing [litlogger](...)", None, None)
        info = logging.LogRecord(rank_zero.name, logging.INFO, __file__, 1, "GPU available: False", None, None)
        assert not rank_zero.filter(tip) and rank_zero.filter(info)
    finally:
        for name, (filters, level) in saved.items():
            loggers[name].filters[:] = filters
            loggers[name].setLevel(level)


@pytest.mark.unit
@pytest.mark.parametrize("device", [False, True], ids=["no-cuda-device", "cuda-device"])
def test_no_cuda_runtime_is_filtered_only_without_a_cuda_device(monkeypatch, device):
    """torch's cpp_extension says "No CUDA runtime is found" once per rank on a CUDA wheel on a
    CPU host: dropped there, shown where a CUDA device is present."""
    from backends.common import quiet

    monkeypatch.setattr(quiet, "after_import", lambda *a, **k: None)  # (no import hooks from a test)
    assert quiet.cuda_device() in (False, True)
    logger = logging.getLogger("torch.utils.cpp_extension")
    filters = list(logger.filters)
    logger.filters[:] = []  # (an earlier test of this process may have installed the filters)
    try:
        quiet.install(device=device)
        said = logging.LogRecord(logger.name, logging.WARNING, __file__, 140,
                                 "No CUDA runtime is found, using CUDA_HOME='%s'", ("/usr/local",), None)
        other = logging.LogRecord(logger.name, logging.WARNING, __file__, 1, "Error building extension", None, None)
        assert bool(logger.filter(said)) == device and logger.filter(other)
    finally:
        logger.filters[:] = filters


@pytest.mark.unit
def test_the_2d_mesh_warnings_are_filtered_only_for_our_model_and_these_placements(monkeypatch):
    """tp / fsdp_tp at 4 ranks and fsdp_ep printed, per rank, FSDP2's view-tensor warning for our
    GPT and DTensor's two-step redistribution of full parameters (_StridedShard): dropped; a user's
    module's view warning and other placements still show -- the gradient norm's (_NormPartial)
    too: parallel/clip.py reduces its float64 squares itself, so nothing of ours prints it."""
    from backends.common import quiet

    monkeypatch.setattr(quiet, "after_import", lambda *a, **k: None)  # (no import hooks from a test)
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    filters = list(logger.filters)
    view = ("FSDP2-wrapped module ({}) returned a view tensor. An in-place op on this view (e.g., `x += y`) "
            "will silently drop the pre-backward hook and skip the all-gather, ...")
    fsdp = "torch.distributed.fsdp._fully_shard._fsdp_state"
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet.install()
            for cls, module in (("FSDPGPT", fsdp), ("FSDPLlamaForCausalLM", fsdp), ("FSDPGPT", "my_own")):
                warnings.warn_explicit(view.format(cls), UserWarning, "x.py", 1, module=module)
        assert [(str(w.message), w.filename) for w in seen] == [
            (view.format("FSDPLlamaForCausalLM"), "x.py"), (view.format("FSDPGPT"), "x.py")]
        said = ("While redistributing from %s to %s, %d sequential %s operations will be performed. This is "
                "suboptimal: ... and may give inconsistent results between ranks due to different reduction "
                "orders. %s")

        def shown(src: str, dst: str = "(Replicate(), Replicate())", op: str = "all_reduce") -> bool:
            args = (src, dst, 2, op, "To optimize, flatten mesh dimensions ...")
            return bool(logger.filter(logging.LogRecord(logger.name, logging.WARNING, __file__, 390, said,
                                                        args, None)))

        assert shown("(_NormPartial(2.0), _NormPartial(2.0))")
        assert not shown("(_StridedShard(dim=0, sf=2), Shard(dim=0))", op="all_gather")
        assert not shown("(_StridedShard(dim=0, sf=4), Shard(dim=0))", op="all_gather")
        assert shown("(Partial(sum), Partial(sum))") and shown("(Shard(dim=0), Shard(dim=1))", op="all_gather")
    finally:
        logger.filters[:] = filters


# --------------------------------------------------------------------- the console of real runs
CONSOLE_RUNS = {
    "single": (),
    "ddp": ("strategy=ddp", "cluster.devices=2"),
    "zero2": ("strategy=zero2", "cluster.devices=2"),
}
PREFIX = re.compile(r"^(\[[^\]]*\]\[[^\]]*\]\[[A-Z]+\] - |(INFO|WARNING|ERROR): |\[rank \d+\] [A-Z]+ \S+: )")


def _messages(log: str) -> list[str]:
    """Each printed line without its logging prefix (time, logger, level), so a line printed by
    two handlers in two formats counts twice; blank lines and rules (-----) aside."""
    lines = (PREFIX.sub("", line).strip() for line in log.splitlines())
    return [line for line in lines if line.strip("-= ")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [pytest.param("single", marks=pytest.mark.slow), "ddp", "zero2"])
def test_the_console_says_each_thing_once(tmp_path, name):
    run = run_cli("train.py", "model=gpt_nano", "trainer.max_steps=3", "cluster.accelerator=cpu",
                  "data.val_fraction=0.1", *CONSOLE_RUNS[name], out=tmp_path / name, timeout=240)
    log = run.log
    twice = [line for line, n in Counter(_messages(log)).items() if n > 1]
    assert twice == [], f"printed more than once: {twice}\n{log}"
    assert "litlogger" not in log and "💡 Tip" not in log, log  # Lightning's advert
    assert "_pytree" not in log and "LeafSpec" not in log, log  # the per-rank deprecation
    assert "compilers.C" not in log and "gcc " not in log and "built successfully" not in log, log  # DeepSpeed's probes
    assert "FutureWarning" not in log and "`srun`" not in log, log
    assert not re.search(r"site-packages/\S+\.py:\d+: ", log), f"a library's warning reached the console:\n{log}"
    assert "[rank 1] INFO" not in log, log  # other ranks: warnings and errors only
    validation = run.report["validation"]
    assert len(validation) == 1
    assert f"validation at step 3: loss {validation[0]['loss']:.4f}" in log, log
    last = run.proc.stdout.strip().splitlines()[-1]
    assert re.search(r"done: 3 steps, final loss \d+\.\d{4}, val loss \d+\.\d{4}, [\d,]+ tokens/s, "
                     r"peak memory [\d.,]+ [MG]iB (RSS|CUDA allocated), "
                     r"(start-up [\d.]+ s \([^)]*\) > training [\d.]+ s, )?report ", last), last
    assert f"val loss {validation[0]['loss']:.4f}" in last
    assert (run.out / "loss.png").stat().st_size > 0 and (run.out / "memory.png").is_file()


@pytest.mark.unit
def test_the_summary_line():
    from observers.report import summary

    report = {"steps": 3, "final_loss": 5.61321, "tokens_per_second": 1000.0,
              "throughput": {"tokens_per_second": 12345.6},
              "validation": [{"step": 3, "loss": 5.56994, "perplexity": 262.4, "samples": 256}],
              "memory": {"ranks": [{"rank": 0, "peak_rss": 400 * 2**20}, {"rank": 1, "peak_rss": 450 * 2**20}]}}
    assert summary(report) == ("done: 3 steps, final loss 5.6132, val loss 5.5699, 12,346 tokens/s, "
                               "peak memory 450 MiB RSS")
    gpu = {**report, "validation": [], "memory": {"ranks": [
        {"rank": 0, "peak_rss": 1, "cuda": {"forward": {"allocated": 3 * 2**30, "reserved": 0},
                                            "backward": {"allocated": 5 * 2**30, "reserved": 0}}}]}}
    assert summary(gpu, ROOT / "report.json") == (f"done: 3 steps, final loss 5.6132, 12,346 tokens/s, "
                                                  f"peak memory 5.0 GiB CUDA allocated, report {ROOT / 'report.json'}")
    # callbacks.throughput=false: the whole loop's rate, which the line says (it read as the same figure)
    unmeasured = {k: v for k, v in report.items() if k != "throughput"}
    assert "1,000 tokens/s (the whole loop's, first step included)" in summary(unmeasured)


# --------------------------------------------------------------------- progress in a log file
PROGRESS_LINE = re.compile(r"step (\d+)/(\d+) \(\d+%\) \| loss \d+\.\d{4} \| lr \d\.\d\de[-+]\d\d \| [\d,]+ tok/s \| "
                           r"\d+\.\d{3} s/step \| ETA \d+:\d\d:\d\d \| mem [\d.,]+ [MG]iB (RSS|CUDA reserved)$")


class _Engine:
    def __init__(self, rank: int = 0):
        self.rank, self.world_size = rank, 1
        self.optimizers = [type("Opt", (), {"param_groups": [{"lr": 3e-4}]})()]


def _progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "observers.progress"]


@pytest.mark.unit
def test_progress_lines_every_log_every_steps_the_first_and_the_last(caplog):
    from observers.progress import Progress

    caplog.set_level(logging.INFO, logger="observers.progress")
    for rank, interactive, expected in ((0, False, [1, 3, 6, 7]), (1, False, []), (0, True, [])):
        caplog.clear()
        p, engine = Progress(7, 1024, log_every=3, interactive=interactive), _Engine(rank)
        p.on_train_start(engine, 0)
        for step in range(7):
            p.on_step_start(engine, step)
            p.on_before_optimizer_step(engine, step)
            p.on_step_end(engine, step + 1, 2.5)
        p.on_train_end(engine)
        lines = _progress_lines(caplog)
        assert [int(PROGRESS_LINE.search(x).group(1)) for x in lines] == expected, (rank, interactive, lines)
    # a resumed run counts from its checkpoint: its first step is 5's successor
    caplog.clear()
    p, engine = Progress(7, 1024, log_every=3, interactive=False), _Engine()
    p.on_train_start(engine, 5)
    for step in (5, 6):
        p.on_step_end(engine, step + 1, 2.5)
    p.on_train_end(engine)
    assert [int(PROGRESS_LINE.search(x).group(1)) for x in _progress_lines(caplog)] == [6, 7]


@pytest.mark.unit
def test_a_long_step_still_says_something_within_the_heartbeat(caplog):
    import time

    from observers.progress import Progress

    caplog.set_level(logging.INFO, logger="observers.progress")
    p, engine = Progress(100, 1024, log_every=50, interactive=False, heartbeat=0.2), _Engine()
    p.on_train_start(engine, 0)
    p.on_step_start(engine, 0)
    p.on_step_end(engine, 1, 2.5)  # a line (the first step)
    p.on_step_start(engine, 1)
    time.sleep(0.7)  # step 2 takes long: the heartbeat says so
    p.on_step_end(engine, 2, 2.4)  # not due (log_every=50) ...
    time.sleep(0.3)  # ... but the heartbeat gives its line
    p.on_step_start(engine, 2)
    p.on_step_end(engine, 3, 2.3)
    p.on_train_end(engine)  # stopped before max_steps: the line of where it stopped
    lines = _progress_lines(caplog)
    running = [x for x in lines if "still running" in x]
    assert running and running[0].startswith("step 2/100 still running: 0:00:0"), lines
    # (step 1 took no time: step 2 is overdue, and no ETA is claimed from that mean)
    assert "since step 1 ended, overdue (" in running[0] and "| last loss 2.5000" in running[0], running
    assert "ETA" not in running[0], running
    steps = [int(m.group(1)) for m in map(PROGRESS_LINE.search, lines) if m]
    assert steps == [1, 2, 3], lines
    assert not any("still running" in x for x in lines[lines.index(running[-1]) + 2:]), lines
    # a job that fails never reaches its train end; the next job of the process (a sweep's) silences it
    failed, engine = Progress(100, 1024, interactive=False, heartbeat=0.2), _Engine()
    failed.on_train_start(engine, 0)
    nxt = Progress(100, 1024, interactive=False, heartbeat=60)
    nxt.on_train_start(engine, 0)
    failed._thread.join(timeout=6)
    assert not failed._thread.is_alive()
    nxt.on_train_end(engine)


@pytest.mark.unit
def test_a_stalled_step_shows_at_the_first_heartbeat_without_an_eta(caplog, monkeypatch):
    """A rank stalled in step 3 of 20 (log_every=10): the first heartbeat, 64 s in, printed only
    step 2's pending line, "7,826 tok/s | 0.065 s/step | ETA 0:00:07", and the stall showed a
    minute later. Now that beat prints step 2's line without the ETA and then "step 3/20 still
    running ... overdue"; a step within its usual time gets the pending line alone, with its ETA."""
    from types import SimpleNamespace

    import observers.progress as progress

    clock = [1000.0]
    monkeypatch.setattr(progress, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    caplog.set_level(logging.INFO, logger="observers.progress")

    def run(step_seconds: float, steps: int) -> progress.Progress:
        p, engine = progress.Progress(20, 1024, log_every=10, interactive=False, heartbeat=60), _Engine()
        p.on_train_start(engine, 0)
        p._stop.set()  # (this test's beats are _pulse's, at the clock it sets)
        p._thread.join(timeout=6)
        for step in range(steps):
            p.on_step_start(engine, step)
            clock[0] += step_seconds
            p.on_step_end(engine, step + 1, 5.6743)
        p.on_step_start(engine, steps)  # the next step runs
        caplog.clear()
        return p

    p = run(0.065, 2)
    clock[0] += 64.0
    p._pulse(clock[0])
    lines = _progress_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("step 2/20 (10%) | loss 5.6743") and "ETA" not in lines[0], lines
    assert lines[1].startswith("step 3/20 still running: 0:01:04 since step 2 ended, overdue (0.065 s a "
                               "step so far) | last loss 5.6743") and "ETA" not in lines[1], lines
    p = run(20.0, 4)  # healthy 20 s steps: step 5 has run 10 s at the beat
    clock[0] += 10.0
    p._pulse(clock[0])
    lines = _progress_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("step 4/20 (20%)") and "| ETA 0:05:20" in lines[0], lines


@pytest.mark.unit
def test_the_heartbeat_between_steps_names_what_runs_not_a_step_that_is_not(caplog):
    """A long final validation printed "step 3/2 still running: 0:01:01 since step 2 ended" (and
    a mid-run one "step 101/300 still running" while step 101 had not started). Between steps
    the line now says what runs: the validation, a checkpoint or the next batch, or the run
    finishing after its last step."""
    import time

    from observers.progress import Progress

    caplog.set_level(logging.INFO, logger="observers.progress")
    p, engine = Progress(3, 1024, log_every=50, interactive=False, heartbeat=0.2), _Engine()
    p.on_train_start(engine, 0)

    def quiet(seconds: float = 0.5) -> list[str]:  # what the heartbeat said meanwhile
        caplog.clear()
        time.sleep(seconds)
        return _progress_lines(caplog)

    p.on_step_start(engine, 0)
    p.on_step_end(engine, 1, 2.5)
    p.on_validation_start(engine, 1)
    said = quiet()
    assert said and all(x.startswith("validating after step 1/3: 0:00:0") for x in said), said
    p.on_validation_end(engine, 1, {"loss": 2.4, "perplexity": 11.0})
    said = quiet()
    assert said and all(x.startswith("after step 1/3, between steps (a checkpoint, the next batch): ")
                        for x in said), said
    p.on_step_start(engine, 1)
    said = quiet()
    assert said and all(x.startswith("step 2/3 still running: ") for x in said), said
    p.on_step_end(engine, 2, 2.4)
    p.on_step_start(engine, 2)
    p.on_step_end(engine, 3, 2.4)
    said = quiet()
    assert said and all(x.startswith("after step 3/3, finishing (a checkpoint, the report): 0:00:0") and
                        "since step 3 ended | last loss 2.4000" in x for x in said), said
    p.on_train_end(engine)
    assert not any(re.search(r"step 4/3", x) for x in _progress_lines(caplog))


@pytest.mark.unit
def test_the_progress_line_times_the_steps_not_the_validation_between(caplog):
    """metrics.csv's step_seconds is a step's start to its end; the progress line's s/step and
    tok/s were the wall clock since the line before, a validation included (0.238 s/step beside
    metrics.csv's 0.068). They are now the steps' own time, as metrics.csv has it."""
    import time

    from observers.progress import Progress

    caplog.set_level(logging.INFO, logger="observers.progress")
    p, engine = Progress(4, 1000, log_every=2, interactive=False, heartbeat=60), _Engine()
    p.on_train_start(engine, 0)
    for step in range(4):
        p.on_step_start(engine, step)
        time.sleep(0.05)
        p.on_step_end(engine, step + 1, 2.5)
        if step == 1:  # a validation after step 2, between the lines of steps 2 and 4
            p.on_validation_start(engine, 2)
            time.sleep(0.6)
            p.on_validation_end(engine, 2, {"loss": 2.4, "perplexity": 11.0})
    p.on_train_end(engine)
    line = _progress_lines(caplog)[-1]
    per = float(re.search(r"\| ([\d.]+) s/step", line).group(1))
    rate = float(re.search(r"\| ([\d,]+) tok/s", line).group(1).replace(",", ""))
    assert line.startswith("step 4/4") and 0.05 <= per < 0.2 and rate == pytest.approx(1000 / per, rel=0.02), line


@pytest.mark.parametrize("backend, extra", [
    pytest.param("lightning", (), marks=pytest.mark.subprocess, id="lightning"),
    pytest.param("accelerate", ("strategy=ddp", "cluster.devices=2"), marks=pytest.mark.multiprocess,
                 id="accelerate-ddp")])
def test_a_run_logged_to_a_file_prints_progress_lines(tmp_path, backend, extra):
    """``python train.py trainer.max_steps=30 > log``: no terminal, so no bar but a progress line
    every callbacks.log_every (10) steps, from rank 0 only."""
    log = tmp_path / "log"
    cmd = [sys.executable, "train.py", "model=gpt_nano", "trainer.max_steps=30", f"backend={backend}", *extra,
           f"hydra.run.dir={tmp_path / 'run'}"]
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    steps = [int(m.group(1)) for m in map(PROGRESS_LINE.search, text.splitlines()) if m]
    assert steps == [1, 10, 20, 30], text
    assert "\x1b[" not in text and "━" not in text, text  # no bar, no terminal codes


@pytest.mark.unit
def test_the_loss_plot_s_label_fits_and_names_moe_only_on_a_moe_run():
    """loss.png's y label read "loss (token cross entropy; a MoE's train adds its aux los..." on a
    dense gpt_nano run, cut off at the figure's edge. It fits, and names MoE only on MoE runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from observers.plots import loss_figure, moe_run

    assert not moe_run({"config": {"model": {"n_experts": 0}}}) and moe_run({"config": {"model": {"n_experts": 4}}})
    for moe in (False, True):
        fig = loss_figure([5.0, 4.0, 3.0], [{"step": 3, "loss": 3.1}], moe)
        fig.canvas.draw()
        label, page = fig.axes[0].yaxis.label, fig.bbox
        box = label.get_window_extent()
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, (box, page)
        assert ("MoE" in label.get_text()) is moe, label.get_text()
        plt.close(fig)


@pytest.mark.unit
def test_the_closing_table_marks_an_uncalibrated_step_time():
    from observers.compare import summary_lines

    rows = {"state_bytes": {"predicted": 2**20, "measured": 2**20, "ratio": 1.0},
            "step_seconds": {"predicted": 0.001, "measured": 0.7, "ratio": None, "calibrated": False}}
    table = summary_lines(rows)
    assert "1.00 MiB" in table[1] and "1.000" in table[1]
    assert "0.700 s" in table[2] and table[2].endswith("uncal.") and "700.0" not in table[2]
    assert any("planner.calibrate=true" in line for line in table[3:])  # what "uncal." means
    legend = summary_lines({"communication": {"predicted": 2**20, "measured": 2**20, "ratio": 1.0},
                            "peak": {"predicted": 2**21, "measured": 2**24, "ratio": 8.0}})[3:]
    assert any("on a ring" in x and "payload" in x for x in legend) and any("allocator" in x for x in legend)
    big = summary_lines({"peak": {"predicted": 2**30, "measured": 2**30, "ratio": 1.0}})
    assert len(big) == 2  # a plan big enough: no note


@pytest.mark.unit
def test_under_checkpointing_the_activations_row_has_no_ratio():
    """Under activation checkpointing the plan's activations hold the block recomputed in
    backward, which forward's saved tensors (what is measured) never do: the row read 0.31
    ("the plan is 3x high"). It says what it compares and gives no ratio."""
    from types import SimpleNamespace

    from observers.compare import Comparison, summary_lines

    plan = {"memory": {"activations": 47 << 20, "params": 0, "grads": 0, "master": 0, "optimizer": 0, "host": 0}}
    memory = SimpleNamespace(ranks=[{"activations": 14 << 20, "params": 1, "grads": 1, "optimizer": 1}])
    for ckpt, ratio in ((True, None), (False, 14 / 47)):
        row = Comparison(plan, memory, checkpointed=ckpt).report()["predicted_vs_measured"]["activations"]
        assert row["ratio"] == (None if ratio is None else pytest.approx(ratio)), row
        assert ("recomputes in backward" in row.get("of", "")) is ckpt
        assert any("recomputed in backward" in x for x in summary_lines({"activations": row})) is ckpt


@pytest.mark.unit
def test_a_one_step_runs_step_growth_has_no_ratio():
    """ddp, trainer.max_steps=1 on 2 ranks: step_growth read 0.433 with no note -- the first
    step, the only one measured, ends with the Adam moments its update creates, which the RSS
    after it holds and its peak did not. The memory observer says when only the first step was
    measured; the row then has no ratio and says why, as communication's warm-up does."""
    from types import SimpleNamespace

    from observers.compare import Comparison, summary_lines
    from observers.memory import MemoryProfile

    plan = {"memory": {"total": 4 << 20, "growth": 2 << 20, "activations": 0, "params": 0, "grads": 0,
                       "master": 0, "optimizer": 0, "host": 0}}
    for peaks, first_only in (([(1 << 20, 3 << 20)], True), ([(1 << 20, 3 << 20), (2 << 20, 4 << 20)], False)):
        profile = MemoryProfile.__new__(MemoryProfile)  # (its hooks' state alone: no allocator change here)
        profile.held, profile._step_peaks, profile._lifetime, profile._before = {}, list(peaks), 0, None
        profile._cuda, profile.snapshot_steps = None, 0
        profile.on_train_end(SimpleNamespace(rank=0))
        assert profile.first_step_only is first_only
        row = Comparison(plan, profile).report()["predicted_vs_measured"]["step_growth"]
        table = summary_lines({"step_growth": row})
        if first_only:
            assert row["ratio"] is None and row["measured"] == 1 << 20, row
            assert table[1].endswith("1 step") and "trainer.max_steps=2" in row["of"], table
            assert any(x.strip().startswith("1 step: device (the host)") for x in table[2:]), table
        else:
            assert row["ratio"] == pytest.approx(1.0) and "no_ratio" not in row, row


@pytest.mark.unit
def test_an_offload_plans_engine_runtime_does_not_hide_the_small_peak_note():
    """gpt_nano on 2 CPU ranks: zero2's peak (2.5 MiB planned, 117 measured) had the note that a
    plan under 64 MiB is mostly the runtime's, zero2_offload's (the same measured peak) a bare 1.4:
    only the offload plan books DeepSpeed's fixed engine_runtime (85 MB), which lifted it over
    the threshold. The threshold reads the plan without it."""
    from types import SimpleNamespace

    from observers.compare import Comparison, summary_lines
    from planner.host import ENGINE_RUNTIME_BYTES

    def peak(host_items: dict) -> list[str]:
        host = sum(v for k, v in host_items.items() if k != "process")
        plan = {"memory": {"total": 2 << 20, "growth": 1 << 20, "host": host, "host_items": host_items,
                           "activations": 0, "params": 0, "grads": 0, "master": 0, "optimizer": 0}}
        memory = SimpleNamespace(ranks=[{"peak_rss_growth": 2 << 20, "peak_rss_run": 117 << 20}])
        rows = Comparison(plan, memory).report()["predicted_vs_measured"]
        return summary_lines({"peak": rows["peak"]})

    note = "a plan under 64 MiB"
    offload = peak({"fp32_master": 1 << 20, "engine_runtime": ENGINE_RUNTIME_BYTES, "process": 5 << 28})
    assert any(note in x for x in offload), offload
    assert not any(note in x for x in peak({"fp32_master": 100 << 20, "engine_runtime": ENGINE_RUNTIME_BYTES}))
