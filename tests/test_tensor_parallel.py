"""trainer=tp (tensor parallel, DTensor on gloo): equal to one process step for step, clipping by the whole
model's norm, checkpoints that resume and export to Hugging Face, data x tensor on 4 ranks, and the
memory estimate against bytes measured per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, once_per_session, path_overrides, run_script
from test_fsdp import last_ckpt, train_sharded
from test_parity import GPT2, assert_same_series, max_param_diff, train

from src.checkpoint.convert import build_module, export_hf, load_checkpoint
from tests.helpers.margins import close64, within

# Under pytest-xdist these tests run on one worker: they share module fixtures (runs) that it makes once.
pytestmark = pytest.mark.xdist_group("tensor_parallel")

TP = ["trainer=tp", "trainer.devices=2", "trainer.strategy.tensor_parallel_size=2"]
CLIP = ["trainer.gradient_clip_val=0.05"]  # below the tiny model's gradient norms: every step is clipped
# 2 epochs of 3 steps, validation and a kept checkpoint after each, constant LR (a cosine schedule's length
# depends on max_steps, which a resumed run would change): the TP run's step-3 checkpoint is where the resume
# test starts from, and the TP run also records its state bytes (the memory estimate's test)
BASE = (
    GPT2
    + CLIP
    + [
        "trainer.limit_train_batches=3",
        "trainer.val_check_interval=3",
        "model.scheduler=null",
        "callbacks.model_checkpoint.save_top_k=-1",
    ]
)
WRAPPERS = ["model.gradient_checkpointing=true"]
STATE_BYTES = ["+callbacks.state_bytes._target_=tests.helpers.callbacks.RecordStateBytes"]


def run_of(tmp: Path, name: str) -> Path:
    (run,) = (tmp / name / "train" / "runs").iterdir()
    return run


@pytest.fixture(scope="session")
def one(tmp_path_factory) -> dict:
    """The one-process run the TP runs are compared with (trained once per session, for all xdist workers)."""
    return once_per_session(tmp_path_factory, "tp-one", lambda tmp: train(tmp, "1", BASE))


@pytest.fixture(scope="session")
def tp(tmp_path_factory) -> tuple[Path, dict]:
    """The 2-rank tensor-parallel run (its tmp dir, its scalars), shared by the tests that read it (once per
    session)."""
    return once_per_session(
        tmp_path_factory, "tp-tp", lambda tmp: (tmp, train_sharded(tmp, "tp", BASE + TP + STATE_BYTES))
    )


@pytest.mark.slow
def test_tensor_parallel_matches_one_process(one, tp):
    """2 ranks splitting each block (1 head each) == 1 process: every step's loss, val loss, final weights.

    The gradients are clipped at every step, so a norm summed over one rank's shard only would show."""
    tmp, run = tp
    assert_same_series(one, run, "train/loss", 1e-5)
    assert_same_series(one, run, "val/loss", 1e-5)
    assert len(run["scalars"]["train/loss"]) == 6
    # the checkpoint reads back in HF GPT-2's names and Conv1D layouts
    within(max_param_diff(one["params"], load_checkpoint(last_ckpt(tmp, "tp"))["state_dict"]), 1e-5, "params")


@FULL_MATRIX_ONLY  # suite time, 12 s: data x tensor stays in 4-rank meshes elsewhere (test_architectures_parity.py's llama pipeline x tensor, test_pipeline.py's data x pipeline)
@pytest.mark.slow
def test_data_x_tensor_on_four_ranks_matches_one_process(tmp_path, one):
    """2 data-parallel groups (FSDP2 over them) x 2 tensor-parallel ranks == 1 process: each group reads
    half of the global batch, both ranks of a group the same half."""
    dxt = train_sharded(tmp_path, "dxt", BASE + ["trainer=tp", "trainer.devices=4"] + WRAPPERS)
    assert_same_series(one, dxt, "train/loss", 1e-5)
    assert_same_series(one, dxt, "val/loss", 1e-5)
    within(max_param_diff(one["params"], load_checkpoint(last_ckpt(tmp_path, "dxt"))["state_dict"]), 1e-5, "params")


