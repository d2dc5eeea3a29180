"""A reward model (model/objective=reward, data=preference): the loss and gradients against TRL's RewardTrainer on the
same ids, the export that transformers loads as a sequence-classification model with the same scores, the
one-sentence errors, and (slow) N ranks equal to one process under DDP, FSDP2 and accumulation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FULL_MATRIX_ONLY, shared
from test_dpo import (
    CPU_DS,
    GPT2_SHAPE,
    LORA,
    dpo_run_args,
    moved,
    our_batch,
    tiny_pairs,
    worst_relative_difference,
)

from src.lm.models.gpt2_module import GPT2LitModule
from src.lm.objectives.reward import Reward
from src.utils.config import ConfigError
from tests.helpers.margins import U32, close64, within

EOS = 50256


def reward_model(seed: int = 0, **settings) -> GPT2LitModule:
    """A 2-layer GPT-2 with a reward head, in float64, every weight moved (so the rewards are far from 0). Not the
    shared tiny GPT-2: its 2-wide hidden states leave LayerNorm two values to give, whatever the input. Seeded first:
    its initial weights must not depend on what the process ran before (one order made the rewards nearly equal)."""
    torch.manual_seed(seed)
    module = GPT2LitModule(vocab_size=50257, seq_len=64, n_layer=2, n_head=2, n_embd=32, objective=Reward(**settings))
    return moved(module, seed, 0.5)


def mean_loss_and_grads(module: GPT2LitModule, batch: dict, mean: bool = True) -> tuple[torch.Tensor, dict]:
    sums, pairs = module.objective.pair_sums(module, batch)
    loss = sums[0] / pairs if mean else sums[0]  # mean=False: a planted mistake
    module.model.zero_grad()
    loss.backward()
    head = "lm_head.weight"  # the reward head's name in the causal LM; transformers' classifier names it score
    return loss.detach(), {
        ("score.weight" if n == head else n): p.grad.clone() for n, p in module.model.named_parameters()
    }


def trls_loss_and_grads(module: GPT2LitModule, pairs: list[dict], center: float, tmp_path, margins=None) -> tuple:
    """TRL's RewardTrainer.compute_loss and its gradients on the exported sequence-classification model (float64),
    fed what TRL's own pipeline tokenizes: prompt + answer + EOS, padded with EOS."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    tokenizer = AutoTokenizer.from_pretrained(shared("tiny-gpt2"))
    model = module.objective.export(module.model, EOS)
    args = RewardConfig(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=len(pairs),
        center_rewards_coefficient=center or None,
    )
    texts = Dataset.from_list([{"chosen": "a", "rejected": "b"}])  # RewardTrainer wants one; unused
    trainer = RewardTrainer(model=model, args=args, train_dataset=texts, processing_class=tokenizer)
    trainer.model.train()
    assert next(trainer.model.parameters()).dtype == torch.float64  # the Trainer did not cast it
    examples = [{"chosen_ids": p["prompt_ids"] + p[f"{k}_ids"] for k in ("chosen",)} for p in pairs]
    for i, (example, p) in enumerate(zip(examples, pairs)):
        if margins is not None:
            example["margin"] = float(margins[i])
        example["rejected_ids"] = p["prompt_ids"] + p["rejected_ids"]
    loss = trainer.compute_loss(trainer.model, DataCollatorForPreference(pad_token_id=EOS)(examples))
    loss.backward()
    return loss.detach().double(), {n: p.grad for n, p in trainer.model.named_parameters()}


