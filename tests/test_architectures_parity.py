"""Llama (grouped-query attention, untied head), Qwen2 (q/k/v biases, tied) and Mistral (a sliding window shorter
than the sequence): N ranks == 1 process under every strategy that reaches them, losses at every step and final
parameters within 1e-5 (fp32), through train.py as a real subprocess, as tests/test_parity.py does for GPT-2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, run_script, shared
from test_fsdp import last_ckpt, train_sharded
from test_parity import QUIET, assert_same_series, max_param_diff, train

from src.checkpoint.convert import build_module, export_hf, load_checkpoint
from tests.helpers.architectures import eager_experts
from tests.helpers.margins import close64, close_fp32_weights, within

pytestmark = pytest.mark.slow

SHAPE = [
    "model.config.hidden_size=32",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "model.config.intermediate_size=64",
]
ADDED = ["+" + a for a in SHAPE]  # model=causal_lm's config is empty: its keys are added
RUN = [
    "data.path=" + str(Path(__file__).parent / "data" / "tiny_corpus.txt"),
    "data.seq_len=32",
    "data.global_batch_size=8",
    "trainer.max_steps=6",
    "trainer.val_check_interval=6",
    "test=false",
    "model.scheduler.num_warmup_steps=2",
    "trainer.gradient_clip_val=0.05",
]  # below the gradient norms: every step clips by the whole model's norm
ARCHS = {
    "llama": ["model=llama", *SHAPE],
    # a padding row (nn.Embedding's padding_idx): ZeRO-3's build once crashed on it (transformers' own
    # init wrote the row of a partitioned, empty weight)
    "qwen2": ["model=qwen2", *SHAPE, "+model.config.pad_token_id=0"],
    "mistral": ["model=mistral", *SHAPE, "model.config.sliding_window=8"],
    # Granite's multipliers and logits scaling (as granite-3's config sets them): pipeline stages that re-implement
    # the forward drop them and train another function; Gemma3: scaled embeddings (a buffer no checkpoint holds),
    # local and global rotary per layer type, q/k norms
    "granite": [
        "model=causal_lm",
        "model.model_type=granite",
        *ADDED,
        "+model.config.embedding_multiplier=12.0",
        "+model.config.logits_scaling=8.0",
        "+model.config.residual_multiplier=0.22",
        "+model.config.attention_multiplier=0.0625",
    ],
    # per-head q/k norms (trainer=tp: one weight for every head, its gradient summed over the ranks' heads)
    "qwen3": ["model=causal_lm", "model.model_type=qwen3", *ADDED, "+model.config.head_dim=8"],
    # fused qkv_proj and gate_up_proj (trainer=tp: colwise_gather_output, rowwise_split_input)
    "phi3": ["model=causal_lm", "model.model_type=phi3", *ADDED, "+model.config.pad_token_id=0"],
    # experts: the router's load-balancing loss is trained (src/lm/objectives/moe.py) and logged as train/aux_loss
    "mixtral": [
        "model=causal_lm",
        "model.model_type=mixtral",
        *ADDED,
        "+model.config.num_local_experts=4",
        "+model.config.num_experts_per_tok=2",
        "+model.config.router_aux_loss_coef=0.5",
    ],
    # Qwen3-MoE: experts beside per-head q/k norms; OLMoE: q/k norms over all heads, every expert fused gate_up
    "qwen3_moe": [
        "model=causal_lm",
        "model.model_type=qwen3_moe",
        *ADDED,
        "+model.config.head_dim=8",
        "+model.config.num_experts=4",
        "+model.config.num_experts_per_tok=2",
        "+model.config.moe_intermediate_size=32",
        "+model.config.router_aux_loss_coef=0.5",
    ],
    "olmoe": [
        "model=causal_lm",
        "model.model_type=olmoe",
        *ADDED,
        "+model.config.num_experts=4",
        "+model.config.num_experts_per_tok=2",
        "+model.config.router_aux_loss_coef=0.5",
    ],
    "gemma3": [
        "model=causal_lm",
        "model.model_type=gemma3_text",
        *ADDED,
        "+model.config.head_dim=8",
        "+model.config.sliding_window=8",
        "+model.config.layer_types=[sliding_attention,full_attention]",
    ],
}
MOE = ("mixtral", "qwen3_moe", "olmoe")


def data_args(arch: str) -> list[str]:
    """Mistral's cases train on padded Alpaca records (prompt labels -100, one padded length per batch; byte
    tokens); the others on ARCHS' text."""
    if arch != "mistral":
        return []
    alpaca = shared("alpaca", "alpaca_en_demo.json")  # skips the case when the shared data is absent
    return ["data=instruct", f"data.path={alpaca}", "data.seq_len=256", "trainer.limit_val_batches=2"]


