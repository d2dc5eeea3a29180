"""The model module and its generation callback, in-process."""

from __future__ import annotations

import math

import pytest
import torch

from src.lm.callbacks.generate_text import GenerateText
from src.lm.data.tokenizers import ByteTokenizer
from src.lm.models.gpt2_module import GPT2LitModule
from tests.helpers.margins import close64, within


class IdsTokenizer(ByteTokenizer):
    """Bytes, decoded as their ids: completions compare token for token (random bytes decode to U+FFFD alike)."""

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def tiny_model() -> GPT2LitModule:
    torch.manual_seed(0)
    return GPT2LitModule(vocab_size=257, seq_len=32, n_layer=1, n_head=2, n_embd=16)


def test_generation_does_not_touch_the_training_rng():
    """Sampling at validation end must not change what the training loop draws next (e.g. the data order)."""
    model, cb = tiny_model(), GenerateText(prompts=["def ", "x = "], max_new_tokens=8, do_sample=True, top_k=5)
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    first = cb.generate(model.model, ByteTokenizer())
    assert torch.equal(torch.rand(5), expected)
    assert cb.generate(model.model, ByteTokenizer()) == first  # its own seed: repeatable samples
    assert [p for p, _ in first] == ["def ", "x = "] and model.model.training


def test_prompts_generated_together_complete_as_each_would_alone():
    """GenerateText runs all prompts in one left-padded batch: each greedy completion is the one a call with
    that prompt alone gives (positions follow the attention mask), for prompts of different lengths."""
    model = GPT2LitModule(vocab_size=257, seq_len=64, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    torch.manual_seed(0)
    with torch.no_grad():  # large random weights: the next token depends on every position (no fixed point)
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    prompts = ["def ", "import os\n", "x"]
    cb = GenerateText(prompts=prompts, max_new_tokens=12, do_sample=False)
    tok = IdsTokenizer()
    together = cb.generate(model.model, tok)
    alone = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode_batch([prompt])[0].tolist()])
        out = model.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.eos_id,
        )[0, ids.shape[1] :].tolist()
        alone.append((prompt, tok.decode(out[: out.index(tok.eos_id)] if tok.eos_id in out else out)))
    assert together == alone
    assert len({completion for _, completion in alone}) == 3 and all(len(c.split()) >= 8 for _, c in alone), alone


def greedy_by_full_forwards(model, tok, prompt: str, max_new_tokens: int) -> tuple[str, str]:
    """The oracle: greedy decoding by a full forward of the whole sequence per token (no cache, no padding,
    no `generate`), through the model's own forward, where peft puts its virtual tokens as in training."""
    seq, new = tok.encode_batch([prompt])[0].tolist(), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = model(input_ids=torch.tensor([seq])).logits[0, -1].argmax().item()
            if token == tok.eos_id:
                break
            seq, new = seq + [token], new + [token]
    return prompt, tok.decode(new)


@pytest.mark.parametrize("method", ["lora", "prompt_tuning", "prefix_tuning", "p_tuning", "bottleneck"])
def test_prompts_generated_together_under_a_peft_adapter_complete_as_greedy_full_forwards(method):
    """The same under peft adapters, against an oracle that does not go through `generate`: with transformers
    5.24 and peft 0.21.2, peft's own generate ignored prefix and prompt tuning's learned tokens after the first
    step (its samples were those of another model), batched or alone."""
    from peft import LoraConfig, PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model

    from src.lm.features import bottleneck

    config = {
        "lora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True),
        "prompt_tuning": lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "prefix_tuning": lambda: PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "p_tuning": lambda: PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=8),
        "bottleneck": lambda: bottleneck.BottleneckConfig(reduction_factor=4),  # hooks on the sublayers, cache or not
    }[method]()
    base = GPT2LitModule(vocab_size=257, seq_len=64, n_layer=2, n_head=2, n_embd=32, dropout=0.0).model
    model = bottleneck.add(base, config) if method == "bottleneck" else get_peft_model(base, config)
    torch.manual_seed(0)
    with torch.no_grad():  # large random weights, adapters too: the next token depends on every position
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    assert_batched_generation_is_the_oracles(model)


