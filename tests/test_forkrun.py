"""The tests' stand-in interpreter (tests/helpers/forkrun.py) runs a script as a fresh `python` would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import gone

from tests.helpers import forkrun

SCRIPT = """
import json, os, sys
import torch
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("X"), "path0": sys.path[0],
                  "threads": torch.get_num_threads(), "name": __name__}))
print("to stderr", file=sys.stderr)
child = __import__("subprocess").run([sys.executable, os.path.join(os.path.dirname(__file__), "child.py")],
                                     capture_output=True, text=True)
print(child.stdout.strip())
sys.exit(3)
"""
CHILD = "import sys; print('child', 'lightning' in sys.modules)"  # preloaded only in a forked run


def test_a_script_runs_as_under_a_fresh_interpreter_and_its_children_fork_too(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "child.py").write_text(CHILD)
    env = {**os.environ, "X": "1", "OMP_NUM_THREADS": "1"}
    runs = {
        python: subprocess.run(
            [python, str(tmp_path / "script.py"), "a", "b c"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        for python in (sys.executable, forkrun.interpreter())
    }
    fresh, forked = runs[sys.executable], runs[forkrun.interpreter()]
    assert forked.returncode == fresh.returncode == 3
    assert forked.stderr == fresh.stderr == "to stderr\n"
    fresh_lines, forked_lines = fresh.stdout.splitlines(), forked.stdout.splitlines()
    assert forked_lines[0] == fresh_lines[0]  # argv, cwd, environment, sys.path[0], threads, __main__
    assert '"threads": 1' in forked_lines[0]
    assert (fresh_lines[1], forked_lines[1]) == ("child False", "child True")  # sys.executable is the stand-in


def _sleeper(tmp_path: Path, name: str) -> tuple[subprocess.Popen, int]:
    """A stand-in running a script that writes its pid and sleeps: (the stand-in, the run's pid)."""
    script, pid_file = tmp_path / "sleep.py", tmp_path / f"pid_{name}"
    script.write_text("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    proc = subprocess.Popen([forkrun.interpreter(), str(script), str(pid_file)])
    while not pid_file.exists() or not pid_file.read_text():
        assert proc.poll() is None
        time.sleep(0.05)
    run_pid = int(pid_file.read_text())
    assert run_pid != proc.pid  # forked by the server, not the stand-in itself
    return proc, run_pid


def test_signals_reach_the_run_and_a_killed_stand_in_takes_its_run_along(tmp_path):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc, run_pid = _sleeper(tmp_path, sig.name)
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == -sig
        assert gone(run_pid), f"the run outlived its stand-in ({sig!r})"
    # a run that dies of SIGKILL itself (a simulated preemption): its stand-in dies of it too
    proc, run_pid = _sleeper(tmp_path, "self")
    os.kill(run_pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_what_the_stand_in_does_not_fork_goes_to_the_real_interpreter(tmp_path):
    """`-c`, and modules outside the project (submitit's local controller needs its own pid to be the one its
    parent sees): exec of the real interpreter, so the pid is the stand-in's and nothing is preloaded."""
    code = "import os, sys; print('lightning' in sys.modules, sys.executable, os.getpid())"
    (tmp_path / "probe.py").write_text(code)
    for args in (["-c", code], ["-m", "probe"]):
        proc = subprocess.Popen([forkrun.interpreter(), *args], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        out = proc.communicate(timeout=60)[0]
        assert out.split() == ["False", str(Path(sys.executable)), str(proc.pid)]


def test_a_process_group_kill_takes_the_whole_job_with_die_with_parent(tmp_path):
    """A job (a run that starts a child run, as rank 0 starts rank 1) SIGKILLed as a process group, the way a
    node goes down: with DIE_WITH_PARENT both runs end. Without it the child run outlives its parent, as a real
    process does (test_hangs relies on that to see orphans)."""
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import os, subprocess, sys, time\n"
        "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "subprocess.Popen([sys.executable, sys.argv[2], sys.argv[3]])\n"
        "time.sleep(60)\n"
    )
    (tmp_path / "sleep.py").write_text(
        "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    )
    for name, extra, child_survives in (("die", forkrun.DIE_WITH_PARENT, False), ("default", {}, True)):
        pids = [tmp_path / f"{name}_parent", tmp_path / f"{name}_child"]
        proc = subprocess.Popen(
            [forkrun.interpreter(), str(parent), str(pids[0]), str(tmp_path / "sleep.py"), str(pids[1])],
            env={**os.environ, **extra},
            start_new_session=True,
        )
        while not all(p.exists() and p.read_text() for p in pids):
            assert proc.poll() is None
            time.sleep(0.05)
        parent_pid, child_pid = (int(p.read_text()) for p in pids)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert gone(parent_pid)
        assert gone(child_pid, timeout=2) != child_survives, name
        if child_survives:
            os.kill(child_pid, signal.SIGKILL)