@pytest.mark.slow
def test_tp_checkpoint_resumes_exactly_and_exports_to_hf(tmp_path, one, tp):
    """Resumed on 2 TP ranks from the TP run's step-3 checkpoint to 6 == 6 steps in one process; its HF export
    gives that run's logits; consolidate and eval.py take it."""
    from transformers import AutoModelForCausalLM

    first = run_of(tp[0], "tp") / "checkpoints" / "step_000003.ckpt"
    resumed = train_sharded(tmp_path, "resumed", BASE + TP + [f"ckpt_path={first}"])
    for tag, n in (("train/loss", 3), ("val/loss", 1)):  # the resumed run logs steps 4-6 only
        (steps_a, a), (steps_b, b) = zip(*one["scalars"][tag][-n:]), zip(*resumed["scalars"][tag])
        assert steps_a == steps_b, tag
        within(max(abs(x - y) for x, y in zip(a, b)), 1e-5, tag)
    ckpt = last_ckpt(tmp_path, "resumed")
    assert load_checkpoint(ckpt)["global_step"] == 6
    within(max_param_diff(one["params"], load_checkpoint(ckpt)["state_dict"]), 1e-5, "params")

    hf = AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "hf")).eval()
    module, _ = build_module(load_checkpoint(ckpt))  # its weights are the one process's (above)
    ids = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        close64(hf.double()(ids).logits, module.double()(ids).logits, "export-hf logits")
    # the command-line form writes one plain file in GPT-2's own layout
    proc = run_script("-m", ["src.tools.checkpoints", "consolidate", str(ckpt), str(tmp_path / "one.ckpt")])
    state = torch.load(Path(proc.stdout.strip()), weights_only=False)
    assert "tensor_parallel" not in state
    within(max_param_diff(one["params"], state["state_dict"]), 1e-5, "params")
    # eval.py takes the sharded dir as it takes FSDP's: on 1 process, and on the 2 TP ranks themselves
    from test_eval import evaluate

    val = one["scalars"]["val/loss"][-1][1]
    for args in ([], TP):
        metrics, _ = evaluate(tmp_path, ckpt, ["trainer.precision=32-true", *args])
        within(abs(metrics["val/loss"] - val), 1e-5, f"eval.py val/loss {args}")


# ---- config errors: checked in-process by the function train.py runs before launching; one real run shows
# the user's view (one line, exit 2, no traceback, no rank started) ----


@pytest.mark.parametrize(
    "override,fragment",
    [
        (["model.n_head=3", "model.n_embd=48"], "model.n_head=3 and model.n_embd=48 must both divide by"),
        (["trainer.devices=3"], "3 process(es) do not divide into tensor_parallel_size=2: set trainer.devices"),
        (["model.lora.enabled=true"], "model.lora.enabled=true is not supported with trainer=tp"),
        (
            ["model.compile=true", "model.gradient_checkpointing=true"],
            "model.compile=true and model.gradient_checkpointing=true together are not supported with trainer=tp",
        ),
        (
            ["trainer.devices=4", "data.global_batch_size=3"],
            "does not divide into 2 data-parallel replica(s) x trainer.accumulate_grad_batches=1",
        ),
    ],
)
def test_tp_config_errors_are_one_sentence(tmp_path, override, fragment):
    from test_configs import compose_cfg
    from test_errors import FAST

    from src.run.checks import resolve_and_check_values
    from src.utils.config import ConfigError

    cfg = compose_cfg([*FAST, *TP, *override], tmp=tmp_path)
    with pytest.raises(ConfigError) as error:
        resolve_and_check_values(cfg)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_an_expert_count_that_does_not_divide_is_one_sentence():
    """trainer=tp splits the experts over the tensor ranks (src/parallel/tensor/experts.py): 3 experts on 2 ranks is
    refused before any rank starts; 4 pass."""
    from transformers import MixtralConfig

    from src.parallel.tensor.plan import check_divisible
    from src.utils.config import ConfigError

    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32, "intermediate_size": 64}
    with pytest.raises(ConfigError, match=r"mixtral's 3 experts do not divide by trainer\.strategy\.tensor_paral"):
        check_divisible(MixtralConfig(num_local_experts=3, **shape), 2)
    check_divisible(MixtralConfig(num_local_experts=4, **shape), 2)


def test_a_per_layer_mlp_width_is_checked_layer_by_layer():
    """Gemma-3n's intermediate_size is a list, one width a layer: each must divide (it crashed with a TypeError)."""
    from transformers import AutoConfig

    from src.parallel.tensor.plan import check_divisible
    from src.utils.config import ConfigError

    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32, "num_hidden_layers": 2}
    check_divisible(AutoConfig.for_model("gemma3n_text", intermediate_size=[64, 128], **shape), 2)
    with pytest.raises(ConfigError, match=r"intermediate_size=\[64, 65\] must all divide"):
        check_divisible(AutoConfig.for_model("gemma3n_text", intermediate_size=[64, 65], **shape), 2)


@pytest.mark.slow
def test_tp_config_error_is_one_line_before_any_rank_starts(tmp_path):
    from test_errors import FAST as USER_FAST
    from test_errors import assert_one_clear_line, run_as_user

    rc, out, _ = run_as_user(
        [
            "train.py",
            *USER_FAST,
            *TP,
            *path_overrides({"log_dir": tmp_path, "cache_dir": tmp_path}),
            "data.path=" + str(Path(__file__).parent / "data" / "tiny_corpus.txt"),
            "model.n_head=3",
            "model.n_embd=48",
        ]
    )
    assert_one_clear_line(rc, out, "model.n_head=3 and model.n_embd=48 must both divide by")
    assert "All distributed processes registered" not in out  # stopped before launching


