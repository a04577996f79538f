"""The benchmarks cannot rot: every ``python -m bench <name> --smoke`` runs (tiny model, 1-3 steps,
one repetition) and writes nothing into BENCHMARKS.md. The real runs are by hand (BENCHMARKS.md
says how)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from bench import common
from bench.__main__ import NAMES
from tests.conftest import ROOT


def _row(out: str, bench: str, *cells: str) -> list[str]:
    """The first row of benchmark ``bench``'s table whose leading cells are ``cells``."""
    text = out.split(f"## bench {bench}\n", 1)[-1].split("\n## bench ", 1)[0]
    for line in text.splitlines():
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if parts[: len(cells)] == list(cells):
            return parts
    raise AssertionError(f"no row {cells} in:\n{text[-3000:]}")


# CI runs the smoke modes of the benchmarks whose scripts change with the product's levers (gpu:
# its variants; overhead: the hand-loop comparison that shows a per-step relapse); the others,
# which only read reports, in the slow tier (together ~2.5 min of CI).
CI_BENCHES = ("gpu",)  # (the GPU session's script; the others run when BENCHMARKS.md is regenerated)


def _smoke(bench: str) -> str:
    before = (ROOT / "BENCHMARKS.md").read_text()
    proc = subprocess.run([sys.executable, "-m", "bench", bench, "--smoke"], cwd=ROOT, env=common.env(),
                          capture_output=True, text=True, timeout=560, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (ROOT / "BENCHMARKS.md").read_text() == before  # smoke mode writes nothing
    return proc.stdout


def _check(bench: str, out: str) -> None:
    if bench == "overhead":  # ours and the hand-written DDP loop ran and trained the same losses
        ddp = _row(out, "overhead", "ddp", "lightning", "none")
        assert all(re.match(r"\d+\.\d+", ddp[i]) for i in (3, 4, 5)), ddp  # step, loop, CPU
        assert float(ddp[7]) < 1e-3, ddp
    elif bench == "startup":  # composing loads no heavy library; a single run does not load DeepSpeed
        single = _row(out, "startup", "single", "lightning", "–")
        assert single[4] == "none" and single[5].endswith("s"), single
        assert "deepspeed" not in single[6] and "wandb" not in single[6], single
    elif bench == "presets":
        assert _row(out, "presets", "ddp", "lightning")[4].endswith("MiB")
    elif bench == "steptime":  # uncalibrated in smoke mode: a measured step, no verdict
        ddp = _row(out, "steptime", "ddp")
        assert float(ddp[2]) > 0 and ddp[3].startswith("–"), ddp
    elif bench == "scaling":
        assert float(_row(out, "scaling", "gpt_nano", "1")[6]) > 0
    elif bench == "gpu":  # its CPU smoke: every variant row measured, the offload ladder trained
        assert _row(out, "gpu", "single", "eager")[2].isdigit()
        assert "Largest model the planner fits" in out and "trained 1 steps" in out, out[-2000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("bench", [b if b in CI_BENCHES else pytest.param(b, marks=pytest.mark.slow)
                                   for b in NAMES])
def test_every_benchmark_runs_in_smoke_mode(bench):
    out = _smoke(bench)
    assert f"## bench {bench}" in out, out[-2000:]
    _check(bench, out)


@pytest.mark.unit
def test_a_benchmark_rewrites_only_its_own_section(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text("# B\n\nkept\n")
    common.write_section("a", "one", doc)
    common.write_section("b", "two", doc)
    common.write_section("a", "three", doc)
    text = doc.read_text()
    assert text.count("<!-- bench:a -->") == 1 and "three" in text and "one" not in text
    assert "two" in text and "kept" in text
