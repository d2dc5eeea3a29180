"""Mixture-of-experts models: the router's load-balancing loss is in the trained loss as transformers defines it
(its own `load_balancing_loss_func`, on each sequence: src/lm/objectives/moe.py), logged, and refused where a strategy or
objective cannot carry it. That 2 ranks, FSDP2, pipeline stages and accumulation train what 1 process trains, aux
loss included, is tests/test_architectures_parity.py's (mixtral cases)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from src.lm.features.packing import check_packing
from src.lm.features.router import check_router_logits
from src.lm.models.causal_lm import CausalLMLitModule
from src.lm.objectives.dpo import DPO
from src.utils.config import ConfigError
from tests.helpers.margins import U32, within

V, T = 64, 16
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
MOE = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}


def module(model_type: str, **kwargs) -> CausalLMLitModule:
    torch.manual_seed(0)
    config = {**SMALL, "num_key_value_heads": 2, **MOE[model_type], "router_aux_loss_coef": 0.5}
    lit = CausalLMLitModule(vocab_size=V, seq_len=T, model_type=model_type, config=config, **kwargs)
    lit.trainer = L.Trainer(logger=False, enable_checkpointing=False, log_every_n_steps=1000, accelerator="cpu")
    return lit


@pytest.mark.parametrize("model_type", list(MOE))
def test_trained_loss_is_the_token_loss_plus_each_sequences_transformers_aux_loss(model_type):
    """A batch of 3 sequences (one right-padded): the loss training backpropagates is the token mean plus
    coef x the mean over the sequences of transformers' own aux_loss on each sequence alone (its forward with
    output_router_logits=True); for one sequence it is transformers' own training loss."""
    lit = module(model_type)
    hf = lit.hf_model
    ids = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, T, dtype=torch.long)
    mask[2, 10:] = 0
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], 1).masked_fill(mask == 0, -100)
    labels[2, 9] = -100  # the last real token predicts nothing
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    loss = lit.training_step(batch, 0)
    with torch.no_grad():
        own = [
            hf(input_ids=ids[b : b + 1], attention_mask=mask[b : b + 1], output_router_logits=True) for b in range(3)
        ]
        aux = torch.stack([o.aux_loss for o in own]).mean()
        token_sum, targets = lit.token_loss(hf(input_ids=ids, attention_mask=mask).logits, labels)
    expected = token_sum / targets + 0.5 * aux
    within(abs(loss.item() - expected.item()), 8 * U32 * expected.item(), "loss with aux")
    assert aux > 1.0  # top-2 routing spread evenly gives 2.0 (top_k): a term of the loss, not a rounding
    # one sequence: transformers' own training loss (token mean + coef x aux_loss)
    one = {k: v[:1] for k, v in batch.items()}
    with torch.no_grad():
        ref = hf(input_ids=ids[:1], labels=ids[:1], output_router_logits=True).loss
    within(abs(lit.training_step(one, 0).item() - ref.item()), 8 * U32 * ref.item(), "one sequence = transformers")
    # router_aux_loss=false: the token loss alone
    plain = module(model_type, router_aux_loss=False)
    within(abs(plain.training_step(batch, 0).item() - (token_sum / targets).item()), 8 * U32 * 10, "no aux")


@pytest.mark.parametrize("name", ["dpo", "reward", "grpo"])
def test_an_objective_without_the_router_loss_on_an_moe_model_is_one_sentence(name):
    from src.lm.objectives.grpo import GRPO
    from src.lm.objectives.reward import Reward
    from src.lm.objectives.verifiers import exact_match

    made = {"dpo": DPO, "reward": Reward, "grpo": lambda: GRPO(rewards=[exact_match])}[name]
    with pytest.raises(ConfigError, match=f"model/objective={name} does not add MixtralForCausalLM's router load-bal"):
        module("mixtral", objective=made())
    module("mixtral", objective=made(), router_aux_loss=False)  # said how to go on: it builds


def test_a_router_loss_of_another_form_is_refused_in_one_sentence():
    """Doge's product-key experts have a router loss of another signature (no top-k): taken per sequence as the
    Switch Transformer form, its router logits would be read wrongly, so it is refused; Mixtral's is taken."""
    from transformers import AutoModelForCausalLM

    from src.lm.objectives.moe import balance_loss_function
    from src.utils.config import ConfigError
    from tests.helpers.architectures import tiny_config

    with torch.device("meta"):
        doge, mixtral = (AutoModelForCausalLM.from_config(tiny_config(a)) for a in ("doge", "mixtral"))
    with pytest.raises(ConfigError, match=r"doge's router load-balancing loss is not the Switch Transformer form.*"
                       r"model\.router_aux_loss=false"):  # fmt: skip
        balance_loss_function(doge)
    assert balance_loss_function(mixtral) is not None