def scored_at_the_eos(prompt: np.ndarray, answer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A planted mistake: the whole sequence read, so the reward is read at the closing EOS."""
    tokens = np.concatenate([prompt, answer]).astype(np.int64)
    return tokens, np.concatenate([tokens[1:], [EOS]])


@pytest.mark.parametrize("center,margins", [(0.0, False), (0.01, False), (0.0, True)])
def test_loss_and_gradients_equal_trls_reward_trainer(center, margins, tmp_path):
    """Our Bradley-Terry loss (and center_rewards, and the data's margins) and its gradients against TRL's
    RewardTrainer on transformers' GPT2ForSequenceClassification built by our export, both in float64 on the same
    pairs: one computation on both sides but for the pooling and the loss, so they agree to float64 rounding
    (allowed: 1e-9 relative). Mistakes it tells apart: the reward read at the EOS (one token later), the pairs'
    losses summed, no centering term, the margins left out."""
    from transformers import AutoTokenizer

    pairs = tiny_pairs(AutoTokenizer.from_pretrained(shared("tiny-gpt2")))
    batch = our_batch(pairs)
    given = torch.tensor([0.5, -0.25, 1.0, 0.0], dtype=torch.float32) if margins else None
    if margins:
        batch["margin"] = given
    ours = reward_model(center_rewards=center)
    theirs = trls_loss_and_grads(ours, pairs, center, tmp_path, given)
    loss_and_grads = mean_loss_and_grads(ours, batch)
    within(worst_relative_difference(loss_and_grads, theirs), 1e-9, "reward vs TRL, relative")
    assert abs(loss_and_grads[0].item() - np.log(2)) > 1e-2  # the rewards are not all equal
    planted = {
        "read at the EOS": mean_loss_and_grads(ours, our_batch(pairs, scored_at_the_eos)),
        "sum over pairs": mean_loss_and_grads(ours, batch, mean=False),
        "centering off" if center else "centering on": mean_loss_and_grads(
            reward_model(center_rewards=0.01 - center), batch
        ),
    }
    if margins:
        planted["margins left out"] = mean_loss_and_grads(ours, {k: v for k, v in batch.items() if k != "margin"})
    for mistake, wrong in planted.items():
        assert worst_relative_difference(wrong, theirs) > 1e-6, mistake


def test_preference_records_with_a_margin_bring_it_to_the_batch(tmp_path):
    """A "margin" per record (TRL's column) reaches the batch by the pair's number; some records with one and some
    without, or a margin that is not a number, is one sentence."""
    import json

    from src.lm.data.corpus import CorpusError
    from src.lm.data.preference import PreferenceDataModule

    records = [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no", "margin": i / 4} for i in range(8)]
    (tmp_path / "m.json").write_text(json.dumps(records))
    dm = PreferenceDataModule(str(tmp_path / "m.json"), seq_len=32, val_fraction=0.25, test_fraction=0.0)
    dm.setup("fit")
    items = [dm.splits["train"][i] for i in range(3)]
    batch = dm.collate_fn()(items)
    assert batch["margin"].tolist() == [item[0] / 4 for item in items]
    (tmp_path / "mixed.json").write_text(json.dumps(records[:2] + [{"prompt": "q", "chosen": "a", "rejected": "b"}]))
    with pytest.raises(CorpusError, match="2 of 3 records have a 'margin': give every record one, or none"):
        PreferenceDataModule(str(tmp_path / "mixed.json"), seq_len=32).setup("fit")
    (tmp_path / "text.json").write_text(json.dumps([{**records[0], "margin": "big"}]))
    with pytest.raises(CorpusError, match="'margin' is 'big', not a number"):
        PreferenceDataModule(str(tmp_path / "text.json"), seq_len=32).setup("fit")


def test_the_export_is_a_sequence_classifier_with_the_same_scores(tmp_path):
    """export writes what AutoModelForSequenceClassification loads (num_labels=1, pad = EOS): its scores on the
    padded batch are the head's at each row's last input token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    module = reward_model().double().eval()  # float64 on both sides: two computations compared to FLOAT64_TOL
    batch = our_batch(tiny_pairs(AutoTokenizer.from_pretrained(shared("tiny-gpt2"))))
    module.objective.export(module.model, EOS).save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float64).eval()
    with torch.no_grad():
        theirs = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        ours = module.objective.scores(module, batch)
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == EOS
    close64(ours, theirs, "scores: ours vs the exported classifier's")
    assert ours.std() > 0.1  # not a constant head


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["model/objective=reward"], "model/objective=reward trains on pairs, but data is TextDataModule"),
        (["data=preference", "model/objective=reward", "trainer=tp"], "does not run under trainer=tp"),
        (["data=preference", "model/objective=reward", "trainer=pipeline"], "does not run under trainer=pipeline"),
    ],
)
def test_objective_data_and_strategy_must_agree(overrides, words):
    from test_configs import compose_cfg

    from src.run.checks import resolve_and_check_values

    with pytest.raises(ConfigError, match=words):
        resolve_and_check_values(compose_cfg(overrides))


