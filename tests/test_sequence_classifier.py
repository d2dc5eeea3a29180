"""A Hugging Face sequence classifier on the base classes (experiment=bert_classifier: model=sequence_classifier on
data=labeled_text): 2 ranks under DDP and FSDP2 train the 1-process model, its export loads in a clean client with
transformers alone and gives the module's logits, and any encoder family fits (BERT, RoBERTa, DistilBERT).

The config's dropouts (0.1) are keyed by sample by the UserModule callback: the hidden ones (nn.Dropout) and the
attention's, drawn inside transformers' attention function (src/core/dropout.py key_module).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, path_overrides, run_script, shared
from test_experiments import parity

from src.checkpoint.convert import build_module, load_checkpoint
from src.core import dropout as keyed
from src.datamodules.labeled_text import LabeledTextDataModule
from src.models.sequence_classifier import SequenceClassifierLitModule
from src.utils.config import ConfigError
from tests.helpers.margins import close64

SMALL = ["experiment=bert_classifier", "data.global_batch_size=8", "data.max_tokens=32"]
FAMILIES = {  # a tiny config of each encoder family, its dropouts at 0.1, and where its layers are
    "bert": ({"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64}, "bert.encoder.layer"),
    "roberta": ({"model_type": "roberta", "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2,
                 "intermediate_size": 64}, "roberta.encoder.layer"),
    "distilbert": ({"model_type": "distilbert", "dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64,
                    "dropout": 0.1, "attention_dropout": 0.1}, "distilbert.transformer.layer"),
}  # fmt: skip


@pytest.mark.slow
# suite time: DDP is tests/test_experiments.py's run of experiment=bert_classifier; FSDP2 stays here
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=FULL_MATRIX_ONLY), "fsdp"])
def test_2_ranks_train_the_1_process_classifier_with_its_dropouts(strategy):
    """Hidden, attention and classifier dropout 0.1, each batch padded to its longest text (another width on 2 ranks
    than on 1 process): every logged value equal."""
    parity([*SMALL, f"trainer={strategy}"])


@pytest.fixture(scope="module")
def data() -> LabeledTextDataModule:
    dm = LabeledTextDataModule(max_tokens=32, global_batch_size=8)
    dm.splits = dm.build_splits()
    return dm


def test_the_stdlib_docstrings_are_labelled_by_package(data):
    assert data.labels == ["asyncio", "email", "importlib", "logging"]
    assert len(data.texts) > 500 and set(data.label_ids.tolist()) == {0, 1, 2, 3}
    assert {"val": 64, "test": 64} == {s: len(data.splits[s]) for s in ("val", "test")}
    batch = data.collate_fn()([data.splits["train"][i] for i in range(4)])
    lengths = batch["attention_mask"].sum(1)
    assert (batch["input_ids"][:, 0] == 256).all() and lengths.max() == batch["input_ids"].shape[1] <= 32
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 0).all()  # padding: the NUL byte, masked


def test_a_jsonl_or_csv_of_text_and_label(tmp_path):
    rows = [{"text": f"{word} {i}", "label": word} for i in range(20) for word in ("spam", "ham")]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "a.csv").write_text("text,label\n" + "\n".join(f"{r['text']},{r['label']}" for r in rows))
    for name in ("a.jsonl", "a.csv"):
        dm = LabeledTextDataModule(path=str(tmp_path / name), val_size=4, test_size=4)
        assert dm.model_kwargs["labels"] == ["ham", "spam"] and dm.label_ids.tolist()[:2] == [1, 0]
    with pytest.raises(ConfigError, match="record 1 lacks 'body' or 'label': set data.text_field"):
        LabeledTextDataModule(path=str(tmp_path / "a.jsonl"), text_field="body")


def test_a_tokenizer_with_special_tokens_wraps_each_text_in_them(tmp_path):
    """A BERT tokenizer's texts are [CLS] ... [SEP], cut to max_tokens with [SEP] kept, padded with its [PAD]."""
    from transformers import BertTokenizer

    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters)]
    BertTokenizer(vocab={word: i for i, word in enumerate(words)}).save_pretrained(tmp_path / "bert")
    (tmp_path / "a.csv").write_text("text,label\n" + "\n".join(f"ab cd,{i % 2}" for i in range(8)))
    dm = LabeledTextDataModule(path=str(tmp_path / "a.csv"), tokenizer=str(tmp_path / "bert"), val_size=2, test_size=2)
    assert [x.tolist() for x in dm.tokenizer.encode(["ab cd", "abcdefghij"], 8)] == [
        [2, 5, 32, 7, 34, 3],  # [CLS] a ##b c ##d [SEP]
        [2, 5, 32, 33, 34, 35, 36, 3],  # [CLS] a ##b ##c ##d ##e ##f [SEP]: 8 tokens
    ]
    assert dm.model_kwargs == {"labels": ["0", "1"], "vocab_size": 57, "pad_token_id": 0}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_any_encoder_family_shards_its_layers_and_exports(family, data, tmp_path):
    """blocks() finds each family's layers; padding a batch wider changes no logit; save_pretrained loads back."""
    from transformers import AutoModelForSequenceClassification

    config, layers = FAMILIES[family]
    module = SequenceClassifierLitModule(**data.model_kwargs, config=config).eval()
    expected = module.model.get_submodule(layers)
    assert [block for _, _, block in module.blocks()] == list(expected)
    assert all(parent is expected for parent, _, _ in module.blocks())
    batch = data.collate_fn()([data.splits["val"][i] for i in range(4)])
    wider = {k: torch.nn.functional.pad(v, (0, 5)) if v.dim() == 2 else v for k, v in batch.items()}
    module.model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert loaded.config.id2label == dict(enumerate(data.labels))
    with torch.no_grad():
        logits = module.double()(batch)
        assert logits.shape == (4, 4)
        close64(module(wider), logits, f"{family} logits padded wider")
        close64(loaded.double()(**{k: v for k, v in batch.items() if k != "labels"}).logits, logits, "reloaded")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_keyed_dropout_gives_a_row_its_masks_at_any_padded_width(family, data):
    """Training forwards with every dropout keyed (the UserModule callback's key_module): a batch with no padding and
    the same batch padded wider give equal logits. Per-batch padding makes the width differ between 1 process and N
    ranks; the keyed attention once read an encoder's unpadded batch (no mask) as causal (train/loss 9e-4 apart)."""
    config, _ = FAMILIES[family]
    module = SequenceClassifierLitModule(**data.model_kwargs, config=config).double().train()
    assert keyed.key_module(module) > 0
    items = [data.splits["train"][i] for i in range(4)]
    width = 12
    batch = data.collate_fn()([{**item, "input_ids": item["input_ids"][:width]} for item in items])
    assert batch["attention_mask"].all()  # no padding: the attention gets no mask
    wider = {k: torch.nn.functional.pad(v, (0, 5)) if v.dim() == 2 else v for k, v in batch.items()}
    keyed.set_keys(keyed.row_keys(torch.arange(4), 4, 0, 0))
    with torch.no_grad():
        close64(module(wider), module(batch), f"{family} keyed training logits padded wider")