STRATEGIES = {
    "ddp": ["trainer=ddp", "trainer.devices=2"],
    "fsdp": ["trainer=fsdp", "trainer.devices=2"],
    "tp": ["trainer=tp", "trainer.devices=2", "trainer.strategy.tensor_parallel_size=2"],
    # 2 data-parallel replicas (FSDP2 over them) x 2 tensor-parallel ranks
    "tp_data": ["trainer=tp", "trainer.devices=4", "trainer.strategy.tensor_parallel_size=2"],
}
# 2 stages of 1 layer, 4 micro-batches; the pipeline clips in its own step, by the same norm
PIPELINE = [
    "trainer=pipeline",
    "trainer.strategy.schedule=1F1B",
    "trainer.gradient_clip_val=null",
    "trainer.strategy.gradient_clip_val=0.05",
]
STRATEGIES["pipeline"] = PIPELINE + ["trainer.devices=2"]
STRATEGIES["pipeline_tp"] = PIPELINE + ["trainer.devices=4", "trainer.strategy.tensor_parallel_size=2"]
# expert parallelism: each expert on 1 of 2 ranks (2 ranks: one copy of each; 4 ranks: 2 copies, FSDP2 over them),
# or on 1 of 4
STRATEGIES["ep2"] = STRATEGIES["fsdp"] + ["trainer.strategy.expert_parallel_size=2"]
STRATEGIES["ep2_data"] = ["trainer=fsdp", "trainer.devices=4", "trainer.strategy.expert_parallel_size=2"]
STRATEGIES["ep4"] = ["trainer=fsdp", "trainer.devices=4", "trainer.strategy.expert_parallel_size=4"]
# ZeRO-3 through the tests' CPU DeepSpeed strategy (tests/helpers/deepspeed_cpu.py)
STRATEGIES["zero3"] = [
    "trainer=deepspeed",
    "trainer.strategy._target_=tests.helpers.deepspeed_cpu.CPUDeepSpeedStrategy",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.strategy.stage=3",
]
STRATEGIES["zero1"] = STRATEGIES["zero3"][:-1] + ["trainer.strategy.stage=1"]
STRATEGIES["zero2"] = STRATEGIES["zero3"][:-1] + ["trainer.strategy.stage=2"]
# LoRA (peft's default projections for the architecture) under FSDP2, against LoRA in one process
LORA = ["model.lora.enabled=true", "model.lora.dropout=0.0"]
STRATEGIES["fsdp_lora"] = ["trainer=fsdp", "trainer.devices=2"]
# 1 process x 4 samples x accumulation 2 (val_check_interval counts micro-batches: 12 are the 6 steps)
STRATEGIES["accumulate"] = ["trainer.accumulate_grad_batches=2", "trainer.val_check_interval=12"]
DENSE = [s for s in STRATEGIES if not s.startswith("ep")]  # expert parallelism: MoE models only
MATRIX = (
    [("llama", s) for s in DENSE]
    + [("qwen2", s) for s in DENSE]
    + [("mistral", "ddp"), ("mistral", "pipeline"), ("mistral", "tp")]
    + [("granite", "pipeline"), ("granite", "fsdp"), ("gemma3", "pipeline"), ("gemma3", "fsdp")]
    + [("mixtral", s) for s in ("ddp", "fsdp", "accumulate", "zero2", "zero3", "tp", "tp_data", "pipeline")]
    + [("mixtral", "pipeline_tp"), ("mixtral", "ep2"), ("mixtral", "ep2_data"), ("mixtral", "ep4")]
    + [("qwen3_moe", "ep2"), ("olmoe", "ep4")]
    + [(moe, s) for moe in ("qwen3_moe", "olmoe") for s in ("ddp", "fsdp", "zero2", "zero3", "tp")]
    + [("qwen3_moe", "pipeline")]  # OLMoE has no pipeline plan
    + [("qwen3", "tp"), ("qwen3", "tp_data"), ("qwen3", "pipeline_tp"), ("phi3", "tp"), ("gemma3", "tp")]
)
# The suite runs one case of each thing that differs between the architectures (GQA + untied head under FSDP2 and
# pipeline x tensor stages; tied embeddings under accumulation (across stages: GPT-2's pipeline tests); q/k/v biases
# under LoRA (ZeRO-3: GPT-2's biases in test_deepspeed.py); a sliding window in a stage); TEST_ALL_ARCHITECTURES=1
# runs the whole matrix (59 cases): llama-ddp, qwen2-pipeline and qwen2-zero3 left it for suite time (58 s).
CORE = [
    ("llama", "fsdp"),
    ("llama", "pipeline_tp"),  # its stages split over 2 tensor ranks: llama-tp alone is in the full matrix (suite time)
    ("qwen2", "fsdp_lora"),
    ("qwen2", "accumulate"),
    ("mistral", "pipeline"),
    ("granite", "pipeline"),
    ("mixtral", "tp"),  # experts split over the tensor ranks (src/parallel/tensor/experts.py), aux loss included
    ("mixtral", "pipeline"),  # the aux loss's routing totals carried through the stages (pipeline/stages.py Routing)
    # expert parallelism: tests/test_expert_parallel.py runs mixtral-ep2_data's parity, with its communication
]


