"""From scratch, a model starts as its architecture starts it: every parameter against transformers' own
initialisation (`AutoModelForCausalLM.from_config`), constants exactly (Gemma's zero-centred norm gains, Mamba's D
and dt_bias, biases) and random tensors in distribution (mean and standard deviation within a bound derived from the
tensor's size: Mamba's and the gated delta rule's A_log, every weight); and on every layout the same values
(src/lm/init.py draws each parameter from its own generator: tests/test_meta_init.py compares the layouts).

The default suite: Llama, Gemma 2, Qwen3-Next (gated delta rule + attention), Falcon-H1 (Mamba-2 hybrid) and GPT-2
(its own adapter's rule, residual projections scaled by 1/sqrt(2 n_layer)); TEST_ALL_ARCHITECTURES=1: every
architecture the architecture matrix builds (tests/test_architecture_matrix.py)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ALL

from tests.helpers.architectures import tiny_or_skip, with_both_plans

DEFAULT = ["llama", "gemma2", "qwen3_next", "falcon_h1"]
ARCHITECTURES = sorted(set(with_both_plans()) | set(DEFAULT)) if ALL else DEFAULT


def differences(ours: torch.nn.Module, theirs: torch.nn.Module) -> list[str]:
    """Each parameter whose initial values are not transformers' in kind: a constant that differs, or a random
    tensor whose mean or standard deviation is off by more than 6 standard errors of n values (the mean of n
    draws varies by sd / sqrt(n), two such means by sd sqrt(2 / n); a sample sd by about sd / sqrt(2 n), the
    ratio of two by sqrt(1 / n))."""
    a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert a.keys() == b.keys(), set(a) ^ set(b)
    bad = []
    for name in a:
        x, y = a[name].detach().double().flatten(), b[name].detach().double().flatten()
        if y.min() == y.max():  # a constant (zeros, ones, a fill value): exactly
            if not bool((x == y).all()):
                bad.append(f"{name}: {x.min().item():.4g}..{x.max().item():.4g}, transformers' {y[0].item():.4g}")
            continue
        n, sd = y.numel(), y.std().item()
        mean_off = abs(x.mean().item() - y.mean().item()) > 6 * sd * math.sqrt(2 / n)
        sd_off = abs(x.std().item() / sd - 1) > 6 / math.sqrt(n)
        if mean_off or sd_off:
            bad.append(
                f"{name}: mean {x.mean().item():.4g} sd {x.std().item():.4g}, transformers' {y.mean().item():.4g} "
                f"{sd:.4g} ({n} values)"
            )
    return bad


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_from_scratch_every_parameter_starts_as_transformers_starts_it(arch):
    from transformers import AutoModelForCausalLM

    from src.lm.models.causal_lm import CausalLMLitModule

    config, fields = tiny_or_skip(arch)
    torch.manual_seed(0)
    try:
        ours = CausalLMLitModule(vocab_size=config.vocab_size, seq_len=32, model_type=arch, config=fields).model
    except Exception as error:
        if arch in DEFAULT:
            raise
        pytest.skip(f"the template does not build it at a tiny size (docs/models.md): {error}"[:300])
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(ours.config)
    assert differences(ours, theirs) == []


def test_gpt2_keeps_its_adapters_rule_which_is_gpt2s():
    """GPT-2's adapter (src/architectures/gpt2_adapter.py) against transformers' GPT-2 init: the same distributions."""
    from transformers import AutoModelForCausalLM

    from src.lm.models.gpt2_module import GPT2LitModule

    torch.manual_seed(0)
    ours = GPT2LitModule(vocab_size=1000, seq_len=64, n_layer=4, n_head=4, n_embd=64).model
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(ours.config)
    assert differences(ours, theirs) == []


def test_the_check_sees_the_generic_rule_on_gemma2_and_a_mamba_hybrid(monkeypatch):
    """The comparison fails for the rule the template used before (N(0, std) weights, unit norm gains, zero
    biases for every architecture): Gemma 2's gains of 1 + w start at 2, Falcon-H1's A_log, D and dt_bias are off."""
    from transformers import AutoModelForCausalLM

    from src.lm import hf
    from src.lm.models.causal_lm import CausalLMLitModule

    monkeypatch.setattr(hf, "architecture_fill", lambda model, fallback: fallback)
    for arch, words in (("gemma2", "input_layernorm.weight"), ("falcon_h1", "mamba.A_log")):
        config, fields = tiny_or_skip(arch)
        ours = CausalLMLitModule(vocab_size=config.vocab_size, seq_len=32, model_type=arch, config=fields).model
        bad = differences(ours, AutoModelForCausalLM.from_config(ours.config))
        assert any(words in line for line in bad), bad