def test_a_pretrained_dir_loads_with_a_new_head_for_other_labels_and_model_dropout(data, tmp_path):
    """model.pretrained: the encoder's weights as saved, a new head where the data's labels differ, model.dropout in
    every dropout probability of the config and its modules; a pretrained dir with model.config is one sentence."""
    kwargs = data.model_kwargs
    saved = SequenceClassifierLitModule(**kwargs, config=FAMILIES["bert"][0])
    saved.model.save_pretrained(tmp_path)
    loaded = SequenceClassifierLitModule(**kwargs, pretrained=str(tmp_path), dropout=0.0)
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), loaded.state_dict().values()))
    config = loaded.model.config
    assert config.hidden_dropout_prob == config.attention_probs_dropout_prob == 0.0
    assert {m.p for m in loaded.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}
    other = SequenceClassifierLitModule(**{**kwargs, "labels": ["no", "yes"]}, pretrained=str(tmp_path))
    assert other.model.config.id2label == {0: "no", 1: "yes"} and other.model.classifier.out_features == 2
    assert torch.equal(
        other.model.bert.embeddings.word_embeddings.weight, saved.model.bert.embeddings.word_embeddings.weight
    )
    assert other.model.config.hidden_dropout_prob == 0.1  # its own without model.dropout
    with pytest.raises(ConfigError, match="model.pretrained=.* and model.config both say what to build"):
        SequenceClassifierLitModule(**kwargs, pretrained=str(tmp_path), config={"hidden_dropout_prob": 0.2})
    with pytest.raises(ConfigError, match="model.config needs a model_type"):
        SequenceClassifierLitModule(**kwargs, config={"hidden_size": 32})
    with pytest.raises(ConfigError, match="has 257 token ids and the data's tokenizer 50257"):
        SequenceClassifierLitModule(**{**kwargs, "vocab_size": 50257}, pretrained=str(tmp_path))


CLIENT = """
import sys, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
out, texts, max_tokens = sys.argv[1], sys.argv[2:], 32
model = AutoModelForSequenceClassification.from_pretrained(out).double().eval()
tok = AutoTokenizer.from_pretrained(out)  # the export's own tokenizer, EOS first as the data does it
ids = [[tok.eos_token_id] + tok(t, add_special_tokens=False)["input_ids"][: max_tokens - 1] for t in texts]
width = max(map(len, ids))
mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
ids = torch.tensor([x + [0] * (width - len(x)) for x in ids])
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask).logits
torch.save({"logits": logits, "labels": [model.config.id2label[i] for i in range(model.config.num_labels)]}, "out.pt")
assert not any(name == "src" or name.startswith("src.") for name in sys.modules)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,args",
    [
        # suite time: the FSDP2 checkpoint is the harder export (a sharded dir); this one is in the full matrix
        pytest.param("1 process", [], id="1-process", marks=FULL_MATRIX_ONLY),
        pytest.param("FSDP2 on 2 ranks", ["trainer=fsdp"], id="fsdp-2-ranks"),  # a sharded checkpoint dir
    ],
)
def test_the_export_loads_in_a_clean_client_with_the_modules_logits(name, args, dirs, tmp_path):
    """Train 4 steps with GPT-2's tokenizer, export-hf, then a Python that imports transformers alone tokenizes texts
    with the exported tokenizer: its logits are the module's, in float64."""
    tokenizer = f"data.tokenizer={shared('gpt2-tokenizer')}"
    run_script(
        "train.py",
        [*SMALL, tokenizer, *args, *path_overrides(dirs), "trainer.max_steps=4", "trainer.val_check_interval=4"]
        + ["trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "trainer.enable_progress_bar=false"],
    )
    (ckpt,) = dirs["log_dir"].rglob("last.ckpt")
    out = tmp_path / "hf"
    run_script("-m", ["src.tools.checkpoints", "export-hf", str(ckpt), str(out)])
    module, dm = build_module(load_checkpoint(ckpt))
    texts = [dm.texts[i] for i in range(5)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    client = subprocess.run(
        [sys.executable, "-c", CLIENT, str(out), *texts], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert client.returncode == 0, client.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["labels"] == dm.labels
    items = [{"input_ids": torch.from_numpy(x), "labels": 0} for x in dm.tokenizer.encode(texts, 32)]
    with torch.no_grad():
        close64(got["logits"], module.double()(dm.collate_fn()(items)), f"export-hf logits ({name})")
