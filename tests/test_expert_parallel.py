"""Expert parallelism (`trainer=fsdp trainer.strategy.expert_parallel_size=k`, src/parallel/expert_parallel.py): each
token reaches its experts on their ranks and comes back, the volume its formula says; a run resumed across it ends
as the straight one; what it cannot do is one sentence. That 2 and 4 ranks train what 1 process trains (losses, aux
loss, final parameters) is tests/test_architectures_parity.py's (mixtral-ep2, -ep2_data, -ep4; qwen3_moe-ep2,
olmoe-ep4; the default suite runs mixtral-ep2_data here, with its communication)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FULL_MATRIX_ONLY, read_events, run_script
from test_architectures_parity import ARCHS, RUN, STRATEGIES
from test_fsdp import last_ckpt, train_sharded
from test_parity import QUIET, assert_same_series, max_param_diff
from test_resume_anywhere import ARGS as RESUME_ARGS

from src.checkpoint.convert import load_checkpoint
from tests.helpers.margins import within

MIXTRAL = ARCHS["mixtral"]  # 2 layers, hidden 32, 4 experts, top-2


@pytest.mark.slow
def test_each_token_goes_to_its_experts_ranks_and_back_with_the_volume_of_the_formula(tmp_path, reference):
    """A real run on 4 ranks, each expert on 1 rank of each pair (expert_parallel_size=2: 2 copies of each, sharded
    by FSDP2), equals the 1-process run (train loss, aux loss and expert load at every step, val loss, final
    parameters within 1e-5, as tests/test_architectures_parity.py's cases), and its collectives, read by
    callbacks.comm at step 2, are the dispatch's: per MoE layer, forward sends the expert counts (int64, one per
    expert), each (token, slot) row to its expert's rank (N k H elements from every rank) and the experts' outputs
    back; backward sends the two gradients the other way. Each rank sends its N k H rows and gets some share back, so
    over the ranks the fp32 all-to-alls of a step add up to exactly 4 x layers x ranks x N k H (N: a rank's tokens)."""
    one = reference(MIXTRAL + RUN)
    log = tmp_path / "comm"
    args = MIXTRAL + RUN + STRATEGIES["ep2_data"] + ["callbacks.comm.every_n_steps=2", f"callbacks.comm.save_dir={log}"]
    run = train_sharded(tmp_path, "ep2_data", args)
    for tag in ("train/loss", "train/aux_loss", "train/expert_load_max", "val/loss"):
        assert_same_series(one, run, tag, 1e-5)
    within(
        max_param_diff(one["params"], load_checkpoint(last_ckpt(tmp_path, "ep2_data"))["state_dict"]), 1e-5, "params"
    )

    ranks, layers, hidden, top_k = 4, 2, 32, 2
    tokens = 8 // ranks * 32  # a rank's micro-batch x seq_len
    sent = {"fp32": 0, "int64": 0}
    for rank in range(ranks):
        record = json.loads((log / f"rank{rank}.jsonl").read_text().splitlines()[0])  # step 2
        exchanges = [c for c in record["collectives"] if c["op"] == "all_to_all"]
        assert len(exchanges) == layers * 5  # counts, rows, outputs forward; two gradients backward
        assert [c["elements"] for c in exchanges if c["dtype"] == "int64"] == [4] * layers
        assert sum(c["elements"] == tokens * top_k * hidden for c in exchanges if c["phase"] == "forward") >= layers
        for c in exchanges:
            sent[c["dtype"]] += c["elements"]
    assert sent["fp32"] == 4 * layers * ranks * tokens * top_k * hidden


def run(tmp: Path, name: str, args: list[str]) -> dict:
    """An 8-step Mixtral run with a step-4 checkpoint (tests/test_resume_anywhere.py's): its train/loss by step, final
    parameters and the step-4 checkpoint."""
    mid = [a for a in RESUME_ARGS if a.startswith("+callbacks.mid")]
    shape = [a for a in RUN if not a.startswith(("trainer.max_steps", "trainer.val_check_interval"))]
    steps = ["data.global_batch_size=8", "trainer.max_steps=8", "trainer.val_check_interval=8"]
    run_script("train.py", QUIET + [f"paths.log_dir={tmp / name}", f"paths.cache_dir={tmp / 'cache'}"]
               + MIXTRAL + shape + steps + mid + args)  # fmt: skip
    (out,) = (tmp / name / "train" / "runs").iterdir()
    loss = {e.step: e.value for e in read_events(out / "tensorboard").Scalars("train/loss")}
    params = load_checkpoint(out / "checkpoints" / "last.ckpt")["state_dict"]
    return {"loss": loss, "params": params, "mid": str(out / "checkpoints" / "mid_4.ckpt")}


@pytest.mark.slow
@FULL_MATRIX_ONLY
def test_a_run_resumed_across_expert_parallelism_ends_like_the_straight_run(tmp_path):
    """Change N mid-run: the step-4 checkpoint of a 2-rank expert-parallel run resumed on 1 process, and 1 process's
    resumed with its experts split over 2 ranks, each end as the straight 1-process run (train/loss at steps 4-7 and
    the final parameters within 1e-5, as tests/test_resume_anywhere.py's cases)."""
    straight = run(tmp_path, "one", [])
    split = run(tmp_path, "ep", STRATEGIES["ep2"])
    for name, source, target in (("ep_to_1", split, []), ("1_to_ep", straight, STRATEGIES["ep2"])):
        resumed = run(tmp_path, name, target + [f"ckpt_path={source['mid']}"])
        assert sorted(resumed["loss"]) == [4, 5, 6, 7]
        within(max(abs(resumed["loss"][s] - straight["loss"][s]) for s in resumed["loss"]), 1e-5, f"{name} loss")
        within(max_param_diff(resumed["params"], straight["params"]), 1e-5, f"{name} params")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model=llama"], r"llama has none: set expert_parallel_size=1"),
        ([*MIXTRAL, "trainer.strategy.expert_parallel_size=3", "trainer.devices=3"], r"4 experts do not divide by"),
        ([*MIXTRAL, "trainer.devices=3"], r"3 process\(es\) do not divide into groups of .*expert_parallel_size=2"),
        ([*MIXTRAL, "+trainer.gradient_clip_algorithm=value"], r"gradient_clip_algorithm=value with .*clip by norm"),
        ([*MIXTRAL, "trainer.strategy.expert_parallel_size=0"], r"expert_parallel_size=0 is not valid"),
    ],
    ids=["no_plan", "experts", "world", "clip_value", "zero"],
)
def test_what_expert_parallelism_cannot_do_is_one_sentence_before_anything_runs(tmp_path, overrides, message):
    from test_configs import compose_cfg

    from src.run.checks import resolve_and_check_values
    from src.utils.config import ConfigError

    base = ["trainer=fsdp", "trainer.devices=2", "trainer.strategy.expert_parallel_size=2"]
    cfg = compose_cfg([*base, "data.global_batch_size=12", *overrides], tmp=tmp_path)
    with pytest.raises(ConfigError, match=message) as error:
        resolve_and_check_values(cfg)
    assert "\n" not in str(error.value)


def test_experts_that_are_not_a_weighted_sum_of_single_experts_are_refused():
    """The dispatch runs each (token, slot) through its expert alone with weight 1 and weights the output on the
    token's rank. The probe before step 1 (float64, on a copy of one experts module) passes Mixtral's experts, even on
    the meta device, and refuses experts that square their routing weights inside."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from src.parallel.expert_parallel import check_dispatch
    from src.utils.config import ArchitectureRefused

    fields = {a.split("=")[0].rsplit(".", 1)[1]: float(a.split("=")[1]) for a in MIXTRAL if a.startswith("+model.")}
    config = AutoConfig.for_model("mixtral", **{k: int(v) if v.is_integer() else v for k, v in fields.items()})
    with torch.device("meta"):
        on_meta = AutoModelForCausalLM.from_config(config)
    check_dispatch(on_meta)
    model = AutoModelForCausalLM.from_config(config)
    experts = model.model.layers[0].mlp.experts

    class Squared(type(experts)):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights**2)

    experts.__class__ = Squared
    with pytest.raises(ArchitectureRefused, match=r"mixtral's experts are not a weighted sum of single experts"):
        check_dispatch(model)