def assert_batched_generation_is_the_oracles(model) -> None:
    """GenerateText's one left-padded batch of prompts of different lengths == greedy_by_full_forwards of each."""
    prompts, tok = ["def ", "import os\n", "x"], IdsTokenizer()
    together = GenerateText(prompts=prompts, max_new_tokens=10).generate(model, tok)
    model.eval()
    oracle = [greedy_by_full_forwards(model, tok, prompt, 10) for prompt in prompts]
    assert together == oracle and len({completion for _, completion in oracle}) >= 2, (together, oracle)


def test_generation_under_prompt_learning_stops_inside_the_position_table():
    """Virtual tokens take positions too: a prompt that nearly fills the context still generates (at least one
    token) without running past GPT-2's position embeddings."""
    from peft import PromptTuningConfig, get_peft_model

    base = GPT2LitModule(vocab_size=257, seq_len=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0).model
    model = get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    [(_, completion)] = GenerateText(prompts=["x" * 10], max_new_tokens=8).generate(model, IdsTokenizer())
    assert 1 <= len(completion.split()) <= 16 - 10 - 4, completion


def test_padding_labels_are_not_counted():
    """Labels are already shifted (labels[t] is the target of position t): the loss is their summed
    cross-entropy in fp32, and -100 is no target."""
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 32))
    labels = torch.randint(0, 256, (2, 32))
    labels[0, -1] = -100
    labels[1, 20:] = -100
    loss_sum, n = model.loss_and_count({"input_ids": ids, "labels": labels})
    assert n == 31 + 20
    logits = model(ids).logits
    manual = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 257), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    torch.testing.assert_close(loss_sum, manual)
    torch.testing.assert_close(model(ids, labels).loss, manual / 51)


def test_eval_loss_is_summed_tokens_over_targets_zero_target_batches_add_nothing_and_nan_shows():
    """An evaluation batch whose labels are all -100 (padding of a short shard) adds exactly 0 to the
    loss sum and the count; a NaN loss is not dropped (torchmetrics' MeanMetric would drop it)."""
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 32))
    labels = torch.randint(0, 256, (2, 32))
    metric = model.val_metrics["loss"]
    metric.update(*model.loss_and_count({"input_ids": ids, "labels": labels}))
    expected = metric.compute().clone()
    empty = model.loss_and_count({"input_ids": ids, "labels": torch.full_like(labels, -100)})
    assert empty[0].item() == 0.0 and empty[1].item() == 0
    metric.update(*empty)
    assert metric.compute().item() == expected.item()
    torch.testing.assert_close(expected, model(ids, labels).loss)
    metric.update(torch.tensor(float("nan")), torch.tensor(64))
    assert torch.isnan(metric.compute())


D, V, T = 16, 257, 32  # the tiny model's width, vocabulary and context
BLOCK = 3 * D * D + D * D + 4 * D * D + 4 * D * D  # c_attn, attn.c_proj, c_fc, mlp.c_proj: 12·d² matmul weights
HEAD = V * D  # the LM head's matmul (its weight is the tied token embedding)


def test_flops_per_token_by_hand():
    """Full training: 6N per token, N = the matmul weights (2 blocks + LM head; no embedding lookups, biases
    or LayerNorms), plus PaLM's 12·L·d·T for attention (src/lm/features/flops.py states the convention)."""
    model = GPT2LitModule(vocab_size=V, seq_len=T, n_layer=2, n_head=2, n_embd=D)
    n = 2 * BLOCK + HEAD
    assert n == 10256 and n < model.n_params  # n_params also has wte's lookup, wpe, biases and LayerNorms
    assert model.flops_per_token == 6 * n + 12 * 2 * D * T


