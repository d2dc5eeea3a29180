"""data=chat (src/lm/data/chat.py) and packing (src/lm/data/packing.py), in one process: the assistant mask
token by token against transformers' own, the EOS learned when it is also the padding, long conversations, bad
input in one sentence, and packed = padded for the loss and the gradients."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import shared

from src.core.datamodule import ignore_labels
from src.lm.data.chat import ChatDataModule, ChatTemplate, encode, read_conversations, spans
from src.lm.data.corpus import CorpusError
from src.lm.data.instruct import pad_collate
from src.lm.data.packing import PackedRows, pack, packed_collate
from src.lm.data.text import IGNORE_INDEX
from src.lm.data.tokenizers import load_tokenizer
from src.utils.config import ConfigError
from tests.helpers.chat_template import MARKED


def as_messages(path, out) -> None:
    """A ShareGPT file rewritten in OpenAI's messages layout (JSONL), tool calls as tool_calls."""
    with open(out, "w", encoding="utf-8") as f:
        for messages, tools in read_conversations(str(path), "sharegpt"):
            f.write(json.dumps({"messages": messages, "tools": tools}, ensure_ascii=False) + "\n")


def gpt2_tokenizer():
    return load_tokenizer(str(shared("gpt2-tokenizer")))


@pytest.mark.parametrize("language", ["en", "zh"])
@pytest.mark.parametrize("layout", ["sharegpt", "messages"])
def test_the_assistant_tokens_are_transformers_assistant_mask_token_by_token(tmp_path, language, layout):
    """Every conversation of the shared tool-call demo: our tokens and targets equal what transformers'
    apply_chat_template(return_assistant_tokens_mask=True) gives on the same template with generation markers."""
    path = shared("chat", f"glaive_toolcall_{language}_demo.json")
    if layout == "messages":
        as_messages(path, tmp_path / "chat.jsonl")
        path = tmp_path / "chat.jsonl"
    tokenizer = gpt2_tokenizer()
    render = ChatTemplate(tokenizer, MARKED)
    checked = 0
    for i, (messages, tools) in enumerate(read_conversations(str(path), "auto")):
        text, turns = spans(render, messages, tools, f"conversation {i}")
        ids, labels = encode(tokenizer, text, turns, "assistant")
        theirs = tokenizer.hf.apply_chat_template(
            messages, tools=tools, chat_template=MARKED, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        tokens = np.append(ids, labels[-1] if labels[-1] != IGNORE_INDEX else theirs["input_ids"][-1])
        assert tokens.tolist() == list(theirs["input_ids"]), f"conversation {i}: other tokens"
        ours = np.concatenate([[False], labels != IGNORE_INDEX])  # labels[t] is the target at position t + 1
        assert ours.tolist() == [bool(m) for m in theirs["assistant_masks"]], f"conversation {i}: other targets"
        checked += 1
    assert checked == 300


def test_each_assistant_turn_learns_its_eos_when_the_eos_is_also_the_padding():
    """GPT-2's tokenizer: the batch is padded with EOS; every assistant turn's closing EOS stays a target."""
    tokenizer = gpt2_tokenizer()
    render = ChatTemplate(tokenizer, None)  # no template of its own: chatml, each turn closed by EOS
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."},
    ]
    text, turns = spans(render, messages, None, "test")
    records = [encode(tokenizer, text, turns, "assistant"), encode(tokenizer, "x" * 40, [(0, 40)], "all")]
    batch = pad_collate(tokenizer.eos_id)(records)
    first = batch["labels"][0]
    assert (first == tokenizer.eos_id).sum() == 2  # the two assistant turns' EOS, not the user turns'
    assert tokenizer.decode(first[first != IGNORE_INDEX].tolist()) == "Hello!<|endoftext|>Goodbye.<|endoftext|>"
    # train_on=last: the final turn alone; all: every token after the first
    last = encode(tokenizer, text, turns, "last")[1]
    assert tokenizer.decode(last[last != IGNORE_INDEX].tolist()) == "Goodbye.<|endoftext|>"
    every = encode(tokenizer, text, turns, "all")[1]
    assert (every != IGNORE_INDEX).all()


def conversation(turns: int, words: int = 20) -> dict:
    """A messages record of `turns` user/assistant exchanges."""
    messages = []
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"question {t} " + "word " * words},
            {"role": "assistant", "content": f"answer {t} " + "word " * words},
        ]
    return {"messages": messages}


def datamodule(tmp_path, records, **kw) -> ChatDataModule:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    dm = ChatDataModule(str(path), global_batch_size=2, val_fraction=0, test_fraction=0, **kw)
    dm.setup("fit")
    return dm


