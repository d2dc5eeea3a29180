"""Prove an experiment of your own: 1 process and N train the same model, value for value.

    python -m src.tools.parity experiment=NAME trainer=ddp [trainer.devices=N] [--steps 20] [any override ...]

Runs train.py twice with the same overrides, once on 1 process (`trainer.devices=1`, the same strategy) and once as
given (trainer=ddp: 2 CPU processes, or every GPU), for `--steps` optimizer steps (validation and test included),
logging every step to CSV; then compares every value both runs logged (losses, metrics, learning rates) at every
step and prints each one's largest difference against its tolerance. Exit 0 when all agree, 1 naming the first
value and step that differ (or a value one run logged and the other did not), 2 for a run that failed. Where values
differ, it also names the parameters whose final weights (each run's last checkpoint) differ most, and says when
such a parameter is a bias before a BatchNorm: the norm subtracts the batch mean, so the bias's gradient is zero but
for rounding, which differs between 1 process and N, and Adam divides each gradient by its own size.

fp32 (`trainer.precision=32-true`) unless the command line sets a precision: equality is a property of the
arithmetic there, while bf16's rounding depends on each rank's micro-batch shape. The tolerance of a value v is
TOLERANCE_ULPS float32 epsilons of max(1, |v|): the reductions N ranks run in another order than 1 process can move
a float32 result by a few units in its last place, and a sample counted twice, a rank's own mean logged, a dropout
mask drawn from a rank's generator or a batch split otherwise moves it by orders of magnitude more. The throughput
callback is off in both runs: its values (tokens/s, a rank's own counts) differ by design.
"""

from __future__ import annotations

import argparse
import csv
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
NAMED = 3  # the weights named where the final checkpoints differ
TOLERANCE_ULPS = 64  # float32 epsilons of max(1, |v|): 7.6e-6 for a loss of about 1 (module doc)
EPS32 = 2.0**-23


def tolerance(value: float) -> float:
    return TOLERANCE_ULPS * EPS32 * max(1.0, abs(value))


def run(overrides: list[str], log_dir: Path) -> dict[tuple[str, int], float]:
    """train.py with `overrides`, logging to CSV under `log_dir`: {(value's name, step): value}. Exit 2 on failure."""
    command = [sys.executable, str(ROOT / "train.py"), *overrides, f"paths.log_dir={log_dir}", "logger=csv"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, errors="replace")
    if proc.returncode != 0:
        refusals = [line.split("[ERROR] - ", 1)[1] for line in proc.stderr.splitlines() if "[ERROR] - " in line]
        if proc.returncode == 2 and refusals:  # a refusal is its one sentence (every rank logs the same)
            print(f"parity: train.py {' '.join(overrides)} refused: {refusals[-1]}", file=sys.stderr)
            raise SystemExit(2)
        sys.stderr.write(proc.stderr[-4000:])
        print(f"parity: train.py {' '.join(overrides)} failed (exit {proc.returncode}), see above", file=sys.stderr)
        raise SystemExit(2)
    values = {}
    for path in log_dir.rglob("metrics.csv"):
        for row in csv.DictReader(path.open()):
            for name, value in row.items():
                if value and name not in ("epoch", "step"):
                    values[(name, int(row["step"]))] = float(value)
    return values


def first_difference(one: dict, many: dict) -> Optional[str]:
    """The sentence for the first (by step, then name) value that differs, or is logged by one run only."""
    for name, step in sorted(one.keys() | many.keys(), key=lambda k: (k[1], k[0])):
        a, b = one.get((name, step)), many.get((name, step))
        if a is None or b is None:
            return f"{name} at step {step} was logged on {'N ranks' if a is None else '1 process'} only"
        if not abs(a - b) <= tolerance(a):  # NaN differs
            return f"{name} differs at step {step}: {b!r} on N ranks, {a!r} on 1 process (|diff| {abs(a - b):.3g} > {tolerance(a):.3g})"
    return None


def final_weights(log_dir: Path) -> Optional[dict]:
    """The floating-point tensors of a run's last checkpoint (last.ckpt, else its newest), by name; None without one."""
    import torch

    found = sorted(log_dir.rglob("*.ckpt"), key=lambda p: (p.name != "last.ckpt", -p.stat().st_mtime))
    if not found:
        return None
    if found[0].is_dir():  # FSDP2's or ZeRO's sharded checkpoint: its shards gathered
        from src.checkpoint.convert import load_checkpoint

        state = load_checkpoint(found[0])["state_dict"]
    else:
        state = torch.load(found[0], map_location="cpu", weights_only=True)["state_dict"]
    return {name: t for name, t in state.items() if t.is_floating_point()}


