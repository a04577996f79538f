"""The Dockerfile (the image cluster=k8s names): no image builder runs here (a Docker client
without a daemon, and no registry to pull the base images from), so its text is linted against
the project it installs, and its check commands run in this shell as they run in the build."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import ROOT

INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "WORKDIR", "COPY", "LABEL", "ENTRYPOINT", "CMD", "USER", "EXPOSE"}


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#")))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word, " ".join(rest.split())))
    return out


@pytest.mark.unit
def test_the_dockerfile_is_well_formed_and_installs_what_the_project_declares():
    steps = _instructions()
    assert {w for w, _ in steps} <= INSTRUCTIONS, {w for w, _ in steps} - INSTRUCTIONS
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    stages = [a.split(" AS ")[-1] for w, a in steps if w == "FROM" and " AS " in a]
    assert args["VARIANT"] == "cuda" and {"base-cpu", "base-cuda"} <= set(stages)
    assert ("FROM", "base-${VARIANT}") in steps  # the last stage: the variant the build argument picks
    # the torch README pins, from an index that holds it; the extras pyproject declares
    readme = (ROOT / "README.md").read_text()
    assert f"torch=={args['TORCH_VERSION']}" in readme
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installs = " ".join(a for w, a in steps if w == "RUN" and "pip install" in a)
    extras = re.search(r'-e "\.\[([a-z0-9,]+)\]"', installs).group(1).split(",")
    assert set(extras) <= set(project["optional-dependencies"]) and {"hf", "k8s"} <= set(extras)
    assert '"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"' in installs
    assert all("TORCH_INDEX=https://download.pytorch.org/whl/" in a for w, a in steps if w == "ENV" and "TORCH_INDEX" in a)
    # Ubuntu 24.04's python3 (3.12) satisfies requires-python
    assert project["requires-python"] == ">=3.11"


@pytest.mark.unit
def test_the_image_layout_is_what_cluster_k8s_runs():
    """WORKDIR is cluster.k8s.workdir, where every pod runs torchrun train.py; the copy leaves out
    what must not ship (git history, virtual environments, run outputs)."""
    from recipes.config import compose

    k = compose(["cluster=k8s"]).cluster.k8s
    steps = _instructions()
    assert ("WORKDIR", k.workdir) in steps and ("COPY", ". .") in steps
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv*", "outputs", "multirun", "**/__pycache__"} <= set(ignored)
    assert (ROOT / "train.py").is_file() and (ROOT / "plan.py").is_file()


@pytest.mark.subprocess
def test_the_build_s_check_commands_pass_here():
    """The last RUN (what fails a build whose configs do not compose) in this checkout's shell."""
    last = [a for w, a in _instructions() if w == "RUN"][-1]
    for part in last.split("&&"):
        argv = shlex.split(part.split(">")[0])
        assert argv[0] == "python"
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 0, f"{part}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
