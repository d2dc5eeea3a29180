"""model.pad_vocab_multiple (src/lm/features/padded_vocab.py): the vocabulary padded to a multiple of N rows computes what
the unpadded model does (float64: loss, every gradient, the padded rows' gradients 0, sampling never picks a padded
token); under tensor parallel (the head a replicated DTensor) 2 ranks train as 1 process; export-hf writes the
unpadded vocabulary; what it cannot serve is refused in one sentence."""

from __future__ import annotations

import pytest
import torch
from conftest import shared

from tests.helpers.architectures import tiny_config
from tests.helpers.margins import close64

V = 100  # the tokenizer's vocabulary in the module-level tests: padded to 128


def module_of(arch: str, **kwargs):
    from src.lm.models.causal_lm import CausalLMLitModule
    from src.lm.models.gpt2_module import GPT2LitModule

    torch.manual_seed(0)
    if arch == "gpt2":
        return GPT2LitModule(vocab_size=V, seq_len=32, n_layer=2, n_head=2, n_embd=16, compile_loss=False, **kwargs)
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(arch).to_dict()
    config = {k: v for k, v in tiny_config(arch).to_dict().items() if k in defaults and v != defaults[k]}
    config.pop("vocab_size", None)
    return CausalLMLitModule(vocab_size=V, seq_len=32, model_type=arch, config=config, compile_loss=False, **kwargs)


def batch_of() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.roll(-1, 1), "sample_index": torch.tensor([3, 8])}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # GPT-2 ties its head to the embedding; tiny Llama does not
def test_a_padded_vocabulary_computes_what_the_unpadded_model_does(arch):
    padded, plain = module_of(arch, pad_vocab_multiple=64).double(), module_of(arch).double()
    assert padded.config.vocab_size == 128 and padded.unpadded_vocab == V and plain.unpadded_vocab is None
    # the unpadded model holds the padded one's real rows
    shapes = {k: v.shape for k, v in plain.state_dict().items()}
    plain.load_state_dict({k: v[: shapes[k][0]] if v.dim() else v for k, v in padded.state_dict().items()})
    batch = batch_of()
    results = []
    for module in (padded, plain):
        module.train()
        loss, _ = module.loss_and_count(batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in module.named_parameters()}))
    (loss, grads), (plain_loss, plain_grads) = results
    close64(loss, plain_loss, "loss")
    for name, grad in plain_grads.items():
        close64(grads[name][: grad.shape[0]], grad, f"grad of {name}")
        if grads[name].shape != grad.shape:  # the padded rows: nothing trains them
            assert grads[name].shape[0] == 128 and not grads[name][V:].any(), name
    padded.eval()
    with torch.no_grad():
        logits = padded.lm_forward({"input_ids": batch["input_ids"]}).logits
        assert (logits[..., V:] == torch.finfo(logits.dtype).min).all()
        torch.manual_seed(0)
        sampled = padded.model.generate(batch["input_ids"][:, :4], max_new_tokens=24, do_sample=True, top_k=0)
    assert sampled.max() < V  # probability 0: never drawn
    padded.padding.probe(padded)  # its probe passes: GPT-2's and Llama's logits are their heads' outputs


def test_the_padding_mask_compiled_with_the_whole_model_computes_the_eager_one(monkeypatch):
    """model.compile=true traces the head's hook (its in-place fill outside autograd) into the graph: through
    AOTAutograd (functionalized, as inductor gets it) loss and every gradient are the eager module's, in float64."""
    from src.parallel.parallelize import parallelize

    plain = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: plain(self, backend="aot_eager"))
    torch._dynamo.reset()
    module = module_of("gpt2", pad_vocab_multiple=64, compile=True)
    module = parallelize(module, **module.wrappers()).double()
    batch = batch_of()
    results = []
    for stance in ("default", "force_eager"):
        module.zero_grad()
        with torch.compiler.set_stance(stance):
            loss, _ = module.loss_and_count(batch)
            loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}))
    (loss, grads), (eager_loss, eager_grads) = results
    close64(loss, eager_loss, "loss")
    for name, grad in eager_grads.items():
        close64(grads[name], grad, f"grad of {name}")
    assert not grads["model.transformer.wte.weight"][V:].any()