def largest_differences(one: dict, many: dict) -> list[tuple[str, float]]:
    """(name, max |diff|) of every weight two state dicts share, the largest first (NaN first of all)."""
    diffs = [
        (name, (t.double() - many[name].double()).abs().max().item())
        for name, t in one.items()
        if name in many and t.shape == many[name].shape and t.numel()
    ]
    return sorted(diffs, key=lambda d: -math.inf if math.isnan(d[1]) else -d[1])


def batchnorm_after(name: str, state: dict) -> Optional[str]:
    """The module after the layer whose bias `name` is, in the state dict's order (a Sequential's next layer), when it
    is a BatchNorm (it has a running_mean); else None."""
    if not name.endswith(".bias"):
        return None
    layer, names = name.removesuffix(".bias"), list(state)
    after = next((n.rpartition(".")[0] for n in names[names.index(name) + 1 :] if not n.startswith(f"{layer}.")), None)
    return after if after and f"{after}.running_mean" in state else None


def localise(one_dir: Path, many_dir: Path) -> list[str]:
    """Where two runs' final weights differ most, and why when it can be told from the model's structure."""
    try:
        one, many = final_weights(one_dir), final_weights(many_dir)
    except Exception as e:  # e.g. an object of the module's own in the checkpoint, which weights_only refuses
        return [f"the final weights were not compared: a checkpoint could not be read ({str(e).splitlines()[0][:200]})"]
    if one is None or many is None:
        return ["the final weights were not compared: a run wrote no checkpoint"]
    diffs = largest_differences(one, many)
    if not diffs:
        return ["the final weights were not compared: the checkpoints share no weight of one shape"]
    worst = [(n, d) for n, d in diffs if not d <= tolerance(one[n].abs().max().item())][:NAMED]  # NaN differs
    if not worst:
        return [
            f"the final weights agree (largest |diff| {diffs[0][1]:.3g}): the runs logged, not trained, differently"
        ]
    lines = ["the final weights differ most in " + ", ".join(f"{n} (max |diff| {d:.3g})" for n, d in worst)]
    for name, _ in worst:
        norm = batchnorm_after(name, one)
        if norm is not None:
            lines.append(
                f"{name} is the bias of the layer before {norm}, a BatchNorm, which subtracts the batch mean: its "
                "gradient is zero but for rounding, which 1 process and N ranks round differently, and Adam divides "
                "each gradient by its own size; build that layer with bias=False"
            )
    return lines


def report(one: dict, many: dict) -> list[str]:
    """One line per value: the steps compared, its largest difference and its tolerance."""
    lines = [f"{'value':<32} {'steps':>5}  {'last (1 process)':>16}  {'largest |diff|':>14}  {'tolerance':>9}"]
    for name in sorted({n for n, _ in one.keys() | many.keys()}):
        steps = sorted({s for n, s in one.keys() & many.keys() if n == name})
        diffs = [abs(one[(name, s)] - many[(name, s)]) for s in steps]
        worst = max(diffs, default=float("nan"))
        tol = min((tolerance(one[(name, s)]) for s in steps), default=float("nan"))
        last = one[(name, steps[-1])] if steps else float("nan")
        lines.append(f"{name:<32} {len(steps):>5}  {last:>16.8g}  {worst:>14.3g}  {tol:>9.3g}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps each run trains (default 20)")
    parser.add_argument("overrides", nargs="*", help="train.py's overrides, e.g. experiment=NAME trainer=ddp")
    args = parser.parse_intermixed_args(argv)  # --steps before, between or after the overrides
    given = args.overrides
    common = [
        *given,
        f"trainer.max_steps={args.steps}",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "extras.print_config=false",
        "callbacks.throughput=null",
    ]
    if not any(o.lstrip("+").startswith("trainer.precision=") for o in given):
        common.append("trainer.precision=32-true")
    single = [o for o in common if not o.lstrip("+").startswith("trainer.devices=")] + ["trainer.devices=1"]
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        one = run(single, Path(tmp) / "one")
        many = run(common, Path(tmp) / "many")
        print("\n".join(report(one, many)))
        difference = first_difference(one, many)
        if difference is not None:
            print(f"parity: {difference}", file=sys.stderr)
            for line in localise(Path(tmp) / "one", Path(tmp) / "many"):
                print(f"parity: {line}", file=sys.stderr)
            return 1
    steps = len({s for _, s in one})
    print(f"parity: {len({n for n, _ in one})} values at {steps} logged step(s) equal on 1 process and N ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