def test_the_head_trains_under_lora_and_is_filled_alike_on_every_build_path():
    """Under LoRA the base weights freeze and the new head trains; built on the meta device and materialised (as
    FSDP2 does) the head gets the values of an eager build."""
    from src.lm import init

    torch.manual_seed(0)
    eager = GPT2LitModule(vocab_size=257, seq_len=32, n_layer=1, n_head=2, n_embd=16, objective=Reward())
    torch.manual_seed(0)
    with init.deferred_init():
        deferred = GPT2LitModule(vocab_size=257, seq_len=32, n_layer=1, n_head=2, n_embd=16, objective=Reward())
    deferred.materialize(torch.device("cpu"), sharded=False)
    head = eager.hf_model.get_output_embeddings().weight
    assert head.shape == (1, 16) and head.data_ptr() != eager.hf_model.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(deferred.hf_model.get_output_embeddings().weight, head, rtol=0, atol=0)
    lora = GPT2LitModule(
        vocab_size=257,
        seq_len=32,
        n_layer=1,
        n_head=2,
        n_embd=16,
        objective=Reward(),
        lora={"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": None},
    )
    trainable = {n for n, p in lora.model.named_parameters() if p.requires_grad}
    assert any("lm_head" in n for n in trainable) and any("lora_" in n for n in trainable)
    assert not any("wte" in n for n in trainable)


def test_settings_are_checked():
    with pytest.raises(
        ConfigError, match=r"model.objective.center_rewards=-1 is not valid: use 0 \(off\) or a positive weight"
    ):
        Reward(center_rewards=-1)


# ---- N ranks == 1 process (slow): every logged statistic and the final weights within 1e-5 (fp32) ----

STATS_LOGGED = [f"{stage}/{name}" for stage in ("train", "val") for name in Reward.STATS]
CASES = {  # name: (args, whether its checkpoint is a sharded dir); LoRA cases hold the adapter in both runs
    "ddp_2x4": (["trainer=ddp", "trainer.devices=2"], False),
    "fsdp_2": (["trainer=fsdp", "trainer.devices=2"], True),
    "zero3_2": (CPU_DS + ["trainer.strategy.stage=3"], True),
    "lora_ddp_2x4": (["trainer=ddp", "trainer.devices=2"], False),
    # val_check_interval counts micro-batches: 10 of them are the 5 steps
    "1x4_accumulate_2": (["trainer.accumulate_grad_batches=2", "trainer.val_check_interval=10"], False),
}


def reward_run_args() -> list[str]:
    """With center_rewards: without it the loss sees only reward differences, so the part of a reward common to
    every sequence (ln_f's bias through the head) gets a gradient that is 0 up to fp32 rounding, which Adam turns
    into lr-sized steps that differ with the rounding (seen: that bias 2.4e-4 apart after 5 steps, the margins
    4e-8). Centering gives it a real gradient, and every statistic and weight is then compared."""
    args = [a.replace("model/objective=dpo", "model/objective=reward") for a in dpo_run_args(GPT2_SHAPE)]
    return args + ["model.objective.center_rewards=0.01", "callbacks.generate_text=null"]


