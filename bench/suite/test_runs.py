"""Wall time of the tests' train.py runs: fresh interpreters against the tests' forking stand-in `python`.

    python -m bench.suite.test_runs [--rounds 3]

Runs test_parity.GPT2 (6 steps of a 2-layer GPT-2 on tests/data) as 1 process, 2-rank DDP and 2-rank DeepSpeed
ZeRO-2 (the tests' CPU strategy), once with `sys.executable` (every rank a fresh interpreter, as with
TEST_FRESH_PROCESSES=1) and once with tests/helpers/forkrun.py's stand-in (every rank forked from a server that
imported torch & co. once), interleaved, and prints the medians and their ratio. The server is started and used
once before the rounds, so its own start (one fresh import per test session) is not in the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tests.helpers import forkrun  # noqa: E402
from tests.test_deepspeed import CPU_DS  # noqa: E402
from tests.test_parity import GPT2, QUIET  # noqa: E402

CASES = {
    "1 process": [],
    "2-rank DDP": ["trainer=ddp", "trainer.devices=2"],
    "2-rank ZeRO-2": CPU_DS + ["trainer.strategy.stage=2"],
}


def seconds(python: str, args: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [f"paths.log_dir={tmp}/logs", f"paths.cache_dir={tmp}/cache"]
        t0 = time.time()
        subprocess.run(
            [python, "train.py", *QUIET, *paths, *GPT2, *args],
            cwd=ROOT,
            env={**env, "PYTHONUNBUFFERED": "1"},
            check=True,
            capture_output=True,
        )
        return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    rounds = ap.parse_args().rounds
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    ways = {"fresh": sys.executable, "forked": forkrun.interpreter()}
    seconds(ways["forked"], [])  # the server's first fork
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for case, args in CASES.items():
            for way in list(ways) if r % 2 == 0 else list(ways)[::-1]:
                times.setdefault((case, way), []).append(seconds(ways[way], args))
    print(f"median of {rounds} interleaved rounds, {os.cpu_count()} CPU cores")
    print(f"{'run':<16}{'fresh s':>9}{'forked s':>10}{'fresh/forked':>14}")
    for case in CASES:
        fresh, forked = (statistics.median(times[(case, w)]) for w in ways)
        print(f"{case:<16}{fresh:>9.1f}{forked:>10.1f}{fresh / forked:>13.2f}x")


if __name__ == "__main__":
    main()