# ---- memory estimate (src/tools/memory.py) ----


def test_estimate_formulas_for_tensor_and_pipeline_parallel():
    from src.tools.memory import activations, estimate, gpt2_params, in_flight, rank_params

    assert rank_params(12, 768) == gpt2_params(12, 768)  # no model parallelism: the whole model
    # tensor parallel 4: the blocks' matrices and column biases split 4 ways, the rest replicated
    assert (
        rank_params(12, 768, tensor_parallel=4)
        == 12 * (12 * 768**2 // 4 + 7 * 768 // 4 + 6 * 768) + 51281 * 768 + 2 * 768
    )
    # per-layer activations: 34 -> 10 + 24/t bytes per element, attention scores / t
    assert activations(1, 12, 768, 1024, 1, False, tp=4) < activations(1, 12, 768, 1024, 1, False) / 2
    # pipeline: GPipe holds all M micro-batches, 1F1B at most K, interleaved a little more than K
    assert (in_flight("gpipe", 4, 16), in_flight("1f1b", 4, 16), in_flight("1f1b", 4, 2)) == (16, 4, 2)
    assert 4 < in_flight("interleaved", 4, 16, stages_per_rank=2) < 16
    gpipe = estimate("large", 8, "ddp", pipeline_parallel=4, schedule="gpipe", microbatches=16, micro_batch=1)
    one_f_one_b = estimate("large", 8, "ddp", pipeline_parallel=4, schedule="1f1b", microbatches=16, micro_batch=1)
    assert gpipe.activations == 4 * one_f_one_b.activations and gpipe.params == one_f_one_b.params
    assert one_f_one_b.params < estimate("large", 8, "ddp").params / 3  # about a quarter of the blocks per stage
    with pytest.raises(ValueError, match="not a multiple of tensor x pipeline"):
        estimate("small", 8, "ddp", tensor_parallel=3)


@pytest.mark.slow
def test_tp_estimate_matches_bytes_measured_per_rank(tp):
    """fp32 Adam on 2 TP ranks: each holds rank_params parameters (its shards + the replicated rest),
    as many gradients and twice as many optimizer values, to the byte (recorded by the shared TP run)."""
    from src.tools.memory import model_states, rank_params

    run = run_of(tp[0], "tp")
    module, _ = build_module(load_checkpoint(run / "checkpoints" / "last.ckpt"))
    c = module.config
    psi = rank_params(c.n_layer, c.n_embd, c.vocab_size, c.n_positions, tensor_parallel=2)
    assert psi < sum(p.numel() for p in module.parameters())  # the split saves something
    expected = dict(zip(("params", "grads", "optimizer"), model_states(psi, 1, "ddp", mixed=False)[:3]))
    for rank in (0, 1):
        assert json.loads((run / f"state_bytes_rank{rank}.json").read_text()) == expected


def test_a_plan_that_leaves_a_parameter_whole_between_split_layers_is_one_sentence():
    """Apertus' xIELU activation holds two scalars between the MLP's colwise and rowwise layers, where each rank sees
    its own share of the intermediate activations; its shipped plan does not say how their gradients combine, so
    each rank would train its own (a different model, exit 0). Qwen3's q/k norms sit there too and are in its plan
    (replicated_with_grad_allreduce): accepted. GLM-4-MoE's MoE layers share one plan with its dense first layer:
    their router and shared experts sit under the `mlp` whose dense colwise / rowwise entries they do not hold
    (a refusal there would falsely refuse 12 MoE architectures)."""
    from transformers import AutoModelForCausalLM

    from src.parallel.tensor.plan import check_whole_inside, layer_plan
    from src.utils.config import ArchitectureRefused
    from tests.helpers.architectures import tiny_config

    for model_type, refused in (("apertus", True), ("qwen3", False), ("llama", False), ("glm4_moe", False)):
        config = tiny_config(model_type)
        with torch.device("meta"):
            layers = AutoModelForCausalLM.from_config(config).model.layers
        block = layers[0]
        if not refused:
            assert model_type != "glm4_moe" or type(layers[0].mlp) is not type(layers[-1].mlp)  # dense, then MoE
            for block in layers:
                check_whole_inside(block, layer_plan(config), model_type)
            continue
        with pytest.raises(ArchitectureRefused, match=r"leaves \['mlp.act_fn.alpha_p', 'mlp.act_fn.alpha_n'\] whole"):
            check_whole_inside(block, layer_plan(config), model_type)