def llama_args(gpt2_args: list[str]) -> list[str]:
    """Another test's GPT-2 overrides as the same run of this file's Llama (GPT-2's shape keys replaced)."""
    gpt2_shape = ("model.n_layer", "model.n_embd", "model.n_head")
    return [a for a in gpt2_args if a.split("=")[0] not in gpt2_shape] + ARCHS["llama"]


CASES = [
    pytest.param(
        a,
        s,
        marks=[] if (a, s) in CORE else [FULL_MATRIX_ONLY],
    )
    for a, s in MATRIX
]


@pytest.mark.parametrize("arch,strategy", CASES, ids=[f"{a}-{s}" for a, s in MATRIX])
def test_n_ranks_match_one_process(tmp_path, reference, arch, strategy):
    lora, data = LORA if strategy.endswith("lora") else [], data_args(arch)
    one = reference(ARCHS[arch] + RUN + data + lora)
    args = ARCHS[arch] + RUN + data + lora + STRATEGIES[strategy]
    if strategy in ("tp", "pipeline"):  # each rank's parameter, gradient and optimizer bytes, for the memory tool
        args += ["+callbacks.state_bytes._target_=tests.helpers.callbacks.RecordStateBytes"]
    if (arch, strategy) == ("llama", "pipeline"):  # the compiled loss on the last stage against 1 eager process: in
        # the full matrix only, as compiling from a cold inductor cache (a fresh clone) costs a 2-rank case ~30 s
        args += ["model.compile_loss=true"]
    if strategy in ("ddp", "accumulate"):  # a checkpoint file
        run = train(tmp_path, strategy, args)
        params = run["params"]
    else:  # a sharded checkpoint dir (DCP), read back whole
        run = train_sharded(tmp_path, strategy, args)
        params = load_checkpoint(last_ckpt(tmp_path, strategy))["state_dict"]
    assert_same_series(one, run, "train/loss", 1e-5)
    assert_same_series(one, run, "val/loss", 1e-5)
    if arch in MOE:  # the aux loss is the mean of each sequence's: the same whatever holds which sequence
        assert_same_series(one, run, "train/aux_loss", 1e-5)
        assert_same_series(one, run, "train/expert_load_max", 1e-5)
    assert len(run["scalars"]["train/loss"]) == 6
    within(max_param_diff(one["params"], params), 1e-5, "params")
    if lora:  # the adapter did train (its B starts at zero), the base did not move
        assert any(t.abs().max() > 0 for name, t in params.items() if "lora_B" in name)
    if strategy in ("tp", "pipeline"):  # src.tools.memory counts the fullest rank's parameters exactly
        from src.tools.memory import config_rank_params

        ckpt = last_ckpt(tmp_path, strategy)
        config = build_module({"config": load_checkpoint(ckpt)["config"], "state_dict": one["params"]})[0].config
        psi = config_rank_params(config, **{"tensor_parallel" if strategy == "tp" else "pipeline_parallel": 2})
        measured = [json.loads((ckpt.parent.parent / f"state_bytes_rank{r}.json").read_text()) for r in (0, 1)]
        assert psi < sum(t.numel() for t in one["params"].values())  # the split saves something
        assert max(m["params"] for m in measured) == 4 * psi  # fp32
        assert max(m["optimizer"] for m in measured) == 8 * psi  # Adam's m and v
    if strategy in ("ddp", "tp", "pipeline", "pipeline_tp", "fsdp_lora"):  # HF's layout: the export loads as it is
        assert_export_gives_the_templates_logits(tmp_path, last_ckpt(tmp_path, strategy))
    if strategy == "tp":  # eval.py on one process reads the tensor-parallel dir and gives the run's val loss
        limit = [a for a in data if a.startswith("trainer.limit_val_batches")]  # the same batches
        loss = eval_val_loss(tmp_path, last_ckpt(tmp_path, strategy), limit)
        within(abs(loss - one["scalars"]["val/loss"][-1][1]), 5e-5, "eval.py val/loss")  # printed to 5 decimals


