"""Extend a pretrained BPE tokenizer's vocabulary for a new language or domain (Chinese-LLaMA's recipe), and
measure tokens per character.

    python -m src.tools.vocab extend --tokenizer DIR --corpus FILE --add N --out DIR
    python -m src.tools.vocab measure --tokenizer DIR [DIR ...] --corpus FILE
    python train.py model=causal_lm model.pretrained=MODEL_DIR data.tokenizer=OUT model.resize_embeddings=true

`extend` trains BPE merges on the corpus with the `tokenizers` library (transformers'
`train_new_from_iterator`: the base's own pre-tokenizer and byte alphabet), then walks them in the order
they were learned (most frequent pair first) and keeps the first N whose result the base lacks and whose two
parts the base (or an earlier kept merge) has. Those N merges and tokens are appended to the base's BPE
model, after its own merges, so every text the base tokenized before keeps its tokens unless a new merge
applies; `AutoTokenizer.from_pretrained(OUT)` loads the result. OUT/vocab_extension.json records, for each
new id, the base ids its text had: training with `model.resize_embeddings=true` initialises each new
embedding row (and an untied head's) as the mean of those rows (src/lm/hf.py).

A corpus is a .txt file (one document), or a .json array / .jsonl of records whose string fields are read
(Alpaca's instruction, input, output; ShareGPT's conversations).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

from src.lm.data.tokenizers import load_hf_tokenizer
from src.utils.errors import UserError

EXTENSION = "vocab_extension.json"  # {"base_vocab_size": n, "pieces": {new id: [base ids]}}


class VocabError(ValueError):
    """Bad input to the tool; the message names it and the fix."""


def corpus_texts(path: Path) -> list[str]:
    """The corpus as a list of texts: a .txt file whole, or every string in a .json array / .jsonl's records."""
    if not path.is_file():
        raise VocabError(f"--corpus {path} is not a file: pass a .txt, .json or .jsonl corpus.")
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise VocabError(
            f"--corpus {path} is not valid JSON ({e.msg} at line {e.lineno}): pass a .txt file or "
            "a JSON array / JSON lines of records."
        ) from None
    texts: list[str] = []

    def strings(value) -> Iterator[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)

    for record in records if isinstance(records, list) else [records]:
        texts.extend(s for s in strings(record) if s.strip())
    if not texts:
        raise VocabError(f"--corpus {path} holds no text.")
    return texts


def load_base(name_or_path: str):
    """The base tokenizer as training loads it (src/lm/data/tokenizers.py: GPT-2's EOS declared)."""

    try:
        tokenizer = load_hf_tokenizer(name_or_path)
    except UserError as e:
        raise VocabError(str(e).replace("data.tokenizer=", "--tokenizer ")) from None
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"] if tokenizer.is_fast else {}
    if model.get("type") != "BPE":
        raise VocabError(
            f"--tokenizer {name_or_path} is not a fast BPE tokenizer (GPT-2, Llama 3, Qwen2 style): "
            "extend works on BPE merges."
        )
    return tokenizer


def pairs(merges: list) -> list[tuple[str, str]]:
    """BPE merges as pairs, whether tokenizer.json stores them as ["a", "b"] or as "a b"."""
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


def extend(tokenizer: str, corpus: Path, add: int, out: Path) -> dict:
    """Write the extended tokenizer to `out` (via a temporary dir renamed into place: whole or absent)."""
    if add < 1:
        raise VocabError(f"--add {add}: add at least 1 token.")
    if out.exists():
        raise VocabError(f"--out {out} exists: pick a new dir (nothing is overwritten).")
    base = load_base(tokenizer)
    texts = corpus_texts(corpus)
    # 4N merges to choose from: most of a corpus's frequent pairs are already the base's
    trained = base.train_new_from_iterator(texts, vocab_size=256 + 4 * add + len(base.all_special_tokens))
    learned = pairs(json.loads(trained.backend_tokenizer.to_str())["model"]["merges"])

    state = json.loads(base.backend_tokenizer.to_str())
    vocab, merges = state["model"]["vocab"], state["model"]["merges"]
    next_id = len(base)  # after the vocabulary and any added tokens
    have, new = set(vocab), []
    for a, b in learned:  # learned order: the most frequent pair of the corpus first
        token = a + b
        if token in have or a not in have or b not in have:
            continue
        vocab[token] = next_id + len(new)
        merges.append([a, b] if merges and isinstance(merges[0], list) else f"{a} {b}")
        have.add(token)
        new.append(token)
        if len(new) == add:
            break
    if len(new) < add:
        raise VocabError(
            f"The corpus yields only {len(new)} new tokens for this tokenizer, fewer than --add {add}: "
            "add fewer, or use a larger corpus."
        )
    bpe = base.backend_tokenizer.model  # the base's own merges, on the byte-level strings the new tokens are
    pieces = {str(vocab[token]): [piece.id for piece in bpe.tokenize(token)] for token in new}
    record = {"base": str(tokenizer), "base_vocab_size": len(base), "pieces": pieces}
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        base.save_pretrained(tmp)  # its config and special tokens; then its BPE model with the new merges
        for slow in ("vocab.json", "merges.txt"):  # the slow tokenizer's files would not know the new tokens
            (tmp / slow).unlink(missing_ok=True)
        (tmp / "tokenizer.json").write_text(json.dumps(state, ensure_ascii=False), encoding="utf-8")
        (tmp / EXTENSION).write_text(json.dumps(record, indent=1, ensure_ascii=False), encoding="utf-8")
        check = load_base(str(tmp))
        if len(check) != len(base) + add or check.eos_token_id != base.eos_token_id:
            raise VocabError(
                f"The extended tokenizer did not load back as written ({len(check)} tokens, EOS "
                f"{check.eos_token_id}); please report this with the base tokenizer's name."
            )
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return record


def tokens_per_char(tokenizer: str, corpus: Path) -> float:
    tok = load_base(tokenizer)
    texts = corpus_texts(corpus)
    tokens = sum(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"])
    return tokens / sum(len(t) for t in texts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("extend", help="add N BPE tokens learned on a corpus")
    e.add_argument("--tokenizer", required=True)
    e.add_argument("--corpus", required=True, type=Path)
    e.add_argument("--add", required=True, type=int)
    e.add_argument("--out", required=True, type=Path)
    m = sub.add_parser("measure", help="tokens per character of a corpus")
    m.add_argument("--tokenizer", required=True, nargs="+")
    m.add_argument("--corpus", required=True, type=Path)
    a = ap.parse_args()
    try:
        if a.command == "extend":
            record = extend(a.tokenizer, a.corpus, a.add, a.out)
            print(f"{a.out}: {len(record['pieces'])} tokens added to {record['base_vocab_size']}")
        else:
            for name in a.tokenizer:
                print(f"{name}: {tokens_per_char(name, a.corpus):.4f} tokens per character")
    except VocabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
