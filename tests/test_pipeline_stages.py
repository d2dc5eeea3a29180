"""trainer=pipeline's stages compute the model's own function, for every architecture transformers ships a pipeline
plan for: the stages chained (each as its rank runs it, what other ranks hold pruned away) against the model's own
forward, in float64 (src/parallel/pipeline/stages.py's `check_stages`, which every pipeline run calls before
step 1); and what differs, fails or is left without a stage is refused in one sentence. The 2-rank runs against one
process are tests/test_pipeline.py's and tests/test_architectures_parity.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from src.lm.hf import decoder_layers
from src.parallel.pipeline.stages import DecoderStage, check_stages, stage_class
from src.utils.config import ConfigError
from tests.helpers.architectures import ARCHITECTURES, SAMPLE, tiny_config, too_large


def tiny_model(model_type: str, layers: int = 4, **fields) -> nn.Module:
    """`model_type` at a CPU size with `layers` layers, or a skip saying why it cannot be built or run so."""
    from transformers import AutoModelForCausalLM

    try:
        config = tiny_config(model_type, layers, **fields)
        if not getattr(config, "base_model_pp_plan", None):
            pytest.skip(f"{model_type} ships no pipeline plan (trainer=pipeline refuses it in one sentence)")
        if reason := too_large(config):
            pytest.skip(reason + " (its config names them otherwise)")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            model(torch.zeros(1, 8, dtype=torch.long))
    except pytest.skip.Exception:
        raise
    except Exception as error:  # noqa: BLE001 - the reason is the skip's
        pytest.skip(f"{model_type} does not build or run at a tiny size from its config defaults: {error}"[:300])
    return model


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_stages_chained_are_the_models_own_forward(model_type):
    """2 stages of 2 layers and 4 of 1 (the interleaved schedule's split): equal to the model's forward to float64's
    rounding, or (outside the sample) refused in one sentence. Stages that re-implement the forward (below) fail
    it: Granite's multipliers, Cohere's logit scale, Gemma2's soft-capping were dropped and Gemma3's
    per-layer-type rotary crashed."""
    model = tiny_model(model_type)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = decoder_layers(model)
    held = list(layers)
    for n_stages in (2, 4):
        try:
            check_stages(model, layers, n_stages, stage_class(model.config), eager=False)
        except ConfigError as refusal:  # the other outcome allowed: one sentence before step 1 (never the sample's)
            assert model_type not in SAMPLE and "\n" not in str(refusal), str(refusal)
    after = model.state_dict()  # the probe leaves the model as it found it: dtypes, modules, values
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert list(layers) == held and model.training


class ReimplementedStage(DecoderStage):
    """Stages as they once were: the last one runs the plan's parts after the layers and the LM head itself,
    dropping whatever the causal LM's own forward does beyond them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.last:
            return super().forward(x)
        hf = self.model[0]
        hooks = [self.layers[-1].register_forward_hook(lambda m, a, out: setattr(self, "out", out))]
        hooks.append(self.layers[0].register_forward_pre_hook(lambda m, a, k: ((x, *a[1:]), k), with_kwargs=True))
        try:
            hf.base_model(inputs_embeds=x, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        h = self.out
        for module in self.outputs.values():
            h = module(h)
        return self.lm_head(h)


@pytest.mark.parametrize(
    "model_type,fields",
    [
        ("granite", {"logits_scaling": 8.0}),  # the causal LM divides its logits
        ("cohere", {"logit_scale": 0.25}),  # and Cohere multiplies them
        ("gemma2", {"final_logit_softcapping": 30.0}),  # tanh soft-capping: differences of ~1e-4 here, caught
    ],
)
def test_a_stage_that_drops_what_the_forward_does_is_refused(model_type, fields):
    model = tiny_model(model_type, **fields)
    layers = decoder_layers(model)
    check_stages(model, layers, 2, DecoderStage, eager=False)  # the real stages pass
    with pytest.raises(ConfigError, match=f"different function than one process for {model_type}: .* by ") as e:
        check_stages(model, layers, 2, ReimplementedStage, eager=False)
    assert "\n" not in str(e.value) and "trainer=fsdp" in str(e.value)


def test_a_stage_that_fails_or_a_parameter_no_stage_owns_is_one_sentence():
    model = tiny_model("llama")
    layers = decoder_layers(model)

    class Failing(DecoderStage):
        def forward(self, x):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied\nmore")

    with pytest.raises(ConfigError, match=r"cannot split llama: running its stages failed \(RuntimeError: mat1 "):
        check_stages(model, layers, 2, Failing, eager=False)
    model.model.adapter = nn.Linear(4, 4)  # a part of the body the pipeline plan does not name
    with pytest.raises(ConfigError, match=r"its parameters \['model.adapter.weight', 'model.adapter.bias'\] are in no"):
        check_stages(model, layers, 2, DecoderStage, eager=False)
