"""Models beyond one rank's memory: under trainer=fsdp (and DeepSpeed ZeRO-3) the model is built on the
meta device and each rank makes only its shards; pretrained weights are read by rank 0 and broadcast.
Parity of the values with 1 process is test_fsdp / test_deepspeed's; here: what each rank holds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import path_overrides, run_script, shared

from src.architectures.gpt2_adapter import GPT2
from src.lm import hf, init
from src.lm.models.gpt2_module import GPT2LitModule
from tests.helpers.architectures import ARCHITECTURES, tiny_config, too_large
from tests.helpers.margins import within

PROBE = ["+callbacks.probe._target_=tests.helpers.callbacks.RecordInitParams"]


def run_probed(tmp: Path, args: list[str]) -> list[dict]:
    """A real 2-rank train.py run with the probe; its per-rank records (rank 0 first)."""
    from test_parity import QUIET

    dirs = {"log_dir": tmp / "logs", "cache_dir": tmp / "cache"}
    run_script("train.py", QUIET + path_overrides(dirs) + PROBE + args + ["test=false"])
    (run,) = (dirs["log_dir"] / "train" / "runs").iterdir()
    records = [json.loads((run / f"init_rank{r}.json").read_text()) for r in range(2)]
    records[0]["logits"] = torch.load(run / "init_logits.pt")
    return records


def assert_never_whole(records: list[dict]) -> None:
    """Before setup no rank holds any parameter storage; after, each holds at most its half of each one
    (rounded up to whole rows: FSDP2 shards dim 0)."""
    for rank, record in enumerate(records):
        assert record["before_setup_bytes"] == 0, (rank, record["before_setup_bytes"], record["full_bytes"])
        for name, (local, full, rows) in record["after_setup"].items():
            assert local <= math.ceil(rows / 2) * (full // rows), (rank, name, local, full)
    totals = [sum(local for local, _, _ in r["after_setup"].values()) for r in records]
    assert sum(totals) == sum(full for _, full, _ in records[0]["after_setup"].values())  # the shards are the model


@pytest.mark.slow
def test_fsdp_builds_on_meta_and_no_rank_holds_the_whole_model(tmp_path):
    from test_fsdp import FSDP
    from test_parity import GPT2

    assert_never_whole(run_probed(tmp_path, GPT2 + FSDP + ["trainer.max_steps=1", "trainer.val_check_interval=1"]))


@pytest.mark.slow
def test_fsdp_pretrained_is_read_by_rank0_scattered_and_gives_the_same_logits(tmp_path):
    from test_fsdp import FSDP
    from transformers import GPT2LMHeadModel

    tiny = shared("tiny-gpt2")
    records = run_probed(
        tmp_path,
        FSDP
        + [
            "experiment=gpt2_continued_pretraining",
            f"model.pretrained={tiny}",
            "trainer.precision=32-true",
            f"data.path={shared('tinyshakespeare', 'input.txt')}",
            "data.seq_len=32",
            "trainer.max_steps=1",
            "trainer.val_check_interval=1",
            "trainer.limit_val_batches=1",
        ],
    )
    assert_never_whole(records)
    one = GPT2LMHeadModel.from_pretrained(tiny).eval()
    ids = torch.arange(12).remainder(50).view(2, 6)
    with torch.no_grad():
        expected = one(ids).logits
    within((records[0]["logits"] - expected).abs().max().item(), 1e-6, "logits")


@pytest.mark.slow
def test_zero3_builds_inside_zero_init_and_no_rank_holds_the_whole_model(tmp_path):
    from test_deepspeed import CPU_DS
    from test_parity import GPT2

    pytest.importorskip("deepspeed")
    records = run_probed(
        tmp_path, GPT2 + CPU_DS + ["trainer.strategy.stage=3", "trainer.max_steps=1", "trainer.val_check_interval=1"]
    )
    assert_never_whole(records)


def test_init_values_do_not_depend_on_how_the_model_is_laid_out():
    """Deferred (meta) and eager builds give the same values, and each parameter's value depends only on
    (base seed, its name): a shard made alone equals the slice of the whole."""
    torch.manual_seed(3)
    eager = GPT2LitModule(vocab_size=257, seq_len=16, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(3)
    with init.deferred_init():
        deferred = GPT2LitModule(vocab_size=257, seq_len=16, n_layer=2, n_head=2, n_embd=16)
    assert init.has_meta(deferred.model) and init.local_param_bytes(deferred.model) == 0
    deferred.materialize(torch.device("cpu"), sharded=False)
    a, b = eager.state_dict(), deferred.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    hf = deferred.hf_model
    assert hf.lm_head.weight is hf.transformer.wte.weight  # still tied after to_empty
    name = "transformer.h.1.mlp.c_fc.weight"
    again = init.full_value(GPT2.fill(deferred.config), deferred.base_seed, name, a["model." + name].shape)
    assert torch.equal(again, a["model." + name])
    # GPT-2's scheme: residual projections scaled by 1/sqrt(2 n_layer), LayerNorm gains 1, biases 0
    assert hf.transformer.h[0].attn.c_proj.weight.std() < 0.6 * hf.transformer.h[0].attn.c_attn.weight.std()
    assert torch.all(hf.transformer.ln_f.weight == 1) and torch.all(hf.transformer.h[0].mlp.c_fc.bias == 0)


# ---- meta-device init gives the model transformers builds: every buffer, persistent or not ----


@pytest.mark.parametrize("model_type", ARCHITECTURES)
@pytest.mark.parametrize("build", ["template", "all_meta"])
def test_meta_built_and_allocated_model_is_the_eagerly_built_one(model_type, build):
    """Built for deferred init and given memory by init.allocate, the model holds every buffer, persistent or not,
    that the eagerly built one holds, before any checkpoint is read (a run from scratch reads none); with the
    checkpoint's tensors it gives the same logits to the bit. Two builds: the template's (hf.build_on_meta: buffers
    built on the CPU, kept) and a model built wholly on meta (transformers' init recomputes the buffers it knows).
    Without it, Gemma's non-persistent embed_scale sat in a module with a weight and kept whatever memory
    to_empty gave it; Apertus' xIELU beta and eps (persistent, set in __init__, not by transformers' init) did so
    in every run from scratch, training another model. The sample runs by default; TEST_ALL_ARCHITECTURES=1 runs
    every causal LM transformers ships with both plans."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    try:  # what cannot be built or run at a tiny size is listed by its skip, with the reason
        config = tiny_config(model_type)
        if reason := too_large(config):
            pytest.skip(reason + " (its config names them otherwise)")
        torch.manual_seed(0)
        eager = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            expected = eager(ids).logits
    except pytest.skip.Exception:
        raise
    except Exception as error:  # noqa: BLE001 - the reason is the skip's
        pytest.skip(f"{model_type} does not build or run at a tiny size from its config defaults: {error}"[:300])
    rng = torch.get_rng_state()
    if build == "template":
        meta = hf.build_on_meta(config)
    else:
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
    tied = eager.get_output_embeddings().weight is eager.get_input_embeddings().weight
    assert (meta.get_output_embeddings().weight is meta.get_input_embeddings().weight) == tied  # one parameter
    init.allocate(meta, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng)  # no draw: every rank's later draws stay the same
    buffers = dict(meta.named_buffers())
    unknown = []  # buffers transformers' init does not recompute: only the template's build has them right
    for name, buffer in eager.named_buffers():
        if not torch.equal(buffers[name], buffer):
            unknown.append(name)
    assert not unknown or (build == "all_meta" and all(name in eager.state_dict() for name in unknown)), unknown
    meta.load_state_dict(eager.state_dict())
    meta.eval()
    with torch.no_grad():
        assert torch.equal(meta(ids).logits, expected)


def test_canary_transformers_init_skips_tensors_marked_initialised():
    """init.allocate marks every parameter `_is_hf_initialized` (private) so that transformers' `_init_weights`
    recomputes a module's buffers without drawing its weights: this fails by name if transformers stops honouring
    the mark."""
    from transformers import initialization

    tensor = torch.zeros(4)
    tensor._is_hf_initialized = True
    initialization.normal_(tensor)
    initialization.constant_(tensor, 1.0)
    assert torch.equal(tensor, torch.zeros(4))
