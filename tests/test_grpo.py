"""Online RL (model/objective=grpo, data=prompts): the loss and gradients against TRL's GRPOTrainer on fixed
completions, the advantages against TRL's formula, the sampler against transformers' filters, the one-sentence
errors, and (slow) N ranks equal to one process: the same samples, rewards, losses and weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, shared
from test_dpo import CPU_DS, LORA, moved, worst_relative_difference

from src.lm.models.gpt2_module import GPT2LitModule
from src.lm.objectives.grpo import GRPO, completion_mask, group_advantages, sample_seed
from src.lm.objectives.verifiers import exact_match, format_match
from src.utils.config import ConfigError
from tests.helpers.margins import U32, within

EOS = 50256


def arithmetic(path: Path, n: int = 40, seed: int = 0) -> Path:
    """n prompts "a+b=" (single digits) with their sum as the answer, as JSONL."""
    generator = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 10, (n, 2), generator=generator).tolist()
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in pairs))
    return path


def policy(beta: float = 0.0, loss_type: str = "grpo", temperature: float = 1.0, seed: int = 0) -> GPT2LitModule:
    """A 2-layer GPT-2 (GPT-2's vocabulary) in float64; with beta > 0 its reference is the starting weights, and the
    policy is then moved so the two differ."""
    objective = GRPO(
        rewards=[exact_match], num_generations=3, max_new_tokens=5, beta=beta, loss_type=loss_type,
        temperature=temperature,
    )  # fmt: skip
    module = GPT2LitModule(vocab_size=50257, seq_len=64, n_layer=2, n_head=2, n_embd=32, objective=objective)
    return moved(module, seed, 0.3)


def fixed_rollouts(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2 prompts of 6 tokens, 3 completions of 5 tokens each (some ending early in an EOS), their advantages."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 50000, (2, 6), generator=generator)
    completions = torch.randint(0, 50000, (6, 5), generator=generator)
    completions[1, 2] = completions[4, 0] = EOS  # masked after their first EOS
    advantages = torch.randn(6, generator=generator, dtype=torch.float64)
    return prompts, completions, advantages


def our_loss_and_grads(module: GPT2LitModule, prompts, completions, advantages) -> tuple[torch.Tensor, dict]:
    """The mean over the prompts of each one's group loss, and its gradients."""
    objective, G = module.objective, 3
    mask = completion_mask(completions, EOS)
    losses = [
        objective.group_loss(module, p, completions[i * G : (i + 1) * G], mask[i * G : (i + 1) * G],
                             advantages[i * G : (i + 1) * G])[0]
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    loss = torch.stack(losses).mean()
    module.model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.model.named_parameters()}


def trls_loss_and_grads(module: GPT2LitModule, prompts, completions, advantages, tmp_path) -> tuple:
    """TRL's GRPOTrainer._compute_loss and its gradients on the same weights (float64), ids and advantages; its
    reference log-probs from TRL's own log-prob function on the starting weights."""
    from datasets import Dataset
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    objective = module.objective
    tokenizer = AutoTokenizer.from_pretrained(shared("tiny-gpt2"))

    def hf_model(state: dict) -> GPT2LMHeadModel:
        model = GPT2LMHeadModel(GPT2Config(**module.config.to_diff_dict())).double()
        model.load_state_dict(state)
        return model

    model = hf_model(module.model.state_dict())
    args = GRPOConfig(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=5,
        temperature=objective.temperature,
        beta=0.0,  # set below: with beta > 0 TRL would load a reference model by the config's hub name
        loss_type=objective.loss_type,
        epsilon=objective.epsilon_low,
    )
    texts = Dataset.from_list([{"prompt": "a"}])  # GRPOTrainer wants one; unused
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
                          train_dataset=texts, processing_class=tokenizer)  # fmt: skip
    trainer.current_gradient_accumulation_steps, trainer.beta = 1, objective.beta
    trainer.model.train()
    assert next(trainer.model.parameters()).dtype == torch.float64  # the Trainer did not cast it
    prompt_ids = prompts.repeat_interleave(3, dim=0)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completions,
        "completion_mask": completion_mask(completions, EOS),
        "advantages": advantages,
    }
    if objective.beta:
        reference = hf_model({k.removeprefix("reference."): v for k, v in module.state_dict().items()
                              if k.startswith("reference.")}).eval()  # fmt: skip
        add_fused_lm_head(reference, temperature=objective.temperature)  # as TRL treats its reference model
        ids = torch.cat([prompt_ids, completions], dim=1)
        with torch.no_grad():
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                reference, ids, torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), 5
            )[0]
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach().double(), {n: p.grad for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize(
    "beta,loss_type,temperature", [(0.0, "grpo", 1.0), (0.04, "grpo", 0.7), (0.04, "dr_grpo", 1.0)]
)
def test_loss_and_gradients_equal_trls_grpo_trainer(beta, loss_type, temperature, tmp_path):
    """Fixed prompts, completions (two ending early in an EOS) and advantages: our clipped policy-gradient loss
    (+ beta x KL to the starting weights) and its gradients against TRL's GRPOTrainer, float64. TRL computes
    log-probs with a fused kernel that keeps each token's log-sum-exp L in fp32; the tolerance, as for DPO
    (tests/test_dpo.py), is 32 fp32 units of L relative. Mistakes it tells apart: the temperature left out of the
    log-probs, the tokens after an EOS kept, the KL's sign."""
    module = policy(beta, loss_type, temperature)
    prompts, completions, advantages = fixed_rollouts()
    with torch.no_grad():
        logits = module.model(input_ids=torch.cat([prompts[:1].expand(3, -1), completions[:3]], 1)).logits
    tol = 32 * U32 * (logits / temperature).logsumexp(-1).abs().max().item()
    theirs = trls_loss_and_grads(module, prompts, completions, advantages, tmp_path)
    ours = our_loss_and_grads(module, prompts, completions, advantages)
    within(worst_relative_difference(ours, theirs), tol, f"grpo {loss_type} beta={beta} vs TRL, relative")
    planted = {"EOS not masked": our_loss_and_grads(module, prompts, completions.where(completions != EOS, 7),
                                                    advantages)}  # fmt: skip
    if temperature != 1.0:
        module.objective.temperature = 1.0
        planted["temperature left out"] = our_loss_and_grads(module, prompts, completions, advantages)
        module.objective.temperature = temperature
    if beta:
        module.objective.beta = -beta
        planted["KL's sign"] = our_loss_and_grads(module, prompts, completions, advantages)
        module.objective.beta = beta
    for mistake, wrong in planted.items():
        assert worst_relative_difference(wrong, theirs) > tol, mistake


def test_advantages_follow_trls_formula():
    """(r - group mean) / (group std + 1e-4), the std unbiased (TRL's nanstd); scale_rewards=none: centred only."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    advantages, std = group_advantages(rewards, "group")
    torch.testing.assert_close(std, nanstd(rewards))
    torch.testing.assert_close(advantages, (rewards - rewards.mean()) / (nanstd(rewards) + 1e-4))
    torch.testing.assert_close(group_advantages(rewards, "none")[0], rewards - rewards.mean())
    assert group_advantages(torch.ones(4, dtype=torch.float64), "group")[0].abs().max() == 0  # no spread: no signal


def test_sampling_is_softmax_sampling_within_transformers_filters():
    """Gumbel-max on logits / temperature samples softmax(logits / temperature) (frequencies over 20000 draws
    within 4 standard errors), and top-k / top-p keep exactly the tokens transformers' warpers keep."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    objective = GRPO(rewards=[exact_match], temperature=0.8)
    generators = [torch.Generator().manual_seed(i) for i in range(20000)]
    draws = objective.pick(logits.expand(20000, -1), generators)
    frequencies = torch.bincount(draws, minlength=6).double() / 20000
    expected = (logits[0] / 0.8).softmax(-1).double()
    within(((frequencies - expected).abs() / (expected * (1 - expected) / 20000).sqrt()).max().item(), 4.0, "z")
    for settings, warper in (({"top_k": 2}, TopKLogitsWarper(2)), ({"top_p": 0.7}, TopPLogitsWarper(0.7))):
        objective = GRPO(rewards=[exact_match], **settings)
        kept = set(objective.pick(logits.expand(2000, -1), generators[:2000]).tolist())
        assert kept == set(torch.isfinite(warper(None, logits.clone())[0]).nonzero().flatten().tolist()), settings


def test_a_completions_randomness_is_its_seed_step_prompt_and_index():
    """The same (seed, step, prompt number) gives the same G completions; another step or prompt, others."""
    module = policy().float().eval()
    prompt = torch.tensor([20, 21, 22])
    one = module.objective.sample(module, prompt, step=3, number=5)
    assert torch.equal(one, module.objective.sample(module, prompt, step=3, number=5))
    assert not torch.equal(one, module.objective.sample(module, prompt, step=4, number=5))
    assert not torch.equal(one, module.objective.sample(module, prompt, step=3, number=6))
    assert len({tuple(row) for row in one.tolist()}) > 1  # the group's samples differ from each other
    assert sample_seed(0, 1, 2, 3) != sample_seed(0, 1, 2, 4)


def test_completion_mask_and_verifiers():
    completions = torch.tensor([[5, EOS, 6], [5, 6, 7], [EOS, 1, 2]])
    assert completion_mask(completions, EOS).tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert exact_match([""] * 3, [" 7", "7 ", "8"], answer=[7, "7", 7]) == [1.0, 1.0, 0.0]
    assert format_match([""] * 2, ["12", "1a"], pattern=r"\d+") == [1.0, 0.0]


@pytest.mark.parametrize(
    "settings,words",
    [
        ({"num_generations": 1}, r"num_generations=1 is not valid: use 2 or more samples per prompt"),
        ({"rewards": []}, "needs at least one reward function"),
        ({"reward_weights": [1.0, 2.0]}, "2 weights for 1 reward functions"),
        ({"loss_type": "dapo"}, "use one of grpo, dr_grpo"),
        ({"scale_rewards": "batch"}, "use group or none"),
        ({"top_p": 0}, r"top_p=0 in \(0, 1\]"),
    ],
)
def test_settings_are_checked(settings, words):
    with pytest.raises(ConfigError, match=words):
        GRPO(**{"rewards": [exact_match], **settings})


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["model/objective=grpo"], r"grpo trains on prompts, but data is TextDataModule, .*: use data=prompts, or"),
        (["data=prompts", "model/objective=grpo", "trainer=tp"], "does not run under trainer=tp"),
        (
            ["data=prompts"],
            r"sft trains on tokens, but data is PromptDataModule, .*: use data=chat or instruct or litdata or text,",
        ),
    ],
)
def test_objective_data_and_strategy_must_agree(overrides, words):
    from test_configs import compose_cfg

    from src.run.checks import resolve_and_check_values

    with pytest.raises(ConfigError, match=words):
        resolve_and_check_values(compose_cfg(overrides))


