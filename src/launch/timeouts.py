"""A stuck distributed job fails in minutes, with one line that says which rank waited in which collective.

torch's default collective timeout is 30 minutes, and during it a rank blocked in a C++ collective
runs no Python at all: Lightning's SIGTERM handler (and Ctrl+C) wait until the collective returns.
So the trainer configs set `trainer.strategy.timeout` (conf/trainer/ddp.yaml says why 10 minutes),
and this module turns what a rank raises when it runs out into a short message:

    Rank 1: collective all_reduce timed out after 30 s (trainer.strategy.timeout): another rank is stuck, ...

The collective is named from the traceback: the innermost torch.distributed.distributed_c10d
function (all_reduce, all_gather_single for FSDP2, barrier, ...), or DDP's gradient all-reduce when the
wait happened inside backward (DDP's reducer runs in C++, below any Python frame). With
HYDRA_FULL_ERROR=1 the full traceback follows the message. On NCCL (not run by the tests), torch's watchdog aborts the
process on timeout with its own line ("Watchdog caught collective operation timeout: ...
OpType=ALLREDUCE ... Timeout(ms)=600000"); the other ranks then fail fast here.
The job's other ranks are then stopped by `hydra_ddp.ddp_job` within seconds, so no process lingers.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Optional

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from src.utils.errors import in_multirun, process_rank

KEY = "trainer.strategy.timeout"
SIGTERM_EXIT = 128 + signal.SIGTERM  # a job stopped by SIGTERM: 143, as a shell reports it
log = logging.getLogger(__name__)

TIMED_OUT = re.compile(r"timed out|timeout|deadline exceeded", re.IGNORECASE)
PEER_LOST = re.compile(
    r"closed by peer|connection reset|broken pipe|connection refused|remote worker crash|"
    r"socket closed|end of file",
    re.IGNORECASE,
)
MILLISECONDS = re.compile(r"(?:waiting |Timeout\(ms\)=)(\d+)\s*(?:ms)?")


class CollectiveError(RuntimeError):
    """A collective failed (timeout or lost rank) in a multirun job: Hydra records it and runs the next job."""


def _frames(tb: Optional[TracebackType]) -> list[tuple[str, str]]:
    """(filename, function) of every frame from the outermost to where the exception was raised."""
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    return frames


def collective_name(exc: BaseException) -> Optional[str]:
    """The collective `exc` came out of, or None when it did not come out of one."""
    frames = _frames(exc.__traceback__)
    c10d = [
        name
        for file, name in frames
        if file.endswith(os.path.join("distributed", "distributed_c10d.py"))
        and not name.startswith("_")
        and name != "wrapper"
    ]  # torch's logging decorators
    if c10d:
        return c10d[-1]
    if any(name == "run_backward" or name == "_engine_run_backward" for _, name in frames):
        return "all_reduce of gradients in backward (DDP)"
    return None


def describe(exc: BaseException) -> Optional[str]:
    """One or two lines for a failed collective, or None when `exc` is not one."""
    text = str(exc)
    name = collective_name(exc)
    is_dist_error = isinstance(exc, getattr(dist, "DistError", ())) or "gloo" in text or "NCCL" in text
    if name is None and not is_dist_error:
        return None
    rank = process_rank()
    where = f"collective {name}" if name else "a collective"
    if TIMED_OUT.search(text) and not PEER_LOST.search(text):
        ms = MILLISECONDS.search(text)
        after = f" after {int(ms.group(1)) / 1000:g} s" if ms else ""
        if name == "init_process_group":
            return (
                f"Rank {rank}: the other ranks did not all start within {KEY} (init_process_group). "
                f"Check that every rank was launched, or raise {KEY}.minutes."
            )
        return (
            f"Rank {rank}: {where} timed out{after} ({KEY}): another rank is stuck, died or called a different "
            f"collective. If it was only busy (e.g. saving a checkpoint), raise {KEY}.minutes. "
            f"Full trace: HYDRA_FULL_ERROR=1."
        )
    if PEER_LOST.search(text):
        return (
            f"Rank {rank}: {where} failed: another rank exited or was killed (its own error, if any, is "
            f"above). Full trace: HYDRA_FULL_ERROR=1."
        )
    return f"Rank {rank}: {where} failed: {text.splitlines()[0][:300]} Full trace: HYDRA_FULL_ERROR=1."


@contextmanager
def distributed_errors() -> Iterator[None]:
    """Report a failed collective in one line and exit 1, instead of a long traceback per rank.

    Also: Lightning ends a run stopped by SIGTERM with `SIGTERMException`, a SystemExit with no code,
    i.e. exit status 0, so a preempted or cancelled job would look finished. It exits 143 (128 + SIGTERM).
    """
    try:
        yield
    except SIGTERMException:
        log.error(f"Rank {process_rank()}: stopped by SIGTERM; exiting with status {SIGTERM_EXIT}.")
        raise SystemExit(SIGTERM_EXIT) from None
    except Exception as exc:
        message = describe(exc)
        if message is None:
            raise
        log.error(message)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if in_multirun():  # let Hydra record this job as failed and run the next one
            raise CollectiveError(message) from None
        sys.stderr.flush()
        raise SystemExit(1) from None


def exit_now(code: int) -> None:
    """End this process with `code` at once, its logs and output flushed, skipping Python's shutdown (no
    atexit handlers, no final garbage collection): for a run already torn down that was told to stop."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
