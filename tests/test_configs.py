"""Every option of every config group composes and instantiates; unknown keys and impossible setups fail clearly."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, shared
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import open_dict

from src.run.job import check_machine
from src.utils.config import ConfigError, check_targets, instantiate_group
from src.utils.errors import translate

CONF = ROOT / "conf"
GROUPS = [
    "trainer",
    "model",
    "model/size",
    "model/peft",
    "model/objective",
    "data",
    "callbacks",
    "logger",
    "paths",
    "hydra",
    "experiment",
    "debug",
]


def options(group: str, conf: Path = CONF) -> list[str]:
    return sorted(p.stem for p in (conf / group).glob("*.yaml"))


def compose_cfg(
    overrides: list[str], name: str = "train", tmp: Path | None = None, keep_hydra: bool = False, conf: Path = CONF
):
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # lets ${hydra:runtime.output_dir} resolve
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp or "/tmp/unused")
        cfg.paths.log_dir = str(tmp or "/tmp/unused")
        if not keep_hydra:
            del cfg["hydra"]  # as in a real run: the task function never sees the hydra node
    return cfg


# Options that only make sense together (a model and the data it reads) are found in conf/, not listed here: a
# user's model, data and the experiment that pairs them compose without editing this file.
PAIRED = {"model": "data", "data": "model"}


def yaml_of(conf: Path, group: str, option: str) -> dict:
    return yaml.safe_load((conf / group / f"{option}.yaml").read_text()) or {}


def picks(defaults: list) -> dict[str, str]:
    """The options a defaults list chooses: `- override /data: digits` and `- data: text` -> {"data": "digits"}."""
    chosen = {}
    for entry in defaults:
        if isinstance(entry, dict):
            for key, value in entry.items():
                if isinstance(value, str):
                    chosen[key.removeprefix("override").strip().strip("/")] = value
    return chosen


def partner_experiment(group: str, option: str, conf: Path = CONF) -> str | None:
    """The experiment `group=option` is composed with, when it needs one: a model (data) option that no experiment
    pairs with the default data (model) of train.yaml, but one does with another (model=convnet: data=digits, in
    experiment=convnet_digits), takes the first such experiment, which brings the partner and whatever else the
    pair needs (callbacks.generate_text=null: no text to generate). An option no experiment uses takes those of an
    option of its group built by the same class (data=mnist: data=digits's, both ImageDataModule). None: the option
    composes alone (with the default partner), as do the options of every other group."""
    if group not in PAIRED:
        return None
    other = PAIRED[group]
    default = picks(yaml.safe_load((conf / "train.yaml").read_text())["defaults"])
    if option == default[group]:
        return None
    experiments = {e: picks(yaml_of(conf, "experiment", e).get("defaults", [])) for e in options("experiment", conf)}

    def users(opt: str) -> list[tuple[str, str]]:  # (experiment, the partner it gives `opt`)
        return [(e, chosen.get(other, default[other])) for e, chosen in experiments.items() if chosen.get(group) == opt]

    used = users(option)
    if not used:
        target = yaml_of(conf, group, option).get("_target_")
        same_class = [o for o in options(group, conf) if target and yaml_of(conf, group, o).get("_target_") == target]
        used = [u for o in same_class if o != option for u in users(o)]
    if not used or any(partner == default[other] for _, partner in used):
        return None
    return used[0][0]


def partners(group: str, option: str, conf: Path = CONF) -> list[str]:
    """The overrides `group=option` needs beside it to compose into a config that runs."""
    if group == "model/size":  # a Llama/Qwen2/Mistral shape goes with its model= only
        size_for = yaml_of(conf, group, option).get("size_for")
        return [f"model={size_for}"] if size_for else []
    experiment = partner_experiment(group, option, conf)
    return [f"experiment={experiment}"] if experiment else []


ALL_OPTIONS = [(g, o) for g in GROUPS for o in options(g)]


def test_every_group_has_options():
    for group in GROUPS:
        assert options(group), f"conf/{group} has no options"
    assert {"default", "cpu", "gpu", "ddp", "fsdp", "deepspeed"} <= set(options("trainer"))
    assert {"tiny", "small", "medium", "large", "xl"} <= set(options("model/size"))


# experiments (or options) built on the hub's GPT-2: the local tiny GPT-2 instead (virtual tokens need room in its
# context), offline
HUB_GPT2 = ("gpt2_continued_pretraining", "gpt2_instruct_lora", "gpt2_dpo", "gpt2_reward", "chat_sft")


def compose_and_instantiate(group: str, option: str, tmp_path: Path, conf: Path = CONF) -> None:
    """Compose `group=option` with its partners and build everything a run builds before training."""
    extra = partners(group, option, conf)
    experiment = option if group == "experiment" else partner_experiment(group, option, conf)
    if experiment == "gpt2_small":  # its tokenizer is the hub's gpt2: use the local files
        extra = extra + [f"data.tokenizer={shared('gpt2-tokenizer')}"]
    if group == "model/peft" or (group, option) == ("model", "causal_lm") or experiment in HUB_GPT2:
        extra = extra + [f"model.pretrained={shared('tiny-gpt2')}", "data.seq_len=64"]
    cfg = compose_cfg([f"{group}={option}"] + extra, tmp=tmp_path, conf=conf)
    assert HydraConfig.get().runtime.choices[group] == option  # the option itself, not one its partner brings
    check_targets(cfg)  # every key of every _target_ node is accepted by its target
    needs_cuda = cfg.trainer.get("accelerator") == "gpu" or "deepspeed" in str(cfg.trainer.strategy)
    if needs_cuda and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs (a )?CUDA"):
            check_machine(cfg.trainer)
        return
    check_machine(cfg.trainer)
    datamodule = instantiate(cfg.data)
    told = getattr(datamodule, "model_kwargs", {})  # as train.py: a plain LightningDataModule tells the model nothing
    # shapes only (GPT-2 xl would need 6 GB of real memory); pretrained weights must really load
    with contextlib.nullcontext() if cfg.model.get("pretrained") else torch.device("meta"):
        model = instantiate(cfg.model, **told)
    callbacks = instantiate_group(cfg.callbacks, "callbacks")
    loggers = instantiate_group(cfg.logger, "logger")
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers)
    assert trainer.max_steps == (1 if cfg.trainer.get("fast_dev_run") else cfg.trainer.max_steps)
    assert trainer.num_devices == cfg.trainer.devices
    if hasattr(model, "config") and "vocab_size" in told:  # a language model and the tokens it reads
        assert datamodule.seq_len <= model.config.max_position_embeddings
        assert model.config.vocab_size == told["vocab_size"]


@pytest.mark.parametrize("group,option", ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_option_composes_and_instantiates(group, option, tmp_path):
    compose_and_instantiate(group, option, tmp_path)


def test_the_template_pairs_are_found_in_conf():
    """The pairs a table here used to list: the vision data with the vision model and vice versa; the text options
    compose alone (with train.yaml's model=gpt2 or data=text), as before."""
    assert partners("model", "convnet") == partners("data", "digits") == ["experiment=convnet_digits"]
    assert partners("data", "mnist") == ["experiment=convnet_digits"]  # no experiment of its own: digits's class
    for group, option in [
        ("model", "gpt2"),
        ("model", "llama"),
        ("data", "text"),
        ("data", "chat"),
        ("data", "prompts"),
    ]:
        assert partners(group, option) == [], (group, option)
    assert partners("model/size", "llama3_1b") == ["model=llama"] and partners("model/size", "small") == []


USER_MODULE = '''
"""A user's addition, as the template's users write one: a tiny MLP on a scikit-learn table (iris)."""
import torch
from torch import nn
from torch.utils.data import Subset, TensorDataset

from src.core.datamodule import ShardedDataModule
from src.core.module import LitModule


class TableDataModule(ShardedDataModule):
    batch_kind = "images"  # (features, label) pairs, no objective

    def __init__(self, val_size=20, test_size=20, global_batch_size=16, eval_batch_size=None, num_workers=0,
                 seed=42, overfit_batches=0):
        super().__init__(global_batch_size, eval_batch_size, num_workers, seed, overfit_batches)
        self.val_size, self.test_size = val_size, test_size

    @property
    def model_kwargs(self):
        return {"n_features": 4, "num_classes": 3}

    def build_splits(self):
        from sklearn.datasets import load_iris

        x, y = load_iris(return_X_y=True)
        data = TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))
        v, t = self.val_size, self.val_size + self.test_size
        splits = {"val": range(v), "test": range(v, t), "train": range(t, len(y))}
        return {split: Subset(data, rows) for split, rows in splits.items()}


class MLPLitModule(LitModule):
    def __init__(self, n_features, num_classes, hidden=32, optimizer=None, scheduler=None, weight_decay=0.0,
                 lr_scaling="none", base_batch_size=16):
        super().__init__(optimizer, scheduler, weight_decay, lr_scaling, base_batch_size)
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log_train_loss(loss, batch_idx)
        return loss
'''
USER_CONF = {
    "model/mlp.yaml": "_target_: user_mlp_table.MLPLitModule\nhidden: 32\noptimizer:\n  _target_: torch.optim.AdamW\n"
    "  _partial_: true\n  lr: 1.0e-2\nscheduler: null\n",
    "data/table.yaml": "_target_: user_mlp_table.TableDataModule\nglobal_batch_size: 16\nseed: ${seed}\n",
    "experiment/mlp_table.yaml": "# @package _global_\ndefaults:\n  - override /data: table\n  - override /model: mlp\n"
    "callbacks:\n  generate_text: null\ntrainer:\n  precision: 32-true\n  max_steps: 100\n",
}


def test_a_users_model_data_and_experiment_compose_without_editing_this_file(tmp_path, monkeypatch):
    """A user's model, data and the experiment pairing them (in a copy of conf/, their code in a module of their
    own) compose and instantiate through the same discovery as the template's options: composed alone, the model
    would be given the text data's vocab_size."""
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    for name, text in USER_CONF.items():
        (conf / name).write_text(text)
    (tmp_path / "user_mlp_table.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert partners("model", "mlp", conf) == partners("data", "table", conf) == ["experiment=mlp_table"]
    assert partners("model", "convnet", conf) == ["experiment=convnet_digits"]  # the template's pairs unchanged
    for group, option in [("model", "mlp"), ("data", "table"), ("experiment", "mlp_table")]:
        compose_and_instantiate(group, option, tmp_path / group, conf=conf)


def test_a_plain_lightning_datamodule_without_model_kwargs_composes_without_editing_this_file(tmp_path, monkeypatch):
    """A LightningDataModule and LightningModule as Lightning's docs teach them (tests/helpers/plain_lightning.py): the
    datamodule tells the model nothing (no `model_kwargs`, which train.py does not ask for either), and its option,
    the model's and their experiment compose and instantiate through the same discovery as the template's."""
    import shutil

    from tests.helpers.plain_lightning import write_configs

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    write_configs(conf)
    assert partners("data", "plain_table", conf) == partners("model", "plain_mlp", conf) == ["experiment=plain"]
    for group, option in [("model", "plain_mlp"), ("data", "plain_table"), ("experiment", "plain")]:
        compose_and_instantiate(group, option, tmp_path / group, conf=conf)


@pytest.mark.parametrize(
    "size,expected", [("small", 124_439_808), ("medium", 354_823_168), ("large", 774_030_080), ("xl", 1_557_611_200)]
)
def test_size_presets_are_the_real_gpt2_shapes(size, expected, tmp_path):
    """Parameter counts of OpenAI's GPT-2 checkpoints (50257 vocab, 1024 context, tied embeddings)."""
    cfg = compose_cfg([f"model/size={size}", "data.seq_len=1024"], tmp=tmp_path)
    with torch.device("meta"):
        model = instantiate(cfg.model, vocab_size=50257)
    assert model.n_params == expected


def test_unknown_key_on_command_line_fails():
    with pytest.raises(ConfigCompositionException, match="lrr"):
        compose_cfg(["model.optimizer.lrr=1e-3"])
    with pytest.raises(ConfigCompositionException, match="nonsense"):
        compose_cfg(["nonsense=1"])


def test_unknown_key_inside_a_target_node_fails_before_any_work(tmp_path):
    cfg = compose_cfg(["+model.optimizer.lrr=1e-3"], tmp=tmp_path)
    with pytest.raises(ConfigError, match=r"model\.optimizer\.lrr.*AdamW"):
        check_targets(cfg)
    cfg = compose_cfg(["+data.seqlen=64"], tmp=tmp_path)
    with pytest.raises(ConfigError, match=r"data\.seqlen.*seq_len"):
        check_targets(cfg)
    # model=gpt2 passes its options on to CausalLMLitModule: a key of neither is refused, naming keys of both
    cfg = compose_cfg(["+model.compile_los=true"], tmp=tmp_path)
    with pytest.raises(ConfigError, match=r"model\.compile_los.*GPT2LitModule.*n_layer.*compile_loss"):
        check_targets(cfg)
    check_targets(compose_cfg(["model.compile_loss=true", "model.n_layer=2"], tmp=tmp_path))  # one of each: taken


@pytest.mark.parametrize("data", ["text", "litdata", "instruct", "chat", "preference", "prompts", "table", "digits"])
def test_a_datamodule_takes_its_own_keys_and_the_shared_ones_and_refuses_a_typo(data, tmp_path):
    """Each datamodule types its own keys and passes the shared ones on (`**shared`) to the base that types them once
    (tokens.py, base.py): the key check follows it, so a shared key is taken and a misspelt one refused in a sentence
    naming the datamodule and the keys of every level."""
    cfg = compose_cfg([f"data={data}", "data.eval_batch_size=2", "data.num_workers=0"], tmp=tmp_path)
    check_targets(cfg.data, "data")
    cfg = compose_cfg([f"data={data}", "+data.eval_batch_sise=2"], tmp=tmp_path)
    target = cfg.data._target_.rsplit(".", 1)[1]
    with pytest.raises(
        ConfigError, match=rf"^Unknown config key 'data\.eval_batch_sise': .*{target} does not take"
    ) as e:
        check_targets(cfg.data, "data")
    accepted = str(e.value).split("accepted keys are: ", 1)[1].rstrip(".").split(", ")
    assert {"global_batch_size", "eval_batch_size", "num_workers", "seed", "overfit_batches"} <= set(accepted)
    assert "shared" not in accepted and "\n" not in str(e.value)


def test_a_subclass_that_inherits_a_datamodules_init_is_checked_as_strictly():
    from src.lm.data.chat import ChatDataModule
    from src.utils.config import accepted_parameters

    keys = set(accepted_parameters(type("MyChat", (ChatDataModule,), {})))
    assert {"path", "layout", "hf_split", "special_tokens", "tokenizer", "seq_len", "global_batch_size"} <= keys
    assert "shared" not in keys  # no **kwargs left: a misspelt key is refused, as for ChatDataModule itself


def test_unknown_top_level_key_in_a_yaml_fails(tmp_path):
    """A typo in a config file (not the command line) is caught by the dataclass schema."""
    exp = CONF / "experiment" / "_test_typo.yaml"
    exp.write_text("# @package _global_\nseeed: 1\n")
    try:
        with pytest.raises(ConfigCompositionException, match="seeed"):
            compose_cfg(["experiment=_test_typo"])
    finally:
        exp.unlink()


def test_machine_checks_name_the_problem_and_the_fix(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("these errors are about machines without CUDA")
    for override, words in [
        ("trainer=deepspeed", "trainer=deepspeed needs CUDA"),
        ("trainer.strategy=fsdp", "FSDP1 strategy .* needs CUDA.*trainer=fsdp \\(FSDP2"),
        ("trainer=deepspeed_stage_3_offload", "trainer=deepspeed needs CUDA"),
        ("trainer=gpu", "accelerator=gpu needs a CUDA GPU"),
        ("trainer.precision=16-mixed", "silently"),
    ]:
        cfg = compose_cfg([override], tmp=tmp_path)
        with pytest.raises(ConfigError, match=words) as e:
            check_machine(cfg.trainer)
        assert "Use trainer" in str(e.value)  # ... and the fix


@pytest.mark.parametrize("bf16_cpu", [False, True])
def test_bf16_on_a_cpu_without_bf16_instructions_warns(bf16_cpu, tmp_path, monkeypatch, caplog):
    """bf16 autocast on an AVX2-only CPU trains ~10x slower than fp32 (docs/performance.md): say so at start."""
    if torch.cuda.is_available():
        pytest.skip("the warning is about CPUs")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_cpu)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    for precision, warns in [("bf16-mixed", not bf16_cpu), ("32-true", False)]:
        caplog.clear()
        check_machine(compose_cfg([f"trainer.precision={precision}"], tmp=tmp_path).trainer)
        assert ("without AVX512-BF16 or AMX" in caplog.text) == warns, (precision, caplog.text)
        if warns:
            assert "Use trainer.precision=32-true" in caplog.text  # ... and the fix


def test_ddp_means_two_cpu_processes_without_gpu(tmp_path):
    cfg = compose_cfg(["trainer=ddp"], tmp=tmp_path)
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 2
    assert cfg.trainer.devices == expected
    assert cfg.trainer.strategy._target_ == "lightning.pytorch.strategies.DDPStrategy"  # "ddp", with a timeout


@pytest.mark.parametrize(
    "cuda,cuda_bf16,cpu_bf16,accelerator,expected",
    [
        (True, True, False, "auto", "bf16-mixed"),  # Ampere and newer
        (True, False, False, "auto", "16-mixed"),  # V100, T4: fp16 with a gradient scaler
        (True, True, True, "cpu", "bf16-mixed"),  # trainer=cpu on a GPU machine: the CPU decides
        (True, True, False, "cpu", "32-true"),
        (False, False, True, "auto", "bf16-mixed"),  # AVX512-BF16 / AMX CPU
        (False, False, False, "auto", "32-true"),  # bf16 would be emulated: slower
    ],
)
def test_default_precision_is_the_fastest_for_the_hardware(
    monkeypatch, cuda, cuda_bf16, cpu_bf16, accelerator, expected
):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: cpu_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    trainer = "cpu" if accelerator == "cpu" else "default"
    assert compose_cfg([f"trainer={trainer}"]).trainer.precision == expected
    assert compose_cfg([f"trainer={trainer}", "trainer.precision=32-true"]).trainer.precision == "32-true"


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ([], "eager"),  # bf16 on this kind of CPU, context 128: measured 1.55x faster
        (["data.seq_len=512"], "sdpa"),  # longer contexts: SDPA (2x at 1024, less memory)
        (["trainer.precision=32-true"], "sdpa"),  # fp32: a tie, SDPA keeps less memory
        (["trainer=gpu"], "sdpa"),  # GPUs: flash attention
    ],
)
def test_default_attention_kernel_is_the_measured_faster_one(monkeypatch, overrides, expected):
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)  # a bf16-capable CPU, no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = compose_cfg(overrides)
    assert cfg.model.attn_implementation == "auto" and cfg.model.fastest_attention == expected


