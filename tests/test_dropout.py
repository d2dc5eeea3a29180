"""Dropout keyed per sample (src/core/dropout.py): a row's masks depend on the seed, the step, its sample and the
module only, so dropout on trains the same model on any number of ranks and any accumulation; a forward that draws
its own random numbers is refused before step 1."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, path_overrides, shared

from tests.helpers.architectures import ARCHITECTURES, SAMPLE, eager_experts, tiny_or_skip
from tests.helpers.margins import within

KEYS = dict(step=3, seed=1234)


def mask(shape, sample_index, salt=7, p=0.25, rows=None):
    from src.core.dropout import keyed_mask, row_keys

    index = torch.as_tensor(sample_index)
    keys = row_keys(index, rows or len(index), **KEYS)
    return keyed_mask(torch.Size(shape), keys, salt, p)


def test_a_rows_mask_depends_on_its_sample_and_position_only():
    """The same sample gets the same mask alone or among others, in any order, right-padded to any width; another
    sample, step, seed or module gets another."""
    from src.core.dropout import keyed_mask, row_keys

    batch = mask((4, 6, 16), [5, 9, 2, 11])
    assert torch.equal(mask((1, 6, 16), [9])[0], batch[1])
    assert torch.equal(mask((2, 6, 16), [11, 5])[1], batch[0])
    assert torch.equal(mask((4, 10, 16), [5, 9, 2, 11])[:, :6], batch)  # padded to 10 positions
    assert torch.equal(mask((4, 2, 6, 6), [5, 9, 2, 11])[:, :, :4, :4], mask((4, 2, 4, 4), [5, 9, 2, 11]))
    assert not torch.equal(batch[0], batch[1])
    assert not torch.equal(batch, mask((4, 6, 16), [5, 9, 2, 11], salt=8))
    index = torch.tensor([5, 9, 2, 11])
    for step, seed in ((4, 1234), (3, 1235)):
        assert not torch.equal(batch, keyed_mask(batch.shape, row_keys(index, 4, step, seed), 7, 0.25))
    # two rows a sample (a pair batch: the chosen rows, then the rejected): each keyed by (sample, block)
    pairs = mask((4, 6, 16), [5, 9], rows=4)
    assert torch.equal(mask((4, 6, 16), [9, 5], rows=4), pairs[[1, 0, 3, 2]])
    assert torch.equal(mask((2, 6, 16), [9], rows=2), pairs[[1, 3]])
    assert not torch.equal(pairs[0], pairs[2])


def test_each_element_is_kept_with_probability_one_minus_p():
    """The keep rate, and the agreement of two masks (independent: (1-p)^2 + p^2), within 6 binomial standard
    deviations of what independent draws give."""
    for p in (0.05, 0.1, 0.5):
        m = mask((64, 32, 48), list(range(100, 164)), p=p)
        n = m.numel()
        within(abs(m.float().mean().item() - (1 - p)), 6 * math.sqrt(p * (1 - p) / n), f"keep rate at p={p}")
        other = mask((64, 32, 48), list(range(200, 264)), p=p)
        agree = (m == other).float().mean().item()
        q = (1 - p) ** 2 + p**2
        within(abs(agree - q), 6 * math.sqrt(q * (1 - q) / n), f"two samples' masks at p={p}")
        # neighbouring positions and features are not correlated either
        within(abs((m[:, 1:] == m[:, :-1]).float().mean().item() - q), 6 * math.sqrt(q * (1 - q) / n), "positions")
        within(abs((m[..., 1:] == m[..., :-1]).float().mean().item() - q), 6 * math.sqrt(q * (1 - q) / n), "features")


@pytest.mark.slow  # inductor compiles C++ kernels
def test_a_compiled_keyed_dropout_draws_the_eager_masks_and_compiles_once():
    """torch.compile of a keyed dropout: the eager function's output, forward and backward, in float64; new keys each
    step (another step, other samples) are graph inputs, not guards: one graph, no break, no recompile. The whole
    compiled GPT-2 with dropout: test_compile.py, full matrix."""
    from torch._dynamo.utils import counters

    from src.core import dropout

    torch._dynamo.reset()
    counters.clear()
    module = dropout.KeyedDropout(0.3, "layers.0.mlp.dropout")

    def f(x):
        return module(x) * x  # elementwise: the compiled values are the eager ones, bit for bit

    compiled = torch.compile(f)
    for step in range(3):
        x = torch.randn(4, 6, 8, dtype=torch.float64, requires_grad=True)
        dropout.set_keys(dropout.row_keys(torch.arange(4) + 10 * step, 4, step, 7))
        got, want = compiled(x), f(x)
        assert torch.equal(got, want) and (got == 0).any()
        ones = torch.ones_like(x)
        assert torch.equal(*(torch.autograd.grad(y, x, ones)[0] for y in (got, want)))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])


@pytest.mark.slow  # inductor compiles C++ kernels
def test_the_dropout_kernel_gives_the_eager_values_with_one_graph_per_rank():
    """compile_dropout (src/core/dropout.py, use_kernel): keyed dropout as one compiled kernel per tensor gives the
    eager ops' values bit for bit, forward and backward, at two probabilities: hidden states in fp32 (then another
    length, then a transposed input) and attention weights in bf16 (4 dims). Forward and backward share one graph per
    tensor rank: a new length, other strides and another p do not recompile (p a Python float in the graph, inductor's
    cache served p=0.3's masks at p=0.05). The same values, so every proof that eager keyed dropout trains the same
    model on any layout holds for the kernel (and test_the_dropout_kernel_trains_like_the_eager_ops_on_two_ranks)."""
    from torch._dynamo.utils import counters

    from src.core import dropout

    torch._dynamo.reset()
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(4, 12, 20, generator=generator),
        torch.randn(4, 15, 20, generator=generator),
        torch.randn(4, 20, 13, generator=generator).transpose(1, 2),
        torch.randn(4, 2, 9, 9, generator=generator).bfloat16(),
    ]
    dropout.set_keys(dropout.row_keys(torch.tensor([3, 1, 4, 1]), 4, step=5, seed=9))
    try:
        for x, p in itertools.product(inputs, (0.3, 0.05)):
            outs = []
            for kernel in (False, True):
                dropout.use_kernel(kernel)
                leaf = x.detach().requires_grad_()
                y = dropout.KeyedDropout(p, "h.0.attn")(leaf)
                y.backward(torch.arange(y.numel(), dtype=y.dtype).view(y.shape) / y.numel())
                outs.append((y, leaf.grad))
            (y0, g0), (y1, g1) = outs
            assert torch.equal(y0, y1) and torch.equal(g0, g1) and (y1 == 0).any(), (tuple(x.shape), p)
    finally:
        dropout.use_kernel(False)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


@pytest.mark.slow  # inductor compiles C++ kernels
def test_the_dropout_kernel_keys_a_forwards_own_functional_dropout_as_the_eager_ops_do(monkeypatch):
    """Seed-OSS draws its residual dropout with F.dropout inside its own forward (keyed through its modules' hooks) and
    its attention dropout in the keyed eager attention: with the kernel (each of those calls through it, counted) its
    training logits and gradients are the eager ops', bit for bit (GPT-2's modules and LoRA's through train.py: the
    two-rank run above)."""
    from src.core import dropout
    from src.lm.models.causal_lm import CausalLMLitModule

    applied = []
    apply = dropout._KeyedKernel.apply
    monkeypatch.setattr(dropout._KeyedKernel, "apply", lambda *args: applied.append(1) or apply(*args))

    config, fields = tiny_or_skip("seed_oss")
    torch.manual_seed(0)
    module = CausalLMLitModule(vocab_size=config.vocab_size, seq_len=16, model_type="seed_oss", config=fields,
                               dropout=0.2)  # fmt: skip
    assert dropout.calls_functional_dropout(
        next(m for m in module.hf_model.modules() if "Attention" in type(m).__name__)
    )
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = []
    try:
        for kernel in (False, True):
            dropout.use_kernel(kernel)
            module.model.zero_grad()
            logits = dropout_forward(module, ids, [3, 4])
            logits.square().mean().backward()
            runs.append((logits.detach(), [p.grad.clone() for p in module.model.parameters() if p.grad is not None]))
    finally:
        dropout.use_kernel(False)
    (eager, eager_grads), (kernel, kernel_grads) = runs
    layers = config.num_hidden_layers
    assert len(applied) >= 2 * layers, (len(applied), layers)  # each layer: its residual and attention dropouts
    assert torch.equal(eager, kernel) and all(map(torch.equal, eager_grads, kernel_grads))


def dropout_forward(module, ids, index):
    from src.core import dropout

    module.train()
    dropout.set_keys(dropout.row_keys(torch.as_tensor(index), ids.shape[0], 0, module.base_seed))
    return module.model(input_ids=ids, use_cache=False).logits


def test_compile_dropout_auto_is_the_kernel_on_a_gpu_only():
    from src.core.dropout import wants_kernel
    from src.utils.config import ConfigError

    assert wants_kernel("auto", torch.device("cuda")) and not wants_kernel("auto", torch.device("cpu"))
    assert wants_kernel(True, torch.device("cpu")) and not wants_kernel(False, torch.device("cuda"))
    with pytest.raises(ConfigError, match=r"compile_dropout='yes': use true, false or auto"):
        wants_kernel("yes", torch.device("cpu"))


def gpt2(**options):
    from src.lm.models.gpt2_module import GPT2LitModule

    return GPT2LitModule(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=16, **options)


def logits(module, ids, index, training, seed=0):
    from src.core import dropout

    module.train(training)
    torch.manual_seed(seed)
    if training:
        dropout.set_keys(dropout.row_keys(torch.as_tensor(index), ids.shape[0], 0, module.base_seed))
    with torch.no_grad():
        return module.model(input_ids=ids, use_cache=False).logits.double()


def test_every_dropout_of_a_model_is_keyed_and_applied():
    """model.dropout=0.1 with LoRA: no torch dropout is left (modules, GPT-2's attention, LoRA's), a training forward
    draws nothing from torch's generator and drops (it differs from evaluation), and attention dropout alone drops
    too; in evaluation the keyed attention gives the logits of the model's own sdpa attention."""
    from torch import nn

    from src.core.dropout import KeyedDropout

    torch.manual_seed(0)
    module = gpt2(
        dropout=0.1, lora={"enabled": True, "r": 4, "alpha": 8, "dropout": 0.05, "target_modules": ["c_attn"]}
    )
    assert not any(type(m) is nn.Dropout for m in module.model.modules())
    names = [m.name for m in module.model.modules() if isinstance(m, KeyedDropout) and m.p > 0]
    assert any("lora_dropout" in n for n in names) and any("resid_dropout" in n for n in names), names
    assert module.hf_model.config._attn_implementation == "keyed_sdpa"
    ids = torch.randint(0, 64, (3, 16))
    a, b = (logits(module, ids, [4, 1, 7], True, seed) for seed in (1, 2))
    assert torch.equal(a, b)
    assert (a - logits(module, ids, [4, 1, 7], False)).abs().max() > 1e-3

    attention_only = gpt2(dropout=None, config={"attn_pdrop": 0.5, "resid_pdrop": 0.0, "embd_pdrop": 0.0})
    # GPT-2's attn_dropout module serves only its reordered-upcast path: the attention function draws it
    assert {
        m.name.rsplit(".", 1)[1] for m in attention_only.model.modules() if isinstance(m, KeyedDropout) and m.p
    } == {"attn_dropout"}
    assert (logits(attention_only, ids, [0, 1, 2], True) - logits(attention_only, ids, [0, 1, 2], False)).abs().max()

    plain = gpt2(dropout=0.0, attn_implementation="sdpa")
    plain.model.load_state_dict(attention_only.model.state_dict())
    assert plain.hf_model.config._attn_implementation == "sdpa"
    for m in (plain, attention_only):
        m.model.double()
    within((logits(plain, ids, [], False) - logits(attention_only, ids, [], False)).abs().max().item(), 1e-12, "eval")


def test_a_rows_training_logits_are_the_same_alone_or_in_any_batch():
    """The whole model, dropout on everywhere: a sample's training logits do not depend on the rows beside it or on
    how far the batch is padded (right padding: its own positions see the same masks)."""
    torch.manual_seed(0)
    module = gpt2(dropout=0.2)
    module.model.double()
    ids = torch.randint(0, 64, (4, 12))
    batch = logits(module, ids, [10, 11, 12, 13], True)
    # float64: another batch shape may take another matmul blocking (last bits); another mask moves them by ~1e-2
    within((logits(module, ids[2:3], [12], True)[0] - batch[2]).abs().max().item(), 1e-12, "alone")
    within((logits(module, ids[[3, 0]], [13, 10], True)[1] - batch[0]).abs().max().item(), 1e-12, "reordered")
    padded = torch.cat([ids, torch.zeros(4, 4, dtype=ids.dtype)], 1)
    within((logits(module, padded, [10, 11, 12, 13], True)[:, :12] - batch).abs().max().item(), 1e-12, "padded")


def test_a_training_batch_that_does_not_name_its_samples_is_one_sentence():
    """A training forward with dropout whose batch has no sample indices (GRPO's sampled completions, with its
    disable_dropout=false) stops in one sentence instead of drawing unkeyed masks."""
    from src.utils.config import ConfigError

    module = gpt2(dropout=0.1)
    module.train()
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(ConfigError, match=r"does not say which sample each row is .* set model\.dropout=0\.$"):
        module.lm_forward({"input_ids": ids})
    with pytest.raises(ConfigError, match="does not say which sample"):  # 3 rows cannot be blocks of 2 samples
        module.lm_forward({"input_ids": torch.cat([ids, ids[:1]]), "sample_index": torch.tensor([0, 1])})
    module.lm_forward({"input_ids": ids, "sample_index": torch.tensor([0, 1])})
    module.eval()
    module.lm_forward({"input_ids": ids})  # evaluation draws no mask


def test_model_dropout_sets_a_pretrained_checkpoints_probabilities():
    """model.dropout=null keeps a checkpoint's dropout (tiny GPT-2's 0.1, keyed); a number sets every probability
    of its config before the model is built, so its attention is left as it was at 0."""
    from src.core.dropout import KeyedDropout, config_fields
    from src.lm.models.causal_lm import CausalLMLitModule

    path = str(shared("tiny-gpt2"))
    kept = CausalLMLitModule(vocab_size=50257, seq_len=32, pretrained=path)
    assert {m.p for m in kept.model.modules() if isinstance(m, KeyedDropout)} == {0.1}
    assert kept.config._attn_implementation.startswith("keyed_") and kept.dropouts > 0
    off = CausalLMLitModule(vocab_size=50257, seq_len=32, pretrained=path, dropout=0.0)
    assert not any(config_fields(off.config).values()) and off.dropouts == 0
    assert not off.config._attn_implementation.startswith("keyed_")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architectures_dropout_is_keyed(arch):
    """model.dropout=0.2 on each architecture (the sample; every one under TEST_ALL_ARCHITECTURES=1): where the model
    transformers builds with that config draws dropout (two training forwards under two generator states differ),
    the template's training forward with keys set draws nothing from the generator and does drop (it differs from
    evaluation); its evaluation gives the logits of the model built without dropout."""
    import copy

    from transformers import AutoModelForCausalLM

    from src.core import dropout
    from src.lm.models.causal_lm import CausalLMLitModule

    config, fields = tiny_or_skip(arch)
    modules = []
    for p in (0.2, 0.0):
        torch.manual_seed(0)
        try:
            modules.append(CausalLMLitModule(vocab_size=config.vocab_size, seq_len=16, model_type=arch, config=fields,
                                             dropout=p))  # fmt: skip
        except Exception as error:
            if arch in SAMPLE:
                raise
            pytest.skip(f"the template does not build it at a tiny size (docs/models.md): {error}"[:300])
    module, plain = modules
    with_dropout = copy.deepcopy(plain.config)
    dropout.set_probabilities(with_dropout, 0.2)
    theirs = AutoModelForCausalLM.from_config(with_dropout)
    plain.model.load_state_dict(module.model.state_dict())
    theirs.load_state_dict(module.model.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        for m in (module.hf_model, plain.hf_model, theirs):
            eager_experts(m).to(dtype)
        try:
            evaluation = logits(module, ids, [], False)
            break
        except RuntimeError:  # a kernel without float64 (linear attention's): float32
            continue
    within((evaluation - logits(plain, ids, [], False)).abs().max().item(), tol * evaluation.abs().max().item(), "eval")
    theirs.train()
    with torch.no_grad():
        drawn = [(torch.manual_seed(seed), theirs(input_ids=ids, use_cache=False).logits)[1] for seed in (1, 2)]
    train = [logits(module, ids, [3, 4], True, seed) for seed in (1, 2)]
    assert torch.equal(train[0], train[1])
    if not torch.equal(*drawn):  # transformers' model draws dropout: the template's drops, keyed
        assert module.dropouts and (train[0] - evaluation).abs().max() > 1e-3 * evaluation.abs().max(), arch


# ---- through train.py (slow) ----

RUN = [
    "model.dropout=0.1",
    "model.lora.enabled=true",  # LoRA's own dropout, 0.05, keyed too
    "model.lora.target_modules=[c_attn,c_proj]",
    "model.scheduler.num_warmup_steps=1",
]


def train(tmp: Path, name: str, args: list[str], model: list[str] | None = None) -> dict:
    """test_parity's GPT-2 run with RUN's dropout, or with `model`'s overrides instead (another architecture)."""
    from test_fsdp import last_ckpt, params_of, train_sharded
    from test_parity import GPT2, train

    base = GPT2 + RUN if model is None else [a for a in GPT2 if not a.startswith("model.")] + model
    if not {"trainer=fsdp", "trainer=deepspeed"} & set(args):  # a checkpoint file, not a sharded dir
        return train(tmp, name, base + args)
    return {**train_sharded(tmp, name, base + args), "params": params_of(last_ckpt(tmp, name))}


@pytest.mark.slow
def test_dropout_trains_the_same_model_on_any_layout(tmp_path, reference):
    """GPT-2 with dropout 0.1 everywhere (attention included) and LoRA's 0.05: 1 x 8 = 2 ranks x 2 x accumulation 2 =
    FSDP2's 2 x 4, step by step, to fp32 rounding. Seed-OSS, whose forward draws its residual dropout itself
    (functional, keyed through its modules' hooks), at 0.1: 1 process = FSDP2 on 2 ranks. ZeRO-2: below."""
    from test_architecture_matrix import overrides
    from test_parity import GPT2, assert_same_series, max_param_diff

    one = reference(GPT2 + RUN)  # shared with the ZeRO-2 case below
    accumulate = ["trainer.accumulate_grad_batches=2", "trainer.val_check_interval=12"]  # micro-batches
    ddp = train(tmp_path, "2x2x2", ["trainer=ddp", "trainer.devices=2", *accumulate])
    fsdp = train(tmp_path, "fsdp", ["trainer=fsdp", "trainer.devices=2"])
    seed_oss = ["model=causal_lm", *overrides("seed_oss"), "model.dropout=0.1"]
    seed_one = train(tmp_path, "seed_oss", [], seed_oss)
    seed_fsdp = train(tmp_path, "seed_oss_fsdp", ["trainer=fsdp", "trainer.devices=2"], seed_oss)
    for a, b in ((one, ddp), (one, fsdp), (seed_one, seed_fsdp)):
        assert_same_series(a, b, "train/loss", 1e-5)
        assert_same_series(a, b, "val/loss", 1e-5)
        within(max_param_diff(a["params"], b["params"]), 1e-5, "params")


@pytest.mark.slow  # two ranks compile the kernels
def test_the_dropout_kernel_trains_like_the_eager_ops_on_two_ranks(tmp_path, reference):
    """compile_dropout=true through train.py on 2 DDP ranks: the model that 1 process trains with the eager ops (the
    run above), and the run's log says the kernel ran."""
    from test_parity import GPT2, assert_same_series, max_param_diff

    one = reference(GPT2 + RUN)
    ddp = train(tmp_path, "kernel", ["trainer=ddp", "trainer.devices=2", "compile_dropout=true"])
    assert_same_series(one, ddp, "train/loss", 1e-5)
    within(max_param_diff(one["params"], ddp["params"]), 1e-5, "params")
    (log,) = (tmp_path / "kernel" / "train" / "runs").glob("*/train.log")
    assert "Dropout keyed by sample, as one compiled kernel per tensor (compile_dropout=true)" in log.read_text()


@FULL_MATRIX_ONLY  # suite time, 11 s: keyed dropout on every layout above (DDP with accumulation, FSDP2) and ZeRO-2's parity without dropout (test_deepspeed.py) stay
@pytest.mark.slow
def test_dropout_under_zero2_trains_like_one_process(tmp_path, reference):
    """The same GPT-2 with dropout and LoRA under ZeRO-2 on 2 ranks (DeepSpeed's CPU-capable subclass): 1 process's
    model. (LoRA trains matrices only: the optimizer gets no empty parameter group, which ZeRO would drop under the
    LR schedule's feet.)"""
    from test_deepspeed import CPU_DS
    from test_parity import GPT2, assert_same_series, max_param_diff

    pytest.importorskip("deepspeed")
    one = reference(GPT2 + RUN)
    zero = train(tmp_path, "zero2", CPU_DS + ["trainer.strategy.stage=2"])
    assert_same_series(one, zero, "train/loss", 1e-5)
    within(max_param_diff(one["params"], zero["params"]), 1e-5, "params")


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, sentence",
    [
        # Mixtral's router jitter multiplies the tokens by noise of its own drawing
        (
            ["model=causal_lm", "model.model_type=mixtral", "+model.config.router_jitter_noise=0.1"]
            + [f"+model.config.{k}={v}" for k, v in dict(hidden_size=16, intermediate_size=32).items()]
            + [f"+model.config.{k}={v}" for k, v in dict(num_hidden_layers=1, num_attention_heads=2).items()]
            + ["+model.config.num_key_value_heads=1", "+model.config.num_local_experts=2"],
            ["draws random numbers of its own (router_jitter_noise=0.1", "set model.config.router_jitter_noise=0."],
        ),
        (
            ["model.dropout=0.1", "trainer=tp", "trainer.devices=2"],
            ["which TensorParallelStrategy would draw per rank", "set model.dropout=0."],
        ),
        (
            ["model.dropout=0.1", "trainer=pipeline", "trainer.devices=2"],
            ["which PipelineStrategy would draw per rank", "set model.dropout=0."],
        ),
    ],
    ids=["jitter", "tp", "pipeline"],
)
def test_a_forward_with_randomness_no_key_reaches_is_refused_before_step_1(tmp_path, args, sentence):
    from test_errors import assert_one_clear_line, run_as_user
    from test_parity import GPT2, QUIET

    dirs = {"log_dir": tmp_path / "run", "cache_dir": tmp_path / "cache"}
    data = [arg for arg in GPT2 if not arg.startswith("model.")] if "model=causal_lm" in args else GPT2
    assert_one_clear_line(*run_as_user(["train.py", *QUIET, *path_overrides(dirs), *data, *args])[:2], *sentence)


@pytest.mark.slow
@FULL_MATRIX_ONLY  # suite time: ZeRO-2 above keys the same way; this adds ZeRO-3's rebuilt policy and reference
def test_dpo_with_dropout_under_zero3_trains_like_one_process(tmp_path):
    """DPO with its dropout kept (disable_dropout=false) at 0.1: ZeRO-3 builds the policy and the reference again inside
    zero.Init, each with the keyed attention's functions; 1 process = 2 ranks, every step."""
    from test_dpo import CPU_DS, GPT2_SHAPE, dpo_run_args
    from test_fsdp import train_sharded
    from test_parity import assert_same_series
    from test_parity import train as train_file

    pytest.importorskip("deepspeed")
    args = dpo_run_args(GPT2_SHAPE) + ["model.dropout=0.1", "model.objective.disable_dropout=false"]
    one = train_file(tmp_path, "one", args)
    zero3 = train_sharded(tmp_path, "zero3", args + CPU_DS + ["trainer.strategy.stage=3"])
    assert_same_series(one, zero3, "train/loss", 1e-5)


@pytest.mark.slow
@FULL_MATRIX_ONLY  # suite time: the masks' keys (step, sample) are what the resume tests already restore
def test_dropout_through_a_change_of_devices_mid_run_ends_like_the_straight_run(tmp_path):
    """Dropout 0.1: a 2-rank DDP run's step-4 checkpoint resumed on 1 process x accumulation 2 ends as the straight
    1-process run (tests/test_resume_anywhere.py's 8 steps, global batch 12)."""
    import test_resume_anywhere as resume

    straight = resume.run(tmp_path, "one", ["model.dropout=0.1"])
    source = resume.run(tmp_path, "ddp2", ["model.dropout=0.1", "trainer=ddp", "trainer.devices=2"])
    moved = ["model.dropout=0.1", "trainer.accumulate_grad_batches=2", f"ckpt_path={source['mid']}"]
    resume.assert_like_straight(resume.run(tmp_path, "resumed", moved), straight)
