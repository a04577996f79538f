"""A fork server for the suite's ``python train.py ...`` runs: the CI tier's time is mostly
interpreters importing torch and Lightning (~6.5 s of a tiny run's ~8.5 s on a 2-core machine).

The server (``python tests/zygote.py SOCKET``) imports the heavy third-party libraries once --
torch, ``torch._dynamo`` and ``torch.distributed`` (Lightning imports them), Lightning through
our torchmetrics shim, Hydra and OmegaConf -- and no module of ours, and forks a child per run.
The child takes the run's working directory, environment, argv and stdio (files), then runs the
script as ``python script ...`` would (``runpy``, ``__main__``), so everything of ours is
imported fresh in it. This is how our own local launcher starts CPU ranks (forked after
import). A run whose environment would change what the libraries read at import (``PYTHON*``,
``TORCH*``, ``OMP_*``, ...) or that asks for ``fresh=True`` (start-up timing) gets a plain
interpreter, as does every run when the server cannot start.

Which tests still start plain interpreters: every command that is not ``run_cli`` (torchrun,
``accelerate launch``, Slurm, user scripts, the import probes and the install test)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the preloaded libraries (or the interpreter) read at start-up: a run that sets any of
# these differently from the server's environment starts a plain interpreter.
IMPORT_TIME = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "LD_", "MALLOC_", "CUDA",
               "LIGHTNING", "PL_", "HYDRA", "TRITON", "HOME", "XDG_")


def _preload() -> None:
    import importlib.util

    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401

    # Lightning as our backend imports it (torchmetrics' transformers/scipy.signal deferred),
    # loaded by path: no package of ours is imported here.
    path = ROOT / "backends" / "lightning" / "torchmetrics_imports.py"
    spec = importlib.util.spec_from_file_location("_zygote_torchmetrics_imports", path)
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    shim.import_lightning()
    import lightning.pytorch  # noqa: F401
    import hydra  # noqa: F401
    import omegaconf  # noqa: F401


def _child(request: dict) -> None:
    """In the forked child: become ``python script args...`` and run it (never returns)."""
    import runpy

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][1]
    sys.argv = request["argv"][1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)  # (an exception or SystemExit ends this interpreter as it would end python's)


def serve(path: str) -> None:
    """One run at a time: fork, answer the child's pid, wait, answer its exit code."""
    try:  # gone with the test session that started it
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    print("ready", flush=True)
    conn, _ = listener.accept()
    stream = conn.makefile("rw")
    for line in stream:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            stream.close()
            conn.close()
            listener.close()
            _child(request)
        stream.write(json.dumps({"pid": pid}) + "\n")
        stream.flush()
        _, status = os.waitpid(pid, 0)
        stream.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        stream.flush()


class Zygote:
    """The client: ``run(cmd, env, cwd, timeout)`` -> CompletedProcess, or None where this run
    needs a plain interpreter."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env = tmp, env
        self.proc: subprocess.Popen | None = None
        self.sock = self.stream = None
        self.failed = False
        self.count = 0

    def _start(self) -> bool:
        if self.stream is not None or self.failed:
            return not self.failed
        path = str(self.tmp / "zygote.sock")
        self.proc = subprocess.Popen([sys.executable, "-u", __file__, path], cwd=ROOT, env=self.env,
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        line = "?"
        while line and line.strip() != "ready":  # (a library may print while it is imported)
            line = self.proc.stdout.readline()
        if not line:
            self.failed = True
            sys.stderr.write("tests/zygote.py did not start: plain interpreters for every run\n")
            return False
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        self.sock, self.stream = conn, conn.makefile("rw")
        return True

    def suits(self, cmd: list[str], env: dict[str, str]) -> bool:
        if len(cmd) < 2 or cmd[0] != sys.executable or cmd[1].startswith("-"):
            return False
        keys = {k for k in {*env, *self.env} if k.startswith(IMPORT_TIME)}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def run(self, cmd: list[str], env: dict[str, str], cwd: Path, timeout: float
            ) -> subprocess.CompletedProcess | None:
        if not self.suits(cmd, env) or not self._start():
            return None
        n = self.count = self.count + 1
        out, err = self.tmp / f"run{n}.out", self.tmp / f"run{n}.err"
        self.stream.write(json.dumps({"argv": cmd, "env": env, "cwd": str(cwd), "stdout": str(out),
                                      "stderr": str(err)}) + "\n")
        self.stream.flush()
        pid = self._answer()["pid"]
        # (the exit code is the next line; nothing else is buffered until the child is done)
        timed_out = not select.select([self.sock], [], [], timeout)[0]
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        code = self._answer()["returncode"]
        stdout, stderr = (p.read_text(errors="replace") for p in (out, err))
        out.unlink()
        err.unlink()
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout.encode(), stderr=stderr.encode())
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)

    def _answer(self) -> dict:
        line = self.stream.readline()
        if not line:
            self.failed = True
            raise RuntimeError("tests/zygote.py stopped answering (its stderr is above); "
                               "STRATAGEM_TEST_ZYGOTE=0 runs every command in a fresh interpreter")
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1])
