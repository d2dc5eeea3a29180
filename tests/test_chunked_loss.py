"""model.loss_chunk=N (src/lm/features/chunked_loss.py): the LM head and the token loss N tokens at a time give the plain
loss and its gradients, never make the logits of every token, are refused in one sentence where that is not the
model's function or the strategy computes the loss elsewhere, and N ranks with it train what 1 process trains with
the plain loss."""

from __future__ import annotations

import contextlib
import importlib.util
import math
from typing import Iterator

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, path_overrides
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from src.lm.features.chunked_loss import check_loss_chunk
from src.lm.models.causal_lm import CausalLMLitModule
from src.lm.models.gpt2_module import GPT2LitModule
from src.lm.objectives.loss import chunked_token_loss, summed_token_loss
from src.utils.config import ArchitectureRefused, ConfigError
from src.utils.labels import IGNORE_INDEX
from tests.helpers.margins import U32, close64, within

NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
VOCAB, SEQ, WIDTH = 301, 40, 32
CHUNK = 23  # 3 x 40 = 120 tokens: 5 chunks of 23 and one of 5 (4 targets)
SHAPE = {"hidden_size": WIDTH, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
MODELS = {  # GPT-2: tied head (the adapter's model, src/architectures/gpt2_adapter.py); Llama: untied
    "gpt2": lambda **kw: GPT2LitModule(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, n_embd=WIDTH, **kw),
    "llama": lambda **kw: causal_lm("llama", {"intermediate_size": 64, "tie_word_embeddings": False}, **kw),
}


def causal_lm(kind: str, fields: dict, **kw) -> CausalLMLitModule:
    return CausalLMLitModule(vocab_size=VOCAB, seq_len=SEQ, model_type=kind, config={**SHAPE, **fields}, **kw)


def batch() -> dict[str, torch.Tensor]:
    """3 rows of 40 tokens: a masked prompt (row 0), right padding (row 1), no target after the last token."""
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, 1)
    labels[:, -1], labels[0, :9], labels[1, 30:] = IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def loss_and_grads(module: CausalLMLitModule, data: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(loss sum, targets, d loss / d the head's input, d loss / d every parameter) of one forward and a backward of the
    token mean, as a training step's (the gradient reaching the loss sum is not 1)."""
    with head_input(module) as seen:
        loss_sum, n_targets = module.loss_and_count(data)
    seen[-1].retain_grad()
    (loss_sum / n_targets).backward()
    return loss_sum, n_targets, seen[-1].grad, {k: p.grad for k, p in module.named_parameters()}


@contextlib.contextmanager
def head_input(module: CausalLMLitModule) -> Iterator[list[torch.Tensor]]:
    """Inside, what the model's head receives, call by call."""
    seen: list[torch.Tensor] = []
    hook = module.hf_model.get_output_embeddings().register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        hook.remove()


@pytest.mark.parametrize("arch", MODELS)
def test_in_float64_the_chunked_loss_and_all_its_gradients_are_the_plain_ones(arch):
    """The whole module in float64, both ways: the loss sum, the target count, the gradient of the head's input and of
    every parameter (the head's weight, tied to the embeddings in GPT-2, and all below it) agree to 1e-9."""
    plain = MODELS[arch]().double()
    chunked = MODELS[arch](loss_chunk=CHUNK).double()
    chunked.load_state_dict(plain.state_dict())
    want, got = loss_and_grads(plain, batch()), loss_and_grads(chunked, batch())
    close64(got[0], want[0], "loss sum")
    assert got[1] == want[1] == 99  # 3 x 39 targets, less 9 of a prompt and 9 of padding: counted exactly
    close64(got[2], want[2], "d loss / d hidden")
    for name, grad in want[3].items():
        close64(got[3][name], grad, f"d loss / d {name}")


def gamma(k: int) -> float:
    """Higham's gamma_k: k fp32 roundings in a row (a sum of k terms) are within gamma_k of exact, relatively."""
    return k * U32 / (1 - k * U32)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", MODELS)
def test_the_chunked_loss_and_its_gradients_are_within_the_rounding_bound(arch, bf16):
    """fp32, and bf16 autocast: the model's head on the hidden states its body gives, chunked_token_loss against
    summed_token_loss: the sum and its gradients w.r.t. the hidden states h and the head's weight W within a bound
    derived from the sums.

    In fp32 each side computes every logit z_iv = sum_k W_vk h_ik (H products) to within gamma_H a_iv of exact, a_iv =
    sum_k |W_vk h_ik| (the chunked side's matmul has fewer rows and may block otherwise); a token's loss
    lse(z_i) - z_iy moves by at most twice its logits' largest error, A_i = max_v a_iv, and its own rounding (a sum of V
    exponentials, a log, a subtraction) is within gamma_(V+2) (1 + |lse_i| + |z_iy|); the sum of the n token losses
    within gamma_n of their absolute sum. With e = gamma_K, K = n + V + H + 2, above each of these, the two sides are
    within 2 e sum_i (ce_i + 2 A_i + 1 + |lse_i| + |z_iy|). The gradient of z is G = p - onehot (zero for an ignored
    token); the softmax p moves by at most (2 A_i + 1) e p_iv on each side; dh = G W sums V terms and dW = G^T h sums
    n: |d dh| <= 2 e (|G| |W| + (2A + 1) p |W|), |d dW| <= 2 e (|G|^T |h| + p^T ((2A + 1) |h|)), elementwise.
    Under bf16 autocast h and W are rounded to bf16 alike on both sides, the products accumulate in fp32 and each
    logit, each G fed to the backward's products and each product's output is rounded to bf16 once (u = 2^-8): with
    e = u + gamma_K the same bounds hold with |G| counted twice (its rounding and the output's). The references (a,
    p, G, lse) are float64. In fp32 a chunk left out or a target shifted by one moves the sum by a token's loss (~ln
    301 = 5.7), over 50 times the bound; bf16's bound is wider than a token's loss."""
    module = MODELS[arch]()
    head, data = module.hf_model.get_output_embeddings(), batch()
    assert head.bias is None
    with head_input(module) as seen, torch.no_grad():
        module.lm_forward(data)
    h = seen[0].flatten(0, 1).requires_grad_()
    labels, weight = data["labels"].flatten()[None], head.weight
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        plain = summed_token_loss(head(h)[None], labels)[0]
        chunked = chunked_token_loss(h[None], labels, head, [weight], CHUNK)[0]
    want = torch.autograd.grad(plain, (h, weight))
    got = torch.autograd.grad(chunked, (h, weight))

    h64, w64, y = h.detach().double(), weight.detach().double(), labels[0]
    z = h64 @ w64.T
    a = (h64.abs() @ w64.abs().T).amax(1)
    kept = y != IGNORE_INDEX
    lse = torch.logsumexp(z, 1)
    z_y = z.gather(1, y.clamp(min=0)[:, None])[:, 0]
    p = torch.softmax(z, 1) * kept[:, None]
    g = (p - torch.nn.functional.one_hot(y.clamp(min=0), VOCAB).double() * kept[:, None]).abs()
    n, k = len(y), len(y) + VOCAB + WIDTH + 2
    e, g = (2.0**-8 + gamma(k), 2 * g) if bf16 else (gamma(k), g)
    spread = (2 * a + 1)[:, None]
    bound_sum = 2 * e * ((lse - z_y) + 2 * a + 1 + lse.abs() + z_y.abs())[kept].sum()
    bound_dh = 2 * e * (g @ w64.abs() + (spread * p) @ w64.abs())
    bound_dw = 2 * e * (g.T @ h64.abs() + p.T @ (spread * h64.abs()))
    assert n == 120 and int(kept.sum()) == 99
    within(abs(chunked.item() - plain.item()), bound_sum.item(), "loss sum")
    within_elementwise(got[0], want[0], bound_dh, "d loss / d hidden")
    within_elementwise(got[1], want[1], bound_dw, "d loss / d head weight")
    if not bf16:
        within(bound_sum.item(), 5.7 / 50, "the bound is tight enough to see a token's loss")


def within_elementwise(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """|actual - expected| <= bound elementwise (0 <= 0 where the bound is 0), the worst ratio recorded."""
    diff = (actual.double() - expected.double()).abs()
    ratio = torch.where(bound > 0, diff / bound.clamp(min=1e-300), diff * math.inf).nan_to_num(0.0)
    within(ratio.max().item(), 1.0, what)


class LogitRows(TorchDispatchMode):
    """The rows of every tensor any operation makes whose last dimension is the vocabulary (the logits, their fp32
    copy, log-softmax, their gradients), forward and backward (the autograd engine runs a CPU backward in the
    calling thread, under the mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            # a token's row is VOCAB wide; the head's weight transposed, (WIDTH, VOCAB), is no token's
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == VOCAB and t.shape != (WIDTH, VOCAB):
                self.rows.append(t.numel() // VOCAB)
        return out


@pytest.mark.parametrize("chunk", [None, CHUNK])
def test_the_chunked_forward_and_backward_never_make_the_logits_of_every_token(chunk):
    """Every vocabulary-wide tensor of a chunked step has at most N rows; the plain step makes the 120 tokens' logits
    (so the check sees them where they are)."""
    module = MODELS["gpt2"](loss_chunk=chunk)
    module.on_validation_start()  # the chunked loss's probe, where on (its own batch: 2 x 16 tokens)
    with LogitRows() as seen:
        loss_sum, _ = module.loss_and_count(batch())
        loss_sum.backward()
    assert max(seen.rows) == (chunk or 3 * SEQ)
    assert min(seen.rows) >= 1


@pytest.mark.parametrize(
    "kind,fields,words",
    [
        ("granite", {"logits_scaling": 8.0}, "its config sets logits_scaling=8.0"),
        ("cohere", {"logit_scale": 0.0625}, "its config sets logit_scale=0.0625"),
        ("gemma2", {"final_logit_softcapping": 30.0, "head_dim": 16}, "its config sets final_logit_softcapping=30.0"),
        ("granite", {}, None),  # logits_scaling=1: nothing changes the logits after the head
        ("gemma2", {"final_logit_softcapping": None, "head_dim": 16}, None),
    ],
)
def test_the_probe_refuses_a_model_whose_logits_are_not_its_heads_output(kind, fields, words):
    module = causal_lm(kind, {"intermediate_size": 64, **fields}, loss_chunk=CHUNK)
    if words is None:
        module.chunked.probe(module)
        return
    with pytest.raises(ArchitectureRefused) as refused:
        module.chunked.probe(module)
    sentence = str(refused.value)
    assert words in sentence and "are not its LM head's output" in sentence and "set model.loss_chunk=null." in sentence
    assert "\n" not in sentence and sentence.count(". ") == 0


def test_the_probe_refuses_a_head_that_does_not_map_each_token_alone():
    """A head whose logits depend on the other tokens (here: centred over them) gives other logits chunk by chunk."""
    module = MODELS["llama"](loss_chunk=CHUNK)
    head = module.hf_model.get_output_embeddings()
    head.forward = lambda x: (
        torch.nn.functional.linear(x, head.weight) - torch.nn.functional.linear(x, head.weight).mean(-2, keepdim=True)
    )
    with pytest.raises(ArchitectureRefused, match="LM head gives other logits 11 tokens at a time than on all of them"):
        module.chunked.probe(module)


def test_the_probe_refuses_a_head_that_reads_a_trained_tensor_outside_it():
    """chunked_token_loss computes the gradients of the head's input and parameters itself: a head that also reads
    another trained tensor (here: the final norm's weight) would leave that one's gradient out."""
    module = MODELS["llama"](loss_chunk=CHUNK)
    head, norm = module.hf_model.get_output_embeddings(), module.hf_model.model.norm
    head.forward = lambda x: torch.nn.functional.linear(x * norm.weight, head.weight)
    with pytest.raises(ArchitectureRefused, match="LM head reads 1 trained tensor.s. that are not its parameters"):
        module.chunked.probe(module)


def test_the_probe_refuses_a_head_with_dropout():
    module = MODELS["llama"](loss_chunk=CHUNK)
    head = module.hf_model.get_output_embeddings()
    head.register_module("dropout", torch.nn.Dropout(0.1))
    with pytest.raises(ArchitectureRefused, match="LM head holds dropout, whose masks its chunks would not draw"):
        module.chunked.probe(module)


@pytest.mark.parametrize(
    "chunk,objective,compile,words",
    [
        (0, "sft", False, r"model.loss_chunk=0 is not valid: use a number of tokens >= 1, or null"),
        ("64", "sft", False, r"model.loss_chunk='64' is not valid"),
        (64, "dpo", False, r"model/objective=dpo reads the model's logits itself, not the token loss"),
        (64, "reward", False, r"model/objective=reward reads the model's logits itself"),
        (64, "sft", True, r"model.compile=true: a network compiled whole would trace .* set model.compile=blocks"),
    ],
)
def test_options_the_chunked_loss_cannot_serve_are_one_sentence(chunk, objective, compile, words):
    from src.lm.objectives.dpo import DPO
    from src.lm.objectives.reward import Reward
    from src.lm.objectives.sft import SFT

    with pytest.raises(ConfigError, match=words):
        check_loss_chunk(chunk, {"sft": SFT, "dpo": DPO, "reward": Reward}[objective](), compile)
    assert check_loss_chunk(None, DPO(), True) is None and check_loss_chunk(64, SFT(), "blocks") == 64


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["trainer=pipeline"], "with trainer=pipeline: its schedule computes the loss from the last stage's"),
        (["trainer=deepspeed_stage_3"], "with DeepSpeed ZeRO-3 is not proven equal to one process"),
    ],
)
def test_strategies_that_compute_the_loss_elsewhere_are_refused_before_any_rank_starts(overrides, words):
    from test_configs import compose_cfg

    from src.run.checks import resolve_and_check_values

    for strategy in ("trainer=ddp", "trainer=fsdp", "trainer=tp", "trainer=deepspeed_stage_2"):
        resolve_and_check_values(compose_cfg([strategy, "model.loss_chunk=64"]))  # these run it
    with pytest.raises(ConfigError, match=words):
        resolve_and_check_values(compose_cfg(overrides + ["model.loss_chunk=64"]))


# ---- through train.py (slow) ----


@pytest.mark.slow
def test_granite_with_logits_scaling_is_refused_in_one_line_before_step_1(tmp_path):
    from test_errors import assert_one_clear_line, run_as_user
    from test_parity import GPT2, QUIET

    dirs = {"log_dir": tmp_path / "run", "cache_dir": tmp_path / "cache"}
    args = [a for a in GPT2 if not a.startswith("model.")] + ["model=causal_lm", "model.model_type=granite"]
    fields = {**SHAPE, "intermediate_size": 64, "logits_scaling": 8.0}
    args += [f"+model.config.{k}={v}" for k, v in fields.items()] + ["model.loss_chunk=48"]
    out = run_as_user(["train.py", *QUIET, *path_overrides(dirs), *args])
    assert_one_clear_line(
        out[0], out[1], "GraniteForCausalLM's logits are not its LM head's output", "logits_scaling=8.0"
    )


LLAMA = ["model=llama", *(f"model.config.{k}={v}" for k, v in {**SHAPE, "intermediate_size": 64}.items())]
CPU_ZERO2 = [
    "trainer=deepspeed",
    "trainer.strategy._target_=tests.helpers.deepspeed_cpu.CPUDeepSpeedStrategy",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.strategy.stage=2",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,strategy",
    [
        pytest.param("gpt2", ["trainer=fsdp", "trainer.devices=2"], id="gpt2-fsdp"),
        pytest.param("gpt2", ["trainer=ddp", "trainer.devices=2"], id="gpt2-ddp", marks=[FULL_MATRIX_ONLY]),
        pytest.param("gpt2", ["trainer=tp", "trainer.devices=2"], id="gpt2-tp", marks=[FULL_MATRIX_ONLY]),
        pytest.param("gpt2", CPU_ZERO2, id="gpt2-zero2", marks=[FULL_MATRIX_ONLY, NEEDS_DEEPSPEED]),
        pytest.param("llama", ["trainer=fsdp", "trainer.devices=2"], id="llama-fsdp", marks=[FULL_MATRIX_ONLY]),
    ],
)
def test_two_ranks_with_the_chunked_loss_train_what_one_process_trains_with_the_plain_loss(
    tmp_path, reference, arch, strategy
):
    """2 gloo ranks, model.loss_chunk=48 (128 tokens a rank: 48 + 48 + 32) against the 1-process plain run: the train
    loss at every step, the val loss and the final parameters within 1e-5, the tolerance of N ranks = 1 process
    (tests/test_parity.py)."""
    from test_fsdp import last_ckpt, train_sharded
    from test_parity import GPT2, assert_same_series, max_param_diff

    from src.checkpoint.convert import load_checkpoint

    args = GPT2 + (LLAMA if arch == "llama" else [])
    if arch == "llama":
        args = [a for a in args if not a.startswith("model.n_")]
    one = reference(args)
    run = train_sharded(tmp_path, "chunked", args + strategy + ["model.loss_chunk=48"])
    assert len(run["scalars"]["train/loss"]) == 6
    assert_same_series(one, run, "train/loss", 1e-5)
    assert_same_series(one, run, "val/loss", 1e-5)
    within(max_param_diff(one["params"], load_checkpoint(last_ckpt(tmp_path, "chunked"))["state_dict"]), 1e-5, "params")