def test_lora_flops_by_hand():
    """LoRA (r=2) on c_attn of a frozen 2-layer base. Forward 2 per weight everywhere. Backward: the input
    gradient (2 per weight) of every matmul above the lowest adapter, i.e. all but layer 0's c_attn and its
    lora_A, which read the frozen embeddings; weight gradients (2 per weight) only for the adapters."""
    lora = {"enabled": True, "r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["c_attn"]}
    model = GPT2LitModule(vocab_size=V, seq_len=T, n_layer=2, n_head=2, n_embd=D, lora=lora)
    a, b = D * 2, 2 * 3 * D  # lora_A: d -> r, lora_B: r -> 3d
    forward = 2 * (2 * BLOCK + HEAD + 2 * (a + b))
    input_grads = 2 * ((BLOCK - 3 * D * D + b) + (BLOCK + a + b) + HEAD)
    weight_grads = 2 * 2 * (a + b)
    assert model.flop_count.per_token == forward + input_grads + weight_grads == 40960
    assert model.flop_count.per_token < 4.1 * (2 * BLOCK + HEAD)  # about 4N, not 6N
    assert model.flop_count.per_context == 2 * 12 * D  # both layers' q, k, v need gradients
    assert model.flops_per_token == 40960 + 2 * 12 * D * T


def test_padded_batch_flops_and_tokens_count_real_tokens_only():
    """An instruction batch padded to its longest record: 3 records of 5, 32 and 12 real tokens are 49
    tokens, each attending over its own record's length; 96 padded positions would be 2x the work."""
    model = GPT2LitModule(vocab_size=V, seq_len=T, n_layer=2, n_head=2, n_embd=D)
    mask = torch.zeros(3, T, dtype=torch.long)
    for row, length in enumerate((5, 32, 12)):
        mask[row, :length] = 1
    batch = {"input_ids": torch.zeros(3, T, dtype=torch.long), "attention_mask": mask}
    expected = 6 * (2 * BLOCK + HEAD) * 49 + 12 * 2 * D * (5 * 5 + 32 * 32 + 12 * 12)
    assert int(model.flops_of_batch(batch)) == expected
    packed = {"input_ids": torch.zeros(3, T, dtype=torch.long)}  # packed text: no mask, every position is real
    assert int(model.flops_of_batch(packed)) == 3 * T * model.flops_per_token
    from src.callbacks.throughput import _num_items

    assert int(_num_items(batch)) == 49 and _num_items(packed) == 3 * T


@pytest.mark.parametrize("adapter", ["none", "lora_c_attn", "lora_c_fc", "prompt_tuning", "bottleneck"])
def test_flop_count_is_what_autograd_computes(adapter):
    """The count walks the model by rules; torch's FlopCounterMode counts the matmuls a real forward +
    backward runs (eager attention: its two batched matmuls are visible). They must agree exactly, so
    the rule for frozen layers (no weight gradients, no input gradients below the lowest trainable
    parameter) is autograd's."""
    from peft import PromptTuningConfig
    from torch.utils.flop_counter import FlopCounterMode

    kwargs: dict = {"vocab_size": V, "seq_len": T, "n_layer": 2, "n_head": 2, "n_embd": D}
    if adapter.startswith("lora"):
        kwargs["lora"] = {"enabled": True, "r": 2, "alpha": 4, "dropout": 0.0, "target_modules": [adapter[5:]]}
    if adapter == "bottleneck":  # d -> d/4 -> d after each attention and MLP (src/lm/features/bottleneck.py)
        from src.lm.features.bottleneck import BottleneckConfig

        kwargs["peft"] = BottleneckConfig(reduction_factor=4)
    if adapter == "prompt_tuning":  # needs a context longer than the input: the shared tiny pretrained GPT-2
        from conftest import shared

        kwargs = {
            "vocab_size": 50257,
            "seq_len": T,
            "pretrained": str(shared("tiny-gpt2")),
            "peft": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        }
    model = GPT2LitModule(attn_implementation="eager", **kwargs)
    ids = torch.randint(0, 256, (2, T))
    with FlopCounterMode(display=False) as counter:
        model.model(input_ids=ids).logits.sum().backward()
    assert counter.get_total_flops() == int(model.flops_of_batch({"input_ids": ids}))


def test_lr_scaling_rules():
    from src.core.module import scaled_lr

    assert scaled_lr(1e-3, "none", 256, 32) == 1e-3
    assert scaled_lr(1e-3, "linear", 256, 32) == pytest.approx(8e-3)  # Goyal et al.: k x batch, k x LR
    assert scaled_lr(1e-3, "sqrt", 128, 32) == pytest.approx(2e-3)
    assert scaled_lr(1e-3, "linear", 16, 32) == pytest.approx(5e-4)  # smaller batches scale down
    with pytest.raises(ValueError, match="lr_scaling='cubic'"):
        scaled_lr(1e-3, "cubic", 64, 32)
    with pytest.raises(ValueError, match="lr_scaling"):
        GPT2LitModule(vocab_size=257, seq_len=8, lr_scaling="linera")  # caught when the model is built


def test_train_loss_needs_one_reduce_per_logging_step_and_none_otherwise():
    """10 optimizer steps x 2 accumulation micro-batches, logging every 5 steps: exactly 2 all-reduces,
    each over the mean of that step's micro-batch losses."""
    from types import SimpleNamespace

    from src.callbacks.divergence import Divergence

    model = tiny_model()
    reduced, logged = [], []
    strategy = SimpleNamespace(reduce=lambda t, reduce_op: reduced.append(t.clone()) or t)
    trainer = SimpleNamespace(accumulate_grad_batches=2, log_every_n_steps=5, global_step=0, strategy=strategy)
    trainer.callbacks = [Divergence()]  # its flag rides in the loss's all-reduce (watch_step_loss)
    model._trainer = trainer
    model.log_dict = lambda metrics, **kw: logged.append(metrics)
    for batch_idx in range(20):
        trainer.global_step = batch_idx // 2
        model.log_train_loss(torch.tensor(float(batch_idx)), batch_idx)
    assert len(reduced) == 2 and len(logged) == 2
    # steps 4 and 9: mean of micro-batches (8, 9) and (18, 19), with the divergence flag (0: all finite)
    assert [t.tolist() for t in reduced] == [[8.5, 0.0], [18.5, 0.0]]


def test_mfu_is_model_flops_over_the_configured_peak():
    """MFU = flops_per_batch x steps/s / peak; Lightning's Throughput does the division, we check the inputs."""
    from lightning.fabric.utilities.throughput import Throughput

    model = tiny_model()
    per_token = model.flops_per_token
    batch, seq = 4, 32
    flops_per_batch = per_token * batch * seq  # what flops_per_batch returns with micro-batch 4
    t = Throughput(available_flops=1e9, window_size=2)
    t.update(time=1.0, batches=1, samples=batch, lengths=batch * seq, flops=flops_per_batch)
    t.update(time=2.0, batches=2, samples=2 * batch, lengths=2 * batch * seq, flops=flops_per_batch)
    metrics = t.compute()
    assert metrics["device/flops_per_sec"] == pytest.approx(flops_per_batch)  # one batch per second
    assert metrics["device/mfu"] == pytest.approx(flops_per_batch / 1e9)


def test_eager_and_sdpa_attention_compute_the_same_loss_and_gradients():
    """model.attn_implementation is a speed switch only: with right padding masked, both give the same numbers
    (in float64: two kernels, one function)."""
    ids = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[2, 20:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for attn in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = GPT2LitModule(vocab_size=257, seq_len=32, n_layer=2, n_head=2, n_embd=16, attn_implementation=attn)
        model.double()
        assert model.config._attn_implementation == attn
        loss = model(ids, labels, mask).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    close64(loss_a, loss_b, "loss")
    for a, b in zip(grads_a, grads_b):
        close64(a, b, "gradient")


def test_training_forward_runs_one_fused_gelu_kernel_with_gelu_new_values():
    """A GPT-2 built from a config runs its MLP's GELU (the exact one, model.activation_function=gelu) as torch's
    one fused kernel, not gelu_new's separate ops (pow, tanh, mul, add) (faster on a CPU: docs/performance.md).
    The two are different functions, |gelu - gelu_new| <= D (4.7e-4, computed below), so the loss with GPT-2's
    gelu_new is the same to first order in D: |Δ loss| <= D sum |∂loss/∂activation|, allowed twice that (a
    worst case: 3e-6 of it is used here; ReLU, 0.17 from GELU, would not pass). In float64: only the functions
    differ."""
    import torch.nn.functional as F
    from torch.profiler import profile
    from transformers.activations import NewGELUActivation

    batch = {"input_ids": torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"].roll(-1, 1)
    model = GPT2LitModule(vocab_size=257, seq_len=32, n_layer=2, n_head=2, n_embd=16).double()
    activations = []

    def keep(module, args, out) -> None:
        out.retain_grad()
        activations.append(out)

    hooks = [block.mlp.act.register_forward_hook(keep) for block in model.hf_model.transformer.h]
    with profile() as prof:
        loss, _ = model.loss_and_count(batch)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::gelu" in ops and not {"aten::tanh", "aten::pow"} & ops, sorted(ops)
    loss.backward()
    first_order = sum(a.grad.abs().sum().item() for a in activations)
    x = torch.linspace(-10, 10, 200_001, dtype=torch.float64)
    D = (F.gelu(x) - NewGELUActivation()(x)).abs().max().item()
    for hook in hooks:
        hook.remove()
    for block in model.hf_model.transformer.h:  # GPT-2's original activation
        block.mlp.act = NewGELUActivation()
    with torch.no_grad():
        within(abs(model.loss_and_count(batch)[0].item() - loss.item()), 2 * D * first_order, "loss, gelu_new")


@pytest.mark.parametrize("prefix", [False, True], ids=["plain", "prefix_tuning"])
def test_the_forward_without_kv_cache_gives_the_cached_loss(prefix):
    """The training and evaluation forward skips the KV cache transformers would fill (a copy of every layer's keys
    and values): the model returns none, and the loss is the cached forward's, on packed text and on a padded batch,
    also under prefix tuning, whose learned prefix is itself a cache."""
    from conftest import shared
    from peft import PrefixTuningConfig

    from src.lm.objectives.loss import summed_token_loss

    torch.manual_seed(0)
    if prefix:  # on pretrained weights, as users run it: the prefix takes positions of the model's context
        model = GPT2LitModule(
            vocab_size=50257,
            seq_len=32,
            pretrained=str(shared("tiny-gpt2")),
            peft=PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        )
    else:
        model = GPT2LitModule(vocab_size=257, seq_len=32, n_layer=2, n_head=2, n_embd=16)
    model.double()  # with and without the cache are two computations: compared in float64
    caches = []
    model.hf_model.register_forward_hook(lambda module, args, out: caches.append(out.past_key_values))
    ids, labels = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    mask = torch.ones_like(ids)
    mask[1, 20:], labels[1, 20:] = 0, -100
    for batch in ({"input_ids": ids, "labels": labels}, {"input_ids": ids, "labels": labels, "attention_mask": mask}):
        caches.clear()
        loss_sum, n_targets = model.loss_and_count(batch)
        cached = model.model(input_ids=ids, attention_mask=batch.get("attention_mask"), use_cache=True).logits
        assert caches[0] is None and caches[1] is not None  # the hook sees a cache where one is made
        expected_sum, expected_n = summed_token_loss(cached, labels)
        close64(loss_sum, expected_sum, "loss sum")
        assert n_targets == expected_n


def test_peak_memory_counts_a_new_allocation():
    """On a CPU it is the process's peak RSS: touching memory beyond the old peak raises it by as much. The block
    reaches 512 MiB above the old peak and the test asks for 100: the resident set also holds pages of mapped files
    (torch's libraries), which the kernel may drop while the block is touched when other processes need memory (the
    likely reason a full suite's run once saw the peak stay where it was with a 128 MiB margin)."""
    import os

    from src.callbacks.throughput import peak_memory_mib

    before = peak_memory_mib(torch.device("cpu"))
    with open("/proc/self/statm") as f:
        resident_mib = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    extra = before - resident_mib + 512  # 512 MiB above the old peak
    block = torch.ones(int(extra * 2**20) // 4)  # float32; ones() touches every page
    assert peak_memory_mib(torch.device("cpu")) - before >= 100 and block[-1] == 1


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fused_optimizer_clips_like_the_unfused_one_under_amp(precision):
    """Lightning refuses gradient clipping with a fused optimizer under AMP; LitModule clips anyway,
    and correctly: on unscaled gradients (fp16 with a GradScaler) exactly as the foreach optimizer is clipped.
    Plain SGD, so the update is lr x the clipped gradient and a wrong clip shows in the weights."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from src.core.module import LitModule

    class Regression(LitModule):
        def __init__(self, fused: bool) -> None:
            super().__init__(None, None, 0.0, "none", 1)
            torch.manual_seed(0)
            self.net, self.fused = torch.nn.Linear(16, 1), fused

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, fused=self.fused, foreach=not self.fused)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, 3 * x.sum(1, keepdim=True))

    def weights_after(fused: bool, clip: float) -> torch.Tensor:
        plugin = MixedPrecision(
            precision, "cpu", torch.amp.GradScaler("cpu", init_scale=256.0) if precision == "16-mixed" else None
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=4,
            gradient_clip_val=clip,
            plugins=[plugin],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = Regression(fused)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=16))
        return model.net.weight.detach().clone()

    torch.manual_seed(0)
    start = torch.nn.Linear(16, 1).weight.detach()
    fused, foreach, unclipped = weights_after(True, 0.05), weights_after(False, 0.05), weights_after(True, 0.0)
    torch.testing.assert_close(fused, foreach)
    # each step moved the weights by exactly lr x clip, and without clipping they move much further
    assert (fused - start).norm() <= 4 * 0.1 * 0.05 + 1e-4 < (unclipped - start).norm() / 10


def test_train_py_runs_bf16_with_the_default_fused_adamw_and_clipping(tmp_path, dirs):
    """What trainer=gpu and experiment=gpt2_small run: bf16-mixed, fused AdamW, gradient clipping."""
    from conftest import FAST, path_overrides
    from test_configs import compose_cfg

    from train import train

    cfg = compose_cfg(
        FAST
        + path_overrides(dirs)
        + [
            "trainer.precision=bf16-mixed",
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
            "trainer.log_every_n_steps=2",
            "callbacks.throughput.window_size=2",
            "trainer.limit_val_batches=2",
            "test=false",
            "logger=csv",
            "optimized_metric=val/loss",
        ],
        tmp=tmp_path,
    )
    assert cfg.trainer.gradient_clip_val > 0 and cfg.model.optimizer.fused
    assert 0 < train(cfg) < math.log(257)  # below the uniform guess's loss after 4 steps
    import csv

    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    assert any(row["train/device/items_per_sec"] for row in rows)  # the throughput callback
    memory_steps = [int(row["step"]) for row in rows if row["train/device/peak_memory_mib"]]
    assert memory_steps == [2, 4]  # once per logging step (log_every_n_steps=2), not every step


def test_throughput_reads_the_clock_on_logging_steps_only_and_leaves_validation_out(tmp_path, monkeypatch):
    """A fake clock: every training batch takes 1 s, every validation batch 100 s, every test batch 10 s.
    The logged rates must be exactly those (validation left out of training's, also when it starts
    between logging steps), with one device sync per logging step or evaluation, not one per batch."""
    import csv
    import types

    import lightning as L

    import src.callbacks.throughput as throughput

    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(throughput, "time", clock)
    syncs = []
    monkeypatch.setattr(throughput, "wait_for_device", lambda device: syncs.append(device))

    class Clock(L.Callback):
        def on_train_batch_start(self, *args):
            now[0] += 1.0

        def on_validation_batch_start(self, *args):
            now[0] += 100.0

        def on_test_batch_start(self, *args):
            now[0] += 10.0

    class Tokens(L.LightningModule):
        flops_per_batch = 1000.0

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 4)

        def training_step(self, batch, batch_idx):
            return self.embed(batch["input_ids"]).square().mean()

        def validation_step(self, batch, batch_idx):
            pass

        def test_step(self, batch, batch_idx):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    batches = [{"input_ids": torch.zeros(8, 16, dtype=torch.long)}] * 20
    monitor = throughput.TokenThroughputMonitor(window_size=10, peak_flops=1e4)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=20,
        log_every_n_steps=5,
        val_check_interval=7,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[monitor, Clock()],
        logger=L.pytorch.loggers.CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Tokens()
    trainer.fit(
        model,
        torch.utils.data.DataLoader(batches, batch_size=None),
        torch.utils.data.DataLoader(batches[:2], batch_size=None),
    )
    trainer.test(model, torch.utils.data.DataLoader(batches[:3], batch_size=None))

    # logging steps 5, 10, 15, 20; validations after steps 7 and 14: at their start and end; the test's end
    assert len(syncs) == 4 + 2 * 2 + 1
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    train = [row for row in rows if row.get("train/device/batches_per_sec")]
    assert [int(row["step"]) for row in train] == [9, 14, 19]  # a full window from the 3rd reading on
    for row in train:
        assert float(row["train/device/batches_per_sec"]) == pytest.approx(1.0)
        assert float(row["train/device/samples_per_sec"]) == pytest.approx(8.0)
        assert float(row["train/device/items_per_sec"]) == pytest.approx(8 * 16)  # tokens
        assert float(row["train/device/flops_per_sec"]) == pytest.approx(1000.0)
        assert float(row["train/device/mfu"]) == pytest.approx(0.1)
    val = [row for row in rows if row.get("validate/device/batches_per_sec")]
    assert [int(row["step"]) for row in val] == [7, 14]  # once per validation
    for row in val:
        assert float(row["validate/device/batches_per_sec"]) == pytest.approx(0.01)
        assert float(row["validate/device/items_per_sec"]) == pytest.approx(8 * 16 / 100)
    test = [row for row in rows if row.get("test/device/batches_per_sec")]
    assert len(test) == 1 and float(test[0]["test/device/samples_per_sec"]) == pytest.approx(0.8)


def test_convnet_val_loss_shows_nan_and_ignores_padding():
    """A diverged ConvNet's val loss is NaN (torchmetrics' default would drop it); padding adds nothing."""
    from src.models.convnet import ConvNetLitModule

    model = ConvNetLitModule().eval()
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([1, 2, 3, 4])
    with torch.no_grad():
        model._eval_step((x, y), model.val_metrics)
        real = model.val_metrics["loss"].compute()
        model._eval_step((x, torch.full((4,), -100)), model.val_metrics)  # an all-padding batch
        clean = model.val_metrics["loss"].compute()
        assert torch.isfinite(clean) and clean == real  # weight 0: the padding changes nothing
        model._eval_step((x * float("nan"), y), model.val_metrics)
    assert torch.isnan(model.val_metrics["loss"].compute())


def no_cache_module(arch: str, objective) -> "GPT2LitModule":
    from src.lm.models.causal_lm import CausalLMLitModule

    if arch == "gpt2":
        return GPT2LitModule(vocab_size=100, seq_len=32, n_layer=1, n_head=2, n_embd=16, objective=objective,
                             compile_loss=False)  # fmt: skip
    config = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 32}  # fmt: skip
    return CausalLMLitModule(vocab_size=100, seq_len=32, model_type=arch, config=config, objective=objective,
                             compile_loss=False)  # fmt: skip


@pytest.mark.parametrize("objective", ["sft", "sft-packed", "dpo", "dpo-lora", "reward", "grpo"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_no_training_or_evaluation_forward_fills_a_kv_cache(arch, objective, monkeypatch):
    """Every forward an objective's loss runs (the policy's and the reference's) asks for no KV cache and returns
    none, whatever the module's device: the module is made to report a CUDA device, where transformers' default
    (config.use_cache) would fill one in every training forward."""
    from src.lm.models.causal_lm import CausalLMLitModule
    from src.lm.objectives.dpo import DPO
    from src.lm.objectives.grpo import GRPO
    from src.lm.objectives.reward import Reward
    from src.lm.objectives.verifiers import exact_match

    made = {"sft": None, "sft-packed": None, "dpo": DPO(), "dpo-lora": DPO(), "reward": Reward(center_rewards=0.01),
            "grpo": GRPO(rewards=[exact_match], num_generations=2, max_new_tokens=3, beta=0.04)}[objective]  # fmt: skip
    module = no_cache_module(arch, made)
    if objective == "dpo-lora":  # the reference is the model with its adapter disabled
        from src.lm import hf

        module.model = __import__("peft").get_peft_model(
            module.model,
            hf.lora_config(
                r=2, alpha=4, dropout=0.0, target_modules=["c_attn" if arch == "gpt2" else "q_proj"], model=module.model
            ),
        )
        module.reference = None
    monkeypatch.setattr(CausalLMLitModule, "device", property(lambda self: torch.device("cuda")))
    seen = []

    def record(_, args, kwargs, output):
        seen.append((kwargs.get("use_cache"), getattr(output, "past_key_values", None)))

    for network in [module.hf_model] + ([module.reference] if module.reference is not None else []):
        network.register_forward_hook(record, with_kwargs=True)
    ids = torch.randint(0, 100, (4, 10), generator=torch.Generator().manual_seed(0))
    if objective.startswith("sft"):
        batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
        if objective == "sft-packed":
            batch["position_ids"] = torch.cat([torch.arange(6), torch.arange(4)]).repeat(4, 1)
        module.loss_and_count(batch)
    elif objective == "grpo":
        module.objective.token_logps(module.model, module, ids, 4)
        module.objective.reference_logps(module, ids, 4)
    else:
        batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "attention_mask": torch.ones_like(ids),
                 "pair_index": torch.arange(2)}  # fmt: skip
        module.objective.pair_sums(module, batch)
    expected = 2 if objective in ("dpo", "dpo-lora") or (objective == "grpo") else 1
    assert len(seen) == expected and all(use is False and cache is None for use, cache in seen), seen
