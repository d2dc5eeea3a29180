"""Preference tuning (model/objective=dpo, data=preference): the pairs, the losses against TRL's DPOTrainer and the
papers' formulas, the one-sentence errors, and (slow) N ranks equal to one process under DDP, FSDP2, ZeRO and with
the LoRA reference."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ALL, FULL_MATRIX_ONLY, shared

from src.lm.data.corpus import CorpusError
from src.lm.data.preference import PreferenceDataModule, pair_collate
from src.lm.models.gpt2_module import GPT2LitModule
from src.lm.objectives.dpo import DPO, answer_logps
from src.utils.config import ConfigError
from tests.helpers.margins import U32, close64, within

EN = "preference/dpo_en_demo.json"


def setup(dm: PreferenceDataModule) -> PreferenceDataModule:
    dm.setup("fit")
    return dm


def rows(dm: PreferenceDataModule, split: str = "train", n: int = 2) -> dict[str, torch.Tensor]:
    return pair_collate(dm.tokenizer.eos_id)([dm.splits[split][i] for i in range(n)])


# ---- the pairs ----


def test_sharegpt_pairs_mask_the_prompt_and_score_each_answer_with_its_eos():
    path = shared(*EN.split("/"))
    records = json.loads(path.read_text())
    dm = setup(
        PreferenceDataModule(str(path), seq_len=32768, max_prompt_len=16384, val_fraction=0.1, test_fraction=0.1)
    )
    assert sum(len(s) for s in dm.splits.values()) == 300 and dm.counts["prompt_cut"] == dm.counts["answer_cut"] == 0
    multi = next(i for i, r in enumerate(records) if len(r["conversations"]) == 5)  # human, gpt, human, gpt, human
    _, c_ids, c_labels, r_ids, r_labels = dm.splits["train"][multi]
    prompt_len = int(np.argmax(c_labels != -100)) + 1  # the first target is the answer's first token
    prompt = bytes(c_ids[:prompt_len].astype(np.uint8)).decode()
    for turn in records[multi]["conversations"]:  # every earlier turn is in the prompt, named by its role
        assert turn["value"] in prompt
    assert prompt.count("\n\nassistant: ") == 2 and prompt.startswith("Below is an instruction")
    chosen = records[multi]["chosen"]["value"].encode()
    assert bytes(c_labels[prompt_len - 1 : -1].astype(np.uint8)) == chosen and c_labels[-1] == dm.tokenizer.eos_id
    assert bytes(r_labels[prompt_len - 1 : -1].astype(np.uint8)) == records[multi]["rejected"]["value"].encode()
    assert np.array_equal(c_ids[:prompt_len], r_ids[:prompt_len])  # one prompt, two answers
    batch = rows(dm, n=3)  # 2B rows: the 3 chosen, then the 3 rejected; right-padded under a mask
    assert batch["input_ids"].shape[0] == 6 and batch["pair_index"].tolist() == [0, 1, 2]
    longest = max(len(dm.splits["train"][i][k]) for i in range(3) for k in (1, 3))
    assert batch["input_ids"].shape[1] == longest and batch["attention_mask"].sum() == sum(
        len(dm.splits["train"][i][k]) for k in (1, 3) for i in range(3)
    )
    assert torch.equal(
        batch["labels"][3, : len(r_labels if multi == 0 else dm.splits["train"][0][4])],
        torch.from_numpy(dm.splits["train"][0][4]),
    )


def test_plain_and_chat_records_and_the_tokenizers_chat_template(tmp_path):
    records = [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
        {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "chosen": {"role": "assistant", "content": "Hello"},
            "rejected": [{"role": "assistant", "content": "Go"}],
        },
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records * 10) + "\n")
    dm = setup(PreferenceDataModule(str(data), seq_len=256, val_fraction=0.1, test_fraction=0.1))
    item = dm.splits["train"][0]
    assert bytes(item[1].astype(np.uint8)).decode() == "2+2=4"  # a plain prompt is used as it is
    second = bytes(dm.splits["train"][1][1].astype(np.uint8)).decode()
    assert second.endswith(
        "system: Be brief.\n\nuser: Hi\n\n### Response:\nHello"
    )  # no chat template: the instruct one
    # a tokenizer with a chat template renders the conversation with it, the answer as the template closes it
    tok = tmp_path / "tok"
    shutil.copytree(shared("gpt2-tokenizer"), tok)
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|endoftext|>"}))
    dm = setup(PreferenceDataModule(str(data), tokenizer=str(tok), seq_len=256, val_fraction=0.1, test_fraction=0.1))
    _, ids, labels, _, r_labels = dm.splits["train"][1]
    hf = dm.tokenizer.hf
    assert hf.decode(ids) == "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>Hello<|end|>"
    assert hf.decode(labels[labels != -100]) == "Hello<|end|><|endoftext|>"
    assert hf.decode(r_labels[r_labels != -100]) == "Go<|end|><|endoftext|>"


def test_long_pairs_lose_the_prompts_start_first_then_the_answers_end(tmp_path):
    data = tmp_path / "pairs.json"
    data.write_text(
        json.dumps(
            [
                {"prompt": "P" * 30 + "Q" * 10, "chosen": "c" * 12, "rejected": "r" * 4},
                {"prompt": "p" * 30, "chosen": "C" * 40, "rejected": "R"},
            ]
            * 5
        )
    )
    dm = setup(PreferenceDataModule(str(data), seq_len=31, max_prompt_len=8, val_fraction=0.2, test_fraction=0.2))
    (_, c_ids, c_labels, r_ids, _), (_, long_ids, long_labels, _, _) = dm.splits["train"][0], dm.splits["train"][1]
    text = bytes(c_ids.astype(np.uint8)).decode()
    assert text == "P" * 9 + "Q" * 10 + "c" * 12 and len(c_ids) == 31  # prompt cut from the left only: answers whole
    assert c_labels[-1] == 256 and bytes(r_ids.astype(np.uint8)).decode().endswith("Q" * 10 + "r" * 4)
    long = bytes(long_ids.astype(np.uint8)).decode()
    assert long == "p" * 8 + "C" * 23 and long_labels[-1] != 256  # prompt down to max_prompt_len, then the answer cut
    assert dm.counts == {"pairs": 10, "prompt_cut": 10, "answer_cut": 5, "dropped": 0, "identical": 0}
    dropped = setup(PreferenceDataModule(str(data), seq_len=56, overlong="drop", val_fraction=0.2, test_fraction=0.2))
    assert dropped.counts["dropped"] == 5 and sum(len(s) for s in dropped.splits.values()) == 5


def test_bad_records_are_one_sentence_each(tmp_path, caplog):
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}]))
    with pytest.raises(CorpusError, match=r"missing.json: record 1 has no 'rejected' answer"):
        PreferenceDataModule(str(missing)).prepare_data()
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n\n{"prompt": "a", "chosen": \n')
    with pytest.raises(CorpusError, match=r"broken.jsonl:3: malformed JSON"):
        PreferenceDataModule(str(broken)).prepare_data()
    turn = tmp_path / "turn.json"
    turn.write_text(json.dumps([{"conversations": [{"from": "robot", "value": "x"}], "chosen": "a", "rejected": "b"}]))
    with pytest.raises(CorpusError, match=r"record 0: .*robot.* is not a turn"):
        PreferenceDataModule(str(turn)).prepare_data()
    same = tmp_path / "same.json"
    same.write_text(
        json.dumps(
            [{"prompt": "q", "chosen": "a", "rejected": "a"}] + [{"prompt": "q", "chosen": "a", "rejected": "b"}] * 9
        )
    )
    with caplog.at_level(logging.WARNING):
        dm = setup(PreferenceDataModule(str(same), val_fraction=0.1, test_fraction=0.1))
    assert dm.counts["identical"] == 1 and "1 pair(s) have the same chosen and rejected answer" in caplog.text
    with pytest.raises(ConfigError, match="max_prompt_len=64 leaves no room"):
        PreferenceDataModule(str(same), seq_len=64, max_prompt_len=64)


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["model/objective=dpo"], r"model/objective=dpo trains on pairs, but data is TextDataModule, which holds tok"),
        (["data=instruct", "model/objective=dpo"], "but data is InstructDataModule, which holds tokens: use data=pref"),
        (["data=preference"], "model/objective=sft trains on tokens, but data is PreferenceDataModule, which holds pa"),
        (["data=preference", "model/objective=dpo", "trainer=pipeline"], "does not run under trainer=pipeline"),
    ],
)
def test_objective_and_data_must_agree(overrides, words):
    from test_configs import compose_cfg

    from src.run.checks import resolve_and_check_values

    with pytest.raises(ConfigError, match=words):
        resolve_and_check_values(compose_cfg(overrides))


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"beta": 0}, r"model.objective.beta=0 is not valid"),
        ({"beta": -0.1}, r"beta=-0.1 is not valid"),
        ({"loss_type": "kto"}, "use one of sigmoid, hinge, ipo"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing applies to loss_type=sigmoid only"),
        ({"label_smoothing": 0.5}, r"label_smoothing=0.5: use a probability in \[0, 0.5\)"),
    ],
)
def test_dpo_settings_are_checked(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        DPO(**kwargs)


# ---- the loss: TRL's DPOTrainer, and the papers' formulas, as oracles ----


def tiny_pairs(tokenizer, n: int = 4, data: str = EN) -> list[dict[str, list[int]]]:
    """n pairs of the English demo's prompts and answers as GPT-2 token ids (prompt cut to 24, answers to 12 + EOS)."""
    records = json.loads(shared(*data.split("/")).read_text())[:n]
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return [
        {
            "prompt_ids": ids(r["conversations"][-1]["value"])[-24:],
            "chosen_ids": ids(r["chosen"]["value"])[:12] + [tokenizer.eos_token_id],
            "rejected_ids": ids(r["rejected"]["value"])[: 5 + 2 * i] + [tokenizer.eos_token_id],
        }
        for i, r in enumerate(records)
    ]


