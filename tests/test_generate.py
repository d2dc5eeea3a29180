"""generate.py as a user runs it: greedy = transformers' generate on the export-hf of the same checkpoint, token for
token (plain, LoRA); a seeded prompts file gives the same text on 1 process and on 2 ranks (DDP and FSDP2 checkpoints,
generated under DDP and FSDP2), and from a 2-rank pipeline checkpoint; a scripted chat on a tiny chat_sft checkpoint;
bad input as one sentence."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, ROOT, free_port, path_overrides, python, run_script, shared
from test_parity import GPT2, QUIET

pytestmark = pytest.mark.slow
SHORT = ["trainer.max_steps=2", "trainer.val_check_interval=2"]
SAMPLED = ["seed=3", "temperature=0.8", "top_k=50", "top_p=0.95"]
PROMPTS = ["Hello", "The cat sat", "Once upon a time", "x", "def f(a, b):"]


def train_run(tmp: Path, args: list[str]) -> Path:
    run_script("train.py", QUIET + path_overrides({"log_dir": tmp / "logs", "cache_dir": tmp / "cache"}) + args)
    (run,) = (tmp / "logs" / "train" / "runs").iterdir()
    return run / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def ddp_checkpoint(tmp_path_factory) -> Path:
    return train_run(tmp_path_factory.mktemp("ddp"), GPT2 + SHORT + ["trainer=ddp", "trainer.devices=2"])


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def generate(tmp: Path, ckpt: Path, args: list[str], check: bool = True, stdin: str | None = None):
    """generate.py's process (stdout, stderr, returncode): run_script's, with `stdin` fed to it."""
    argv = [f"ckpt_path={ckpt}", *QUIET[:2], f"paths.log_dir={tmp / 'gen'}", f"paths.cache_dir={tmp / 'cache'}", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(
        [python(), "generate.py", *argv], cwd=ROOT, env=env, input=stdin or "", capture_output=True, text=True,
        errors="replace", timeout=600,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"generate.py {' '.join(argv)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def completions(tmp: Path, ckpt: Path, prompts: Path, name: str, args: list[str]) -> list[dict]:
    out = tmp / f"{name}.jsonl"
    generate(tmp, ckpt, [f"prompts_file={prompts}", f"output={out}", "max_new_tokens=12", *args])
    return [json.loads(line) for line in out.read_text().splitlines()]


def transformers_greedy(hf_dir: Path, prompt_ids: list[list[int]], eos: int, max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    out = []
    for ids in prompt_ids:
        with torch.no_grad():
            row = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos,
            )[0, len(ids) :].tolist()  # fmt: skip
        out.append(row[: row.index(eos)] if eos in row else row)
    return out


# suite time: LoRA's greedy run in the full matrix (the plain one stays; test_finetune exports LoRA to a clean client)
@pytest.mark.parametrize(
    "kind", ["plain", pytest.param("lora", marks=FULL_MATRIX_ONLY), pytest.param("zero2", marks=FULL_MATRIX_ONLY)]
)
def test_greedy_is_transformers_generate_on_the_exported_model(tmp_path, ddp_checkpoint, prompts_file, kind):
    """Also from a ZeRO dir (the tests' CPU DeepSpeed, stage 2; in the full matrix: it JIT-builds CPU Adam), read as
    it is: eval.py's consolidation into the run dir, once."""
    from src.checkpoint.convert import export_hf

    ckpt = ddp_checkpoint
    if kind == "zero2":
        from test_deepspeed import CPU_DS

        ckpt = train_run(tmp_path, GPT2 + SHORT + [*CPU_DS, "trainer.strategy.stage=2"])
        assert ckpt.is_dir()
    if kind == "lora":  # its B matrices drawn at random: 2 steps from zero would leave the base model's text
        ckpt = train_run(tmp_path, GPT2 + SHORT + ["model.lora.enabled=true", "model.lora.dropout=0"])
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        for key in [k for k in state["state_dict"] if "lora_B" in k]:
            state["state_dict"][key] = torch.randn(state["state_dict"][key].shape) * 0.5
        torch.save(state, ckpt)
    ours = completions(tmp_path, ckpt, prompts_file, "greedy", ["temperature=0"])
    assert [r["prompt"] for r in ours] == PROMPTS
    theirs = transformers_greedy(export_hf(ckpt, tmp_path / "hf"), [list(p.encode()) for p in PROMPTS], 256, 12)
    assert [r["tokens"] for r in ours] == theirs
    assert [r["completion"] for r in ours] == [
        bytes(t for t in ids if t < 256).decode(errors="replace") for ids in theirs
    ]


def greedy_by_full_forwards(model, ids: list[int], eos: int, max_new_tokens: int) -> list[int]:
    """The oracle: a full forward of the whole sequence per token (no cache, no `generate`), through the model's own
    forward, where peft puts its virtual tokens as in training."""
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax().item()
            if token == eos:
                break
            new.append(token)
    return new


def test_greedy_under_prefix_tuning_is_the_full_forwards_of_the_adapted_model(tmp_path, prompts_file):
    """Prefix tuning does not merge into the weights (no export to compare with): greedy = the oracle's decode through
    the peft model's own forward, with a prefix made large enough to change what the model writes."""
    from src.checkpoint.convert import build_module, load_checkpoint

    ckpt = train_run(
        tmp_path,
        [*GPT2[:1], *GPT2[5:], *SHORT, f"model.pretrained={shared('tiny-gpt2')}", "data.seq_len=32",
         "model/peft=prefix_tuning", "model.peft.num_virtual_tokens=4"],
    )  # fmt: skip
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    (key,) = [k for k in state["state_dict"] if "prompt_encoder" in k]
    state["state_dict"][key] = torch.randn(state["state_dict"][key].shape, generator=torch.Generator().manual_seed(0))
    torch.save(state, ckpt)
    ours = completions(tmp_path, ckpt, prompts_file, "prefix", ["temperature=0"])
    module, datamodule = build_module(load_checkpoint(ckpt))
    tokenizer = datamodule.tokenizer
    prompt_ids = [tokenizer.encode_batch([p])[0].tolist() for p in PROMPTS]
    oracle = [greedy_by_full_forwards(module.model, ids, tokenizer.eos_id, 12) for ids in prompt_ids]
    assert [r["tokens"] for r in ours] == oracle
    base = [greedy_by_full_forwards(module.model.get_base_model(), ids, tokenizer.eos_id, 12) for ids in prompt_ids]
    assert base != oracle  # the prefix changes the text: generate.py did not drop it


@pytest.mark.parametrize("forms", [pytest.param(("fsdp",)), pytest.param(("ddp", "fsdp"), marks=FULL_MATRIX_ONLY)])
def test_seeded_samples_are_the_same_on_one_process_and_two_ranks(
    tmp_path, ddp_checkpoint, fsdp_checkpoint, prompts_file, forms
):
    """Each prompt's randomness is keyed by (seed, prompt number): the text does not depend on the ranks, nor on the
    checkpoint's form; a .txt of the same prompts reads as the .jsonl. Suite time: the FSDP2 checkpoint alone (on 1
    process, 2 DDP and 2 FSDP2 ranks); the DDP one's too in the full matrix (test_a_pipeline_checkpoint_samples_as_one_
    process_trained samples the DDP checkpoint against a pipeline one's)."""
    first = {}
    for name, ckpt in {"ddp": ddp_checkpoint, "fsdp": fsdp_checkpoint}.items():
        if name not in forms:
            continue
        one = first[name] = completions(tmp_path, ckpt, prompts_file, f"{name}-one", SAMPLED)
        assert [r["prompt"] for r in one] == PROMPTS
        greedy = completions(tmp_path, ckpt, prompts_file, f"{name}-greedy", ["temperature=0"])
        assert [r["tokens"] for r in one] != [r["tokens"] for r in greedy]  # it sampled
        splits = {"ddp": ["trainer=ddp", "trainer.devices=2"]}
        if name == "fsdp":  # FSDP2's gathers in every forward: both ranks run as many, one with a padding prompt
            splits["fsdp"] = ["trainer=fsdp", "trainer.devices=2"]
        for split, args in splits.items():
            assert completions(tmp_path, ckpt, prompts_file, f"{name}-{split}", [*SAMPLED, *args]) == one, split
    txt = tmp_path / "prompts.txt"
    txt.write_text("\n".join(PROMPTS) + "\n\n")
    seeded = completions(tmp_path, fsdp_checkpoint, txt, "txt", SAMPLED)
    assert seeded == first["fsdp"]
    other = completions(tmp_path, fsdp_checkpoint, prompts_file, "seed4", [*SAMPLED, "seed=4"])
    assert [r["tokens"] for r in other] != [r["tokens"] for r in seeded]


def test_a_pipeline_checkpoint_samples_as_one_process_trained(tmp_path, ddp_checkpoint, prompts_file):
    """A 2-rank trainer=pipeline run's checkpoint (a DCP dir, each stage's blocks from its rank) is consolidated once
    and samples, prompt for prompt, the text of the same run trained without stages; sampling under the pipeline
    itself is one sentence (no rank holds the whole model)."""
    pipeline = train_run(tmp_path, GPT2 + SHORT + ["trainer=pipeline", "trainer.devices=2"])
    staged = completions(tmp_path, pipeline, prompts_file, "pipeline", SAMPLED)
    assert staged == completions(tmp_path, ddp_checkpoint, prompts_file, "whole", SAMPLED)
    under = generate(tmp_path, pipeline, [f"prompts_file={prompts_file}", "trainer=pipeline", "trainer.devices=2"],
                     check=False)  # fmt: skip
    assert "trainer=PipelineStrategy cannot generate (no rank holds the whole model)" in one_sentence(under)


def test_one_prompt_streams_to_stdout(tmp_path, ddp_checkpoint, prompts_file):
    greedy = completions(tmp_path, ddp_checkpoint, prompts_file, "greedy", ["temperature=0"])
    proc = generate(tmp_path, ddp_checkpoint, [f"prompt={PROMPTS[2]!r}", "temperature=0", "max_new_tokens=12"])
    assert proc.stdout == greedy[2]["completion"] + "\n"  # the text alone: the log goes to stderr


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> Path:
    """experiment=chat_sft at a CPU size (tests/test_experiments.py's CPU_SIZE) on the shared tool-call chats, its
    weights then drawn at random (N(0, 0.5): what it writes depends on the whole conversation, which 2 steps from the
    tiny GPT-2 do not give) and EOS's embedding row x3 (its turns end within a few tokens)."""
    tmp = tmp_path_factory.mktemp("chat")
    chats = tmp / "chats.json"
    chats.write_text(json.dumps(json.loads(shared("chat", "glaive_toolcall_en_demo.json").read_text())[:40]))
    ckpt = train_run(
        tmp,
        [
            "experiment=chat_sft", f"model.pretrained={shared('tiny-gpt2')}", f"data.path={chats}", "data.seq_len=512",
            "data.global_batch_size=4", "trainer.limit_val_batches=1", "test=false", *SHORT,
        ],
    )  # fmt: skip
    state, generator = torch.load(ckpt, map_location="cpu", weights_only=False), torch.Generator().manual_seed(0)
    weights = state["state_dict"]
    for key, value in weights.items():
        if value.is_floating_point():
            weights[key] = torch.randn(value.shape, generator=generator) * 0.5
    for key in [k for k in weights if k.endswith(("wte.weight", "lm_head.weight"))]:
        weights[key][50256] *= 3  # GPT-2's EOS, which closes a ChatML turn here
    torch.save(state, tmp / "random.ckpt")
    return tmp / "random.ckpt"


def test_chat_three_turns_on_a_chat_checkpoint(tmp_path, chat_checkpoint):
    """Each reply is transformers' greedy completion of the whole conversation so far (the earlier replies in it),
    rendered by the template the checkpoint trained with, stopped at the end of the assistant's turn."""
    from src.checkpoint.convert import export_hf, read_config
    from src.lm.data.chat import ChatTemplate
    from src.lm.data.tokenizers import load_tokenizer

    turns = ["Hi, who are you?", "What is the weather in Paris?", 'tool: {"temperature": 21}']
    proc = generate(tmp_path, chat_checkpoint, ["chat=true", "temperature=0", "max_new_tokens=10"],
                    stdin="\n".join(turns) + "\n")  # fmt: skip
    replies = [line[len("assistant: ") :] for line in proc.stdout.splitlines() if line.startswith("assistant: ")]
    assert len(replies) == 3, proc.stdout
    tokenizer = load_tokenizer(read_config(chat_checkpoint)["data"]["tokenizer"])
    render = ChatTemplate(tokenizer, read_config(chat_checkpoint)["data"].get("chat_template"))
    hf_dir = export_hf(chat_checkpoint, tmp_path / "hf")
    messages: list[dict] = []
    ended = []
    for turn, reply in zip(turns, replies):
        role, text = ("tool", turn[5:].strip()) if turn.startswith("tool:") else ("user", turn)
        messages.append({"role": role, "content": text})
        ids = tokenizer.encode_batch([render(messages, None, True)])[0].tolist()
        (expected,) = transformers_greedy(hf_dir, [ids], tokenizer.eos_id, 10)
        assert reply == tokenizer.decode(expected)
        ended.append(len(expected) < 10)
        messages.append({"role": "assistant", "content": reply})
    assert any(ended)  # a turn ended at its end-of-turn token, not at max_new_tokens


def one_sentence(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Traceback" not in ln][-1:]
    assert "Traceback" not in proc.stderr
    return line


def test_bad_input_is_one_sentence(tmp_path, ddp_checkpoint):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    line = one_sentence(generate(tmp_path, ddp_checkpoint, [f"prompts_file={bad}"], check=False))
    assert 'line 2 is not a JSON object with a "prompt" string' in line
    line = one_sentence(generate(tmp_path, ddp_checkpoint, ["chat=true"], check=False, stdin="hi\n"))
    assert "chat=true needs a chat template: this checkpoint's tokenizer has none" in line
    ranks = ["chat=true", "chat_template=chatml", "trainer=ddp", "trainer.devices=2"]
    line = one_sentence(generate(tmp_path, ddp_checkpoint, ranks, check=False, stdin="hi\n"))
    assert "chat=true runs in one process" in line
    line = one_sentence(generate(tmp_path, ddp_checkpoint, [], check=False))
    assert "give one of prompt=" in line
    convnet = train_run(tmp_path / "convnet", ["experiment=convnet_digits", "trainer.max_steps=1", "test=false",
                                               "trainer.val_check_interval=1", "trainer.limit_val_batches=1"])  # fmt: skip
    line = one_sentence(generate(tmp_path, convnet, ["prompt=hi"], check=False))
    assert "not a language model that writes text" in line
