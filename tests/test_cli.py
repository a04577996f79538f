"""The real CLI in subprocesses: the issue's commands, multirun, experiments, and bad input that
must fail before any process starts."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, run_cli
from tests.test_named_recipes import RECIPES

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

REPORT_KEYS = {"strategy", "backend", "world_size", "global_batch_size", "micro_batch_size",
               "accumulation", "losses", "final_loss", "wall_seconds", "tokens_per_second", "config",
               "memory"}


def test_two_process_ddp_writes_the_report(tmp_path):
    run = run_cli("train.py", "strategy=ddp", "cluster.devices=2", "cluster.accelerator=cpu",
                  "model=gpt_nano", "trainer.max_steps=5", out=tmp_path / "ddp")
    r = run.report
    assert REPORT_KEYS <= r.keys()
    assert (r["strategy"], r["backend"], r["world_size"]) == ("ddp", "lightning", 2)
    assert r["global_batch_size"] == r["micro_batch_size"] * 2 * r["accumulation"]
    assert len(r["losses"]) == 5 and r["final_loss"] == r["losses"][-1]
    assert r["config"]["strategy"]["name"] == "ddp" and r["tokens_per_second"] > 0
    assert [m["rank"] for m in r["memory"]["ranks"]] == [0, 1]
    pred = r["memory"]["predicted"]  # the planner, next to what each rank really held
    for rank in r["memory"]["ranks"]:
        assert (rank["params"], rank["grads"], rank["optimizer"]) == \
            (pred["params"], pred["grads"], pred["master"] + pred["optimizer"])
    assert "report" in run.log and str(tmp_path / "ddp" / "report.json") in run.log


def test_cfg_job_prints_the_composed_config(tmp_path):
    run = run_cli("train.py", "--cfg", "job", "strategy=ddp", out=tmp_path / "cfg")
    assert "strategy:" in run.proc.stdout and "family: ddp" in run.proc.stdout
    assert "bucket_cap_mb: 25" in run.proc.stdout
    assert not (tmp_path / "cfg" / "report.json").exists()


def test_cfg_job_resolve_prints_the_resolved_config(tmp_path):
    """Audit hydra #9: paths.output_dir was typed str, and under --cfg Hydra has no run directory
    yet (None): ``--cfg job --resolve`` always failed ("Incompatible value 'None' for field of
    type 'str'", exit 2). It prints the resolved config, the output directory null."""
    run = run_cli("train.py", "--cfg", "job", "--resolve", "model=gpt_nano", out=tmp_path / "cfg", check=False)
    assert run.proc.returncode == 0, run.log[-3000:]
    assert f"root_dir: {ROOT}" in run.proc.stdout and "output_dir: null" in run.proc.stdout, run.proc.stdout
    assert "${" not in run.proc.stdout  # (resolved)


@pytest.mark.slow  # (CI: test_launch's multirun of three 2-process strategies, each into its own dir)
def test_multirun_sweeps_each_job_into_its_own_dir(tmp_path):
    sweep = tmp_path / "sweep"
    run = run_cli("train.py", "-m", "trainer.lr=1e-3,3e-3", "model=gpt_nano", "trainer.max_steps=2",
                  "callbacks.progress_bar=false", f"hydra.sweep.dir={sweep}", out=tmp_path / "unused")
    reports = [json.loads((sweep / str(i) / "report.json").read_text()) for i in (0, 1)]
    assert [r["config"]["trainer"]["lr"] for r in reports] == [1e-3, 3e-3]
    assert all(len(r["losses"]) == 2 for r in reports), run.log[-2000:]


@pytest.mark.parametrize("name", [p.stem for p in sorted((ROOT / "conf" / "experiment").glob("*.yaml"))
                                  if p.stem not in RECIPES])  # (those: tests/test_named_recipes.py)
def test_experiment_smoke(tmp_path, name):
    run = run_cli("train.py", f"experiment={name}", "model=gpt_nano", "trainer.max_steps=2",
                  "callbacks.progress_bar=false", out=tmp_path / name)
    assert len(run.report["losses"]) == 2


def _fails_before_launch(run, *needles: str) -> None:
    assert run.proc.returncode != 0
    for needle in needles:
        assert needle in run.log, f"{needle!r} not in:\n{run.log[-3000:]}"
    assert "Initializing distributed" not in run.log, "a process group was started"
    assert not (run.out / "report.json").exists()


def test_unknown_strategy_lists_the_presets(tmp_path):
    run = run_cli("train.py", "strategy=zero7", out=tmp_path / "bad", check=False)
    _fails_before_launch(run, "strategy=zero7: no such strategy; did you mean zero3? (strategy=zero3); "
                         "the options: 3d, auto, ddp,", "single")


def test_unknown_model_lists_the_models(tmp_path):
    run = run_cli("train.py", "model=gpt_huge", out=tmp_path / "bad", check=False)
    _fails_before_launch(run, "gpt_huge", "gpt_nano", "llama_70b")


def test_batch_arithmetic_is_printed(tmp_path):
    run = run_cli("train.py", "strategy=ddp", "cluster.devices=2", "cluster.accelerator=cpu",
                  "trainer.global_batch_size=12", "trainer.micro_batch_size=4",
                  out=tmp_path / "bad", check=False)
    assert run.proc.returncode == 2
    _fails_before_launch(run, "trainer.global_batch_size=12", "12 / 8 = 1.5")


def test_too_many_processes_is_explained(tmp_path):
    run = run_cli("train.py", "strategy=ddp", "cluster.devices=64", "cluster.accelerator=cpu",
                  "trainer.global_batch_size=64", "trainer.micro_batch_size=1",
                  out=tmp_path / "bad", check=False)
    assert run.proc.returncode == 2
    _fails_before_launch(run, "cluster.devices=64", "core(s)", "cluster.oversubscribe=true")


def test_a_failed_run_leaves_no_report(tmp_path):
    run = run_cli("train.py", "model=gpt_nano", "trainer.max_steps=2",
                  f"trainer.resume_from={tmp_path / 'missing.ckpt'}", out=tmp_path / "fail", check=False)
    assert run.proc.returncode != 0
    assert not (tmp_path / "fail" / "report.json").exists()
    assert not list((tmp_path / "fail").glob(".report.json*")), "a temp file was left behind"


@pytest.mark.parametrize("script", ["train.py", "plan.py"])
def test_a_value_of_the_wrong_type_and_a_mistyped_option_are_one_line_each(tmp_path, script):
    """OmegaConf's four lines naming the schema's class, and Hydra's option list with its search
    path, become one line each: the override, what the key takes or the closest option, exit 2."""
    for i, (override, line) in enumerate((("cluster.devices=two", "cluster.devices=two: cluster.devices takes an integer"),
                           ("model=llama70b", "model=llama70b: no such model; did you mean llama_70b? "
                                              "(model=llama_70b); the options: "))):
        run = run_cli(script, override, out=tmp_path / f"{script}{i}", check=False)
        assert run.proc.returncode == 2, run.log[-2000:]
        said = [x for x in run.proc.stderr.splitlines() if x.strip()]
        assert len(said) == 1 and said[0].startswith(line), run.proc.stderr
