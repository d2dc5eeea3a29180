"""Fine-tuning real GPT-2: pretrained weights, instruction data with exact label masking, LoRA / peft, export."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, path_overrides, run_script, shared

from src.lm.data.corpus import CorpusError
from src.lm.data.instruct import ALPACA, ALPACA_NO_INPUT, InstructDataModule, encode, read_records
from src.lm.data.text import IGNORE_INDEX
from src.lm.data.tokenizers import load_tokenizer
from src.lm.models.gpt2_module import GPT2LitModule
from src.parallel.parallelize import parallelize
from src.utils.config import ConfigError
from tests.helpers.margins import close64, close_fp32_weights, within


def test_masking_is_exact_token_by_token():
    tok = load_tokenizer(str(shared("gpt2-tokenizer")))
    record = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "The sum is 5."}
    ((ids, labels),) = encode([record], tok, ALPACA, ALPACA_NO_INPUT)
    prompt = ALPACA.format(**record)
    prompt_ids = tok.encode_batch([prompt])[0].tolist()
    response_ids = tok.encode_batch(["The sum is 5."])[0].tolist()
    # labels are shifted targets: the EOS (appended) is only a target, never an input
    assert ids.tolist() == prompt_ids + response_ids
    assert labels.tolist() == [IGNORE_INDEX] * (len(prompt_ids) - 1) + response_ids + [50256]
    assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == "The sum is 5.<|endoftext|>"
    assert (labels[:-1][labels[:-1] != IGNORE_INDEX] == ids[1:][labels[:-1] != IGNORE_INDEX]).all()  # next token
    hi = {"instruction": "Say hi.", "input": "", "output": "Hi"}
    (no_input,) = encode([hi], tok, ALPACA, ALPACA_NO_INPUT)
    assert tok.decode(no_input[0].tolist()).startswith(ALPACA_NO_INPUT.format(instruction="Say hi."))
    # records encoded together (one tokenizer call) are each what it is alone, in their order
    together = encode([hi, record, hi], tok, ALPACA, ALPACA_NO_INPUT)
    for got, alone in zip(together, [no_input, (ids, labels), no_input], strict=True):
        assert [a.tolist() for a in got] == [a.tolist() for a in alone]


def test_alpaca_file_batches_and_overlong_policy(tmp_path):
    path = str(shared("alpaca", "alpaca_en_demo.json"))
    tok = str(shared("gpt2-tokenizer"))
    dm = InstructDataModule(path, tokenizer=tok, seq_len=256, global_batch_size=4)
    dm.setup()
    sizes = [len(dm.splits[s]) for s in ("train", "val", "test")]
    assert sum(sizes) == 999 and sizes[1] == sizes[2] == 50
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert ((batch["attention_mask"] == 0) <= (batch["labels"] == IGNORE_INDEX)).all()  # padding never learned
    assert max(len(ids) for ids, _ in dm.splits["train"].items) <= 256
    dropped = InstructDataModule(path, tokenizer=tok, seq_len=256, overlong="drop", global_batch_size=4)
    dropped.setup()
    assert sum(len(dropped.splits[s]) for s in ("train", "val", "test")) < 999  # long records are skipped


def test_bad_records_name_their_index(tmp_path):
    f = tmp_path / "data.json"
    f.write_text(json.dumps([{"instruction": "a", "output": "b"}, {"instruction": "c"}]))
    with pytest.raises(CorpusError, match="record 1 needs string fields"):
        read_records(str(f))
    g = tmp_path / "data.jsonl"
    g.write_text('{"instruction": "a", "output": "b"}\n{"instruction": \n')
    with pytest.raises(CorpusError, match=rf"{g}:2: malformed JSON"):
        read_records(str(g))


def test_pretrained_weights_load_and_give_the_same_logits():
    from transformers import AutoModelForCausalLM

    path = str(shared("tiny-gpt2"))
    module = GPT2LitModule(vocab_size=50257, seq_len=64, pretrained=path).eval()
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        close64(module.double()(ids).logits, reference.double()(ids).logits, "pretrained logits")
    with pytest.raises(ValueError, match="50260 tokens .* 50257: set model.resize_embeddings=true"):
        GPT2LitModule(vocab_size=50260, seq_len=64, pretrained=path)  # 3 new special tokens, no resize asked for
    bigger = GPT2LitModule(vocab_size=50260, seq_len=64, pretrained=path, resize_embeddings=True)
    assert bigger.hf_model.get_input_embeddings().weight.shape[0] == 50260
    with pytest.raises(ValueError, match="exceeds"):
        GPT2LitModule(vocab_size=50257, seq_len=2048, pretrained=path)
    with pytest.raises(ValueError, match=r"257 tokens but .* 50257: use its own tokenizer"):
        GPT2LitModule(vocab_size=257, seq_len=64, pretrained=path)  # e.g. the byte tokenizer by mistake


def test_lora_trains_only_the_adapter():
    torch.manual_seed(0)
    module = GPT2LitModule(
        vocab_size=257,
        seq_len=32,
        n_layer=2,
        n_head=2,
        n_embd=32,
        lora={"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["c_attn"]},
    )
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen_before = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        ids = torch.randint(0, 257, (4, 32))
        module(ids, ids).loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in module.named_parameters():
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), f"frozen {n} changed"
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in module.named_parameters() if "lora_B" in n)


@pytest.mark.parametrize("method", ["prefix_tuning", "prompt_tuning"])
def test_other_peft_methods_are_selectable(method, tmp_path):
    from hydra.utils import instantiate
    from test_configs import compose_cfg

    cfg = compose_cfg(
        [f"model/peft={method}", f"model.pretrained={shared('tiny-gpt2')}", "data.seq_len=64"], tmp=tmp_path
    )
    module = instantiate(cfg.model, vocab_size=50257)
    assert type(module.model).__name__ == "PeftModelForCausalLM"
    assert 0 < sum(p.numel() for p in module.parameters() if p.requires_grad) < 102_640 / 10
    ids = torch.randint(0, 50257, (2, 16))
    assert torch.isfinite(module(ids, ids).loss)


@pytest.mark.slow
def test_instruct_lora_recipe_runs_offline_and_exports(dirs):
    from test_parity import QUIET
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.checkpoint.convert import build_module, export_hf, load_checkpoint

    run_script(
        "train.py",
        QUIET
        + path_overrides(dirs)
        + [
            "experiment=gpt2_instruct_lora",
            f"model.pretrained={shared('tiny-gpt2')}",
            f"data.path={shared('alpaca', 'alpaca_en_demo.json')}",
            "data.seq_len=128",
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
            "trainer.limit_val_batches=2",
            "trainer.limit_test_batches=2",
        ],
    )
    (run,) = (dirs["log_dir"] / "train" / "runs").iterdir()
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    from safetensors.torch import load_file

    # peft names a wrapped layer's own weight ...c_attn.base_layer.weight
    base = {
        k.removeprefix("model.base_model.model.").replace(".base_layer", ""): v
        for k, v in ckpt["state_dict"].items()
        if "lora_" not in k
    }
    original = load_file(shared("tiny-gpt2", "model.safetensors"))
    for name, value in original.items():  # the frozen base weights did not move in training
        assert torch.equal(base[name], value), name
    out = export_hf(run / "checkpoints" / "last.ckpt", dirs["log_dir"] / "hf")
    assert (out / "adapter" / "adapter_config.json").is_file()  # the adapter alone, via save_pretrained
    merged = AutoModelForCausalLM.from_pretrained(out).eval()  # a plain GPT-2: LoRA merged in
    assert not any("lora" in n for n, _ in merged.named_parameters())
    module, _ = build_module(ckpt)
    ids = torch.randint(0, 50257, (1, 12))
    with torch.no_grad():
        depth = merged.config.num_hidden_layers + 1
        close_fp32_weights(merged.double()(ids).logits, module.double()(ids).logits, "merged LoRA logits", depth)
    tok = AutoTokenizer.from_pretrained(out)  # the tokenizer travels with it, and generation works
    gen = merged.generate(
        **tok("Hello", return_tensors="pt"), max_new_tokens=3, do_sample=False, pad_token_id=tok.eos_token_id
    )
    assert gen.shape[1] == 4


@pytest.mark.slow
def test_continued_pretraining_recipe_runs_offline(dirs):
    from test_parity import QUIET

    proc = run_script(
        "train.py",
        QUIET
        + path_overrides(dirs)
        + [
            "experiment=gpt2_continued_pretraining",
            f"model.pretrained={shared('tiny-gpt2')}",
            f"data.path={shared('tinyshakespeare', 'input.txt')}",
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
            "trainer.limit_val_batches=2",
            "trainer.limit_test_batches=2",
            # the recipe's pieces (pretrained weights, their own BPE) with shorter blocks: with a 50,257-token LM head
            # each of the recipe's 8 x 256 batches is 400 MB of logits
            "data.seq_len=64",
        ],
    )
    assert "val/loss = " in proc.stdout + proc.stderr


def test_special_tokens_extend_the_vocabulary_and_the_embeddings(tmp_path):
    from src.lm.data.text import TextDataModule

    (tmp_path / "c.txt").write_text("<|user|> hello <|assistant|> hi\n" * 50)
    dm = TextDataModule(
        path=str(tmp_path / "c.txt"),
        tokenizer=str(shared("gpt2-tokenizer")),
        seq_len=16,
        global_batch_size=2,
        special_tokens=["<|user|>", "<|assistant|>"],
        cache_dir=str(tmp_path),
    )
    assert dm.vocab_size == 50259
    ids = dm.tokenizer.encode_batch(["<|user|> hello"])[0].tolist()
    assert ids[0] == 50257 and len(ids) == 2  # one new id, not pieces of BPE
    with pytest.raises(
        ConfigError, match="tokenizer has 50259 tokens and .* embeddings 50257: set model.resize_embeddings=true"
    ):
        GPT2LitModule(seq_len=16, pretrained=str(shared("tiny-gpt2")), **dm.model_kwargs)
    module = GPT2LitModule(seq_len=16, pretrained=str(shared("tiny-gpt2")), resize_embeddings=True, **dm.model_kwargs)
    assert module.hf_model.get_input_embeddings().num_embeddings == 50259
    with pytest.raises(ValueError, match="byte tokenizer"):
        load_tokenizer("bytes", ["<|user|>"])


def assert_checkpointing_changes_no_numbers(build) -> None:
    """build(gradient_checkpointing) -> a module, given its switches by the composer as under DDP or one device
    (src/parallel/parallelize.py): each block runs twice (forward, then recomputed in backward) and the loss
    and gradients are the same as without."""
    ids = torch.randint(0, 257, (2, 32))
    grads = []
    for gc in (False, True):
        torch.manual_seed(0)
        module = build(gc)
        parallelize(module, **module.wrappers())
        module.train()
        calls = []
        # a part inside the first block: the recompute runs it again (the block's own hooks stay outside the
        # checkpoint in transformers >= 5.24, and a recompute stops early, before any post-hook)
        next(module.blocks()[0][2].children()).register_forward_pre_hook(lambda *_: calls.append(1))
        loss = module(ids, ids).loss
        loss.backward()
        assert len(calls) == (2 if gc else 1)
        grads.append((loss.detach(), [p.grad.clone() for p in module.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b)


def test_gradient_checkpointing_changes_memory_not_math():
    assert_checkpointing_changes_no_numbers(
        lambda gc: GPT2LitModule(vocab_size=257, seq_len=32, n_layer=2, n_head=2, n_embd=32, gradient_checkpointing=gc)
    )


# ---- debug=overfit: data.overfit_batches, sharded like any run ----


def test_overfit_batches_shards_the_same_samples_over_ranks(monkeypatch, tmp_path):
    """data.overfit_batches=2 with a global batch of 8: 16 samples, split between 2 ranks without overlap
    (Lightning's trainer.overfit_batches gives every rank the same batches), and evaluated on the same 16."""
    from pathlib import Path

    from src.lm.data.text import TextDataModule

    corpus = Path(__file__).parent / "data" / "tiny_corpus.txt"
    seen = {}
    for rank in range(2):
        monkeypatch.setattr("src.core.datamodule.rank_and_world", lambda trainer: (rank, 2))
        dm = TextDataModule(
            path=str(corpus), seq_len=32, global_batch_size=8, overfit_batches=2, cache_dir=str(tmp_path)
        )
        dm.setup("fit")
        train = dm.train_dataloader()
        assert len(train) == 2  # 16 samples / 2 ranks / micro-batch 4: an epoch is the 2 global batches
        seen[rank] = [i for batch in train.batch_sampler for i in batch]
        assert list(dm.val_dataloader().sampler) == list(range(rank, 16, 2))
        assert dm.splits["val"] is dm.splits["train"] is dm.splits["test"]
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == list(range(16))


@FULL_MATRIX_ONLY  # suite time, 10 s: debug=overfit on 2 ranks = 1 process stays (this file)
@pytest.mark.slow
def test_overfit_with_instruct_data_runs(dirs):
    """debug=overfit on instruction data: its padding collate (now a DataLoader constructor argument, the
    form Lightning uses when it rebuilds a loader) batches records of different lengths."""
    from test_parity import QUIET

    proc = run_script(
        "train.py",
        QUIET
        + path_overrides(dirs)
        + [
            "debug=overfit",
            "data=instruct",
            f"data.path={shared('alpaca', 'alpaca_en_demo.json')}",
            f"model.pretrained={shared('tiny-gpt2')}",
            "data.seq_len=128",
            "data.overfit_batches=2",
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
        ],
    )
    out = proc.stdout + proc.stderr
    assert "train, val and test are the first 16 training samples" in out and "val/loss = " in out


@pytest.mark.slow
def test_overfit_on_2_ranks_trains_as_1_process(tmp_path):
    """debug=overfit under DDP: each rank reads its half of every global batch, so 2 processes end with
    the parameters of 1 (with Lightning's overfit_batches both ranks read the same micro-batches)."""
    from test_parity import GPT2, assert_same_series, max_param_diff, train

    overfit = GPT2 + ["debug=overfit", "data.overfit_batches=2", "trainer.max_steps=6", "trainer.val_check_interval=6"]
    one = train(tmp_path, "1", overfit)
    two = train(tmp_path, "2", overfit + ["trainer=ddp", "trainer.devices=2"])
    within(max_param_diff(one["params"], two["params"]), 1e-5, "params")
    assert_same_series(one, two, "train/loss", 1e-5)
    assert_same_series(one, two, "val/loss", 1e-5)


def test_lightning_overfit_batches_is_a_clear_error(dirs):
    proc = run_script("train.py", path_overrides(dirs) + ["+trainer.overfit_batches=4"], check=False)
    assert proc.returncode != 0
    assert "trainer.overfit_batches=4 is not supported" in proc.stderr + proc.stdout
    assert "data.overfit_batches" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_logged_flops_and_tokens_per_sec_follow_the_hand_formula(dirs):
    """A real LoRA instruction run (tiny GPT-2: 1 layer, d=2, V=50257; LoRA r=8 on c_attn), 2 records a
    batch, one step per throughput reading. Each reading's FLOPs per batch and real tokens per batch give
    back the batch's two record lengths through the hand formula; they must be lengths of real records
    (padding counted would not solve), some pairs unequal (so padding was there), and MFU = FLOP/s / peak."""
    import csv
    import math

    run_script(
        "train.py",
        path_overrides(dirs)
        + [
            "extras.print_config=false",
            "trainer.enable_progress_bar=false",
            "trainer.num_sanity_val_steps=0",
            "callbacks.generate_text=null",
            "trainer.precision=32-true",
            "logger=csv",
            "test=false",
            "experiment=gpt2_instruct_lora",
            f"model.pretrained={shared('tiny-gpt2')}",
            f"data.path={shared('alpaca', 'alpaca_en_demo.json')}",
            "data.global_batch_size=2",
            "trainer.max_steps=12",
            "trainer.val_check_interval=12",
            "trainer.limit_val_batches=1",
            "trainer.log_every_n_steps=1",
            "callbacks.throughput.window_size=1",
            "callbacks.throughput.peak_flops=1e9",
        ],
    )
    d, v, r = 2, 50257, 8
    block, head, a, b = 12 * d * d, v * d, d * r, r * 3 * d
    per_token = 2 * (block + head + a + b) + 2 * ((block - 3 * d * d + b) + head) + 2 * (a + b)  # forward, dx, dW
    per_context = 12 * d  # per token per token of its record: 1 layer, its q, k, v need gradients

    tok = load_tokenizer(str(shared("tiny-gpt2")))
    records = read_records(str(shared("alpaca", "alpaca_en_demo.json")))
    lengths = {min(len(ids), 512) for ids, _ in encode(records, tok, ALPACA, ALPACA_NO_INPUT)}
    (metrics,) = dirs["log_dir"].rglob("metrics.csv")
    rows = [row for row in csv.DictReader(open(metrics)) if row.get("train/device/flops_per_sec")]
    assert len(rows) >= 8
    pairs = []
    for row in rows:
        rate = {k: float(row[f"train/device/{k}_per_sec"]) for k in ("batches", "samples", "items", "flops")}
        assert rate["samples"] / rate["batches"] == pytest.approx(2)
        s = rate["items"] / rate["batches"]  # l1 + l2, real tokens of the batch
        q = (rate["flops"] / rate["batches"] - per_token * s) / per_context  # l1² + l2²
        root = math.sqrt(max(2 * q - s * s, 0.0))
        pair = ((s + root) / 2, (s - root) / 2)
        assert all(abs(x - round(x)) < 1e-3 for x in pair), (row, pair)
        assert {round(x) for x in pair} <= lengths, (pair, sorted(lengths))
        pairs.append(pair)
        assert float(row["train/device/mfu"]) == pytest.approx(rate["flops"] / 1e9)
    assert any(round(x) != round(y) for x, y in pairs)  # batches that had padding


def test_the_mfu_peak_of_an_h200_is_its_dense_one_where_lightning_has_none(monkeypatch):
    """MFU's denominator on the GPU a device session gets: torch names it "NVIDIA H200" (SXM) or "NVIDIA H200 NVL";
    Lightning 2.6.6's table matches neither (None: no MFU) and lists the H200 with sparsity. The callback's peak is
    the dense one (bf16 989.4e12, as the H100 SXM's), TF32's for fp32 when torch allows it; other GPUs and CPUs go to
    Lightning's table. Only the name is faked here (no GPU): tests/test_gpu.py checks the logged MFU on one."""
    from lightning.fabric.utilities.throughput import get_available_flops

    from src.callbacks.throughput import available_flops, dense_peak

    assert dense_peak("NVIDIA H200", torch.bfloat16) == 989.4e12
    assert dense_peak("NVIDIA H200 NVL", torch.bfloat16) == 835.5e12
    assert dense_peak("NVIDIA H200", torch.float16) == 989.4e12
    assert dense_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) is None  # Lightning's (dense) figure stands
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert dense_peak("NVIDIA H200", torch.float32) == 494.7e12
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert dense_peak("NVIDIA H200", torch.float32) == 67e12
    assert available_flops(torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert available_flops(torch.device("cuda", 0), torch.bfloat16) == 989.4e12
    assert get_available_flops(torch.device("cuda", 0), torch.bfloat16) is None  # why ours: Lightning has none