# ---- N ranks == 1 process (slow): the same samples, rewards, losses and weights ----

REWARDS = [
    "model.objective.rewards=[{_target_: tests.helpers.rewards.digit_share, _partial_: true},"
    "{_target_: src.lm.objectives.verifiers.exact_match, _partial_: true}]",
    "model.objective.reward_weights=[1.0,2.0]",
]


def grpo_run_args(prompts: Path) -> list[str]:
    return [
        "data=prompts",
        "model/objective=grpo",
        f"data.path={prompts}",
        "data.seq_len=32",
        "data.val_fraction=0.1",
        "model.n_layer=2",
        "model.n_embd=32",
        "model.n_head=2",
        "data.global_batch_size=8",
        "model.objective.num_generations=4",
        "model.objective.max_new_tokens=6",
        "model.objective.beta=0.04",
        *REWARDS,
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "test=false",
        "model.scheduler.num_warmup_steps=1",
        "model.optimizer.lr=1e-2",
    ]


STATS_LOGGED = [f"train/{name}" for name in ("loss", "reward", "reward_std", "completion_length", "kl",
                "rewards/digit_share", "rewards/exact_match")] + ["val/reward", "val/rewards/digit_share"]  # fmt: skip
CASES = {  # name: (args, whether its checkpoint is a sharded dir); LoRA: the adapter in both runs, the reference
    # the model without it
    "ddp_2x4": (["trainer=ddp", "trainer.devices=2"], False),
    "fsdp_2": (["trainer=fsdp", "trainer.devices=2"], True),
    "zero3_2": (CPU_DS + ["trainer.strategy.stage=3"], True),
    "lora_ddp_2x4": (["trainer=ddp", "trainer.devices=2"], False),
    # val_check_interval counts micro-batches: 8 of them are the 4 steps
    "1x4_accumulate_2": (["trainer.accumulate_grad_batches=2", "trainer.val_check_interval=8"], False),
}


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    return arithmetic(tmp_path_factory.mktemp("prompts") / "sums.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize(  # suite time: ZeRO-3, LoRA and DDP in the full matrix (FSDP2's 2 ranks stay)
    "case",
    [pytest.param(c, marks=[FULL_MATRIX_ONLY] if c in ("zero3_2", "lora_ddp_2x4", "ddp_2x4") else []) for c in CASES],
)
def test_n_ranks_match_one_process(tmp_path, reference, prompts_file, case):
    """1 process x 8 prompts against 2 x 4 under DDP and FSDP2 (the reference policy sharded like the policy, the
    sampling's forwards in lockstep) and 1 x 4 x accumulation 2: every logged statistic at every step (the rewards
    are the samples' own: equal rewards are equal samples, up to a tie) and the final weights within 1e-5."""
    from test_fsdp import last_ckpt, train_sharded
    from test_parity import assert_same_series, max_param_diff, train

    from src.checkpoint.convert import load_checkpoint

    args, sharded = CASES[case]
    lora = LORA if "lora" in case else []
    one = reference(grpo_run_args(prompts_file) + lora)
    run = (train_sharded if sharded else train)(tmp_path, case, grpo_run_args(prompts_file) + lora + args)
    params = load_checkpoint(last_ckpt(tmp_path, case))["state_dict"] if sharded else run["params"]
    for tag in STATS_LOGGED:
        assert_same_series(one, run, tag, 1e-5)
    assert len(run["scalars"]["train/loss"]) == 4
    within(max_param_diff(one["params"], params), 1e-5, "params")
    rewards = [v for _, v in one["scalars"]["train/rewards/digit_share"]]
    assert min(rewards) > 0 and len(set(rewards)) > 1  # samples with a spread, which change from step to step
    assert one["scalars"]["train/kl"][-1][1] > 0  # the policy moved away from its reference


