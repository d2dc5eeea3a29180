"""Run a pytest selection several times and count each test's failures: `make flake-check` (FLAKE_RUNS=20).

    python tests/helpers/flake_check.py --runs 20 -- -m slow -n 3 --dist loadgroup

Each run writes a JUnit XML report to a temp dir; at the end one line per test that failed or errored at least
once (its count, the first line of its first message) and a total. A test that fails 1 time in 20 is a defect.
Exit status 1 if any test failed in any run, else 0.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def outcomes(report: Path) -> dict[str, str]:
    """test id -> 'passed' | 'failed' | 'skipped', from one JUnit XML report (errors count as failed)."""
    result = {}
    for case in ET.parse(report).iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            message = (bad.get("message") or "").strip().splitlines()
            result[test] = "failed: " + (message[0][:160] if message else "(no message)")
        elif case.find("skipped") is not None:
            result.setdefault(test, "skipped")
        else:
            result.setdefault(test, "passed")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("pytest_args", nargs="*", help="after --: the pytest selection and options")
    args = p.parse_args(argv)
    failures, first_message, runs_seen = Counter(), {}, Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(1, args.runs + 1):
            report = Path(tmp) / f"run{i}.xml"
            t0 = time.monotonic()
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--junitxml={report}",
                    *args.pytest_args,
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            if not report.exists():  # pytest itself failed (a bad option, a collection error)
                print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
                return 2
            results = outcomes(report)
            bad = {t: o for t, o in results.items() if o.startswith("failed")}
            for test, outcome in results.items():
                runs_seen[test] += outcome != "skipped"
            for test, outcome in bad.items():
                failures[test] += 1
                first_message.setdefault(test, outcome)
            print(
                f"run {i}/{args.runs}: {len(results)} tests, {len(bad)} failed, {time.monotonic() - t0:.0f} s"
                + "".join(f"\n  FAILED {t}" for t in sorted(bad)),
                flush=True,
            )
    print(f"\n{len(runs_seen)} tests x {args.runs} runs; failures per test:")
    for test, count in failures.most_common():
        print(f"  {count:3d}/{runs_seen[test]:<3d} {test}  ({first_message[test]})")
    print(
        f"{sum(failures.values())} failures in all, {len(failures)} tests failed at least once"
        if failures
        else "0 failures"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
