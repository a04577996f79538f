"""Every launch command README.md prints runs as printed with ``--dry-run`` (exit 0): each
``python launch.py ...`` line, each ``python train.py ... cluster=...`` line, and every
``python train.py`` line of the Launching section, read from README.md's code blocks (a ``\\``
continuation joined, a ``# comment`` cut, a bare ``...`` -- "your other overrides" -- dropped,
``--dry-run`` added where the line has none). train.py's ``--dry-run`` composes, validates at RUN
depth, plans and asks the launcher (launchers/dry_run.py); launch.py's builds the submission.
Both run in this process (the same ``main`` the command line reaches, no engine imported)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex

import pytest

from tests.conftest import ROOT

PENDING: dict[str, str] = {
    # README line as printed -> the line that runs, while README.md is being fixed (empty: every
    # README line runs as printed).
}


def launch_commands(text: str) -> list[str]:
    """The README's launch commands, one line each, in order."""
    found = []
    launching = re.search(r"^## Launching.*?(?=^## )", text, re.S | re.M)
    section = launching.group(0) if launching else ""
    for block in re.findall(r"^```(?:bash|sh|shell)?\n(.*?)^```", text, re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = " ".join(line.split("  #")[0].split(" # ")[0].split())
            if not line.startswith(("python launch.py", "python train.py")):
                continue
            if "launch.py" in line or "cluster=" in line or block in section:
                found.append(line)
    return found


COMMANDS = launch_commands((ROOT / "README.md").read_text())


def _run(line: str) -> tuple[int, str]:
    """The command's exit code and output, run here with --dry-run (plan.py's as it is)."""
    argv = [a for a in shlex.split(line) if a != "..."][1:]
    script, args = argv[0], argv[1:]
    if "--dry-run" not in args and script != "plan.py":  # (plan.py: a query, nothing to start)
        args.append("--dry-run")
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if script == "train.py":
                from launchers import dry_run

                code = dry_run.main(args)
            else:
                spec = importlib.util.spec_from_file_location("launch_script", ROOT / script)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                module.main(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue()


@pytest.mark.unit
def test_the_readme_has_every_kind_of_launch():
    joined = "\n".join(COMMANDS)
    for kind in ("cluster=torchrun", "hydra/launcher=submitit_slurm", "cluster=sagemaker", "cluster=ray",
                 "cluster=k8s", "python train.py strategy=ddp cluster.devices=2"):
        assert kind in joined, f"no README launch command with {kind}:\n{joined}"


def _tier(line: str):
    """unit, but Ray's launcher check imports Ray, whose import subclasses subprocess.Popen (the unit
    tier refuses Popen): those lines are in the subprocess tier."""
    return pytest.mark.subprocess if "cluster=ray" in line else pytest.mark.unit


@pytest.mark.parametrize("line", [pytest.param(c, marks=_tier(c), id=c[:60]) for c in COMMANDS])
def test_each_readme_launch_command_runs_with_dry_run(line):
    if "cluster=ray" in line and importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (the dry run says: pip install -e '.[ray]')")
    code, out = _run(PENDING.get(line, line))
    assert code == 0, f"{line}\n-> exit {code}:\n{out[-3000:]}"
    assert "nothing was started" in out or "--dry-run" in line


@pytest.mark.unit
def test_a_pending_readme_line_still_fails_as_printed():
    """Each replacement is needed: the README line as printed does not run (drop the entry once
    README.md carries the replacement)."""
    for old in PENDING:
        if old in COMMANDS:
            assert _run(old)[0] == 2, old


def table_commands(text: str) -> list[str]:
    """The strategy table's "run it" column, each as the train.py command it abbreviates."""
    table = text.split("<!-- strategy-table -->", 1)[1].split("<!-- /strategy-table -->", 1)[0]
    found = []
    for row in table.strip().splitlines()[2:]:
        cell = row.rstrip(" |").rsplit("|", 1)[-1].strip().strip("`")
        found.append(cell.replace("...", "python train.py", 1) if cell.startswith("...") else cell)
    return found


TABLE = table_commands((ROOT / "README.md").read_text())


@pytest.mark.unit
@pytest.mark.parametrize("line", TABLE, ids=[c.split("strategy=")[-1][:40] for c in TABLE])
def test_each_strategy_table_command_runs_as_printed(line):
    """Each preset's "run it" command is valid as printed (its batch divides the mesh, its schedule
    has its microbatches): a dry run on this machine, told to oversubscribe its two cores; a GPU or
    NVMe line through plan.py, which checks the configuration and not this machine."""
    assert line.startswith("python train.py"), line
    elsewhere = "cluster.accelerator=gpu" in line or "nvme_path=" in line
    code, out = _run(line.replace("train.py", "plan.py") if elsewhere else line + " cluster.oversubscribe=true")
    assert code == 0, f"{line}\n-> exit {code}:\n{out[-3000:]}"
    assert "one replica" not in out, f"{line}: a hybrid row that builds no replicas\n{out[-3000:]}"
