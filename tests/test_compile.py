"""model.compile compiles and stays compiled: through torch's own dynamo counters, on a CPU with inductor, the
compiled region (each whole network by default under DDP and one device; each block with model.compile=blocks) is
compiled once for training and once for evaluation (grad mode is a guard), with no graph break, and no step after
the first compiles again; the forwards that are not the run's (generation, the packing check) run eagerly instead
of compiling graphs of their own. (A KV cache in the training forward made every block recompile on a guard of
transformers' DynamicCache until dynamo's limit, then run eagerly: seen on an H200, ../shared/gpu/.) And the
compiled model computes what the eager one does: in float64, loss and gradients to FLOAT64_TOL; under DDP through
train.py, what the eager run trains (full matrix)."""

from __future__ import annotations

import pytest
import torch
from conftest import FULL_MATRIX_ONLY

from tests.helpers.architectures import SAMPLE, eager_experts, tiny_config
from tests.helpers.margins import close64

pytestmark = pytest.mark.slow  # inductor compiles C++ kernels: 15-40 s an architecture on 2 cores


def compiled_module(arch: str, compile=True, config_overrides=None, **kwargs):
    from src.lm.models.causal_lm import CausalLMLitModule
    from src.lm.models.gpt2_module import GPT2LitModule
    from src.parallel.parallelize import parallelize

    torch.manual_seed(0)
    if arch == "gpt2":
        module = GPT2LitModule(vocab_size=100, seq_len=32, n_layer=2, n_head=2, n_embd=16, compile=compile,
                               compile_loss=False, **kwargs)  # fmt: skip
    else:
        from transformers import AutoConfig

        defaults = AutoConfig.for_model(arch).to_dict()  # the fields tiny_config changes, as the matrix passes them
        config = {k: v for k, v in tiny_config(arch).to_dict().items() if k in defaults and v != defaults[k]}
        config.pop("vocab_size", None)
        config.update(config_overrides or {})
        module = CausalLMLitModule(vocab_size=100, seq_len=32, model_type=arch, config=config, compile=compile,
                                   compile_loss=False, **kwargs)  # fmt: skip
    return parallelize(module, **module.wrappers())  # as configure_model applies it under DDP and one device


def batch_of(vocab: int = 100) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.roll(-1, 1), "sample_index": torch.tensor([3, 8])}


@pytest.mark.parametrize(
    "arch, compile",
    # suite time: the whole network compiled (40 s) in the full matrix; the compiled blocks stay
    [pytest.param("gpt2", True, marks=FULL_MATRIX_ONLY), ("gpt2", "blocks")]
    # suite time: keyed dropout quadruples the cold compile (~70 s here); test_dropout compiles a keyed dropout alone
    + [pytest.param("gpt2", "dropout", marks=FULL_MATRIX_ONLY)]
    + [pytest.param(a, True, marks=FULL_MATRIX_ONLY) for a in SAMPLE],
)
def test_the_compiled_region_compiles_once_and_computes_what_the_eager_model_does(arch, compile, monkeypatch):
    """GPT-2 in float64, so that its first step is also checked against the same module run eagerly: loss and every
    gradient to FLOAT64_TOL (inductor's fusions reorder sums, ~1e-15 in float64; a wrong graph moves them by far
    more). `dropout`: the whole model compiled with dropout 0.1 (keyed: src/core/dropout.py), its masks graph inputs,
    not guards. The sample's architectures (full matrix) in fp32, their graphs only."""
    from torch._dynamo.utils import counters

    from src.lm.callbacks.generate_text import GenerateText
    from src.lm.features.packing import check_packing
    from src.lm.models.causal_lm import CausalLMLitModule

    torch._dynamo.reset()
    counters.clear()
    dropout = compile == "dropout"
    compile = True if dropout else compile
    module = compiled_module(arch, compile, **({"dropout": 0.1} if dropout else {}))
    if arch == "gpt2":
        module.double()
    # torch's private mark of Module.compile(): if it is renamed, this line fails (the canary of that name)
    wrapped = [m for m in module.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert wrapped == ([module.model] if compile is True else [b for _, _, b in module.blocks()])
    assert ("forward" in vars(module.model.get_output_embeddings())) == (compile == "blocks")  # the head's own
    # as on a GPU: the forward's choices must not depend on the device (a KV cache was kept on accelerators)
    monkeypatch.setattr(CausalLMLitModule, "device", property(lambda self: torch.device("cuda")))
    batch = batch_of()

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        module.zero_grad()
        module.train()
        loss, _ = module.loss_and_count(batch)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in module.named_parameters()}

    graphs = []
    for i in range(3):
        loss, grads = step()
        if i == 0 and arch == "gpt2":
            with torch.compiler.set_stance("force_eager"):
                eager_loss, eager_grads = step()
            close64(loss, eager_loss, "loss")
            for name, grad in eager_grads.items():
                close64(grads[name], grad, f"grad of {name}")
        module.eval()
        with torch.no_grad():
            module.loss_and_count(batch)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # one graph for training, one for evaluation (the blocks share theirs; the head has its own), none after step 1
    n = 2 if compile is True else 4
    assert graphs == [n, n, n], graphs
    monkeypatch.undo()
    # the forwards that are not the run's: eager, no graph of their own (generation: a cache and a new length a step)
    if arch == "gpt2":
        check_packing(module)

        class Tokenizer:
            eos_id = 0

            def encode_batch(self, texts):
                return [torch.tensor([1, 2, 3])] * len(texts)

            def decode(self, ids):
                return str(ids)

        callback = GenerateText(prompts=["a", "b"], max_new_tokens=4)
        assert len(callback.generate(module.model, Tokenizer())) == 2
        assert counters["stats"]["unique_graphs"] == n, counters["stats"]


