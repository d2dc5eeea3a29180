"""Communication per step, measured: a config's collectives on N gloo ranks beside the ZeRO paper's and Megatron's counts.

    python -m bench.scale.comm trainer=ddp                                     # 2 ranks, the tiny GPT-2
    python -m bench.scale.comm trainer=fsdp --ranks 2 3 4 model.n_layer=6 model.n_embd=384 model.n_head=6
    python -m bench.scale.comm trainer=fsdp trainer.strategy.reshard_after_forward=false --each
    python -m bench.scale.comm trainer=deepspeed_stage_1 \
        'trainer.strategy.config={zero_optimization: {use_multi_rank_bucket_allreduce: false}}'
    python -m bench.scale.comm trainer=tp --ranks 2              # or trainer=pipeline; any train.py override goes through

Each N runs train.py itself (the config as given, on CPU, N gloo processes, no validation, test or checkpoint) for
1 + --steps optimizer steps with callbacks.comm profiling every step after the first (src/callbacks/comm.py says
what is read and how bytes are counted), then prints, per rank and step, each collective (--each) or each kind of
collective per phase, and the step's bytes beside the formula:
  data parallel, Ψ trainable parameters, B the step's bytes an element (its mix of dtypes), per rank, ring
  (Rajbhandari et al. 2020):
    DDP 2(N-1)/N·Ψ·B; FSDP2 full shard and ZeRO-3 3(N-1)/N·Ψ·B; FSDP2 reshard_after_forward=false 2(N-1)/N·Ψ·B;
    ZeRO-1 and ZeRO-2: 2(N-1)/N·Ψ·B by the paper, and the practitioners' notes' 3(N-1)/N·Ψ·B for ZeRO-1.
  tensor parallel over t ranks (Megatron, Shoeybi et al. 2019): 2 all-reduces in forward and 2 in backward per
    block, each of b·s·h elements (b the batch of one tensor-parallel group, s the sequence, h the width).
  pipeline, K stages, M micro-batches of b/M: a stage sends its output forward and its input gradient backward,
    one send of (b/M)·s·h per micro-batch and boundary in each direction.
  expert parallelism (trainer=fsdp expert_parallel_size=k, an MoE model's E experts on 1 rank of each k, c = N/k
    copies of each): FSDP2 3(N-1)/N over the Ψ_d dense parameters and 3(c-1)/c over a rank's Ψ_e/k expert ones, plus
    per MoE layer 4 all-to-alls of n·top_k·h elements at (k-1)/k (the rows to the experts' ranks and the outputs
    back, forward and backward; n a rank's tokens), exact for balanced routing, and the E expert counts. The
    callback counts an all-to-all at (N-1)/N (it cannot see the group), and so does the printed formula.
DeepSpeed without CUDA runs through the tests' CPU strategy (tests/helpers/deepspeed_cpu.py), in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RANK_GIB = 0.6  # resident memory of one CPU rank of a small config (torch, Lightning, the data): measured 0.46-0.5
PHASES = ("forward", "backward", "optimizer", "logging", "other")
SIZES = {"fp64": 8, "int64": 8, "fp32": 4, "int32": 4, "bf16": 2, "fp16": 2, "uint8": 1, "bool": 1}  # bytes an element
CPU_DEEPSPEED = [
    "trainer.strategy._target_=tests.helpers.deepspeed_cpu.CPUDeepSpeedStrategy",
    "trainer.precision=32-true",
]


class Refused(Exception):
    """Bad input: one sentence for the user, exit 2."""


def multi_process_trainers() -> list[str]:
    """conf/trainer/ options that start several processes (default, cpu, gpu run one)."""
    paths = sorted((ROOT / "conf" / "trainer").glob("*.yaml"))
    return [p.stem for p in paths if isinstance((yaml.safe_load(p.read_text()) or {}).get("strategy"), dict)]


def check_request(overrides: list[str], ranks: list[int]) -> str:
    """The trainer option asked for; Refused for an unknown one, one that runs one process, or too many ranks."""
    trainer = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer=")), "ddp")
    known = multi_process_trainers()
    if trainer not in known:
        raise Refused(
            f"trainer={trainer} is not a strategy bench.scale.comm can measure: use one of {', '.join(known)}."
        )
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        free = int(re.search(r"MemAvailable:\s+(\d+)", meminfo.read_text()).group(1)) / 2**20
        most = int(free // RANK_GIB)
        if max(ranks) > most:
            raise Refused(
                f"--ranks {max(ranks)} needs about {max(ranks) * RANK_GIB:.0f} GiB ({RANK_GIB} GiB a CPU rank) and "
                f"{free:.0f} GiB is available here: use --ranks {max(2, most)} or fewer (the volumes follow "
                "(N-1)/N, so 2, 3 and 4 ranks already show how they grow)."
            )
    return trainer


def train(overrides: list[str], n: int, steps: int, tmp: str, comm: str, python: str, more: tuple = ()) -> None:
    """train.py on n CPU ranks for `steps` steps, no validation, test or checkpoints, logs under `tmp`."""
    first = [
        "extras.print_config=false",
        "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1",
        f"data.global_batch_size={4 * n}",
        "callbacks.generate_text=null",
    ]
    last = [
        f"trainer.devices={n}",
        "trainer.accelerator=cpu",
        f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "test=false",
        "++callbacks.model_checkpoint=null",
        "++callbacks.last_checkpoint=null",
        "++callbacks.validate_at_end=null",
        f"++callbacks.comm={comm}",
        f"paths.log_dir={tmp}/logs",
        *more,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))  # DeepSpeed's CPU Adam
    proc = subprocess.run(
        [python, "train.py", *first, *overrides, *last],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        errors="replace",
    )
    if proc.returncode:
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "[ERROR]" in line]
        if proc.returncode == 2 and errors:
            raise Refused(f"train.py refused {' '.join(overrides)} on {n} ranks: {errors[-1].split(' - ', 1)[-1]}")
        raise RuntimeError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def overhead(overrides: list[str], n: int, rounds: int, python: str = sys.executable) -> None:
    """callbacks.comm as used in training (every_n_steps=2, TensorBoard): rank 0's profiled and plain step times."""
    trainer = check_request(overrides, [n])
    import torch

    extra = CPU_DEEPSPEED if trainer.startswith("deepspeed") and not torch.cuda.is_available() else []
    with tempfile.TemporaryDirectory(prefix="bench-comm-") as tmp:
        timer = f"++callbacks.timer={{_target_:bench.common.StepTimer,warmup:1,out:{tmp}/times.json}}"
        train(
            overrides + extra,
            n,
            2 + 2 * rounds,
            tmp,
            "{_target_:src.callbacks.comm.CommVolume,every_n_steps:2}",
            python,
            (timer,),
        )
        steps = json.loads(Path(tmp, "times.json").read_text())["steps_s"]  # steps 2, 3, ...: even ones profiled
    profiled, plain = statistics.median(steps[0::2]), statistics.median(steps[1::2])
    extra_s = profiled - plain
    print(
        f"trainer={trainer} on {n} ranks, median of {rounds}: a step {plain:.3f} s, a profiled step {profiled:.3f} s "
        f"(+{extra_s:.3f} s); callbacks.comm.every_n_steps=10: +{100 * extra_s / (10 * plain):.1f}% of training time, "
        f"=100: +{100 * extra_s / (100 * plain):.2f}%"
    )