@pytest.mark.slow
@FULL_MATRIX_ONLY  # 70 s: docs/performance.md records its run; the parity tests above stay in the suite
def test_grpo_raises_the_reward_of_a_short_sft_on_sums(tmp_path):
    """python -m bench.learn.grpo_learning as docs/performance.md runs it: SFT 150 steps, then experiment=gpt2_grpo for
    400 steps; the training reward's last tenth is above its first, and the held-out reward rises."""
    from conftest import run_script

    proc = run_script("-m", ["bench.learn.grpo_learning", "--work", str(tmp_path)])
    tenths = [float(x) for x in proc.stdout.split("by tenths of")[1].split(":")[1].split("\n")[0].split()]
    held_out = [float(x.split()[-1]) for x in proc.stdout.split("sums):")[1].split("\n")[0].split("step")[1:]]
    assert tenths[-1] > tenths[0] + 0.2 and held_out[-1] > held_out[0] + 0.1, proc.stdout


def test_a_reward_model_scores_completions_as_its_export_does(tmp_path):
    """RewardModelScore on export-hf's dir of a reward model (bytes): the scores of prompt + completion are the
    reward model's own (the head at the last real token); the policy's tokenizer must be the reward model's."""
    from src.lm.data.tokenizers import ByteTokenizer, HFTokenizer
    from src.lm.objectives.reward import Reward, RewardModelScore

    torch.manual_seed(0)
    module = GPT2LitModule(vocab_size=257, seq_len=32, n_layer=1, n_head=2, n_embd=16, objective=Reward()).eval()
    module.objective.export(module.model, 256).save_pretrained(tmp_path)
    (tmp_path / "TOKENIZER.md").write_text("bytes")  # as export-hf writes it for the byte tokenizer
    score = RewardModelScore(str(tmp_path))
    prompts, completions = ["3+4=", "3+4=", "12+1="], ["7", "8 and more", ""]
    ids = [list((p + c).encode()) for p, c in zip(prompts, completions)]
    batch = torch.full((3, max(map(len, ids))), 256)
    mask = torch.zeros_like(batch)
    for i, row in enumerate(ids):
        batch[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    with torch.no_grad():
        ours = module.objective.scores(module, {"input_ids": batch, "attention_mask": mask})
    torch.testing.assert_close(torch.tensor(score(prompts=prompts, completions=completions)), ours)
    score.check_tokenizer(ByteTokenizer())  # the same: no error
    with pytest.raises(ConfigError, match="has another tokenizer than the policy's"):
        score.check_tokenizer(HFTokenizer(str(shared("gpt2-tokenizer"))))
    with pytest.raises(ConfigError, match="is not a Hugging Face dir: export the reward model's checkpoint"):
        RewardModelScore(str(tmp_path / "nowhere"))


@pytest.mark.slow
def test_sft_then_a_reward_model_then_grpo_from_config_alone(tmp_path):
    """The pipeline the issue names, offline, each stage a train.py run from its experiment: SFT on Alpaca records,
    a reward model from that checkpoint on preference pairs (experiment=gpt2_reward), exported by the tool, then
    GRPO from the SFT checkpoint (experiment=gpt2_grpo) rewarded by that reward model. 2 steps a stage (bytes)."""
    from conftest import path_overrides, read_events, run_script
    from test_fsdp import last_ckpt
    from test_parity import QUIET

    shape = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "trainer.max_steps=2", "test=false"]
    stage = lambda name: QUIET + shape + path_overrides({"log_dir": tmp_path / name, "cache_dir": tmp_path / "c"})  # noqa: E731
    run_script("train.py", stage("sft") + ["data=instruct", f"data.path={shared('alpaca', 'alpaca_en_demo.json')}",
                                           "data.seq_len=256", "trainer.val_check_interval=2"])  # fmt: skip
    sft = last_ckpt(tmp_path, "sft")
    run_script("train.py", stage("reward") + [
        "experiment=gpt2_reward", f"model.pretrained={sft}", f"data.path={shared('preference', 'dpo_en_demo.json')}",
        "data.seq_len=64", "data.max_prompt_len=32", "trainer.val_check_interval=2",
    ])  # fmt: skip
    run_script("-m", ["src.tools.checkpoints", "export-hf", str(last_ckpt(tmp_path, "reward")), str(tmp_path / "rm")])
    run_script("train.py", stage("grpo") + [
        "experiment=gpt2_grpo", f"model.pretrained={sft}", f"data.path={arithmetic(tmp_path / 'sums.jsonl')}",
        f"model.objective.rewards=[{{_target_: src.lm.objectives.reward.RewardModelScore, path: {tmp_path / 'rm'}}}]",
        "trainer.val_check_interval=2", "model.objective.num_generations=2",
    ])  # fmt: skip
    (run,) = (tmp_path / "grpo" / "train" / "runs").iterdir()
    events = read_events(run / "tensorboard")
    rewards = [e.value for e in events.Scalars("train/rewards/reward_model")]
    assert len(rewards) == 2 and all(r == r and r != 0 for r in rewards)  # the reward model's scores, finite
    assert any(tag.startswith("samples/grpo") for tag in events.Tags()["tensors"])  # completions in the text tab