def test_packing_with_a_router_loss_is_one_sentence():
    """The load-balancing loss is taken per row, which would mix packed records: refused before step 1, naming both
    ways out."""
    with pytest.raises(
        ConfigError, match=r"data.packing=true and a mixture-of-experts router loss.*router_aux_loss=fal"
    ):
        check_packing(module("mixtral"))


@pytest.mark.parametrize("split", [(3,), (1, 2), (2, 1), (1, 1, 1)], ids=lambda s: "+".join(map(str, s)))
def test_routing_totals_carried_through_stages_give_each_sequences_transformers_loss(split):
    """Pipeline stages (src/parallel/pipeline/schedule.py) hold a share of the layers each: each adds its layers' routing to
    the totals it received (`stage_statistics`), and the last takes the loss from them (`statistics_balance`). For
    every split of 3 MoE layers into stages, each sequence's value and its gradient are Mixtral's own
    load_balancing_loss_func on that sequence alone, a right-padded row included. Tolerance: both sides add the same
    n = T x L float32 terms (possibly in another order), so each total is within n U32 relatively, the product of two
    within 2n U32; 4n U32 leaves room for the final sums."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from src.lm.objectives.moe import each_sequence
    from src.parallel.pipeline.stages import stage_statistics, statistics_balance

    batch, t, experts, k, n_layers = 3, 12, 4, 2, 3
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(batch * t, experts, generator=g, requires_grad=True) for _ in range(n_layers)]
    mask = torch.ones(batch, t, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    totals = (torch.zeros(batch, experts), torch.zeros(batch, experts))
    first = 0
    for size in split:  # stage by stage, in order
        totals = stage_statistics(logits[first : first + size], mask, *totals, k)
        first += size
    carried = statistics_balance(*totals, mask, n_layers)
    own = each_sequence(load_balancing_loss_func, tuple(logits), mask, batch, experts, k)
    tol = 4 * t * n_layers * U32
    within(((carried - own).abs() / own.abs()).max().item(), tol, "per-sequence router loss, relative")
    weights = torch.randn(batch, generator=g)  # any combination of the sequences' losses: their gradients too
    got = torch.autograd.grad((carried * weights).sum(), logits)
    want = torch.autograd.grad((own * weights).sum(), logits)
    scale = max(w.abs().max().item() for w in want)
    within(max((a - b).abs().max().item() for a, b in zip(got, want)) / scale, tol, "its gradient, relative")


def test_pipeline_stages_are_refused_where_the_carried_router_loss_is_not_the_models_own():
    """The probe before step 1 (src/parallel/pipeline/stages.py check_stages) compares the router loss carried through the stages
    with the model's own function on each sequence of a probe batch: a model whose routers are found and counted as
    transformers records them passes; the same with one MoE layer miscounted is refused in one sentence."""
    from src.parallel.pipeline.stages import DecoderStage, Routing, check_stages
    from src.utils.config import ArchitectureRefused

    lit = module("mixtral")
    hf = lit.hf_model
    routing = Routing(hf, lit.router_balance)
    assert (routing.n_layers, len(routing.routers)) == (2, 2)  # one router per layer, not its MoE block as well
    check_stages(hf, hf.model.layers, 2, DecoderStage, eager=False, routing=routing)
    routing.n_layers = 3
    with pytest.raises(ArchitectureRefused, match=r"router load-balancing loss differently from one process.*"
                       r"model\.router_aux_loss=false"):  # fmt: skip
        check_stages(hf, hf.model.layers, 2, DecoderStage, eager=False, routing=routing)


def test_a_forward_that_gives_no_router_logits_is_refused_in_one_sentence():
    """flint's own forward fails with output_router_logits=True at a small size (inside transformers' loss): a run that
    trains its router loss stops before step 1 in one sentence; Mixtral's forward gives them and passes."""
    from transformers import AutoConfig

    from src.utils.config import ArchitectureRefused
    from tests.helpers.architectures import tiny_config

    defaults = AutoConfig.for_model("flint").to_dict()
    fields = {k: v for k, v in tiny_config("flint", layers=2).to_dict().items() if v != defaults.get(k, v)}
    flint = CausalLMLitModule(vocab_size=V, seq_len=T, model_type="flint", config=fields)
    flint.trainer = L.Trainer(logger=False, enable_checkpointing=False, accelerator="cpu")
    with pytest.raises(ArchitectureRefused, match=r"FlintForCausalLM's forward with output_router_logits=True fails "
                       r"\(IndexError.*model\.router_aux_loss=false"):  # fmt: skip
        check_router_logits(flint)
    check_router_logits(module("mixtral"))
