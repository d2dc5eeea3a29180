"""Tests only: an interpreter that starts `python script.py ...` (or `python -m module ...`) by forking a server
that has already imported torch, Lightning, transformers and the project, instead of importing them afresh.

Why: a fresh interpreter spends ~6.5 s of one core importing (`python -X importtime -c "import train"`: torch
1.9 s, torchmetrics via Lightning 2.7 s, torch._dynamo via Lightning 1.4 s), while a test's run trains a tiny
model for a few steps. In a 2-rank run, rank 0 then waits ~10 s at the rendezvous for rank 1's imports.

How: one server per test session (`serve`: imports PRELOAD, listens on a Unix socket; `start()` in pytest's
controller, shared by its xdist workers); `interpreter()` returns the path of a small executable that stands in for
`python`. Run as `STAND_IN script.py args`, the stand-in sends its argv, environment, cwd and its
stdin/stdout/stderr file descriptors to the server; the server forks a supervisor, which forks the run; the
stand-in forwards the signals it gets to the run and exits with the run's exit code (or dies of the run's signal).
Inside the run `sys.executable` is the stand-in, so the ranks Lightning's DDP launcher starts
(`sys.executable train.py ...`) are forked from the server too, through the real launcher.
It forks scripts (after an optional `-u`: torchrun starts its ranks so, and takes the stand-in from PYTHON_EXEC),
the project's own modules (`-m src.…`, `-m bench.…`) and submitit's task (`-m submitit.core._submit`: the train.py
job that `hydra/launcher=submitit_local` runs, started by the launcher's sys.executable); anything else (`-c`, other
options, other modules, no server) it hands to the real interpreter with exec. A run's pid is not the pid its parent
sees (the stand-in's), so programs that need that (submitit's local controller, `-m submitit.local._local`, names its
job dir by it) must start as real processes: they do. So does torchrun's agent: its c10d rendezvous numbers the nodes by sorted
(host, pid), and the two-"node" tests need node 0's agent, started first, to have the lower pid.

What stays the same as a fresh `python script.py args`: the run is a process of its own with its own pid, cwd,
environment, argv, file descriptors 0-2 (which its own children inherit) and exit code; the script runs as
`__main__` with sys.path[0] its dir, so Hydra, Lightning's launcher and `sys.exit` behave as from a shell; atexit
handlers run at the end; a stand-in killed by SIGKILL takes its run with it (the supervisor kills it).
What differs: the modules in PRELOAD were imported with the server's environment (the test session's, minus
OMP_NUM_THREADS), so a variable read at import time is the session's, except OMP_NUM_THREADS, which the run
applies with torch.set_num_threads as torch's import would; the run's parent is its supervisor, not the stand-in,
and it is in the server's process group: tests that SIGKILL a process group put DIE_WITH_PARENT in its environment.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What a train.py / eval.py run imports before and during its first steps (the server imports them once).
PRELOAD = [
    "torch",
    "lightning",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "hydra",
    "omegaconf",
    "torch.utils.tensorboard",
    "lightning.pytorch.loggers.tensorboard",
    "torch.distributed.checkpoint",
    "src.launch.resolvers",
    "src.utils.config",
    "src.run.job",
    "src.utils.errors",
    "src.callbacks.essentials",
    "src.launch.hydra_ddp",
    "src.launch.timeouts",
    "src.lm.init",
    "src.lm.models.gpt2_module",
    "src.lm.data.text",
    "src.tools.checkpoints",
    "src.checkpoint.latest",
    "src.checkpoint.convert",
    "transformers.optimization",
    "peft",
]

# The stand-in for `python`: stdlib only and run with -S, so it starts in milliseconds.
STAND_IN = r"""#!{python} -S
import json, os, signal, socket, sys
PYTHON, SERVER = {python!r}, {server!r}
args = sys.argv[1:]
unbuffered = args[:1] == ["-u"]  # torchrun starts its ranks as `python -u script ...`
args = args[1:] if unbuffered else args
script = bool(args) and not args[0].startswith("-")
module = args[1] if args[:1] == ["-m"] and len(args) > 1 else ""
project_module = module.split(".")[0] in ("src", "bench") or module == "submitit.core._submit"
if not (script or project_module) or not os.path.exists(SERVER):
    os.execv(PYTHON, [PYTHON, *sys.argv[1:]])  # anything else, or no server: the real interpreter