def sliding_gemma3(**kwargs):
    """Gemma 3 with a sliding layer (window 8, shorter than the context 32) and a full one."""
    config = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
    return compiled_module("gemma3_text", True, config_overrides=config, attn_implementation="sdpa", **kwargs)


@pytest.mark.parametrize(
    "arch, compile, inputs, handed",
    [
        ("gpt2", True, "plain", [(True, True)] * 2),  # the whole model: SDPA's is_causal, as eagerly
        ("gpt2", "blocks", "plain", [(True, True)]),  # one graph for both blocks, their masks made eagerly
        ("gpt2", True, "padded", [(False, False)] * 2),
        ("gpt2", True, "packed", [(False, False)] * 2),
        ("gemma3", True, "plain", [(False, False), (True, True)]),  # the sliding layer keeps its window
    ]
    # the sample's architectures (their own masks, soft-capping, ...): the traced graph computes the eager loss
    + [pytest.param(a, True, "plain", None, marks=FULL_MATRIX_ONLY) for a in SAMPLE if a != "gemma2"],  # no SDPA
)
def test_what_the_compiled_attention_is_handed(arch, compile, inputs, handed, monkeypatch):
    """(no mask, is_causal) of each SDPA call in the compiled graph: a batch with no padding and no packing gets SDPA's
    is_causal and no mask in every layer whose eager forward got none (src/parallel/compiled_attention.py: the whole
    model's trace builds an explicit causal mask, a slower kernel on a GPU); a padded or packed batch, or a layer with a
    window shorter than the context, keeps its mask. In float64 the compiled graph (run as traced) computes the eager
    model's loss: a window dropped would move it by far more than FLOAT64_TOL."""
    calls = []

    def recorder(graph, example_inputs):
        for node in graph.graph.nodes:
            if "scaled_dot_product_attention" in str(node.target):
                calls.append((node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None) is None,
                               node.kwargs.get("is_causal")))  # fmt: skip
        return graph

    plain = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: plain(self, backend=recorder))
    compile_function = torch.compile
    monkeypatch.setattr(torch, "compile", lambda f, **kwargs: compile_function(f, backend=recorder))  # the head
    torch._dynamo.reset()
    if arch == "gemma3":
        module = sliding_gemma3()
    else:
        module = compiled_module(arch, compile, **({} if arch == "gpt2" else {"attn_implementation": "sdpa"}))
        eager_experts(module.model)  # float64
    module.double()
    batch = batch_of()
    if inputs == "padded":
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["attention_mask"][0, 24:] = 0
        batch["labels"][0, 23:] = -100
    if inputs == "packed":
        batch["position_ids"] = torch.cat([torch.arange(20), torch.arange(12)]).repeat(2, 1)
    loss, _ = module.loss_and_count(batch)
    assert calls == handed if handed is not None else calls, calls
    with torch.compiler.set_stance("force_eager"):
        eager, _ = module.loss_and_count(batch)
    close64(loss, eager, "loss")


def test_the_region_is_the_whole_network_only_where_no_mesh_or_hook_divides_it():
    from src.parallel.parallelize import compile_region
    from src.utils.config import ConfigError

    assert compile_region(True, whole_model=True) == "model"
    assert compile_region(True, whole_model=False) == "blocks"  # FSDP2, tp, pipeline stages, ZeRO-3
    assert compile_region("blocks", whole_model=True) == "blocks"
    assert compile_region(False, whole_model=True) is None
    with pytest.raises(ConfigError, match=r"model.compile='model': use true"):
        compile_region("model", whole_model=True)
    from src.lm.models.gpt2_module import GPT2LitModule

    with pytest.raises(ConfigError, match=r"model.compile='model': use true"):  # when the module is built
        GPT2LitModule(vocab_size=100, seq_len=32, n_layer=1, n_head=2, n_embd=16, compile="model")


