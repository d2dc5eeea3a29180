"""Data: packing keeps every token, the cache invalidates and is safe under concurrency, bad input is named."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import shared, worker_processes

from src.core.datamodule import micro_batch_size
from src.lm.data.corpus import Corpus, CorpusError
from src.lm.data.text import IGNORE_INDEX, TextDataModule, split_blocks
from src.lm.data.token_cache import load_or_build
from src.lm.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer
from src.utils.config import ConfigError

DOCS = ["first document", "a second, much longer document " * 20, "ünïcödé ☃", "last"]


def write_corpus(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text(DOCS[0])
    (root / "b.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS[1:]) + "\n")
    return root


def expected_stream(tokenizer, docs) -> np.ndarray:
    return np.concatenate([np.append(ids, tokenizer.eos_id) for ids in tokenizer.encode_batch(docs)])


@pytest.mark.parametrize("tok", ["bytes", "gpt2"])
@pytest.mark.parametrize("seq_len", [7, 16, 1000])
def test_packing_keeps_every_token(tmp_path, tok, seq_len):
    tokenizer = ByteTokenizer() if tok == "bytes" else HFTokenizer(str(shared("gpt2-tokenizer")))
    corpus = Corpus.from_config(str(write_corpus(tmp_path / "c")), None, "train", "text")
    stream = np.asarray(load_or_build(corpus, tokenizer, tmp_path / "cache"))
    np.testing.assert_array_equal(stream, expected_stream(tokenizer, DOCS))  # docs joined by EOS, nothing cut

    dm = TextDataModule(
        path=str(tmp_path / "c"),
        tokenizer=tok if tok == "bytes" else str(shared("gpt2-tokenizer")),
        seq_len=seq_len,
        global_batch_size=1,
        val_fraction=0.0,
        test_fraction=0.0,
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup()
    blocks = [dm.splits["train"][i] for i in range(len(dm.splits["train"]))]
    assert all(len(b["input_ids"]) == seq_len for b in blocks)
    labels = torch.cat([b["labels"] for b in blocks])
    kept = labels[labels != IGNORE_INDEX].numpy()
    # labels are shifted targets: every token but the first (which has no context) once, in order
    np.testing.assert_array_equal(kept, stream[1:])
    assert (labels == IGNORE_INDEX).sum() == len(blocks) * seq_len - (len(stream) - 1)  # only the tail is padding
    for b in blocks:  # each target is the token that follows its input
        real = b["labels"] != IGNORE_INDEX
        np.testing.assert_array_equal(b["input_ids"][1:][real[:-1]], b["labels"][:-1][real[:-1]])
    assert dm.splits["train"].target_counts().tolist() == [int((b["labels"] != IGNORE_INDEX).sum()) for b in blocks]


def test_every_token_after_the_first_is_a_target_exactly_once_over_train_val_test(tmp_path):
    """Blocks read seq_len + 1 tokens (overlapping by one): no token is lost at block boundaries,
    and the padding of the stream's last, partial block is masked."""
    stream_len = 1 + 10 * 13 + 5  # 136 tokens: 10 full blocks of 13 targets and one partial block of 5
    (tmp_path / "t.txt").write_bytes(bytes(range(65, 65 + 26)) * 5 + b"abcde")  # + EOS = 136 tokens
    dm = TextDataModule(
        path=str(tmp_path / "t.txt"),
        seq_len=13,
        global_batch_size=1,
        val_fraction=0.2,
        test_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup()
    stream = np.asarray(dm.tokens())
    assert len(stream) == stream_len
    blocks = [dm.splits[s][i] for s in ("train", "val", "test") for i in range(len(dm.splits[s]))]
    assert [len(dm.splits[s]) for s in ("train", "val", "test")] == [8, 2, 1] and len(blocks) == 11
    targets = torch.cat([b["labels"] for b in blocks])
    np.testing.assert_array_equal(targets[targets != IGNORE_INDEX].numpy(), stream[1:])
    last = blocks[-1]
    assert last["labels"].tolist()[5:] == [IGNORE_INDEX] * 8  # the partial block's padding is no target
    assert last["input_ids"].tolist()[:6] == stream[-6:].tolist()
    counts = np.concatenate([dm.splits[s].target_counts() for s in ("train", "val", "test")])
    assert counts.tolist() == [13] * 10 + [5]


def test_splits_are_disjoint_and_cover_all_blocks(tmp_path):
    (tmp_path / "t.txt").write_text("x" * 10_000)
    dm = TextDataModule(
        path=str(tmp_path / "t.txt"),
        seq_len=100,
        global_batch_size=4,
        val_fraction=0.1,
        test_fraction=0.05,
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup()
    sizes = [len(dm.splits[s]) for s in ("train", "val", "test")]
    assert sizes == [85, 10, 5] and sum(sizes) == 100  # 10001 tokens (text + EOS) -> 10000 targets in 100 blocks
    starts = [dm.splits[s].first for s in ("train", "val", "test")]
    assert starts == [0, 85, 95]


def test_cache_is_reused_and_invalidated_when_corpus_or_tokenizer_change(tmp_path):
    root = write_corpus(tmp_path / "c")
    cache = tmp_path / "cache"
    corpus = lambda: Corpus.from_config(str(root), None, "train", "text")  # noqa: E731
    first = load_or_build(corpus(), ByteTokenizer(), cache)
    bins = list(cache.glob("*.bin"))
    mtime = bins[0].stat().st_mtime_ns
    again = load_or_build(corpus(), ByteTokenizer(), cache)
    assert list(cache.glob("*.bin")) == bins and bins[0].stat().st_mtime_ns == mtime  # not rebuilt
    np.testing.assert_array_equal(first, again)

    (root / "a.txt").write_text("changed text")
    changed = load_or_build(corpus(), ByteTokenizer(), cache)
    assert len(list(cache.glob("*.bin"))) == 2
    assert bytes(np.asarray(changed[:12], dtype=np.uint8)) == b"changed text"

    gpt2 = load_or_build(corpus(), HFTokenizer(str(shared("gpt2-tokenizer"))), cache)
    assert len(list(cache.glob("*.bin"))) == 3 and len(gpt2) < len(changed)


def _build_in_process(root: str, cache: str, log: str, start) -> None:
    from src.lm.data import token_cache

    real_build = token_cache._build

    def recording_build(*args):
        with open(log, "a") as f:
            f.write("built\n")
        real_build(*args)

    token_cache._build = recording_build
    corpus = Corpus.from_config(root, None, "train", "text")
    start.wait()  # the 3 "ranks" ask for the cache at the same moment
    np.save(f"{log}.{mp.current_process().name}.npy", np.asarray(load_or_build(corpus, ByteTokenizer(), cache)))


def test_cache_is_built_once_when_ranks_start_together(tmp_path):
    root = write_corpus(tmp_path / "c")
    (root / "big.txt").write_text("lorem ipsum " * 200_000)  # slow enough that the ranks overlap
    log = tmp_path / "builds.log"
    ctx = worker_processes()
    start = ctx.Barrier(3)
    procs = [
        ctx.Process(
            target=_build_in_process, args=(str(root), str(tmp_path / "cache"), str(log), start), name=f"rank{i}"
        )
        for i in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert log.read_text() == "built\n"  # exactly one writer
    arrays = [np.load(f) for f in sorted(tmp_path.glob("builds.log.rank*.npy"))]
    assert len(arrays) == 3 and all(np.array_equal(a, arrays[0]) for a in arrays)
    assert not list((tmp_path / "cache").glob("*.tmp*"))  # no half-written file left


def test_hf_tokenizer_from_tokenizer_json_and_from_vocab_merges_only(tmp_path):
    full = load_tokenizer(str(shared("gpt2-tokenizer")))
    assert full.encode_batch(["Hello world"])[0].tolist() == [15496, 995]
    assert full.eos_id == 50256 and full.vocab_size == 50257
    only = tmp_path / "vocab-merges-only"
    only.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(shared("gpt2-tokenizer", name), only / name)
    slim = load_tokenizer(str(only))
    assert slim.encode_batch(["Hello world"])[0].tolist() == [15496, 995]
    text = shared("tinyshakespeare", "input.txt").read_text()[:20_000]
    assert slim.encode_batch([text])[0].tolist() == full.encode_batch([text])[0].tolist()
    assert slim.eos_id == full.eos_id == 50256


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode_batch(["héllo ☃"])[0]
    assert tok.decode(ids.tolist() + [tok.eos_id]) == "héllo ☃"


def test_embedded_default_corpus_needs_no_download(tmp_path):
    corpus = Corpus.from_config(None, None, "train", "text")
    assert len(corpus.files) > 50 and all(f.suffix == ".py" for f in corpus.files)
    dm = TextDataModule(seq_len=128, global_batch_size=32, cache_dir=str(tmp_path / "cache"))
    dm.setup()
    assert len(dm.splits["train"]) > 10_000


def test_real_text_with_gpt2_tokenizer(tmp_path):
    dm = TextDataModule(
        path=str(shared("tinyshakespeare", "input.txt")),
        tokenizer=str(shared("gpt2-tokenizer")),
        seq_len=256,
        global_batch_size=8,
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (8, 256) and batch["input_ids"].max() < 50257
    n = sum(len(dm.splits[s]) for s in ("train", "val", "test"))
    assert 1100 < n < 1400  # ~338k GPT-2 tokens in tinyshakespeare


# ---- bad input: the error names the file (and line) and the fix ----


def test_missing_path(tmp_path):
    with pytest.raises(CorpusError, match=r"data\.path=.*nope.*does not exist"):
        Corpus.from_config(str(tmp_path / "nope"), None, "train", "text")


def test_dir_without_text_files(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(CorpusError, match="no .txt or .jsonl"):
        Corpus.from_config(str(tmp_path), None, "train", "text")


def test_empty_corpus(tmp_path):
    (tmp_path / "blank.txt").write_text("  \n\n")
    corpus = Corpus.from_config(str(tmp_path), None, "train", "text")
    with pytest.raises(CorpusError, match="empty"):
        load_or_build(corpus, ByteTokenizer(), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.bin")) and not list((tmp_path / "cache").glob("*.json"))


def test_malformed_jsonl_names_file_and_line(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"text": broken}\n')
    corpus = Corpus.from_config(str(f), None, "train", "text")
    with pytest.raises(CorpusError, match=rf"{f}:4: malformed JSON"):
        load_or_build(corpus, ByteTokenizer(), tmp_path / "cache")


def test_jsonl_without_the_text_field(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text('{"text": "ok"}\n{"content": "x"}\n')
    corpus = Corpus.from_config(str(f), None, "train", "text")
    with pytest.raises(CorpusError, match=rf"{f}:2: .*'text'.*data.text_field"):
        load_or_build(corpus, ByteTokenizer(), tmp_path / "cache")


def test_unsupported_file_type(tmp_path):
    f = tmp_path / "data.parquet"
    f.write_bytes(b"x")
    with pytest.raises(CorpusError, match="unsupported file type"):
        Corpus.from_config(str(f), None, "train", "text")


def test_corpus_too_small_for_the_splits():
    with pytest.raises(CorpusError, match="smaller data.seq_len"):
        split_blocks(2, 0.05, 0.05)


def test_global_batch_must_divide():
    assert micro_batch_size(32, 2, 2) == 8
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size=10 does not divide into 4 device\(s\) x trainer.accumulate_grad_batches=1 = 4",
    ):
        micro_batch_size(10, 4, 1)


def test_unknown_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.tokenizer=bytes"):
        load_tokenizer(str(tmp_path / "no-such-tokenizer"))


def test_hf_dataset_source(tmp_path, monkeypatch):
    """data.hf_dataset: our fingerprinting, column check and document iteration (the hub itself needs internet)."""
    datasets = pytest.importorskip("datasets", reason="needs the `datasets` package (pip install -e '.[hf]')")
    ds = datasets.Dataset.from_dict({"story": DOCS, "id": list(range(len(DOCS)))})
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: calls.append((name, split)) or ds)
    corpus = Corpus.from_config(None, "someone/stories", "train", "story")
    assert calls == [("someone/stories", "train")] and corpus.description == "hf:someone/stories[train]"
    stream = load_or_build(corpus, ByteTokenizer(), tmp_path / "cache")
    np.testing.assert_array_equal(stream, expected_stream(ByteTokenizer(), DOCS))
    with pytest.raises(CorpusError, match=r"no column 'text'.*\['story', 'id'\].*data.text_field"):
        Corpus.from_config(None, "someone/stories", "train", "text")
    with pytest.raises(CorpusError, match="not both"):
        Corpus.from_config(str(tmp_path), "someone/stories", "train", "text")


# ---- image data ----


def test_mnist_from_idx_files_splits_the_test_set(tmp_path):
    from src.datamodules.images import ImageDataModule

    dm = ImageDataModule(
        dataset="mnist", path=str(shared("mnist")), val_size=1000, test_size=1000, global_batch_size=32
    )
    dm.setup()
    assert [len(dm.splits[s]) for s in ("train", "val", "test")] == [8000, 1000, 1000]  # train images absent
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 1, 28, 28) and 0.0 <= x.min() and x.max() <= 1.0 and 0 <= y.min() and y.max() <= 9
    counts = torch.bincount(torch.cat([dm.splits["val"][i][1][None] for i in range(1000)]), minlength=10)
    assert counts.min() > 50  # a shuffled split: every digit is in val


def test_mnist_errors_name_the_problem(tmp_path):
    from src.datamodules.images import ImageDataModule, read_idx

    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte.*data=digits"):
        ImageDataModule(dataset="mnist", path=str(tmp_path)).setup()
    bad = tmp_path / "t10k-images-idx3-ubyte"
    bad.write_bytes((2051).to_bytes(4, "big") + (10).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2 + b"\0" * 100)
    with pytest.raises(ValueError, match="truncated"):
        read_idx(bad)


def test_digits_offline_default():
    from src.datamodules.images import ImageDataModule

    dm = ImageDataModule(val_size=200, test_size=200, global_batch_size=64)
    dm.setup()
    assert [len(dm.splits[s]) for s in ("train", "val", "test")] == [1397, 200, 200]


def test_mixing_corpora_follows_the_weights(tmp_path):
    """A 100x larger corpus does not drown the small one: the realised mix is the configured 0.7 / 0.3."""
    (tmp_path / "big.txt").write_text("b" * 200_000)
    (tmp_path / "small.txt").write_text("s" * 2_000)
    dm = TextDataModule(
        mix=[{"path": str(tmp_path / "big.txt"), "weight": 0.3}, {"path": str(tmp_path / "small.txt"), "weight": 0.7}],
        seq_len=50,
        global_batch_size=10,
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup()
    train = dm.splits["train"]
    firsts = [int(train[i]["input_ids"][0]) for i in range(len(train))]
    share_small = firsts.count(ord("s")) / len(firsts)
    assert len(train) > 3000 and abs(share_small - 0.7) < 0.02  # by tokens, small is 1% of the data
    assert len(dm.splits["val"]) == len(dm.splits["val"].datasets[0]) + len(dm.splits["val"].datasets[1])
    with pytest.raises(ValueError, match="exactly 'path' and 'weight'"):
        TextDataModule(mix=[{"path": "x", "wieght": 1}])
    with pytest.raises(ValueError, match="not both"):
        TextDataModule(path="x", mix=[{"path": "y", "weight": 1}])