if os.environ.get("FORKRUN_DIE_WITH_PARENT") == "1":  # see DIE_WITH_PARENT
    import ctypes
    parent = os.getppid()
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: SIGKILL when the parent dies
    if os.getppid() != parent:  # it died before that
        os.kill(os.getpid(), signal.SIGKILL)
for fd in (0, 1, 2):
    try:
        os.fstat(fd)
    except OSError:
        os.open(os.devnull, os.O_RDWR)  # takes the lowest free descriptor: this one
request = json.dumps({{"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "unbuffered": unbuffered}})
request = request.encode()
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.connect(SERVER)
socket.send_fds(server, [len(request).to_bytes(8, "big")], [0, 1, 2])
server.sendall(request)
replies = server.makefile("rb")
pid = int(replies.readline())
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, lambda number, frame: os.kill(pid, number))
line = replies.readline()
code = int(line) if line else 1
if code < 0:  # the run died of a signal: so does its stand-in
    if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (these two cannot be caught, so need no reset)
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""

# For tests that SIGKILL a job's process group (a node going down): a run is forked from the server, so it is not
# in the group of the stand-in the test started, and neither are the ranks it starts. With this in the job's
# environment, every stand-in of the job dies with its parent process (PR_SET_PDEATHSIG), and its supervisor then
# kills its run: the group's SIGKILL reaches the top stand-in, which takes rank 0 along, whose death takes the
# other ranks' stand-ins, and so their runs. The real interpreter ignores the variable (a fresh job is all in
# the group already). Not the default: a real process outlives its parent, and test_hangs checks for orphans.
DIE_WITH_PARENT = {"FORKRUN_DIE_WITH_PARENT": "1"}

_stand_in: str | None = None


def interpreter() -> str:
    """The stand-in's path: that of the server `start()` made for this test session (its dir in FORKRUN_DIR, which
    pytest-xdist's workers inherit from the controller: one server, one set of imports, for all of them), or else
    of one started here on the first call. Waits for the server's imports."""
    global _stand_in
    if _stand_in is None:
        tmp = os.environ.get("FORKRUN_DIR") or start()
        end = time.time() + 600
        while not os.path.exists(os.path.join(tmp, "server.sock")):  # it appears once the server listens
            if os.path.exists(os.path.join(tmp, "failed")) or time.time() > end:  # (its error is on stderr)
                raise AssertionError("the tests' fork server did not start")
            time.sleep(0.05)
        _stand_in = os.path.join(tmp, "python")
    return _stand_in


def start() -> str:
    """Start a server in the background and return its dir; it exits when this process is gone (its stdin is our
    pipe). conftest.py starts the session's in pytest's controller, so the imports overlap the workers' collection."""
    tmp = tempfile.mkdtemp(prefix="forkrun-")
    server, stand_in = os.path.join(tmp, "server.sock"), os.path.join(tmp, "python")
    Path(stand_in).write_text(STAND_IN.format(python=sys.executable, server=server))
    os.chmod(stand_in, 0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "FORKRUN_DIR")}
    server_process = subprocess.Popen(
        [sys.executable, "-c", f"from tests.helpers.forkrun import serve; serve({server!r}, {stand_in!r})"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
    )
    atexit.register(_stop, server_process, tmp)
    return tmp


def _stop(server: subprocess.Popen, tmp: str) -> None:
    if not os.path.exists(os.path.join(tmp, "server.sock")):
        server.kill()  # still importing (a session that ran no script): it reads the closed pipe only after that
    server.stdin.close()
    server.wait()
    shutil.rmtree(tmp, ignore_errors=True)


# ---- in the server ----


def serve(path: str, stand_in: str) -> None:
    import gc
    import selectors

    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except BaseException:
        Path(path).with_name("failed").touch()  # the waiting test processes fail at once instead of timing out
        raise
    # The preloaded modules' ~500k objects out of the cyclic collector's reach in every run forked from here, as the
    # gc module's docs advise before fork(): a full collection in a run otherwise walks them all (~0.2 s of one core
    # each time) and writes to their pages. A tiny GPT-2 run: 0.93 -> 0.66 s of CPU (docs/testing.md).
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the supervisors
    os.rename(path + ".new", path)  # ready: the path appears only once it accepts connections
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    events.register(0, selectors.EVENT_READ)
    while True:
        for key, _ in events.select():
            if key.fileobj == 0:
                if not os.read(0, 1):  # the test process is gone
                    os._exit(0)
                continue
            conn, _ = listener.accept()
            if os.fork() == 0:
                events.close()
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                try:
                    _supervise(conn, stand_in)
                finally:
                    os._exit(0)
            conn.close()


def _supervise(conn: socket.socket, stand_in: str) -> None:
    """Fork one run, tell the stand-in its pid, then its exit code; kill it if the stand-in goes away first."""
    import select

    header, fds, _, _ = socket.recv_fds(conn, 8, 3)
    while len(header) < 8:
        header += conn.recv(8 - len(header))
    size, request = int.from_bytes(header, "big"), b""
    while len(request) < size:
        chunk = conn.recv(size - len(request))
        if not chunk:
            return
        request += chunk
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become(json.loads(request), fds, stand_in)
    for fd in fds:
        os.close(fd)
    conn.sendall(b"%d\n" % pid)
    ended = os.pidfd_open(pid)
    readable, _, _ = select.select([conn, ended], [], [])
    if ended not in readable:  # the stand-in closed the connection: it was killed
        os.kill(pid, signal.SIGKILL)
    _, status, usage = os.wait4(pid, 0)
    if os.environ.get("FORKRUN_LOG"):  # what each run cost: for finding where the suite's time goes
        with open(os.environ["FORKRUN_LOG"], "a") as f:
            request = json.loads(request)
            f.write(
                json.dumps(
                    {
                        "test": request["env"].get("PYTEST_CURRENT_TEST"),
                        "cwd": request["cwd"],
                        "argv": request["argv"],
                        "cpu": usage.ru_utime + usage.ru_stime,
                    }
                )
                + "\n"
            )
    try:
        conn.sendall(b"%d\n" % os.waitstatus_to_exitcode(status))
    except OSError:
        pass


def _add_pythonpath() -> None:
    """The run's PYTHONPATH entries after sys.path[0], where the interpreter puts them (the server's were its own)."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = entries


def _become(request: dict, fds: list[int], stand_in: str) -> None:
    """In the forked run: become `python argv...` in the request's cwd and environment, then exit with its code."""
    import io
    import runpy
    import traceback

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.executable = stand_in  # the run's own `python script` children (Lightning's ranks) start here too
    if "OMP_NUM_THREADS" in os.environ:  # what torch's import does with it in a fresh process
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    buffered = not (request["unbuffered"] or os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=not buffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    argv, code = request["argv"], 0
    try:
        if argv[0] == "-m":  # `python -m module args`: sys.path[0] is the cwd
            sys.argv = ["-m", *argv[2:]]
            sys.path[0] = os.getcwd()
            _add_pythonpath()
            sys.modules.pop(argv[1], None)  # preloaded: run it afresh as __main__ (runpy warns otherwise)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # `python script args`: sys.path[0] is the script's dir
            path = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(path)
            _add_pythonpath()
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