@pytest.mark.parametrize("script,args", [("train.py", []), ("eval.py", ["ckpt_path=some.ckpt"])])
def test_printing_the_resolved_config_works_outside_a_run(tmp_path, script, args):
    """`--cfg job --resolve` resolves paths.output_dir too (Hydra's runtime.output_dir is unset then)."""
    from conftest import run_script

    proc = run_script(script, ["--cfg", "job", "--resolve", f"paths.log_dir={tmp_path}", *args], timeout=120)
    task = "train" if script == "train.py" else "eval"
    assert f"output_dir: {tmp_path}/{task}/runs/" in proc.stdout
    assert "${" not in proc.stdout  # every interpolation resolved
    assert not (tmp_path / task).exists()  # printing creates no run dir


def test_dependency_floors_hold_and_each_names_its_reason():
    """pyproject.toml parses; every installed dependency satisfies its range (a floor raised past what CI
    installs fails here), and every floor carries a comment saying which API or check sets it."""
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text()
    project = tomllib.loads(text)["project"]
    assert project["dependencies"]
    for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(spec)
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            continue  # an optional extra not installed here
        assert req.specifier.contains(installed, prereleases=True), f"{req.name} {installed} is outside {req.specifier}"
    block = text[text.index("dependencies = [") : text.index("]", text.index("dependencies = ["))]
    for line in block.splitlines()[1:]:
        if line.strip().startswith('"'):
            assert "#" in line, f"pyproject.toml: {line.strip()} has no comment naming what sets its floor"