def eval_val_loss(tmp_path: Path, ckpt: Path, extra: list[str]) -> float:
    """val/loss as eval.py prints it (to 5 decimals) for `ckpt`, on one process."""
    proc = run_script(
        "eval.py",
        [f"ckpt_path={ckpt}", *QUIET[:3], f"paths.log_dir={tmp_path / 'eval'}", f"paths.cache_dir={tmp_path / 'ec'}"]
        + ["trainer.precision=32-true", *extra],
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("EVAL "))
    return dict((k, float(v)) for k, v in (kv.split("=") for kv in line[5:].split()))["val/loss"]


def assert_export_gives_the_templates_logits(tmp_path: Path, ckpt: Path) -> None:
    """export-hf of a sharded checkpoint loads with AutoModelForCausalLM in this process and gives the logits of the
    template's module holding the checkpoint's weights (the 1-process run's, checked before), in float64 (LoRA
    merged into fp32 weights: to their rounding); the LoRA adapter loads with PeftModel onto the base."""
    from transformers import AutoModelForCausalLM

    out = export_hf(ckpt, tmp_path / "hf")
    module, _ = build_module(load_checkpoint(ckpt))
    ids = torch.randint(0, 257, (2, 32))
    eager_experts(module.hf_model)
    with torch.no_grad():
        expected = module.double()(ids).logits
        # loaded as trained (fp32), then cast as the module is: constants a model computes when built (Gemma's
        # embed_scale = sqrt(hidden)) hold the same fp32-rounded value on both sides
        exported = eager_experts(AutoModelForCausalLM.from_pretrained(out)).double().eval()(ids).logits
    if not (out / "adapter").is_dir():
        close64(exported, expected, "export-hf logits")
    else:
        depth = module.hf_model.config.num_hidden_layers + 1
        close_fp32_weights(exported, expected, "export-hf merged LoRA logits", depth)
        from peft import PeftModel

        base = module.hf_model  # the adapter's base weights (frozen, equal to the start's), the adapter removed
        base = AutoModelForCausalLM.from_config(base.config, dtype=torch.float64)
        base.load_state_dict(
            {
                k.replace("base_model.model.", "").replace(".base_layer", ""): v
                for k, v in module.model.state_dict().items()
                if "lora_" not in k
            }
        )
        with torch.no_grad():
            adapted = PeftModel.from_pretrained(base, out / "adapter").eval().double()(ids).logits
        close64(adapted, expected, "export-hf adapter logits")