def test_a_long_conversation_keeps_its_turns_that_fit(tmp_path):
    """overlong=turns: the longest prefix ending with an assistant turn within seq_len, never cut inside a turn;
    truncate cuts at seq_len; drop skips it; conversations without an assistant turn are skipped."""
    records = [conversation(1), conversation(6), {"messages": [{"role": "user", "content": "alone"}]}]
    one = len(datamodule(tmp_path, records[:1], seq_len=4096).splits["train"][0][0])
    dm = datamodule(tmp_path, records, seq_len=3 * one)
    kept = dm.splits["train"][1]
    text = "".join(chr(b) for b in kept[0][kept[0] < 256])
    assert len(dm.splits["train"]) == 2 and len(kept[0]) <= 3 * one
    assert "answer 1" in text and "answer 2" not in text  # two whole exchanges of six
    assert kept[1][kept[1] != IGNORE_INDEX][-1] == 256  # the last target: the kept turn's EOS
    truncated = datamodule(tmp_path, records, seq_len=3 * one, overlong="truncate").splits["train"][1]
    assert len(truncated[0]) == 3 * one
    assert len(datamodule(tmp_path, records, seq_len=3 * one, overlong="drop").splits["train"]) == 1
    with pytest.raises(CorpusError, match=r"No conversation of .* trains at data.seq_len=8 \(1 without"):
        datamodule(tmp_path, records, seq_len=8)


@pytest.mark.parametrize(
    "records, kw, message",
    [
        ([{"prompt": "x"}], {}, r"record 0 has neither layout \(keys: \['prompt'\]\)"),
        ([{"messages": [{"role": "robot", "content": "x"}]}], {}, r"record 0 turn 0 has the role 'robot'"),
        ([conversation(1)], {"chat_template": "no/such.jinja"}, r"data.chat_template='no/such.jinja' is no file"),
        (
            [conversation(1)],
            {"chat_template": "{{ messages[9].content }}"},
            r"conversation 0: the chat template failed",
        ),
        ([conversation(1)], {"train_on": "user"}, r"data.train_on='user': use one of assistant, last, all"),
        (
            [conversation(2)],  # a template that drops the earlier assistant turns from the history
            {
                "chat_template": "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}{{ m.content }}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
            },
            r"conversation 0: the chat template renders the turns before assistant turn \d differently",
        ),
    ],
)
def test_bad_chat_input_is_one_sentence_naming_it(tmp_path, records, kw, message):
    with pytest.raises((CorpusError, ConfigError), match=message):
        datamodule(tmp_path, records, **kw)


def test_a_hugging_face_dataset_trains_as_its_json_file(tmp_path):
    """data.path=hf:<name>: the rows `datasets.load_dataset` gives (here a local parquet dir, as a hub dataset
    arrives; the hub itself needs internet) become the same conversations, tokens and targets as the JSON file;
    a split the dataset lacks is one sentence."""
    datasets = pytest.importorskip("datasets", reason="needs the `datasets` package (pip install -e '.[hf]')")
    records = json.loads(shared("chat", "glaive_toolcall_en_demo.json").read_text())[:60]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(records))
    (tmp_path / "hub").mkdir()
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "hub" / "train.parquet"))
    kw = dict(tokenizer=str(shared("gpt2-tokenizer")), seq_len=2048, val_fraction=0.1, test_fraction=0.0)
    from_json, from_hub = ChatDataModule(str(path), **kw), ChatDataModule(f"hf:{tmp_path / 'hub'}", **kw)
    for dm in (from_json, from_hub):
        dm.setup("fit")
    assert len(from_json.splits["train"]) == len(from_hub.splits["train"]) == 54
    for a, b in zip(from_json.splits["train"].items, from_hub.splits["train"].items, strict=True):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    with pytest.raises(
        CorpusError, match=r"^The Hugging Face dataset .*\(split 'test'\) could not be loaded .*data.hf_split"
    ):
        ChatDataModule(f"hf:{tmp_path / 'hub'}", hf_split="test", **kw).prepare_data()


