"""Content hashes of corpus files, computed once and then trusted while the file's `stat` says it is untouched.

Why: the token cache is keyed by the corpus *content*, and reading every byte at every start costs
as much as the corpus is large (a 50 GB corpus, 50 GB read by every rank before step 1). Here a
file is hashed (streaming, 8 MiB at a time) only the first time it is seen, and its SHA-256 is kept
in an index in the cache dir beside the stat it had: (size, mtime_ns, ctime_ns, inode). A later
start stats the file (no byte read) and reuses the hash when all four are unchanged.

Which edits this catches, and why it cannot miss one:
- any write, truncation or append changes mtime_ns and ctime_ns (POSIX: both are set on every
  data change); an editor that writes a new file and renames it over the old one gives a new inode;
- an edit that restores size and mtime afterwards (`touch -d`, `os.utime`, `cp -p`, `rsync -t`)
  still moves ctime_ns, which no user program can set (utime itself sets ctime to "now");
- the one gap is the timestamp tick: two writes within one tick of the file system's clock (1 ns
  on ext4/xfs, 1 s on some NFS servers and HFS+, 2 s on FAT) can leave the same size, mtime and
  ctime. So a file whose mtime or ctime is within UNVERIFIED_WINDOW_NS (2 s) of the moment hashing
  began is "unverified": it is hashed again at every start until it has been quiet for longer than
  that, then its entry is trusted. An edit after the hash began therefore has a time stamp inside
  the window (or a different stat) and is always re-hashed.
Assumption (documented in conf/data/text.yaml): the clock of the host that hashes and the clock of
the file server agree within the window (NTP). When the stat differs, the file is re-hashed and the
cache is rebuilt only if the content changed (touching a file costs one read, not a rebuild).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Optional

CHUNK_BYTES = 8 << 20  # hashlib.update chunk: memory stays constant whatever the file size
UNVERIFIED_WINDOW_NS = 2_000_000_000  # >= the coarsest common timestamp tick (FAT: 2 s)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def stat_key(st: os.stat_result) -> list[int]:
    """What every change to a file moves (no st_dev: it differs between nodes mounting one file system)."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def trusted(entry: Optional[dict], st: os.stat_result) -> bool:
    """True when `entry` (from the index) may stand for the file's content without reading it."""
    if not entry or entry.get("stat") != stat_key(st):
        return False
    return max(st.st_mtime_ns, st.st_ctime_ns) < entry["hashed_at_ns"] - UNVERIFIED_WINDOW_NS


def hash_entry(path: Path) -> dict:
    """Hash `path`, with the stat it had before the first byte was read (a change during the read moves it)."""
    while True:
        before, hashed_at = os.stat(path), time.time_ns()
        digest = sha256_file(path)
        if stat_key(os.stat(path)) == stat_key(before):
            return {"stat": stat_key(before), "hashed_at_ns": hashed_at, "sha256": digest}


class FileHashes:
    """The index of one corpus (one JSON file under `index_dir`); `None` index_dir = hash every time."""

    def __init__(self, files: list[Path], index_dir: Optional[Path]) -> None:
        self.files = [Path(os.path.abspath(f)) for f in files]
        key = hashlib.sha256("\0".join(map(str, self.files)).encode()).hexdigest()[:20]
        self.index = Path(index_dir) / f"{key}.json" if index_dir else None
        self.hashed: list[Path] = []  # files whose bytes were read this time (tests and logs)
        self._old: dict = {}
        self._new: dict = {}

    def _load(self) -> dict:
        try:
            return json.loads(self.index.read_text()) if self.index else {}
        except (OSError, ValueError):  # missing or damaged: hash again
            return {}

    def sha256s(self) -> list[str]:
        self._old, self._new = self._load(), {}
        for f in self.files:
            entry = self._old.get(str(f))
            if not trusted(entry, os.stat(f)):
                entry = hash_entry(f)
                self.hashed.append(f)
            self._new[str(f)] = entry
        return [self._new[str(f)]["sha256"] for f in self.files]

    def save(self) -> None:
        """Keep the hashes for the next start; called once the cache they key exists (a failed build leaves none)."""
        if self.index and self._new and self._new != self._old:  # atomic: others read the old index or the new
            self.index.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.index.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self._new))
            os.replace(tmp, self.index)