def test_test_latest_names_a_torch_release_beyond_the_range(tmp_path):
    """make test-latest installs the newest torch pyproject.toml allows, and scripts/newest_torch.py names a newer
    one that pip could install here (from pip's --report) but the range keeps out; none when there is none."""
    import importlib.util
    import json

    from packaging.version import Version

    spec = importlib.util.spec_from_file_location("newest_torch", ROOT / "scripts" / "newest_torch.py")
    newest_torch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(newest_torch)
    installed = Version(torch.__version__.split("+")[0])
    report = tmp_path / "torch.json"
    for newest, named in ((f"{installed.major}.{installed.minor + 1}.0", True), (str(installed), False)):
        report.write_text(json.dumps({"install": [{"metadata": {"name": "torch", "version": newest}}]}))
        line = newest_torch.main(str(report))
        assert line.startswith(f"test-latest: torch {installed}")
        assert (f"torch {newest} installs here but is outside pyproject.toml's range" in line) == named, line
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH=\"'torch$(TORCH_RANGE)'\"" in makefile  # test-latest's torch is the range's, not the lock's


@pytest.mark.parametrize("model,size", [("gpt2", "llama3_1b"), ("qwen2", "mistral_7b"), ("llama", "qwen2_05b")])
def test_a_size_preset_of_another_architecture_is_one_sentence(model, size, tmp_path):
    """GPT2Config reads hidden_size as n_embd and Qwen2Config ignores a sliding window: without the check these
    built a 909M-parameter GPT-2, or a Qwen2 that is not Mistral-7B's shape, without a word."""
    cfg = compose_cfg([f"model={model}", f"model/size={size}"], tmp=tmp_path)
    with torch.device("meta"), pytest.raises(Exception) as raised:
        instantiate(cfg.model, vocab_size=32000)
    assert re.search(rf"preset is a \w+ shape and this is model={model}: use model=", translate(raised.value))