def test_prompts_plain_or_chat_rendered_with_their_fields(tmp_path):
    """data=prompts: text is used as it is; chat messages (and ShareGPT turns) go through the tokenizer's chat
    template with the generation prompt; every other field is kept for the reward functions; long prompts lose
    their start; evaluation's padding prompt is numbered -1."""
    from src.lm.data.chat import CHATML
    from src.lm.data.prompts import PromptDataModule
    from src.lm.data.tokenizers import HFTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    records = [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": messages, "answer": "4", "difficulty": 1},
        {"prompt": [{"from": "human", "value": "3+3="}], "answer": "6"},
    ]
    (tmp_path / "p.json").write_text(json.dumps(records * 4))
    tokenizer = HFTokenizer(str(shared("gpt2-tokenizer")))
    tokenizer.hf.chat_template = CHATML
    dm = PromptDataModule(str(tmp_path / "p.json"), seq_len=64, max_prompt_len=12, val_fraction=0.25)
    dm.__dict__["tokenizer"] = tokenizer  # the cached property, with a chat template
    dm.setup("fit")
    assert dm.texts[0] == "1+1="
    assert dm.texts[1] == tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert dm.texts[2].endswith("<|im_start|>assistant\n") and "3+3=" in dm.texts[2]
    assert dm.columns[1] == {"answer": "4", "difficulty": 1}
    number, ids = dm.splits["train"][1]
    assert number == 1 and ids.tolist() == tokenizer.encode_batch([dm.texts[1]])[0][-12:].tolist()  # the start cut
    assert dm.padding_sample(dm.splits["val"][0])[0] == -1