def our_batch(pairs: list[dict], sequence=None) -> dict[str, torch.Tensor]:
    from src.lm.data.preference import sequence as masked

    sequence = sequence or masked
    items = [
        (
            i,
            *sequence(np.array(p["prompt_ids"]), np.array(p["chosen_ids"])),
            *sequence(np.array(p["prompt_ids"]), np.array(p["rejected_ids"])),
        )
        for i, p in enumerate(pairs)
    ]
    return pair_collate(50256)(items)


def unmasked_sequence(prompt: np.ndarray, answer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A planted mistake: the prompt's tokens left as targets (no -100)."""
    tokens = np.concatenate([prompt, answer]).astype(np.int64)
    return tokens[:-1], tokens[1:].copy()


def perturbed_policy(seed: int = 0, **dpo) -> GPT2LitModule:
    """The tiny pretrained GPT-2 as policy, its reference the pretrained weights; the policy's weights then moved,
    so the log-ratios (and so each loss type's shape) are far from zero. In float64, policy and reference."""
    module = GPT2LitModule(vocab_size=50257, seq_len=64, pretrained=str(shared("tiny-gpt2")), objective=DPO(**dpo))
    return moved(module, seed, 0.5)


def moved(module: GPT2LitModule, seed: int, scale: float) -> GPT2LitModule:
    """`module` in float64 with each of its trained model's weights moved by scale x N(0, 1) (its reference, if
    any, stays at the starting weights); in training mode."""
    module.double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale)
    return module.train()