@pytest.mark.parametrize("kind", ["instruct", "preference"])
def test_instructions_and_pairs_read_from_a_hugging_face_dataset_split(tmp_path, kind):
    """data=instruct and data=preference read data.path=hf:<name> too, the split named by data.hf_split."""
    datasets = pytest.importorskip("datasets", reason="needs the `datasets` package (pip install -e '.[hf]')")
    from src.lm.data.instruct import InstructDataModule
    from src.lm.data.preference import PreferenceDataModule

    module, name = {
        "instruct": (InstructDataModule, ("alpaca", "alpaca_en_demo.json")),
        "preference": (PreferenceDataModule, ("preference", "dpo_en_demo.json")),
    }[kind]
    records = json.loads(shared(*name).read_text())[:30]
    (tmp_path / "rows.json").write_text(json.dumps(records))
    (tmp_path / "hub").mkdir()
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "hub" / "validation.parquet"))
    kw = dict(seq_len=256, val_fraction=0.0, test_fraction=0.0)
    ours, hub = module(str(tmp_path / "rows.json"), **kw), module(f"hf:{tmp_path / 'hub'}", hf_split="validation", **kw)
    for dm in (ours, hub):
        dm.setup("fit")
    assert len(ours.splits["train"]) == len(hub.splits["train"]) > 0
    for a, b in zip(ours.splits["train"].items, hub.splits["train"].items, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_packing_is_data_the_same_rows_for_any_rank_count():
    """Rows filled in order, records whole, positions restarting at each record; padding a record of its own."""
    items = [(np.arange(n), np.arange(n) + 1) for n in (5, 4, 3, 6, 2)]
    assert pack(items, 9) == [[0, 1], [2, 3], [4]]
    rows = PackedRows(items, 9)
    assert rows[0]["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert rows.target_counts().tolist() == [9, 9, 2]
    padding = ignore_labels(rows[0])  # evaluation's padding row: its labels ignored, its positions kept
    assert (padding["labels"] == IGNORE_INDEX).all() and padding["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    batch = packed_collate(99)([rows[1], rows[2]])
    assert batch["position_ids"][1].tolist() == [0, 1, 0, 1, 2, 3, 4, 5, 6] and "attention_mask" not in batch
    assert (batch["labels"][1, 2:] == IGNORE_INDEX).all() and (batch["input_ids"][1, 2:] == 99).all()


def packed_and_padded(model_type: str, device: str = "cpu", dtype: torch.dtype = torch.float64):
    """The same six real shared chats (GPT-2's tokenizer) padded (one per row, attention mask) and packed (position
    ids) through one model on `device` in `dtype`: ((summed token loss, gradients) padded, the same packed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from src.lm.objectives.loss import summed_token_loss

    tokenizer = gpt2_tokenizer()
    render = ChatTemplate(tokenizer, None)
    items = []
    for i, (messages, tools) in enumerate(
        read_conversations(str(shared("chat", "glaive_toolcall_en_demo.json")), "auto")
    ):
        text, turns = spans(render, messages, tools, str(i))
        ids, labels = encode(tokenizer, text, turns, "assistant")
        if len(ids) <= 300:
            items.append((ids, labels))
        if len(items) == 6:
            break
    # the ids renumbered into the few the six use (suite time: a 50257-wide float64 head was most of the test)
    used = np.unique(np.concatenate([ids for ids, _ in items] + [[tokenizer.eos_id]]))
    new = {int(t): i for i, t in enumerate(used)}
    items = [
        (np.array([new[int(t)] for t in ids]), np.array([new.get(int(t), IGNORE_INDEX) for t in labels]))
        for ids, labels in items
    ]
    eos, vocab = new[tokenizer.eos_id], len(used)
    sizes = {"n_layer": 2, "n_embd": 32, "n_head": 2} if model_type == "gpt2" else {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64,
    }  # fmt: skip
    config = AutoConfig.for_model(model_type, vocab_size=vocab, **sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device, dtype).eval()  # no dropout: the two draw alike

    def loss_and_grads(batch):
        model.zero_grad()
        batch = {k: v.to(device) for k, v in batch.items()}
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        loss, _ = summed_token_loss(model(**inputs, use_cache=False).logits, batch["labels"])
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    padded = loss_and_grads(pad_collate(eos)(items))
    rows = PackedRows(items, 700)
    assert len(rows) < len(items)  # packing did pack
    return padded, loss_and_grads(packed_collate(eos)([rows[i] for i in range(len(rows))]))


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_packed_rows_give_the_padded_batch_loss_and_gradients(model_type):
    """The same conversations padded and packed (`packed_and_padded`): the summed token loss and every gradient agree
    in float64."""
    padded, packed = packed_and_padded(model_type)
    assert abs(padded[0] - packed[0]) <= 1e-9 * abs(padded[0])
    assert max((a - b).abs().max().item() for a, b in zip(padded[1], packed[1])) <= 1e-9


@pytest.mark.parametrize(
    "model_type, config, refused",
    [
        ("gpt2", {"n_layer": 2, "n_embd": 32, "n_head": 2}, False),
        ("llama", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}, False),
        # OPT's forward builds its mask without transformers' packed-sequence check: packed records see each other
        ("opt", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 64,
                 "word_embed_proj_dim": 32}, True),
    ],
)  # fmt: skip
def test_a_model_that_lets_packed_records_see_each_other_is_refused_before_step_1(model_type, config, refused):
    from src.lm.features.packing import check_packing
    from src.lm.models.causal_lm import CausalLMLitModule

    module = CausalLMLitModule(vocab_size=100, seq_len=32, model_type=model_type, config=config)
    if refused:
        with pytest.raises(ConfigError, match=r"data.packing=true: opt's forward \(.* attention\) lets packed"):
            check_packing(module)
    else:
        check_packing(module)


def test_packing_under_pipeline_stages_is_one_sentence_before_any_rank_starts(tmp_path):
    """The stages pass no position ids between them: packed conversations would see each other (checked by
    src/run/checks.py on the composed config, as train.py does)."""
    from test_configs import compose_cfg

    from src.run.checks import resolve_and_check_values

    cfg = compose_cfg(
        ["data=chat", "data.packing=true", "trainer=pipeline", "trainer.devices=2", "model.n_layer=2"], tmp=tmp_path
    )
    with pytest.raises(ConfigError, match=r"^data.packing=true with trainer=pipeline: .* set data.packing=false"):
        resolve_and_check_values(cfg)
    cfg.data.packing = False
    resolve_and_check_values(cfg)  # the same config unpacked passes
