"""Change N in the middle of a run: a step-4 checkpoint of an 8-step run, resumed on another number of ranks or under
another strategy, ends as the uninterrupted 1-process run does (train/loss at steps 4-7 and the final parameters
within 1e-5; fp32, global batch 12, a cosine LR schedule, mid-epoch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ALL, FULL_MATRIX_ONLY, ROOT, once_per_session, path_overrides, python, read_events, run_script
from test_architectures_parity import llama_args
from test_parity import GPT2, QUIET, max_param_diff

from src.checkpoint.convert import load_checkpoint
from tests.helpers import forkrun
from tests.helpers.margins import within

ARGS = GPT2 + [
    "data.global_batch_size=12",  # divides into 1, 2, 3 and 4 ranks
    "trainer.max_steps=8",
    "trainer.val_check_interval=8",
    # a mid-epoch checkpoint at step 4 (an epoch is ~80 steps), kept beside last.ckpt
    "+callbacks.mid={_target_:lightning.pytorch.callbacks.ModelCheckpoint,dirpath:${paths.output_dir}/checkpoints,"
    "filename:'mid_{step}',auto_insert_metric_name:false,every_n_train_steps:4,save_top_k:-1,monitor:null}",
]
SOURCES = {  # the strategies whose step-4 checkpoints are resumed elsewhere
    "one": [],
    "ddp2": ["trainer=ddp", "trainer.devices=2"],
    "fsdp2": ["trainer=fsdp", "trainer.devices=2"],
    "tp2": ["trainer=tp", "trainer.devices=2"],
    "pipeline2": ["trainer=pipeline", "trainer.devices=2"],
}
# The same for Llama (grouped-query attention, untied head; tests/test_architectures_parity.py's), in the full
# architecture matrix only (TEST_ALL_ARCHITECTURES=1): its sources are named llama_<GPT-2's source name>.
LLAMA = llama_args(ARGS)
SOURCES.update({f"llama_{name}": SOURCES[name] for name in ("one", "fsdp2", "tp2", "pipeline2")})


def run(tmp: Path, name: str, args: list[str]) -> dict:
    """train.py with ARGS + args: its train/loss by step, its final parameters (any checkpoint form, gathered) and
    the path of its step-4 checkpoint."""
    dirs = {"log_dir": tmp / name, "cache_dir": tmp / "cache"}
    run_script("train.py", QUIET + path_overrides(dirs) + (LLAMA if name.startswith("llama") else ARGS) + args)
    (out,) = (dirs["log_dir"] / "train" / "runs").iterdir()
    loss = {e.step: e.value for e in read_events(out / "tensorboard").Scalars("train/loss")}
    params = load_checkpoint(out / "checkpoints" / "last.ckpt")["state_dict"]
    return {"loss": loss, "params": params, "mid": str(out / "checkpoints" / "mid_4.ckpt")}


@pytest.fixture(scope="session")
def source(tmp_path_factory):
    """source(name): the 8-step run of SOURCES[name], trained once per session (for all xdist workers)."""
    return lambda name: once_per_session(tmp_path_factory, f"resume-{name}", lambda tmp: run(tmp, name, SOURCES[name]))


def assert_like_straight(resumed: dict, straight: dict) -> None:
    assert sorted(resumed["loss"]) == [4, 5, 6, 7]  # it continued at step 4 and stopped at 8
    within(max(abs(resumed["loss"][s] - straight["loss"][s]) for s in resumed["loss"]), 1e-5, "train/loss")
    within(max_param_diff(resumed["params"], straight["params"]), 1e-5, "params")


CASES = {  # name: (source, the resumed run's overrides)
    "ddp_2_to_1": ("ddp2", []),
    "1_to_ddp_2": ("one", ["trainer=ddp", "trainer.devices=2"]),
    "ddp_2_to_3": ("ddp2", ["trainer=ddp", "trainer.devices=3"]),
    # the data position is global: 2 ranks x 6 -> 1 rank x 6 x accumulation 2 rescales Lightning's batch counters
    "ddp_2_to_1_accumulating_2": ("ddp2", ["trainer.accumulate_grad_batches=2"]),
    "fsdp_2_to_1": ("fsdp2", []),
    "ddp_2_to_fsdp_2": ("ddp2", ["trainer=fsdp", "trainer.devices=2"]),
    "tp_2_to_1": ("tp2", []),
    "pipeline_2_to_1": ("pipeline2", []),
    "1_to_pipeline_2": ("one", ["trainer=pipeline", "trainer.devices=2"]),
    "llama_fsdp_2_to_1": ("llama_fsdp2", []),
    "llama_tp_2_to_1": ("llama_tp2", []),
    "llama_pipeline_2_to_1": ("llama_pipeline2", []),
    "llama_1_to_fsdp_2": ("llama_one", ["trainer=fsdp", "trainer.devices=2"]),
    "llama_fsdp_2_to_tp_2": ("llama_fsdp2", ["trainer=tp", "trainer.devices=2"]),
}


FULL_ONLY = ("ddp_2_to_1", "ddp_2_to_3", "1_to_pipeline_2", "ddp_2_to_fsdp_2")  # suite time


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",  # the Llama cases and FULL_ONLY in the full matrix
    [pytest.param(c, marks=[FULL_MATRIX_ONLY] if c.startswith("llama") or c in FULL_ONLY else []) for c in CASES],
)
def test_a_step_4_checkpoint_resumed_elsewhere_ends_like_the_straight_run(tmp_path, source, case):
    from_name, target = CASES[case]
    straight = source("llama_one" if case.startswith("llama") else "one")
    resumed = run(tmp_path, case, target + [f"ckpt_path={source(from_name)['mid']}"])
    assert_like_straight(resumed, straight)


@pytest.mark.slow
def test_every_source_run_matches_one_process(source):
    """The sources themselves: N ranks = 1 process (their checkpoints are what the resumes start from)."""
    for name in SOURCES:
        arch = "llama_" if name.startswith("llama") else ""
        if arch and not ALL:
            continue
        run_, straight = source(name), source(f"{arch}one")
        within(max(abs(run_["loss"][s] - straight["loss"][s]) for s in straight["loss"]), 1e-5, f"train/loss {name}")
        within(max_param_diff(run_["params"], straight["params"]), 1e-5, f"params {name}")


# ---- what cannot be exact is one sentence ----


def refusal(tmp: Path, args: list[str]) -> str:
    """The one [ERROR] line of a run train.py refuses (exit 2), as a user sees it (no HYDRA_FULL_ERROR)."""
    dirs = {"log_dir": tmp, "cache_dir": tmp / "cache"}
    proc = run_script(
        "train.py", QUIET + path_overrides(dirs) + ARGS + args, check=False, env={"HYDRA_FULL_ERROR": "0"}
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "[ERROR]" in line]
    return line


@pytest.mark.slow
def test_another_global_batch_is_refused_unless_asked_for(tmp_path, source):
    mid = source("ddp2")["mid"]
    line = refusal(tmp_path / "refused", [f"ckpt_path={mid}", "data.global_batch_size=8"])
    assert "trained with data.global_batch_size=12 and this run has 8" in line and "+resume_with_new_batch" in line
    dirs = {"log_dir": tmp_path / "asked", "cache_dir": tmp_path / "cache"}
    proc = run_script(
        "train.py",
        QUIET
        + path_overrides(dirs)
        + ARGS
        + [f"ckpt_path={mid}", "data.global_batch_size=8", "+resume_with_new_batch=true"],
    )
    assert "+resume_with_new_batch: from step 4 on, batches of 8 samples" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_global_batch_that_does_not_divide_names_the_device_counts_that_do(tmp_path, source):
    line = refusal(tmp_path, [f"ckpt_path={source('ddp2')['mid']}", "trainer=ddp", "trainer.devices=5"])
    assert "data.global_batch_size=12 does not divide into 5 device(s)" in line
    assert "use 4 or 6 device(s)" in line


def test_working_shapes_are_the_nearest_divisors():
    from src.core.datamodule import working_shapes

    assert working_shapes(12, 5, 1).startswith("use 4 or 6 device(s)")
    assert "trainer.accumulate_grad_batches=6 on 2 device(s)" in working_shapes(12, 2, 5)


@pytest.mark.slow
def test_a_zero_checkpoint_on_another_rank_count_or_strategy_is_one_sentence(tmp_path):
    """DeepSpeed repartitions no ZeRO optimizer state to another world size: refused before any rank starts."""
    pytest.importorskip("deepspeed", reason="needs the deepspeed package: pip install -e '.[deepspeed]'")
    from test_deepspeed import CPU_DS

    zero = run(tmp_path, "zero2", CPU_DS + ["trainer.strategy.stage=2", "trainer.max_steps=4"])
    line = refusal(
        tmp_path / "one", CPU_DS + ["trainer.strategy.stage=2", "trainer.devices=1", f"ckpt_path={zero['mid']}"]
    )
    assert "DeepSpeed ZeRO checkpoint of 2 ranks and this run has 1" in line and "model.pretrained=" in line
    line = refusal(tmp_path / "ddp", ["trainer=ddp", f"ckpt_path={zero['mid']}"])
    assert "resumes only under trainer=deepspeed" in line


@pytest.mark.slow
def test_a_torchrun_elastic_job_that_loses_a_node_continues_on_the_other_and_ends_like_one_process(tmp_path, source):
    """torchrun --nnodes=1:2 --max-restarts=1: two agents ("nodes") of 1 process on localhost. At step 3 node 1
    disappears (its rank SIGKILLs its agent, then itself); node 0's rank fails on the lost peer, its agent restarts
    the job with the 1 node left (MEMBER 1/1), and resume=auto continues the run dir's step-3 checkpoint of 2 ranks
    on 1, to the uninterrupted 1-process run's losses and parameters."""
    from conftest import free_port

    port, run_dir = free_port(), tmp_path / "run"
    # The agents are real processes (the rendezvous orders nodes by pid); their workers run through the tests'
    # stand-in python (PYTHON_EXEC), dying with their agent (DIE_WITH_PARENT); the lost node's rank kills its agent
    # by the pid the test writes to AGENT_PID_FILE. Node 0 hosts the rendezvous store and survives.
    elastic = ["--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d"]
    elastic += [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic"]
    job = ["train.py", "trainer=ddp", "resume=auto", f"hydra.run.dir={run_dir}", f"paths.cache_dir={tmp_path / 'c'}"]
    job += [
        "callbacks.last_checkpoint.every_n_train_steps=1",
        "+callbacks.fault._target_=tests.helpers.faults.RankFault",
    ]
    job += ["+callbacks.fault.step=3", "+callbacks.fault.action=kill_node", "+callbacks.fault.only_where_env=LOSE_NODE"]
    nodes = []
    # Node 0's agent finds node 1 gone when it has missed keep_alive_max_attempt heartbeats keep_alive_interval s apart:
    # 3 x 1 s here (torch's default 3 x 5 s was 15 s of the test waiting); the agents do little else, and a live one
    # beats every second
    for node in (0, 1):  # started together: each waits up to last_call_timeout for the other before the first round
        conf = f"--rdzv-conf=last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3,is_host={node == 0}"
        agent_pid = tmp_path / f"agent_pid_{node}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOSE_NODE": str(node), "AGENT_PID_FILE": str(agent_pid)}
        env.update(PYTHON_EXEC=python(), **forkrun.DIE_WITH_PARENT)
        nodes.append(
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *elastic, conf, *job, *QUIET, *ARGS],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        agent_pid.write_text(str(nodes[-1].pid))
        time.sleep(0.5)
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    assert nodes[1].returncode == -signal.SIGKILL and list(run_dir.glob("fault_rank*"))
    assert nodes[0].returncode == 0, outs[0][-3000:]
    assert "MEMBER: 1/2" in outs[0] and "MEMBER: 1/1" in outs[0]  # 2 nodes, then the one left
    assert "resume=auto: continuing from" in outs[0]
    straight = source("one")
    loss = {e.step: e.value for e in read_events(run_dir / "tensorboard").Scalars("train/loss")}
    assert sorted(loss) == list(range(8))  # steps 0-3 on 2 nodes, 3-7 on 1 (step 3 logged by both: the last wins)
    within(max(abs(loss[s] - straight["loss"][s]) for s in loss), 1e-5, "train/loss")
    params = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    within(max_param_diff(params, straight["params"]), 1e-5, "params")