def mean_loss_and_grads(module: GPT2LitModule, batch: dict, mean: bool = True) -> tuple[torch.Tensor, dict]:
    sums, pairs = module.objective.pair_sums(module, batch)
    loss = sums[0] / pairs if mean else sums[0]  # mean=False: a planted mistake
    module.model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.model.named_parameters()}


def trls_loss_and_grads(loss_type: str, beta: float, policy: dict, pairs: list[dict], tmp_path) -> tuple:
    """TRL's DPOTrainer.compute_loss and its gradients, the models in float64, on the same ids as ours."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tokenizer = AutoTokenizer.from_pretrained(shared("tiny-gpt2"))
    model = AutoModelForCausalLM.from_pretrained(shared("tiny-gpt2"), dtype=torch.float64)
    model.load_state_dict(policy)
    reference = AutoModelForCausalLM.from_pretrained(shared("tiny-gpt2"), dtype=torch.float64)
    args = DPOConfig(
        output_dir=str(tmp_path),
        beta=beta,
        loss_type=[loss_type],
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=len(pairs),
    )
    texts = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])  # DPOTrainer wants one; unused
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=texts, processing_class=tokenizer)
    trainer.model.train()
    assert next(trainer.model.parameters()).dtype == torch.float64  # the Trainer did not cast it
    loss = trainer.compute_loss(trainer.model, DataCollatorForPreference(pad_token_id=tokenizer.eos_token_id)(pairs))
    loss.backward()
    return loss.detach().double(), {n: p.grad for n, p in trainer.model.named_parameters()}


def worst_relative_difference(ours: tuple, theirs: tuple) -> float:
    """The largest of |Δ loss| / |loss| and, per gradient tensor, max |Δ g| / max |g|, that max floored at 1e-9 of
    the largest gradient entry (a tensor the loss leaves without gradient, as a reward model's final-norm bias, is
    then compared with the others' scale). Gradients named as in the HF model on both sides ("model." dropped)."""
    (loss, grads), (their_loss, their_grads) = ours, theirs
    grads, their_grads = ({n.removeprefix("model."): g for n, g in d.items()} for d in (grads, their_grads))
    assert grads.keys() == their_grads.keys()
    floor = 1e-9 * max(g.abs().max().item() for g in their_grads.values())
    worst = abs(loss.item() - their_loss.item()) / abs(their_loss.item())
    for name, g in their_grads.items():
        worst = max(worst, (grads[name] - g).abs().max().item() / max(g.abs().max().item(), floor))
    return worst


@pytest.mark.parametrize(  # suite time: ipo and hinge on the English pairs in the full matrix
    "loss_type,data",
    [
        ("sigmoid", EN),
        pytest.param("ipo", EN, marks=FULL_MATRIX_ONLY),
        pytest.param("hinge", EN, marks=FULL_MATRIX_ONLY),
        ("ipo", "preference/dpo_zh_demo.json"),
    ],
)
def test_loss_and_gradients_equal_trls_dpo_trainer(loss_type, data, tmp_path):
    """Our DPO loss and its gradients against TRL's DPOTrainer, both models in float64 on the same ids.

    The tolerance, derived. With float64 models the only fp32 arithmetic left is TRL's chunked log-prob kernel
    (trl/kernels/chunked_logprob.py), which keeps each token's log-sum-exp log z in fp32 whatever the input dtype.
    log z rounded to fp32 is off by up to U32 |log z| <= U32 L (L: the largest |log z| of the batch, ~12 here);
    each token's log-prob z_t - log z and each softmax probability exp(z - log z) of its backward inherit that, a
    few U32 L relative (the exp and the online rescaling add units of U32, not of L). Everything after is float64:
    sums over each answer's tokens, the log-ratios (the policy is moved far from its reference, so they are no small
    difference of large numbers) and the backward, which is linear in those probabilities. So the loss differs by a
    few U32 L of its size; a gradient entry can differ by more of its tensor's largest entry where it sums many
    tokens' contributions that cancel (tiny GPT-2's ln_f.bias: 2 entries, each a sum over every token and class).
    The test allows 128 U32 L (9.1e-5 here) of |loss| and of each tensor's largest gradient. Seen on a Xeon with
    ATen's default, AVX2 and AVX-512 kernels, one thread or two: at most 4.2 U32 L on the English pairs and 10.2 U32
    L on the Chinese ones (ln_f.bias under ipo); on a Zen 4 EPYC (AVX512-BF16) 45 U32 L on the Chinese pairs under
    ipo, in every tensor of the first block alike (their gradients, ~1e-6, are 4e-5 of the embedding's: what reaches
    them has cancelled), a ratio of 0.35; in fp32 the same comparison differed 65 times more, CPU-dependent. The
    comparison still tells our mistakes apart: a β 1 % off, the padding or (ipo) the prompt's tokens left as targets,
    the pairs' losses summed instead of averaged each exceed it (asserted below)."""
    from transformers import AutoTokenizer

    pairs = tiny_pairs(AutoTokenizer.from_pretrained(shared("tiny-gpt2")), data=data)
    batch = our_batch(pairs)
    beta = 0.5 if loss_type == "ipo" else 0.1
    ours = perturbed_policy(beta=beta, loss_type=loss_type)
    with torch.no_grad():
        logits = ours.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert logits.dtype == torch.float64
    tol = 128 * U32 * logits.logsumexp(-1).abs().max().item()
    theirs = trls_loss_and_grads(loss_type, beta, ours.model.state_dict(), pairs, tmp_path)
    loss_and_grads = mean_loss_and_grads(ours, batch)
    assert loss_and_grads[0].dtype == torch.float64
    within(worst_relative_difference(loss_and_grads, theirs), tol, f"dpo {loss_type} vs TRL, relative")
    assert abs(loss_and_grads[0].item() - {"sigmoid": np.log(2), "ipo": 1.0, "hinge": 1.0}[loss_type]) > 1e-2
    padding_as_targets = {**batch, "labels": batch["labels"].where(batch["attention_mask"].bool(), 50256)}
    planted = {
        "beta 1% off": mean_loss_and_grads(perturbed_policy(beta=beta * 1.01, loss_type=loss_type), batch),
        "padding not masked": mean_loss_and_grads(ours, padding_as_targets),
        "sum over pairs": mean_loss_and_grads(ours, batch, mean=False),
    }
    if loss_type == "ipo":  # sigmoid and hinge see only h, where a prompt's log-probs cancel: the same loss exactly
        planted["prompt not masked"] = mean_loss_and_grads(ours, our_batch(pairs, unmasked_sequence))
    for mistake, wrong in planted.items():
        assert worst_relative_difference(wrong, theirs) > tol, mistake


def test_conservative_dpo_and_rpo_follow_their_formulas():
    """cDPO (label_smoothing ε) and RPO (sft_weight α) against the papers' formulas, computed here from
    transformers' own logits: -(1-ε) log σ(βh) - ε log σ(-βh) - α log π(c)/|c|, averaged over pairs; float64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pairs = tiny_pairs(AutoTokenizer.from_pretrained(shared("tiny-gpt2")))
    batch = our_batch(pairs)
    beta, eps, alpha = 0.2, 0.1, 0.7
    ours = perturbed_policy(seed=1, beta=beta, label_smoothing=eps, sft_weight=alpha)
    loss, _ = mean_loss_and_grads(ours, batch)
    reference = AutoModelForCausalLM.from_pretrained(shared("tiny-gpt2"), dtype=torch.float64).eval()

    def logps(model) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        lp = torch.log_softmax(logits, -1)
        mask = batch["labels"] != -100
        picked = lp.gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0] * mask
        return picked.sum(1), mask.sum(1)

    with torch.no_grad():
        (pi, n), (ref, _) = logps(ours.model.eval()), logps(reference)
    B = len(pairs)
    h = (pi[:B] - ref[:B]) - (pi[B:] - ref[B:])
    expected = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h) - alpha * pi[:B] / n[:B]
    close64(loss, expected.mean(), "cDPO + RPO vs formula")
    assert answer_logps(torch.zeros(1, 3, 5), torch.tensor([[-100, 1, 2]]))[1].item() == 2


def test_precomputed_reference_log_probs_refuse_other_pairs():
    """A table from a checkpoint belongs to the pairs it was computed on: other pairs are one sentence."""
    dm = setup(PreferenceDataModule(str(shared(*EN.split("/"))), seq_len=64, max_prompt_len=32))
    dpo = DPO(precompute_reference=True)
    dpo.load_state({"table": torch.zeros(300, 2), "fingerprint": "not these pairs"})
    with pytest.raises(ConfigError, match="computed on other preference pairs than this run reads"):
        dpo.precompute_table(None, dm)


# ---- N ranks == 1 process (slow): losses at every step, every statistic, final weights within 1e-5 (fp32) ----

GPT2_SHAPE = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2"]


def dpo_run_args(shape: list[str] = GPT2_SHAPE) -> list[str]:
    return [
        "data=preference",
        "model/objective=dpo",
        f"data.path={shared(*EN.split('/'))}",
        "data.seq_len=48",
        "data.max_prompt_len=24",
        *shape,
        "data.global_batch_size=8",
        "trainer.max_steps=5",
        "trainer.val_check_interval=5",
        "test=false",
        "model.scheduler.num_warmup_steps=2",
        "model.optimizer.lr=3e-3",
    ]


CPU_DS = [
    "trainer=deepspeed",
    "trainer.strategy._target_=tests.helpers.deepspeed_cpu.CPUDeepSpeedStrategy",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
]
LORA = ["model.lora.enabled=true", "model.lora.dropout=0.0", "model.lora.target_modules=[c_attn,c_fc]"]
LLAMA = [
    "model=llama",
    "model.config.hidden_size=32",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "model.config.intermediate_size=64",
]
CASES = {  # name: (args, whether the run holds the LoRA adapter, whether its checkpoint is a sharded dir)
    "ddp_2x4": (["trainer=ddp", "trainer.devices=2"], False, False),
    "llama_fsdp_2": (["trainer=fsdp", "trainer.devices=2"], False, True),  # GQA, untied head, RoPE
    # val_check_interval counts micro-batches: 10 of them are the 5 steps
    "1x4_accumulate_2": (["trainer.accumulate_grad_batches=2", "trainer.val_check_interval=10"], False, False),
    "fsdp_2": (["trainer=fsdp", "trainer.devices=2"], False, True),
    "zero2_2": (CPU_DS + ["trainer.strategy.stage=2"], False, True),
    "zero3_2": (CPU_DS + ["trainer.strategy.stage=3"], False, True),
    "lora_reference_ddp_2x4": (LORA + ["trainer=ddp", "trainer.devices=2"], True, False),
    "precomputed_reference_ddp_2x4": (
        ["model.objective.precompute_reference=true", "trainer=ddp", "trainer.devices=2"],
        False,
        False,
    ),
}
STATS_LOGGED = [
    "train/loss",
    "train/rewards/chosen",
    "train/rewards/rejected",
    "train/rewards/margins",
    "train/rewards/accuracies",
    "train/logps/chosen",
    "train/logps/rejected",
    "val/loss",
    "val/rewards/chosen",
    "val/rewards/rejected",
    "val/rewards/margins",
    "val/rewards/accuracies",
    "val/logps/chosen",
    "val/logps/rejected",
]


@pytest.mark.slow
@pytest.mark.parametrize(  # suite time: ZeRO-2, ZeRO-3 and Llama in the full matrix; GPT-2 under FSDP2 stays
    "case",
    [pytest.param(c, marks=[FULL_MATRIX_ONLY] if c in ("zero2_2", "zero3_2", "llama_fsdp_2") else []) for c in CASES],
)
def test_n_ranks_match_one_process(tmp_path, reference, case):
    """The 1 x 8 run (a frozen copy of the starting weights as reference; with LoRA, the model without its adapter)
    against 2 x 4 under DDP, FSDP2, ZeRO-2/3 (the reference sharded like the policy), 1 x 4 x accumulation 2, and
    the table precomputed on 2 ranks. Validation: 15 pairs over 2 ranks, one rank padded."""
    from test_fsdp import last_ckpt, train_sharded
    from test_parity import assert_same_series, max_param_diff, train

    from src.checkpoint.convert import load_checkpoint

    args, lora, sharded = CASES[case]
    shape = LLAMA if "llama" in case else GPT2_SHAPE
    one = reference(dpo_run_args(shape) + (LORA if lora else []))
    run = (train_sharded if sharded else train)(tmp_path, case, dpo_run_args(shape) + args)
    params = load_checkpoint(last_ckpt(tmp_path, case))["state_dict"] if sharded else run["params"]
    for tag in STATS_LOGGED:  # log-probs are sums of ~40 tokens' (about -130): 1e-4 is 1e-6 of them, one fp32 ulp
        assert_same_series(one, run, tag, 1e-4 if "logps" in tag else 1e-5)
    assert len(run["scalars"]["train/loss"]) == 5
    reference_weights = {k for k in one["params"] if k.startswith("reference.")}
    if "precomputed" in case or lora:  # one model only: no copy of it in the checkpoint
        assert not {k for k in params if k.startswith("reference.")}
        one_params = {k: v for k, v in one["params"].items() if k not in reference_weights}
    else:
        assert reference_weights and all(torch.equal(one["params"][k], params[k]) for k in reference_weights)
        one_params = one["params"]
    within(max_param_diff(one_params, params), 1e-5, "params")
    assert one["scalars"]["train/rewards/margins"][-1][1] != 0  # the policy moved away from its reference
    if "llama" in case:  # the policy exports like any checkpoint (the reference stays behind)
        from transformers import AutoModelForCausalLM

        from src.checkpoint.convert import export_hf

        exported = AutoModelForCausalLM.from_pretrained(export_hf(last_ckpt(tmp_path, case), tmp_path / "hf"))
        for name, value in exported.state_dict().items():
            torch.testing.assert_close(value, params[f"model.{name}"], rtol=0, atol=0)


@pytest.mark.slow
@FULL_MATRIX_ONLY  # suite time: the parity cases and TRL's loss as the oracle stay
def test_dpo_learns_to_prefer_the_chosen_answers_of_8_pairs(tmp_path):
    """experiment=gpt2_dpo as docs/fine-tuning.md runs it offline, overfitting 2 batches of 4 pairs: the policy starts as its
    reference (margin 0), then every pair's chosen answer gets the higher reward, and the samples callback still
    samples the policy."""
    from conftest import path_overrides, read_events, run_script
    from test_parity import QUIET

    quiet = [a for a in QUIET if not a.startswith("callbacks.generate_text")]
    run_script(
        "train.py",
        quiet
        + path_overrides({"log_dir": tmp_path, "cache_dir": tmp_path / "cache"})
        + [
            "experiment=gpt2_dpo",
            f"model.pretrained={shared('tiny-gpt2')}",
            f"data.path={shared(*EN.split('/'))}",
            "data.seq_len=64",
            "data.global_batch_size=4",  # 8 pairs: the 50257-token logits of 16 rows cost half the test's time
            "data.overfit_batches=2",
            "model.optimizer.lr=1e-2",
            "model.scheduler.num_warmup_steps=2",
            "trainer.max_steps=12",
            "trainer.val_check_interval=12",
            "test=false",
            "callbacks.generate_text.max_new_tokens=4",
        ],
    )
    (run,) = (tmp_path / "train" / "runs").iterdir()
    events = read_events(run / "tensorboard")
    margins = [e.value for e in events.Scalars("train/rewards/margins")]
    assert margins[0] == 0 and margins[-1] > 0.2 and margins[-1] > margins[len(margins) // 2] > 0  # 0.34 here
    assert events.Scalars("train/rewards/accuracies")[-1].value == 1.0
    assert events.Scalars("val/rewards/accuracies")[-1].value == 1.0  # the same 8 pairs (data.overfit_batches)
    assert any(tag.startswith("samples/") for tag in events.Tags()["tensors"])


# ---- SFT -> DPO: model.pretrained takes a checkpoint of this template, in any of its forms ----


@pytest.mark.slow
@FULL_MATRIX_ONLY  # suite time: DPO from a pretrained dir stays in the suite
def test_dpo_starts_from_the_weights_of_an_instruction_tuning_checkpoint(tmp_path):
    """Instruction tuning under FSDP2 (a DCP dir) and ZeRO-2 (a ZeRO dir), 2 steps each; then DPO with
    model.pretrained=<that checkpoint>, and =<its consolidated .ckpt file>: the policy and its reference start
    from the checkpoint's weights (not its optimizer or step), and the first step's rewards are 0. The ZeRO-2 dir
    form runs in the full matrix (TEST_ALL_ARCHITECTURES=1; suite time)."""
    from conftest import path_overrides, read_events, run_script
    from hydra.utils import instantiate
    from test_configs import compose_cfg
    from test_fsdp import last_ckpt
    from test_parity import QUIET

    from src.checkpoint.convert import consolidate, is_dcp, is_deepspeed, load_checkpoint
    from src.run.job import check_export_and_seed

    shape = GPT2_SHAPE
    sft = [
        "data=instruct",
        f"data.path={shared('alpaca', 'alpaca_en_demo.json')}",
        "trainer.max_steps=2",
        "data.seq_len=384",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "test=false",
        *shape,
    ]
    forms = {"fsdp": ["trainer=fsdp", "trainer.devices=2"]} | (
        {"zero2": CPU_DS + ["trainer.strategy.stage=2"]} if ALL else {}
    )
    for name, strategy in forms.items():
        run_script(
            "train.py",
            QUIET + path_overrides({"log_dir": tmp_path / name, "cache_dir": tmp_path / "cache"}) + sft + strategy,
        )
    dcp, zeros = last_ckpt(tmp_path, "fsdp"), [last_ckpt(tmp_path, "zero2")] if ALL else []
    assert is_dcp(dcp) and all(is_deepspeed(zero) for zero in zeros)
    dpo = (
        dpo_run_args()[:3]
        + shape
        + [
            "data.seq_len=48",
            "data.max_prompt_len=24",
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            "test=false",
            "model.optimizer.lr=3e-3",
            "model.scheduler.num_warmup_steps=1",
        ]
    )

    run_script(
        "train.py",
        QUIET
        + path_overrides({"log_dir": tmp_path / "dpo", "cache_dir": tmp_path / "cache"})
        + dpo
        + [f"model.pretrained={dcp}"],
    )
    sft_weights = load_checkpoint(dcp)["state_dict"]
    ours = load_checkpoint(last_ckpt(tmp_path, "dpo"))
    for key, value in sft_weights.items():  # the reference is the SFT policy, unchanged
        torch.testing.assert_close(ours["state_dict"][key.replace("model.", "reference.", 1)], value, rtol=0, atol=0)
    assert ours["global_step"] == 3  # counted from 0, not from the SFT run's step
    (events,) = (tmp_path / "dpo" / "train" / "runs").iterdir()
    logged = read_events(events / "tensorboard")
    rewards = logged.Scalars("train/rewards/margins")
    assert rewards[0].value == 0 and rewards[-1].value != 0  # step 1: policy == reference; then it moves
    # eval.py on 2 ranks reports the preference metrics of the checkpoint; its val/loss is the run's own
    from test_eval import evaluate

    metrics, _ = evaluate(tmp_path, last_ckpt(tmp_path, "dpo"), ["trainer=ddp", "trainer.devices=2"])
    assert {"val/rewards/accuracies", "test/rewards/margins", "test/logps/rejected"} <= metrics.keys()
    # 1 process in training, 2 ranks here: other batch shapes, so fp32 log-prob sums (~-130) differ by up to ~1e-4,
    # and the loss -log sigmoid(beta * margin) by beta/2 x the margin's 4 of them: 2e-5 (1.4e-5 seen on an EPYC)
    assert abs(metrics["val/loss"] - logged.Scalars("val/loss")[-1].value) <= 1e-4

    for source in [consolidate(dcp, tmp_path / "sft.ckpt"), *zeros]:  # the file form and the ZeRO dir
        cfg = compose_cfg(dpo + [f"model.pretrained={source}", f"paths.cache_dir={tmp_path / 'cache'}"], tmp=tmp_path)
        check_export_and_seed(cfg)
        assert cfg.data.tokenizer == "bytes"  # the checkpoint's own tokenizer, not the export dir
        datamodule = instantiate(cfg.data)
        module = instantiate(cfg.model, **datamodule.model_kwargs)
        expected = load_checkpoint(source)["state_dict"]
        for name, value in module.model.state_dict().items():
            torch.testing.assert_close(value, expected[f"model.{name}"], rtol=0, atol=0, msg=name)


def precompute_one_step(tmp_path, **data) -> tuple:
    """One training step of a 1-layer GPT-2 (SGD at lr 0) with the reference table precomputed on `data`'s splits:
    (the datamodule, the module)."""
    import functools

    import lightning as L

    dm = PreferenceDataModule(str(shared(*EN.split("/"))), seq_len=48, max_prompt_len=24, **data)
    module = GPT2LitModule(
        vocab_size=257,
        seq_len=48,
        n_layer=1,
        n_head=2,
        n_embd=16,
        objective=DPO(precompute_reference=True),
        optimizer=functools.partial(torch.optim.SGD, lr=0.0),
    )
    L.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        accelerator="cpu",
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=tmp_path,
    ).fit(module, datamodule=dm)
    return dm, module


def test_precomputed_reference_when_overfitting_a_few_batches(tmp_path):
    """data.overfit_batches=2: the splits are a Subset of the training pairs, which keep their numbers in the table."""
    dm, module = precompute_one_step(tmp_path, global_batch_size=8, overfit_batches=2)
    numbers = sorted(dm.splits["train"][i][0] for i in range(16))
    assert (module.objective.table < 0).all(dim=1).nonzero().flatten().tolist() == numbers  # those 16 pairs, no others


def test_precomputed_reference_with_no_validation_split(tmp_path):
    """data.val_fraction=0 and test_fraction=0: the table covers the training pairs (an empty split is skipped)."""
    _, module = precompute_one_step(tmp_path, val_fraction=0, test_fraction=0)
    assert (
        module.objective.table.shape == (300, 2) and (module.objective.table < 0).all()
    )  # every pair's log-probs, once


def test_a_checkpoint_from_before_objectives_were_a_config_group_builds_its_dpo_model(tmp_path):
    """A checkpoint stored `model.objective: dpo` and `model.dpo: {...}` (before objectives were a config group): eval.py, export-hf and
    SFT -> DPO read its config as `model.objective: {_target_: ...DPO, ...}`, with its settings."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from test_configs import compose_cfg

    from src.checkpoint.convert import read_config

    cfg = compose_cfg(["experiment=gpt2_dpo", "model.pretrained=null", *GPT2_SHAPE, "model.objective.beta=0.3"])
    stored = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("model", "data")}
    settings = {k: v for k, v in stored["model"].pop("objective").items() if k != "_target_"}
    stored["model"] |= {"objective": "dpo", "dpo": settings}  # as train.py stored it before
    torch.save({"config": stored}, tmp_path / "old.ckpt")
    module = instantiate(OmegaConf.create(read_config(tmp_path / "old.ckpt")).model, vocab_size=257)
    assert isinstance(module.objective, DPO) and module.objective.beta == 0.3 and module.reference is not None