@pytest.mark.parametrize(
    "model,size,vocab,expected",
    [
        ("llama", "smollm2_135m", 49152, 134_515_008),
        ("llama", "llama3_1b", 128256, 1_235_814_400),
        ("llama", "llama2_7b", 32000, 6_738_415_616),
        ("qwen2", "qwen2_05b", 151936, 494_032_768),
        ("qwen2", "qwen2_15b", 151936, 1_543_714_304),
        ("mistral", "mistral_7b", 32000, 7_241_732_096),
    ],
)
def test_size_presets_of_llama_qwen2_mistral_are_the_published_shapes(model, size, vocab, expected, tmp_path):
    """Parameter counts of SmolLM2-135M, Llama-3.2-1B, Llama-2-7B, Qwen2.5-0.5B/1.5B and Mistral-7B-v0.1 with
    their own vocabularies (built on the meta device: shapes only)."""
    cfg = compose_cfg([f"model={model}", f"model/size={size}"], tmp=tmp_path)
    with torch.device("meta"):
        module = instantiate(cfg.model, vocab_size=vocab)
    assert module.n_params == expected
    tiny = compose_cfg([f"model={model}"], tmp=tmp_path)  # without a size preset: the CPU-sized default
    assert tiny.model.config.hidden_size == 128


def test_float32_matmul_precision_is_set_before_the_model_and_a_bad_value_is_one_sentence(tmp_path):
    """float32_matmul_precision (conf/train.yaml, conf/eval.yaml): job.check_export_and_seed sets torch's precision for fp32 matrix
    products on the rank it runs on (every rank runs it); torch's own default stays the default."""
    import torch

    from src.run.job import check_export_and_seed
    from src.utils.config import ConfigError

    assert (
        compose_cfg([]).float32_matmul_precision == "highest" == compose_cfg([], name="eval").float32_matmul_precision
    )
    try:
        check_export_and_seed(compose_cfg(["float32_matmul_precision=high", "extras.print_config=false"], tmp=tmp_path))
        assert torch.get_float32_matmul_precision() == "high"
        with pytest.raises(ConfigError, match=r"float32_matmul_precision='tf32': use highest, high or medium"):
            check_export_and_seed(
                compose_cfg(["float32_matmul_precision=tf32", "extras.print_config=false"], tmp=tmp_path)
            )
    finally:
        torch.set_float32_matmul_precision("highest")
