"""Data at scale: a warm start reads no corpus bytes yet sees every edit, the cold build streams with
bounded memory and exact tokens, and the cache build is shared by ranks and nodes without relying on flock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FULL_MATRIX_ONLY, ROOT, python, shared

from src.lm.data.corpus import Corpus, CorpusError
from src.lm.data.file_hashes import UNVERIFIED_WINDOW_NS, hash_entry, trusted
from src.lm.data.text import TextDataModule
from src.lm.data.token_cache import load_or_build
from src.lm.data.tokenizers import ByteTokenizer, HFTokenizer


def shakespeare() -> str:
    return shared("tinyshakespeare", "input.txt").read_text()


def read_syscall_bytes() -> int:
    """Bytes this process has read with read() so far (page-cache hits included; memory-mapped pages not)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def quiet_corpus(root: Path, size_mb: int) -> Path:
    """A corpus whose files were last changed more than UNVERIFIED_WINDOW_NS ago, so its hashes can be trusted."""
    root.mkdir(parents=True, exist_ok=True)
    text = shakespeare()
    with (root / "big.jsonl").open("w") as f:
        for i in range(size_mb * 2**20 // len(text) + 1):
            f.write(json.dumps({"text": f"{i}\n{text}"}) + "\n")
    (root / "small.txt").write_text("a small document\n\nwith two paragraphs\n")
    time.sleep(UNVERIFIED_WINDOW_NS / 1e9 + 0.2)
    return root


def load(root: Path, cache: Path, tokenizer=None, **kw) -> tuple[np.memmap, Corpus]:
    corpus = Corpus.from_config(str(root), None, "train", "text", **kw)
    return load_or_build(corpus, tokenizer or ByteTokenizer(), cache), corpus


# ---- goal 1: warm start independent of corpus size, and still catching every edit ----


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts read() bytes with Linux's /proc/self/io")
def test_warm_start_reads_no_corpus_bytes(tmp_path):
    root = quiet_corpus(tmp_path / "c", size_mb=16)
    corpus_bytes = sum(f.stat().st_size for f in root.iterdir())
    before = read_syscall_bytes()
    cold, corpus = load(root, tmp_path / "cache")
    cold_read = read_syscall_bytes() - before
    assert corpus.file_hashes.hashed and cold_read >= 2 * corpus_bytes  # hashed once, then tokenized

    before = read_syscall_bytes()
    warm, corpus = load(root, tmp_path / "cache")
    warm_read = read_syscall_bytes() - before
    # The old fingerprint read every byte (16 MB) at every start; now: the hash index and the meta file.
    assert corpus.file_hashes.hashed == [] and warm_read < 64 * 1024, warm_read
    assert len(warm) == len(cold) and np.array_equal(warm[-1000:], cold[-1000:])


def test_same_size_edit_with_mtime_put_back_is_detected(tmp_path):
    """`os.utime` restores size and mtime after an edit (as cp -p, rsync -t, touch -d would): ctime still moves."""
    root = quiet_corpus(tmp_path / "c", size_mb=1)
    f = root / "small.txt"
    first, _ = load(root, tmp_path / "cache")
    st = f.stat()
    f.write_text(f.read_text().replace("small", "SMALL"))  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    edited, corpus = load(root, tmp_path / "cache")
    assert corpus.file_hashes.hashed == [Path(os.path.abspath(f))]
    assert b"a SMALL document" in np.asarray(edited[-60:]).astype(np.uint8).tobytes()
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 2


def test_edit_with_a_new_mtime_is_detected_and_a_touch_rebuilds_nothing(tmp_path):
    root = quiet_corpus(tmp_path / "c", size_mb=1)
    f = root / "small.txt"
    load(root, tmp_path / "cache")
    os.utime(f)  # touched, content unchanged: hashed again, same key, no rebuild
    _, corpus = load(root, tmp_path / "cache")
    assert (
        corpus.file_hashes.hashed == [Path(os.path.abspath(f))] and len(list((tmp_path / "cache").glob("*.bin"))) == 1
    )
    f.write_text(f.read_text() + "appended\n")
    edited, _ = load(root, tmp_path / "cache")
    assert np.asarray(edited[-10:-1]).astype(np.uint8).tobytes() == b"appended\n"
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 2


def test_a_change_within_one_timestamp_tick_of_hashing_is_never_trusted(tmp_path):
    """On a file system with coarse time stamps (1-2 s), an edit right after the hash can leave size, mtime and
    ctime as they were: a file changed within UNVERIFIED_WINDOW_NS of the moment hashing began is hashed again."""
    f = tmp_path / "f.txt"
    f.write_text("text")
    entry = hash_entry(f)
    st = f.stat()
    assert not trusted(entry, st)  # written just before hashing: inside the window
    assert trusted({**entry, "hashed_at_ns": max(st.st_mtime_ns, st.st_ctime_ns) + UNVERIFIED_WINDOW_NS + 1}, st)
    assert not trusted({**entry, "hashed_at_ns": max(st.st_mtime_ns, st.st_ctime_ns) + UNVERIFIED_WINDOW_NS}, st)
    assert not trusted({**entry, "stat": [st.st_size + 1, *entry["stat"][1:]], "hashed_at_ns": 2**62}, st)


# ---- goal 2: the cold build streams, with exact tokens ----


@pytest.mark.parametrize("tok", ["bytes", "gpt2"])
def test_txt_read_in_pieces_gives_the_whole_file_tokens(tmp_path, tok):
    """A .txt file is one document read in small pieces cut before whitespace: byte tokens and GPT-2 BPE equal
    the encoding of the whole file at once (blank lines, CRLF, multi-byte characters split across reads)."""
    tokenizer = ByteTokenizer() if tok == "bytes" else HFTokenizer(str(shared("gpt2-tokenizer")))
    text = shakespeare()[:150_000] + "\r\n\r\nünïcödé ☃ " * 500 + "\n\n\n  tail  \n"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text(text)
    corpus = Corpus.from_config(str(tmp_path / "c"), None, "train", "text", txt_chunk_chars=997)
    pieces = list(corpus.pieces())
    assert len(pieces) > 50 and "".join(p for p, _ in pieces) == text and [e for _, e in pieces].count(True) == 1
    assert max(len(p) for p, _ in pieces) <= 2 * 997
    stream = load_or_build(corpus, tokenizer, tmp_path / "cache")
    whole = np.append(tokenizer.encode_batch([text])[0], tokenizer.eos_id)
    np.testing.assert_array_equal(stream, whole)


def test_hf_dataset_read_in_batches_and_streaming(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="needs the `datasets` package (pip install -e '.[hf]')")
    docs = [f"story {i}: " + "once upon a time " * (i % 7) for i in range(2500)]  # several batches of 1000
    docs[1234] = "   "  # a blank document adds nothing, as in files
    ds = datasets.Dataset.from_dict({"story": docs})
    calls = []

    def load_dataset(name, split, streaming=False):
        calls.append(streaming)
        return ds.to_iterable_dataset() if streaming else ds

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    tok = ByteTokenizer()
    expected = np.concatenate([np.append(t, tok.eos_id) for t in tok.encode_batch([d for d in docs if d.strip()])])
    for streaming in (False, True):
        dm = TextDataModule(
            hf_dataset="someone/stories",
            text_field="story",
            hf_streaming=streaming,
            seq_len=16,
            global_batch_size=4,
            cache_dir=str(tmp_path / f"cache{streaming}"),
        )
        np.testing.assert_array_equal(dm.tokens(), expected)
    assert calls == [False, True]


def test_a_failure_after_some_batches_leaves_no_cache_and_no_hash_index(tmp_path):
    f = tmp_path / "c" / "data.jsonl"
    f.parent.mkdir()
    f.write_text("".join(json.dumps({"text": f"doc {i} " * 50}) + "\n" for i in range(5000)) + "{broken\n")
    corpus = Corpus.from_config(str(f), None, "train", "text")
    with pytest.raises(CorpusError, match=rf"{f}:5001: malformed JSON"):
        load_or_build(corpus, ByteTokenizer(), tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*") if not p.name.endswith(".lock")) == []


BUILD_AND_REPORT_RSS = """
import resource, sys
from src.lm.data.corpus import Corpus
from src.lm.data.token_cache import load_or_build
from src.lm.data.tokenizers import ByteTokenizer
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tokens = load_or_build(Corpus.from_config(sys.argv[1], None, "train", "text"), ByteTokenizer(), sys.argv[2])
print(len(tokens), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
"""


def test_cold_build_memory_does_not_grow_with_the_file(tmp_path):
    """One 96 MB .txt document: the whole-file path held it several times over (bytes, str, uint16 ids: > 400 MB);
    streamed, the build's peak RSS grows by the size of one batch of pieces (~8 MiB of text), not of the file."""
    text = shakespeare()
    big = tmp_path / "big.txt"
    with big.open("w") as f:
        for i in range(96 * 2**20 // len(text)):
            f.write(f"{i}\n\n{text}")
    out = subprocess.run(
        [sys.executable, "-c", BUILD_AND_REPORT_RSS, str(big), str(tmp_path / "cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    n_tokens, grew_mb = map(int, out.stdout.split())
    assert n_tokens == big.stat().st_size + 1
    assert grew_mb < 120, f"peak RSS grew by {grew_mb} MB while building a {big.stat().st_size >> 20} MB file"


# ---- goal 3: who builds the cache ----


def test_cache_shared_picks_who_runs_prepare_data():
    """Lightning runs prepare_data on global rank 0 (prepare_data_per_node=False) or local rank 0 of every node."""
    assert TextDataModule(cache_shared=True).prepare_data_per_node is False
    assert TextDataModule(cache_shared=False).prepare_data_per_node is True


def test_build_falls_back_to_an_exclusive_lock_file_where_flock_fails(tmp_path, monkeypatch, caplog):
    """Lustre without -o flock answers flock with an error: the build still runs, under an O_EXCL lock file."""
    import errno

    import filelock._unix as unix

    def no_flock(fd, op):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(unix.fcntl, "flock", no_flock)
    (tmp_path / "a.txt").write_text("some text")
    tokens, _ = load(tmp_path / "a.txt", tmp_path / "cache")
    assert np.asarray(tokens).astype(np.uint8)[:9].tobytes() == b"some text"
    assert "O_EXCL" in caplog.text and not list((tmp_path / "cache").glob("*.excl"))


def torchrun_two_nodes(tmp: Path, cache_dirs: tuple[Path, Path], shared: bool) -> list[str]:
    """2 "nodes" x 1 process on localhost (torchrun sets GROUP_RANK, which Lightning reads as the node rank)."""
    from conftest import free_port
    from test_parity import GPT2, QUIET

    port, procs = free_port(), []
    for node in (0, 1):
        run = [
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=cache{shared}",
            f"--node-rank={node}",
            "train.py",
            "trainer=ddp",
            *QUIET,
            *GPT2,
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            f"hydra.run.dir={tmp / f'run{shared}{node}'}",
            f"data.cache_dir={cache_dirs[node]}",
            f"data.cache_shared={str(shared).lower()}",
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHON_EXEC": python()}  # torchrun starts its ranks with it
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *run],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    return outs


@FULL_MATRIX_ONLY  # suite time, 22 s: the cache built once by ranks starting together stays (test_data.py)
@pytest.mark.slow
def test_two_nodes_build_the_cache_once_shared_or_once_per_node_local_disk(tmp_path):
    """data.cache_shared=false with a node-local cache dir per node: each node's local rank 0 builds its own cache
    in prepare_data. data.cache_shared=true with one dir: only global rank 0 builds; node 1 waits at Lightning's
    barrier and then reads the finished cache (no lock needed for that)."""
    local = (tmp_path / "node0-disk", tmp_path / "node1-disk")
    outs = torchrun_two_nodes(tmp_path, local, shared=False)
    assert all("Tokenized" in out for out in outs)
    assert all(len(list(d.glob("*.bin"))) == 1 and len(list(d.glob("*.json"))) == 1 for d in local)

    one = tmp_path / "shared-fs"
    outs = torchrun_two_nodes(tmp_path, (one, one), shared=True)
    assert "Tokenized" in outs[0] and "Tokenized" not in outs[1]
    assert len(list(one.glob("*.bin"))) == 1


MEMORY_PER_BLOCK = """
import resource
import numpy as np
from src.lm.data.text import PackedBlocks
from src.parallel.samplers import ResumableDistributedSampler

n = 20_000_000  # blocks: a 2.5 GB corpus at seq_len 128 (here seq_len 1 over zero pages: no token memory)
data = PackedBlocks(np.zeros(n + 1, dtype=np.uint16), seq_len=1, first=0, count=n, pad_id=0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sampler = ResumableDistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0, drop_last=True)
batch = [index for index, _ in zip(sampler, range(8))]
totals = sampler.step_totals(data.target_counts(), 4, 2, epoch=0)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024 / n, len(totals), int(totals[0]), len(set(batch)))
"""


def test_the_train_order_and_step_totals_cost_a_few_bytes_a_block():
    """20 M training blocks, 2 ranks: the first batch and the epoch's step totals raise peak RSS by at most 6 bytes
    a block (the epoch's int32 permutation is 4). Before, a Python list of the rank's indices, its copy and the
    per-block target counts with their gather took ~40 bytes a block: 0.8 GB per rank for a 2.5 GB corpus."""
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_PER_BLOCK], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    per_block, steps, first_total, distinct = proc.stdout.split()
    # 10 M blocks per rank, 4 per micro-batch, 2 micro-batches per step; each step 4 x 2 ranks x 2 blocks of 1 target
    assert (int(steps), int(first_total), int(distinct)) == (1_250_000, 16, 8)
    assert float(per_block) <= 6, f"{float(per_block):.1f} bytes of peak RSS per training block"