def test_a_checkpoint_from_before_src_objectives_builds_its_objective_and_rewards(tmp_path):
    """A stored config names its objective and reward functions where they lived before src/lm/objectives/
    (`src.models.grpo.GRPO`, `src.models.verifiers.exact_match`): read back, they are named where they are now and
    the model builds with them."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from test_configs import compose_cfg

    from src.checkpoint.convert import read_config
    from src.lm.objectives.grpo import GRPO

    cfg = compose_cfg(["model/objective=grpo", "data=prompts", "model.pretrained=null", *GPT2_SHAPE])
    stored = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("model", "data")}
    stored = OmegaConf.to_container(
        OmegaConf.create(OmegaConf.to_yaml(stored).replace("src.lm.objectives.", "src.models."))
    )  # as train.py stored it before
    assert stored["model"]["objective"]["_target_"] == "src.models.grpo.GRPO"
    torch.save({"config": stored}, tmp_path / "old.ckpt")
    config = read_config(tmp_path / "old.ckpt")
    assert "src.models.grpo" not in str(config) and "src.models.verifiers" not in str(config)
    module = instantiate(OmegaConf.create(config).model, vocab_size=257)
    assert isinstance(module.objective, GRPO)


def test_a_checkpoint_from_before_src_lm_builds_its_model_and_data(tmp_path):
    """A stored config names its model, data and objective where they lived before src/lm/ (`src.models.gpt2`,
    `src.datamodules.text`, `src.objectives.sft`): read back, they are named where they are now and build."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from test_configs import compose_cfg

    from src.checkpoint.convert import read_config
    from src.lm.models.gpt2_module import GPT2LitModule

    cfg = compose_cfg(["model.pretrained=null", *GPT2_SHAPE])
    stored = OmegaConf.to_yaml({key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("model", "data")})
    for new, old in [("src.lm.models.gpt2_module.", "src.models.gpt2."), ("src.lm.data.", "src.datamodules.")]:
        stored = stored.replace(new, old)
    stored = OmegaConf.to_container(OmegaConf.create(stored.replace("src.lm.objectives.", "src.objectives.")))
    assert stored["model"]["_target_"] == "src.models.gpt2.GPT2LitModule"  # as train.py stored it before
    assert stored["data"]["_target_"] == "src.datamodules.text.TextDataModule"
    torch.save({"config": stored}, tmp_path / "old.ckpt")
    config = read_config(tmp_path / "old.ckpt")
    assert "src.models.gpt2" not in str(config) and "src.datamodules" not in str(config)
    assert "src.objectives" not in str(config).replace("src.lm.objectives", "")
    assert config["data"]["_target_"] == "src.lm.data.text.TextDataModule"
    assert isinstance(instantiate(OmegaConf.create(config).model, vocab_size=257), GPT2LitModule)
