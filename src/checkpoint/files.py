"""Checkpoints that a kill can never half-write, and the reading side that understands that.

Every form is written beside its target on the same file system, then renamed into place:

* one file (DDP, 1 device, FSDP with save_distributed_checkpoint=false): `AtomicCheckpointIO`
  writes `<path>.tmp`, fsyncs it and `os.replace`s it over `<path>` (Lightning's own save goes
  through an fsspec transaction whose temp file lives in /tmp, so the final move is a copy);
* a sharded dir (FSDP2's DCP dir, DeepSpeed's ZeRO dir): `save_sharded` has every rank write
  into `<path>.tmp/`; after a barrier rank 0 renames `<path>` -> `<path>.old`, `<path>.tmp` ->
  `<path>` and deletes `<path>.old` (a dir cannot be renamed over a non-empty dir).

So `<path>` is always a complete checkpoint or absent. A kill leaves at most a `.tmp` (never
complete as far as we know: discarded) or, between the two renames, a `.old` without `<path>`
(the previous complete checkpoint: renamed back). `recover` does both before each save and
before resume=auto looks; readers skip `.tmp`/`.old` names.
"""

from __future__ import annotations

import logging
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

log = logging.getLogger(__name__)
RESUME_ENV = "TEMPLATE_RESUME_DECISION"  # rank 0's resume=auto choice, inherited by the ranks Lightning starts
STAGING = (".tmp", ".old")  # suffixes of the names beside a checkpoint that are never a checkpoint themselves


def staging(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def recover(path: str | Path) -> None:
    """Undo what a kill during a save of `path` left behind (call on one rank only)."""
    path = Path(path)
    tmp, old = staging(path, ".tmp"), staging(path, ".old")
    if old.exists():
        if path.exists():  # killed after the new one was in place: the old one is no longer needed
            _remove(old)
        else:  # killed between the two renames: the previous complete checkpoint goes back
            log.warning(f"Restoring {path} from {old.name}: a save was interrupted between its two renames.")
            os.rename(old, path)
    if tmp.exists():
        _remove(tmp)


def swap_in(new: Path, path: Path) -> None:
    """Put the complete `new` at `path`, keeping the previous one until `new` is there."""
    old = staging(path, ".old")
    _remove(old)
    if path.exists() or path.is_symlink():
        os.rename(path, old)
    os.rename(new, path)
    _fsync_dir(path.parent)
    _remove(old)


def save_sharded(strategy: Any, write: Callable[[Path], None], filepath: str | Path) -> None:
    """All ranks write their shards with `write(<path>.tmp)`; once all are done, rank 0 renames it to `path`."""
    path = Path(strategy.broadcast(str(filepath)))
    if strategy.is_global_zero:
        recover(path)
    strategy.barrier("atomic_save_start")
    write(staging(path, ".tmp"))
    strategy.barrier("atomic_save_written")  # every rank's shards and rank 0's metadata are on disk
    if strategy.is_global_zero:
        swap_in(staging(path, ".tmp"), path)
    strategy.barrier("atomic_save_done")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch.save checkpoint IO, but a local file is written as `<path>.tmp` and renamed."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Optional[Any] = None
    ) -> None:
        if storage_options is not None or "://" in str(path):  # remote storage: Lightning's fsspec transaction
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = staging(path, ".tmp")
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        if path.is_dir():  # a sharded checkpoint of an earlier run at this name
            swap_in(tmp, path)
        else:
            os.replace(tmp, path)
            _fsync_dir(path.parent)


# ---- reading: is a checkpoint complete, and which one is the newest complete one ----


def _zip_problem(path: Path) -> Optional[str]:
    """torch.save writes a zip whose index is at the end: a truncated or foreign file has none."""
    try:
        with zipfile.ZipFile(path) as z:
            if not any(n.endswith("data.pkl") for n in z.namelist()):
                return "it is not a torch.save file"
    except (zipfile.BadZipFile, OSError) as e:
        return f"it is truncated or not a checkpoint ({e})"
    return None


def problem(path: str | Path) -> Optional[str]:
    """Why `path` cannot be resumed from (None if it looks complete). Cheap: reads indexes, not tensors."""
    path = Path(path)
    if not path.exists():
        return "it does not exist"
    if path.is_file():
        return _zip_problem(path)
    if (path / "latest").is_file():  # DeepSpeed: `latest` names the tag dir holding the shards
        tag = (path / "latest").read_text().strip()
        parts = sorted((path / tag).glob("*.pt")) if tag else []
        if not parts:
            return f"its shard dir {tag!r} is missing or empty"
        return next((f"its {p.name}: {why}" for p in parts if (why := _zip_problem(p))), None)
    if not (path / ".metadata").is_file():
        return "it is a directory without DCP .metadata or DeepSpeed 'latest'"
    from src.checkpoint import safe_load
    from src.utils.errors import CheckpointError

    try:
        metadata = safe_load.dcp_metadata(path)
    except CheckpointError:  # a type the template does not write: refused, never skipped for another checkpoint
        raise
    except Exception as e:  # noqa: BLE001  (any unreadable metadata means the same to the caller)
        return f"its .metadata is unreadable ({e})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in ends.items():
        shard = path / name
        if not shard.is_file() or shard.stat().st_size < end:
            return f"its shard {name} is missing or truncated"
    if (path / "meta.pt").exists():
        return _zip_problem(path / "meta.pt")
    return None


def _mtime(path: Path) -> float:
    if path.is_dir():
        return max((p.stat().st_mtime for p in path.rglob("*") if p.is_file()), default=path.stat().st_mtime)
    return path.stat().st_mtime


def candidates(ckpt_dir: str | Path) -> list[Path]:
    """The checkpoints in `ckpt_dir`, newest first, without staging (.tmp/.old) names."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.name.endswith(".ckpt")]
    return sorted(found, key=_mtime, reverse=True)