def run(overrides: list[str], n: int, steps: int, python: str = sys.executable, log_dir: Path | None = None) -> dict:
    """train.py on n gloo ranks with callbacks.comm on every step after the first: the records and the config.
    The run's dir (TensorBoard, logs) is kept under `log_dir` if given, else deleted."""
    trainer = check_request(overrides, [n])
    import torch

    extra = CPU_DEEPSPEED if trainer.startswith("deepspeed") and not torch.cuda.is_available() else []
    tmp = tempfile.mkdtemp(prefix="bench-comm-", dir=log_dir)
    try:
        train(
            overrides + extra,
            n,
            1 + steps,
            tmp,
            f"{{_target_:src.callbacks.comm.CommVolume,every_n_steps:1,save_dir:{tmp}/comm}}",
            python,
        )
        records = [
            json.loads(line)
            for path in sorted(Path(tmp, "comm").glob("rank*.jsonl"))
            for line in path.read_text().splitlines()
        ]
        (config,) = Path(tmp, "logs").rglob("config_resolved.yaml")
        return {"trainer": trainer, "n": n, "records": records, "config": yaml.safe_load(config.read_text())}
    finally:
        if log_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)


def strategy(cfg: dict) -> dict:
    """What the formulas need from the resolved config."""
    s = cfg["trainer"]["strategy"]
    target = s.get("_target_", "") if isinstance(s, dict) else str(s)
    kind = {
        "DDPStrategy": "ddp",
        "FSDP2Strategy": "fsdp",
        "TensorParallelStrategy": "tp",
        "PipelineStrategy": "pipeline",
    }
    name = next((v for k, v in kind.items() if target.endswith(k)), "zero" if "DeepSpeed" in target else target)
    info = {"name": name, "seq": cfg["data"]["seq_len"], "batch": cfg["data"]["global_batch_size"]}
    if name == "fsdp" and not s.get("reshard_after_forward", True):
        info["name"] = "fsdp_no_reshard"
    if name == "zero":
        info["name"] = f"zero{s['stage']}"
    info.update(
        ep=s.get("expert_parallel_size", 1),
        t=s.get("tensor_parallel_size", 1),
        k=s.get("pipeline_parallel_size", 1),
        m=s.get("n_microbatches", 1),
        v=s.get("stages_per_rank", 1),
    )
    return info


