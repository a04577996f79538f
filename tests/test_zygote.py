"""The test harness's fork server (tests/zygote.py): a forked run looks to its script and to the
test as ``python script args...`` in a subprocess does."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.zygote import Zygote

SCRIPT = """
import os, sys
print(sys.argv[1:], os.getcwd(), os.environ.get("ZYGOTE_PROBE"), sys.path[0] == os.path.dirname(__file__),
      __name__, "torch" in sys.modules, "strategies" in sys.modules)
print("to stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "sleep":
    import time; time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.subprocess
def test_a_forked_run_is_what_a_fresh_interpreter_would_be(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    zygote = Zygote(tmp_path / "zygote", env)
    (tmp_path / "zygote").mkdir()
    try:
        run = zygote.run([sys.executable, str(script), "3"], {**env, "ZYGOTE_PROBE": "x"}, tmp_path, 60)
        assert run is not None and run.returncode == 3, run
        assert run.stdout.strip() == f"['3'] {tmp_path} x True __main__ True False", run.stdout
        assert run.stderr == "to stderr\n"
        raised = zygote.run([sys.executable, str(script), "raise"], env, tmp_path, 60)
        assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: boom"), raised.stderr
        t0 = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            zygote.run([sys.executable, str(script), "sleep"], env, tmp_path, 1)
        assert time.monotonic() - t0 < 10
        # what the preloaded libraries read at import, changed: a plain interpreter instead
        assert zygote.run([sys.executable, str(script), "0"], {**env, "PYTHONPATH": "/x"}, tmp_path, 60) is None
        assert zygote.run([sys.executable, str(script), "0"], env, tmp_path, 60).returncode == 0
    finally:
        zygote.close()