def test_what_the_padding_cannot_serve_is_one_sentence():
    from test_configs import compose_cfg

    from src.run.checks import resolve_and_check_values
    from src.utils.config import ArchitectureRefused, ConfigError

    with pytest.raises(ConfigError, match=r"a number of rows >= 1, or null"):
        module_of("gpt2", pad_vocab_multiple=0)
    with pytest.raises(ConfigError, match=r"a pretrained model keeps its checkpoint's vocabulary"):
        module_of("gpt2", pad_vocab_multiple=64, pretrained=str(shared("tiny-gpt2")))
    with pytest.raises(ConfigError, match=r"the chunks call the head without the padding's mask"):
        module_of("gpt2", pad_vocab_multiple=64, loss_chunk=8)
    # Gemma 2 soft-caps its logits: the padded columns would leave the minimum (checked before step 1)
    gemma2 = module_of("gemma2", pad_vocab_multiple=64)
    with pytest.raises(ArchitectureRefused, match=r"Gemma2ForCausalLM's logits are not its head's output"):
        gemma2.padding.probe(gemma2)
    for strategy in ("trainer=ddp", "trainer=fsdp", "trainer=tp", "trainer=deepspeed_stage_3"):
        resolve_and_check_values(compose_cfg([strategy, "model.pad_vocab_multiple=64"]))  # these run it
    with pytest.raises(ConfigError, match=r"no rank runs the whole model, so the padding's mask is not checked"):
        resolve_and_check_values(compose_cfg(["trainer=pipeline", "model.pad_vocab_multiple=64"]))


@pytest.mark.slow
def test_a_padded_gpt2_on_2_tensor_parallel_ranks_trains_as_1_process_and_exports_unpadded(tmp_path):
    from test_fsdp import last_ckpt, train_sharded
    from test_parity import GPT2, max_param_diff, train
    from transformers import AutoModelForCausalLM

    from src.checkpoint.convert import build_module, export_hf, load_checkpoint
    from tests.helpers.margins import within

    args = GPT2 + ["model.pad_vocab_multiple=64"]
    one = train(tmp_path, "one", args)
    train_sharded(tmp_path, "tp", args + ["trainer=tp", "trainer.devices=2", "trainer.strategy.tensor_parallel_size=2"])
    assert one["params"]["model.transformer.wte.weight"].shape[0] % 64 == 0
    within(max_param_diff(one["params"], load_checkpoint(last_ckpt(tmp_path, "tp"))["state_dict"]), 1e-5, "params")
    ckpt = last_ckpt(tmp_path, "one")
    out = export_hf(ckpt, tmp_path / "hf")
    module, _ = build_module(load_checkpoint(ckpt))
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    vocab = module.unpadded_vocab
    assert exported.config.vocab_size == vocab and exported.get_output_embeddings().weight.shape[0] == vocab
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, module.lm_forward({"input_ids": ids}).logits[..., :vocab])


def test_generate_pys_keyed_sampling_never_picks_a_padded_token():
    """generate.py's sampling (src/run/sampling.py: keyed Gumbel-max, temperature, top-k, top-p) reads the head's
    masked output: at temperature 5, where the padded rows' own logits would be drawn often, no padded id comes."""
    from types import SimpleNamespace

    from src.run import sampling

    padded = module_of("gpt2", pad_vocab_multiple=64).eval()
    drawn = []
    for number, (top_k, top_p) in enumerate([(0, 1.0), (120, 1.0), (0, 0.99)]):
        cfg = SimpleNamespace(temperature=5.0, top_k=top_k, top_p=top_p, max_new_tokens=24, seed=0)
        drawn += sampling.complete(padded.model, [1, 2, 3, 4], cfg, number, stops=[V + 27])  # a stop never drawn
    assert len(drawn) == 72 and max(drawn) < V