def test_compile_auto_is_decided_from_the_run_before_the_model_is_built(tmp_path, monkeypatch):
    """model.compile=auto (the default: src/lm/features/compiling.py auto_compile, written into the config by
    src/run/checks.py before anything reads it): false on this CPU, true wherever a compile_mode asks for it; with a GPU
    (torch.cuda.is_available patched: the decision, not a GPU run) true from AUTO_MIN_STEPS training steps or a run
    bounded by epochs, false below, blocks with model.loss_chunk (a network compiled whole is refused with it), true
    under FSDP2 (each block: its own rule), false under the pipeline (whose own check refuses model.compile)."""
    from test_configs import compose_cfg

    from src.lm.features.compiling import AUTO_MIN_STEPS
    from src.run.checks import resolve_and_check_values

    def resolved(overrides: list[str]):
        cfg = compose_cfg(["trainer.precision=32-true", *overrides], tmp=tmp_path)
        assert cfg.model.compile == "auto" or "model.compile=false" in overrides
        resolve_and_check_values(cfg)
        return cfg.model.compile

    long = [f"trainer.max_steps={AUTO_MIN_STEPS}"]
    assert resolved(long) is False  # no GPU here
    assert resolved(["model.compile_mode=max-autotune-no-cudagraphs"]) is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolved(long) is True
    assert resolved(["trainer.max_steps=-1", "trainer.max_epochs=1"]) is True
    assert resolved([f"trainer.max_steps={AUTO_MIN_STEPS - 1}"]) is False
    assert resolved([*long, "trainer.accelerator=cpu"]) is False
    assert resolved([*long, "model.loss_chunk=1024"]) == "blocks"
    assert resolved([*long, "trainer=fsdp", "trainer.devices=2"]) is True
    assert resolved([*long, "trainer=pipeline", "trainer.devices=2", "model.n_layer=2"]) is False
    assert resolved([*long, "model.compile=false"]) is False


def test_compile_mode_is_torch_compiles_and_a_mode_without_compile_is_one_sentence():
    """model.compile_mode reaches torch.compile: reduce-overhead asks inductor for CUDA graphs, which it skips on a CPU
    and counts in torch's own counters (without the mode: no skip counted, tests/test_compile.py's other graphs). A mode
    with model.compile=false, or one torch.compile does not know, is one sentence when the module is built."""
    from torch._dynamo.utils import counters

    from src.utils.config import ConfigError

    torch._dynamo.reset()
    counters.clear()
    module = compiled_module("gpt2", compile_mode="reduce-overhead")
    module.eval()
    with torch.no_grad():  # one graph to compile, the forward's
        module.loss_and_count(batch_of())
    assert counters["inductor"]["cudagraph_skips"] == 1, dict(counters["inductor"])
    with pytest.raises(
        ConfigError, match=r"model.compile_mode=reduce-overhead with model.compile=false compiles nothing"
    ):
        compiled_module("gpt2", compile=False, compile_mode="reduce-overhead")
    with pytest.raises(ConfigError, match=r"model.compile_mode='fast': use null or one of torch.compile's modes"):
        compiled_module("gpt2", compile_mode="fast")


@FULL_MATRIX_ONLY  # suite time: two gloo ranks compiling a whole GPT-2 each take ~1 min on 2 cores
def test_a_whole_compiled_model_under_ddp_trains_the_eager_model(tmp_path, reference):
    """train.py, 2 gloo ranks, model.compile=true (the whole network and its loss compiled, the log says so)
    against the eager 2-rank reference run of test_parity, at test_parity's fp32 tolerance; the checkpoint holds
    the plain model's parameter names."""
    from test_parity import GPT2_DDP, assert_same_series, max_param_diff, train

    from tests.helpers.margins import within

    eager = reference(GPT2_DDP)
    compiled = train(tmp_path, "compiled", GPT2_DDP + ["model.compile=true"])
    for tag in ("train/loss", "val/loss"):
        assert_same_series(eager, compiled, tag, 1e-5)
    within(max_param_diff(eager["params"], compiled["params"]), 1e-5, "params")
    (log,) = (tmp_path / "compiled" / "train" / "runs").glob("*/train.log")
    assert "compile model" in log.read_text() and "Token loss: compiled" in log.read_text()