@pytest.mark.slow
@pytest.mark.parametrize(  # suite time: all but FSDP2 in the full matrix (DPO's DDP cases run the same pair step)
    "case", [pytest.param(c, marks=[] if c == "fsdp_2" else [FULL_MATRIX_ONLY]) for c in CASES]
)
def test_n_ranks_match_one_process(tmp_path, reference, case):
    """The 1 x 8 run against 2 x 4 under DDP and FSDP2 (the head sharded with the model) and 1 x 4 x accumulation
    2: every logged statistic at every step, the validation's (15 pairs over 2 ranks, one rank padded), and the
    final weights, head included."""
    from test_fsdp import last_ckpt, train_sharded
    from test_parity import assert_same_series, max_param_diff, train

    from src.checkpoint.convert import load_checkpoint

    args, sharded = CASES[case]
    lora = LORA if "lora" in case else []
    one = reference(reward_run_args() + lora)
    run = (train_sharded if sharded else train)(tmp_path, case, reward_run_args() + lora + args)
    params = load_checkpoint(last_ckpt(tmp_path, case))["state_dict"] if sharded else run["params"]
    for tag in STATS_LOGGED:
        assert_same_series(one, run, tag, 1e-5)
    assert len(run["scalars"]["train/loss"]) == 5
    (head,) = [v for k, v in params.items() if k.endswith("lm_head.weight")]  # under LoRA, peft's names
    assert head.shape == (1, 32)  # the head, not the embeddings: untied
    within(max_param_diff(one["params"], params), 1e-5, "params")
    assert one["scalars"]["train/rewards/margins"][-1][1] != one["scalars"]["train/rewards/margins"][0][1]
    if case == "ddp_2x4":  # eval.py reports the statistics: val/ as the run logged it last, test/ too
        from test_eval import evaluate

        metrics, _ = evaluate(tmp_path, last_ckpt(tmp_path, case), ["trainer.precision=32-true"])
        assert {f"test/{name}" for name in Reward.STATS} <= metrics.keys()
        for name in Reward.STATS:
            within(abs(metrics[f"val/{name}"] - run["scalars"][f"val/{name}"][-1][1]), 1e-5, f"eval.py val/{name}")
    if case == "fsdp_2":  # the sharded checkpoint exports as transformers' classifier, with the template's scores
        from transformers import AutoModelForSequenceClassification

        from src.checkpoint.convert import build_module, export_hf

        classifier = AutoModelForSequenceClassification.from_pretrained(
            export_hf(last_ckpt(tmp_path, case), tmp_path / "hf")
        )
        module, datamodule = build_module(load_checkpoint(last_ckpt(tmp_path, case)))
        module, classifier = module.double().eval(), classifier.double().eval()  # the fp32 weights, in float64
        datamodule.setup("validate")
        batch = next(iter(datamodule.eval_loader("val")))
        with torch.no_grad():
            theirs = classifier(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
            close64(module.objective.scores(module, batch), theirs, f"{case}: scores vs the exported classifier's")


@pytest.mark.parametrize("arch", ["gemma2", "llama"])
def test_a_reward_model_whose_lm_forward_rescales_its_logits_exports_its_own_scores(arch, tmp_path):
    """Gemma 2 soft-caps what the output layer gives in its causal LM forward; transformers' sequence classifier
    applies its head to the decoder's last hidden state and nothing more. The reward model switches the cap off, so
    the export gives the template's scores exactly (with the cap: 8e-6 apart on a tiny Gemma 2, more as the rewards
    grow)."""
    from transformers import AutoModelForSequenceClassification

    from src.lm.models.causal_lm import CausalLMLitModule

    config = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, head_dim=8)  # fmt: skip
    if arch == "gemma2":
        config["final_logit_softcapping"] = 0.5  # small, so that the cap shows at these rewards
    torch.manual_seed(0)
    module = CausalLMLitModule(vocab_size=257, seq_len=32, model_type=arch, config=config, objective=Reward())
    module = module.double().eval()
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    ids = torch.randint(0, 256, (4, 12))
    mask = torch.ones_like(ids)
    ids[2:, 9:], mask[2:, 9:] = 256, 0
    module.objective.export(module.model, 256).save_pretrained(tmp_path)
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float64).eval()
    with torch.no_grad():
        ours = module.objective.scores(module, {"input_ids": ids, "attention_mask": mask})
        theirs = classifier(input_ids=ids, attention_mask=mask).logits[:, 0]
    if arch == "llama":
        close64(ours, theirs, f"{arch}: scores vs the exported classifier's")
    else:  # Gemma 2's RMSNorm computes in float32 whatever the model's dtype (its own x.float()): a few fp32
        # roundings a layer apart, 2 layers (1.2e-7 here; the cap left on moves them by > 1e-3, below)
        within((ours - theirs).abs().max().item(), 8 * 2 * U32 * theirs.abs().max().item(), f"{arch}: scores")
    if arch == "gemma2":  # with the cap back on, the template's scores would not be the export's
        module.hf_model.config.final_logit_softcapping = 0.5
        with torch.no_grad():
            assert (
                module.objective.scores(module, {"input_ids": ids, "attention_mask": mask}) - theirs
            ).abs().max() > 1e-3


def test_an_architecture_without_a_sequence_classifier_is_refused_as_a_reward_model():
    """Granite has no AutoModelForSequenceClassification: its reward model could not be exported (nor used as
    GRPO's reward), so it is one sentence when built, not a traceback after training."""
    from src.lm.models.causal_lm import CausalLMLitModule

    config = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    with pytest.raises(ConfigError, match="model/objective=reward on granite: transformers has no sequence-classif"):
        CausalLMLitModule(vocab_size=257, seq_len=32, model_type="granite", config=config, objective=Reward())
