"""Every experiment in conf/experiment/, the template's and each one a user adds, trains the same model on 1 process
and on 2 ranks: `python -m src.tools.parity experiment=NAME trainer=ddp`, the command docs/your-model.md gives a user,
run as a user runs it. A new experiment is proven the day its file is added, with nothing to edit here.

The template's language-model experiments start from Hugging Face GPT-2 and data files of the user's (their
`model.pretrained`, `data.path`): here they run at a CPU size on the shared test data (CPU_SIZE), in the full tier
(TEST_ALL_ARCHITECTURES=1), as their objectives are proven in the default suite by their own files (test_parity,
test_finetune, test_chat_parity, test_dpo, test_reward, test_grpo); so is the default tiny GPT-2 (FULL_TIER). The full
tier also runs the experiments that need no such change under FSDP2 and ZeRO-2 (tests/helpers/deepspeed_cpu.py).
"""

from __future__ import annotations

import importlib.util

import pytest
from conftest import ALL, ROOT, SHARED, run_script

pytestmark = pytest.mark.slow

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
TINY = str(SHARED / "tiny-gpt2")
LM = ["trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "data.global_batch_size=4"]
CPU_SIZE = {  # the template's experiments that need a hub model or the user's data, at a CPU size on shared data
    "gpt2_small": ["model/size=tiny", f"data.tokenizer={SHARED / 'gpt2-tokenizer'}", "data.seq_len=32", *LM],
    "gpt2_continued_pretraining": [
        f"model.pretrained={TINY}",
        f"data.path={SHARED / 'tinyshakespeare'}",
        "data.seq_len=32",
        *LM,
    ],
    "gpt2_instruct_lora": [
        f"model.pretrained={TINY}",
        f"data.path={SHARED / 'alpaca' / 'alpaca_en_demo.json'}",
        "data.seq_len=64",
        *LM,
    ],  # fmt: skip
    "chat_sft": [
        f"model.pretrained={TINY}",
        f"data.path={SHARED / 'chat' / 'glaive_toolcall_en_demo.json'}",
        "data.seq_len=128",
        "data.val_fraction=0.1",
        "data.test_fraction=0.1",
        *LM,
    ],  # fmt: skip
    "gpt2_dpo": [
        f"model.pretrained={TINY}",
        f"data.path={SHARED / 'preference' / 'dpo_en_demo.json'}",
        "data.seq_len=64",
        *LM,
    ],  # fmt: skip
    "gpt2_reward": [
        f"model.pretrained={TINY}",
        f"data.path={SHARED / 'preference' / 'dpo_en_demo.json'}",
        "data.seq_len=64",
        *LM,
    ],  # fmt: skip
}
FULL_TIER = {  # template experiments that need no change, proven in the default suite by their own files
    "stdlib_tiny": "the default tiny GPT-2 on text (test_parity.py, test_train.py)",
}
NEEDS = {  # what a template experiment needs that no test data here has
    "gpt2_grpo": "a prompts file with verifiable answers and an SFT checkpoint to start from (test_grpo proves GRPO)",
}
CPU_DEEPSPEED = [
    "trainer=deepspeed",
    "trainer.strategy._target_=tests.helpers.deepspeed_cpu.CPUDeepSpeedStrategy",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
]


def parity(args: list[str]) -> None:
    proc = run_script("-m", ["src.tools.parity", "--steps", "10", *args], check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "equal on 1 process and N ranks" in proc.stdout


def cases() -> list:
    out = []
    for name in EXPERIMENTS:
        if name in NEEDS:
            out.append(pytest.param(name, [], marks=pytest.mark.skip(reason=f"{name} needs {NEEDS[name]}"), id=name))
        elif name in CPU_SIZE or name in FULL_TIER:
            full = pytest.mark.skipif(not ALL, reason="full tier: TEST_ALL_ARCHITECTURES=1 runs it")
            out.append(pytest.param(name, CPU_SIZE.get(name, []), marks=full, id=name))
        else:
            out.append(pytest.param(name, [], id=name))
    return out


@pytest.mark.parametrize("name,extra", cases())
def test_the_experiment_trains_the_same_model_on_2_ranks(name, extra):
    parity([f"experiment={name}", "trainer=ddp", *extra])


STRATEGIES = {"fsdp": ["trainer=fsdp"], "zero2": [*CPU_DEEPSPEED, "trainer.strategy.stage=2"]}


@pytest.mark.skipif(not ALL, reason="full tier: TEST_ALL_ARCHITECTURES=1 runs every experiment under every strategy")
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if n not in CPU_SIZE and n not in NEEDS])
def test_the_experiment_trains_the_same_model_under_each_strategy(name, strategy):
    if strategy == "zero2" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed package: pip install -e '.[deepspeed]'")
    parity([f"experiment={name}", *STRATEGIES[strategy]])
