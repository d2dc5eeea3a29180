"""src.tools.vocab: a BPE vocabulary extended on a corpus (Chinese on GPT-2's tokenizer here), loaded by
AutoTokenizer and by training, with new embedding rows that start as the mean of the base tokens they replace."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_script, shared

from src.tools.vocab import EXTENSION, VocabError, extend, tokens_per_char

GPT2_TOKENIZER = str(shared("gpt2-tokenizer"))


@pytest.fixture(scope="module")
def extended(tmp_path_factory):
    """GPT-2's tokenizer + 100 tokens learned on 300 Chinese Alpaca records; 100 other records held out."""
    tmp = tmp_path_factory.mktemp("vocab")
    records = json.loads(shared("alpaca", "alpaca_zh_demo.json").read_text(encoding="utf-8"))
    (tmp / "train.json").write_text(json.dumps(records[:300], ensure_ascii=False), encoding="utf-8")
    (tmp / "held.json").write_text(json.dumps(records[-100:], ensure_ascii=False), encoding="utf-8")
    extend(GPT2_TOKENIZER, tmp / "train.json", 100, tmp / "ext")
    return tmp


def test_extended_tokenizer_loads_round_trips_and_shortens_the_new_language(extended):
    from transformers import AutoTokenizer

    base, ext = AutoTokenizer.from_pretrained(GPT2_TOKENIZER), AutoTokenizer.from_pretrained(extended / "ext")
    assert len(ext) == len(base) + 100 and ext.eos_token_id == 50256
    held = [
        r["instruction"] + r["input"] + r["output"]
        for r in json.loads((extended / "held.json").read_text(encoding="utf-8"))
    ]
    assert all(ext.decode(ext(t)["input_ids"]) == t for t in held)  # nothing lost
    before, after = (tokens_per_char(t, extended / "held.json") for t in (GPT2_TOKENIZER, str(extended / "ext")))
    assert after < 0.85 * before, (before, after)  # held-out Chinese: 1.81 -> 1.46 tokens per character
    record = json.loads((extended / "ext" / EXTENSION).read_text(encoding="utf-8"))
    for new_id, pieces in record["pieces"].items():  # each new token is its base pieces joined
        assert "".join(base.convert_ids_to_tokens(pieces)) == ext.convert_ids_to_tokens(int(new_id))
        assert int(new_id) >= len(base) and len(pieces) >= 2


def test_training_with_it_starts_new_rows_as_their_pieces_mean(extended):
    """model.resize_embeddings=true with the extended tokenizer: the base rows and the base vocabulary's logits are
    untouched, each new row is the mean of its pieces' rows."""
    from src.lm.models.gpt2_module import GPT2LitModule

    tiny = str(shared("tiny-gpt2"))
    base = GPT2LitModule(vocab_size=50257, seq_len=64, pretrained=tiny).eval()
    grown = GPT2LitModule(
        vocab_size=50357, seq_len=64, pretrained=tiny, resize_embeddings=True, tokenizer=str(extended / "ext")
    ).eval()
    old, new = base.hf_model.get_input_embeddings().weight, grown.hf_model.get_input_embeddings().weight
    assert torch.equal(new[:50257], old)
    pieces = json.loads((extended / "ext" / EXTENSION).read_text(encoding="utf-8"))["pieces"]
    for new_id, ids in pieces.items():
        torch.testing.assert_close(new[int(new_id)], old[ids].mean(dim=0))
    ids = torch.randint(0, 50257, (2, 64))
    with torch.no_grad():
        assert torch.equal(grown(ids).logits[..., :50257], base(ids).logits)


def test_bad_input_is_one_sentence_and_writes_nothing(extended, tmp_path):
    with pytest.raises(VocabError, match="exists: pick a new dir"):
        extend(GPT2_TOKENIZER, extended / "train.json", 10, extended / "ext")
    with pytest.raises(VocabError, match="yields only .* fewer than --add 100000"):
        extend(GPT2_TOKENIZER, extended / "train.json", 100_000, tmp_path / "out")
    assert not list(tmp_path.iterdir())  # no half-written dir
    (tmp_path / "bad.json").write_text("{not json")
    proc = run_script(
        "-m",
        [
            "src.tools.vocab",
            "extend",
            "--tokenizer",
            GPT2_TOKENIZER,
            "--corpus",
            str(tmp_path / "bad.json"),
            "--add",
            "10",
            "--out",
            str(tmp_path / "o"),
        ],
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "is not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()
