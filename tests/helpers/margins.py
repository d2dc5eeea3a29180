"""Tolerances that say how close they came. A check between two different computations (N ranks against 1
process, our loss against TRL's, an exported model against the module) goes through `within` or `close`: they
assert, and when TEST_MARGINS names a file they append one JSON line there (the test, what was compared, the
largest difference, the tolerance and their ratio). `python -m tests.helpers.margins FILE [FILE ...]` prints the
largest ratio each check reached, so the margin left on a CPU is measured, not guessed (docs/testing.md).

The ratio is what matters across CPUs: a check at 0.9 on one machine fails on the next whose kernels round
otherwise (it has happened). The two ways out are float64 on both sides (U64 below: 1e-9 is ~10^7 of its units and ~100
times below fp32's rounding, so an fp32 step left in either side still shows) or a tolerance derived from the
computation, with its derivation beside the check."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import torch

U32 = 2.0**-24  # fp32's unit roundoff: a rounded value is within U32 of the exact one, relatively
U64 = 2.0**-53
FLOAT64_TOL = 1e-9  # for two computations both run in float64 (module docstring)


def record(what: str, diff: float, tol: float) -> float:
    """Appends the check to $TEST_MARGINS (when set) and returns diff / tol."""
    ratio = diff / tol if tol else (0.0 if diff == 0 else float("inf"))
    path = os.environ.get("TEST_MARGINS")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        line = json.dumps({"test": test, "what": what, "diff": diff, "tol": tol, "ratio": ratio})
        with open(path, "a") as f:  # one short write per line: the xdist workers' lines do not interleave
            f.write(line + "\n")
    return ratio


def within(diff: float, tol: float, what: str) -> None:
    """assert diff <= tol, recording how close it came."""
    record(what, float(diff), tol)
    assert diff <= tol, f"{what}: {diff:.3g} > {tol:.3g}"


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float, atol: float) -> None:
    """torch.testing.assert_close's rule, |a - e| <= atol + rtol |e| elementwise, recording the worst ratio."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shapes {tuple(a.shape)} and {tuple(e.shape)}"
    ratio = ((a - e).abs() / (atol + rtol * e.abs())).max().item() if a.numel() else 0.0
    record(what, ratio, 1.0)
    assert ratio <= 1.0, f"{what}: off by {ratio:.3g} times the tolerance (rtol={rtol:g}, atol={atol:g})"


def close64(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Two computations run in float64 on both sides agree to FLOAT64_TOL (module docstring)."""
    assert actual.dtype == expected.dtype == torch.float64, f"{what}: {actual.dtype}, {expected.dtype}"
    close(actual, expected, what, rtol=FLOAT64_TOL, atol=FLOAT64_TOL)


def close_fp32_weights(actual: torch.Tensor, expected: torch.Tensor, what: str, depth: int) -> None:
    """Two float64 computations of one model, one of them with its weights rounded to fp32 on the way (a merged
    LoRA export stores W + s BA in fp32, the checkpoint's dtype): each such weight is off by <= U32 of itself, so
    each of the `depth` layers' outputs by a few U32 of its size, and the logits by <= 8 depth U32 of their
    largest value, an fp32 forward's rounding (~1e-5 here) being well outside."""
    assert actual.dtype == expected.dtype == torch.float64, f"{what}: {actual.dtype}, {expected.dtype}"
    within((actual - expected).abs().max().item(), 8 * depth * U32 * expected.abs().max().item(), what)


def report(paths: list[str]) -> list[tuple[float, str, str, int]]:
    """(largest ratio, test, what, times checked) per check, the closest first."""
    worst: dict[tuple[str, str], float] = defaultdict(float)
    count: dict[tuple[str, str], int] = defaultdict(int)
    for path in paths:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                key = (row["test"], row["what"])
                worst[key] = max(worst[key], row["ratio"])
                count[key] += 1
    return sorted(((r, *key, count[key]) for key, r in worst.items()), reverse=True)


if __name__ == "__main__":
    rows = report(sys.argv[1:])
    for ratio, test, what, n in rows:
        print(f"{ratio:9.3g}  {test}  [{what}]  x{n}")
    print(f"{len(rows)} checks; the largest ratio {rows[0][0]:.3g}" if rows else "no checks recorded")
