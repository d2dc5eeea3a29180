"""Tests only: run `python train.py ARGS` (or eval.py, or any script) as a process forked from one that has
already imported torch, Lightning, transformers and the project, instead of a fresh interpreter.

Why: a fresh interpreter spends ~6.5 s of one core importing (`python -X importtime -c "import train"`: torch
1.9 s, torchmetrics via Lightning 2.7 s, torch._dynamo via Lightning 1.4 s), while a test's run trains a tiny
model for a few steps. Measured over the suite, the processes' CPU time was almost all imports. multiprocessing's
"forkserver" keeps one clean server per test process that imports `PRELOAD` once and forks a child per run.

What stays the same as `subprocess.run([python, script, *args])`: the run is its own process (its own pid,
state, exit code, and stdout/stderr at file descriptors 1 and 2, which its own children inherit); it starts in
`cwd` with exactly `env`; `sys.argv` is `[script, *args]` and the script runs as `__main__`, so Hydra, Lightning's
DDP launcher (which starts the other ranks as fresh `python script ...` processes) and `sys.exit` behave as from
a shell; atexit handlers run at the end. What differs: the modules in PRELOAD were imported with the server's
environment (the test session's, minus OMP_NUM_THREADS, as run_script passes it), so a variable read at import
time by one of them is the session's; Python's `random` is reseeded at fork (as a fresh process seeds it).
Tests that signal a run or need a special environment start their own subprocess.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# What a train.py / eval.py run imports before and during its first steps (the server imports them once).
PRELOAD = [
    "torch", "lightning", "transformers", "transformers.models.gpt2.modeling_gpt2", "hydra", "omegaconf",
    "torch.utils.tensorboard", "lightning.pytorch.loggers.tensorboard", "torch.distributed.checkpoint",
    "src.utils.resolvers", "src.utils.config", "src.utils.run", "src.utils.errors", "src.callbacks.essentials",
    "src.distributed.hydra_ddp", "src.distributed.timeouts", "src.models.init", "src.models.gpt2",
    "src.datamodules.text", "src.tools.checkpoints",
]

_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        omp = os.environ.pop("OMP_NUM_THREADS", None)  # the server starts now, with this environment
        try:
            _context.Process(target=os.getpid).start()  # starts the server
        finally:
            if omp is not None:
                os.environ["OMP_NUM_THREADS"] = omp
    return _context


def _run(script: str, args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked child: become `python script *args`, then exit with its code."""
    import atexit
    import io
    import runpy
    import traceback

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    code = 0
    try:
        if script == "-m":  # `python -m module args`: argv[0] is the module's file, sys.path[0] the cwd
            sys.argv = ["-m", *args[1:]]
            sys.path.insert(0, cwd)
            sys.modules.pop(args[0], None)  # preloaded: run it afresh as __main__ (runpy warns otherwise)
            runpy.run_module(args[0], run_name="__main__", alter_sys=True)
        else:  # `python script args`: sys.path[0] is the script's dir
            path = str(Path(cwd, script).resolve())
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:  # what the interpreter does with sys.exit(x)
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # an uncaught exception: traceback and exit 1
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run(script: str, args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Like subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), from a forked child (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = _forkserver().Process(target=_run, args=(script, list(args), dict(env), str(cwd), out, err))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired([script, *args], timeout, Path(out).read_text(), Path(err).read_text())
        return subprocess.CompletedProcess([sys.executable, script, *args], child.exitcode,
                                           Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace"))