DATA_PARALLEL = {
    "ddp": [("DDP 2(N-1)/N·Ψ", 2)],
    "fsdp": [("FSDP/ZeRO-3 3(N-1)/N·Ψ", 3)],
    "fsdp_no_reshard": [("ZeRO-2-like 2(N-1)/N·Ψ", 2)],
    "zero1": [("paper 2(N-1)/N·Ψ", 2), ("notes 3(N-1)/N·Ψ", 3)],
    "zero2": [("paper and notes 2(N-1)/N·Ψ", 2)],
    "zero3": [("paper and notes 3(N-1)/N·Ψ", 3)],
}


def expected(info: dict, record: dict, element_bytes: float) -> list[tuple[str, float, int, int]]:
    """(label, bytes, count, elements of each) per formula for one rank's step; count 0 where only bytes are compared."""
    n = record["world"]
    if info["name"] in ("fsdp", "fsdp_no_reshard") and info.get("ep", 1) > 1:
        k, passes = info["ep"], 3 if info["name"] == "fsdp" else 2
        copies, experts = n // k, record["expert_params"]
        dense = (record["params"] - experts) * passes * (n - 1) / n
        sharded = experts / k * passes * (copies - 1) / copies
        rows = info["batch"] // n * info["seq"] * record["top_k"] * record["hidden_size"]
        # at (N-1)/N, not (k-1)/k: callbacks.comm cannot see an all-to-all's group and counts it over the world
        exchange = 4 * record["moe_layers"] * (n - 1) / n * rows
        return [
            (
                "FSDP2 3(N-1)/N·Ψ_d + 3(c-1)/c·Ψ_e/k + 4 all-to-alls of n·top_k·h a MoE layer at (N-1)/N",
                (dense + sharded + exchange) * element_bytes,
                0,
                0,
            )
        ]
    if info["name"] in DATA_PARALLEL:
        return [
            (label, k * (n - 1) / n * record["params"] * element_bytes, 0, 0)
            for label, k in DATA_PARALLEL[info["name"]]
        ]
    h, layers, s = record["hidden_size"], record["layers"], info["seq"]
    if info["name"] == "tp":
        t = info["t"]
        elements = info["batch"] // (n // t) * s * h  # the batch of one tensor-parallel group
        return [
            (
                "Megatron 4 all-reduces of b·s·h a block",
                4 * layers * 2 * (t - 1) / t * elements * element_bytes,
                4 * layers,
                elements,
            )
        ]
    if info["name"] == "pipeline":
        k, v, m, t = info["k"], info["v"], info["m"], info["t"]
        elements = info["batch"] // (n // (k * t)) // m * s * h  # one micro-batch's activations
        position = (record["rank"] // t) % k
        stages = [position + i * k for i in range(v)]
        boundaries = sum((st < k * v - 1) + (st > 0) for st in stages)  # outgoing sends: forward and backward
        return [
            (
                "one send of (b/M)·s·h a micro-batch and boundary",
                boundaries * m * elements * element_bytes,
                boundaries * m,
                elements,
            )
        ]
    return []


def summarize(result: dict) -> list[dict]:
    """Per rank and step: bytes by phase, the total, and each formula with its ratio."""
    info = strategy(result["config"])
    rows = []
    for rec in sorted(result["records"], key=lambda r: (r["step"], r["rank"])):
        coll = rec["collectives"]
        by_phase = defaultdict(float)
        for c in coll:
            by_phase[c["phase"]] += c["bytes"]
        total = sum(by_phase.values())
        # B: the step's bytes per element on the wire, so that fp32 and bf16 collectives (FSDP2's param_dtype) mix
        ring_elements = sum(c["bytes"] / SIZES.get(c["dtype"], 4) for c in coll)
        element_bytes = total / ring_elements if ring_elements else 4
        row = {
            "rank": rec["rank"],
            "step": rec["step"],
            "params": rec["params"],
            "total": total,
            "phases": dict(by_phase),
            "element_bytes": element_bytes,
            "formulas": [],
        }
        for label, value, count, elements in expected(info, rec, element_bytes):
            if count:  # tensor and pipeline parallel: the activation messages, counted
                op = "all_reduce" if info["name"] == "tp" else "send"
                hits = [c for c in coll if c["op"] == op and c["elements"] == elements and c["phase"] != "logging"]
                measured = sum(c["bytes"] for c in hits)
                value = value / element_bytes * (SIZES.get(hits[0]["dtype"], 4) if hits else element_bytes)  # their B
                row["formulas"].append(
                    {
                        "label": label,
                        "bytes": value,
                        "count": count,
                        "measured_count": len(hits),
                        "measured": measured,
                        "ratio": measured / value if value else float("nan"),
                    }
                )
            else:
                row["formulas"].append({"label": label, "bytes": value, "measured": total, "ratio": total / value})
        rows.append(row)
    return rows


def mib(x: float) -> str:
    return f"{x / 2**20:.3f}"


def collective_lines(rec: dict, each: bool) -> list[str]:
    """One line per kind of collective and phase (per collective with `each`), in phase order."""
    groups = defaultdict(lambda: [0, 0, 0.0])
    for i, c in enumerate(rec["collectives"]):
        key = (PHASES.index(c["phase"]), c["op"], c["dtype"], c["group"]) + ((i,) if each else ())
        groups[key][0] += 1
        groups[key][1] += c["elements"]
        groups[key][2] += c["bytes"]
    return [
        f"{PHASES[key[0]]:<9} {key[1]:<14} {key[2]:<5} {key[3]:>2} {count:>5} {elements:>12,} {mib(size):>9}"
        for key, (count, elements, size) in sorted(groups.items())
    ]


def summary_lines(row: dict) -> list[str]:
    phases = ", ".join(f"{p} {mib(row['phases'][p])}" for p in PHASES if row["phases"].get(p))
    cols = [
        f"{f['label']} = {mib(f['bytes'])}: x{f['ratio']:.4f}"
        + (f" ({f['measured_count']} of {f['count']} messages)" if "count" in f else "")
        for f in row["formulas"]
    ]
    return [f"{mib(row['total']):>9}  {'; '.join(cols)}", f"{'':>9}  by phase: {phases}"]


def print_by_rank(lines: dict[tuple[int, int], list[str]]) -> None:
    """Lines keyed by (step, rank); ranks whose lines are the same are printed once, e.g. `0-3`."""
    for step in sorted({s for s, _ in lines}):
        same: dict[tuple, list[int]] = defaultdict(list)
        for (s, rank), text in sorted(lines.items()):
            if s == step:
                same[tuple(text)].append(rank)
        for text, ranks in same.items():
            label = (
                f"{ranks[0]}-{ranks[-1]}"
                if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1
                else ",".join(map(str, ranks))
            )
            for line in text:
                print(f"{label:>5} {step:>4} {line}")


def report(result: dict, each: bool = False) -> None:
    info, n, records = strategy(result["config"]), result["n"], result["records"]
    held = "" if info["name"] != "pipeline" else " (rank 0's stages)"
    print(
        f"\n== trainer={result['trainer']} ({info['name']}) on {n} gloo ranks, Ψ = {records[0]['params']:,} trainable "
        f"parameters{held}; MiB: what a rank sends, by the ring algorithm"
    )
    print(
        f"{'ranks':>5} {'step':>4} {'phase':<9} {'collective':<14} {'dtype':<5} {'n':>2} {'count':>5} "
        f"{'elements':>12} {'MiB':>9}"
    )
    print_by_rank({(r["step"], r["rank"]): collective_lines(r, each) for r in records})
    print(f"{'ranks':>5} {'step':>4} {'MiB':>9}  formula = MiB: measured / formula")
    print_by_rank({(row["step"], row["rank"]): summary_lines(row) for row in summarize(result)})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2], help="numbers of gloo ranks to run (each a run)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps profiled, after one unprofiled warm-up step")
    p.add_argument("--each", action="store_true", help="list every collective, not one line per kind and phase")
    p.add_argument(
        "--overhead",
        type=int,
        metavar="ROUNDS",
        help="instead: time callbacks.comm's profiled steps against plain ones (every_n_steps=2, ROUNDS of each)",
    )
    argv = sys.argv[1:] if argv is None else argv
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]  # train.py's, anywhere on the line
    args, unknown = p.parse_known_args([a for a in argv if a not in overrides])
    try:
        if min(args.ranks) < 2 or args.steps < 1:
            raise Refused(
                "--ranks takes numbers of processes >= 2 (one process communicates nothing) and --steps >= 1."
            )
        if unknown:
            raise Refused(
                f"unknown argument {unknown[0]}: bench.scale.comm takes --ranks, --steps, --each, --overhead "
                "and train.py's key=value overrides."
            )
        trainer = check_request(overrides, args.ranks)
        if not any(o.startswith("trainer=") for o in overrides):  # train.py's own default runs one process
            overrides = [f"trainer={trainer}", *overrides]
        for n in args.ranks:
            if args.overhead:
                overhead(overrides, n, args.overhead)
            else:
                report(run(overrides, n, args.steps), args.each)
    except Refused as e:
        print(f"bench.scale.comm: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
