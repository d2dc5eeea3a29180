"""The real trackers for tests/test_trackers.py: an `mlflow server` process on localhost, and W&B's offline run files
read back with wandb's own record schema."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def mlflow_server(tmp: Path):
    """`mlflow server` with a SQLite store and a local artifact root in `tmp`; yields its http:// URI."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--default-artifact-root", str(tmp / "artifacts"),
    ]  # fmt: skip
    log = open(tmp / "server.log", "w")
    # Without MLflow's job execution (server-side GenAI jobs, unused here): it starts one more process that imports
    # mlflow and polls its queue for the server's lifetime, ~5 s of the server's start on 2 busy cores.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    uri = f"http://127.0.0.1:{port}"
    try:
        end = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.time() > end:
                    raise RuntimeError(f"mlflow server did not start: {(tmp / 'server.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield uri
    finally:  # killed, with its workers (its group): a graceful stop takes ~6 s, and the tests have read what they need
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
        log.close()


def wandb_records(path: Path):
    """The records of a run-<id>.wandb file as wandb's protobuf `Record`s. The file: ':W&B', magic 0xBEE1 and
    version 0, then LevelDB's log format (32 KiB blocks of chunks with a 7-byte header: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and data[4:7] == b"\xe1\xbe\x00", f"{path} is no W&B run file"
    pos, block, payload = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero padding at a block's end
            pos += room
            continue
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record
            payload = b""


def wandb_history(run_dir: Path) -> list[dict]:
    """Every history row of the offline runs under a wandb dir, in the order the attempts ran, as {key: value}."""
    rows = []
    for path in sorted(run_dir.glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def wandb_runs(run_dir: Path) -> list[dict]:
    """Each offline attempt's run record: id, group, tags, and its exit code (None if it never ended)."""
    out = []
    for path in sorted(run_dir.glob("offline-run-*/run-*.wandb")):
        run, exit_code = None, None
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
            elif kind == "exit":
                exit_code = record.exit.exit_code
        out.append({"id": run.run_id, "group": run.run_group, "tags": list(run.tags), "exit_code": exit_code})
    return out
