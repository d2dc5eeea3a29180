"""Checkpoints in any of their forms: one file (DDP, single device, FSDP with
save_distributed_checkpoint=false), a sharded DCP dir (FSDP2 or tensor parallel, one shard per rank), or a DeepSpeed
ZeRO dir (converted with DeepSpeed's zero_to_fp32).

    python -m src.tools.checkpoints consolidate CKPT_DIR [OUT.ckpt]   # sharded dir -> one fp32 file (the CLI:
    python -m src.tools.checkpoints export-hf CKPT OUT_DIR            # src/tools/checkpoints.py)

Resume training from the sharded dir itself (`ckpt_path=.../last.ckpt` with the same strategy);
the consolidated file holds the weights, step counters and config for eval and export, not the
optimizer state. Names ending in .tmp or .old beside a checkpoint are a save in progress or the
previous version during its swap (src/checkpoint/files.py), never checkpoints to read.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

import src.launch.resolvers  # noqa: F401
from src.checkpoint import safe_load
from src.checkpoint.files import problem
from src.checkpoint.resharding import LAYOUT_KEY, to_hf
from src.utils.errors import CheckpointError


def is_dcp(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def is_deepspeed(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "latest").is_file()


def is_sharded(path: str | Path) -> bool:
    return is_dcp(path) or is_deepspeed(path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint as one dict with "state_dict" (and "config" when train.py wrote it); sharded forms
    are gathered into full fp32 weights, without their optimizer state."""
    path = Path(path)
    if not path.exists():
        old = path.with_name(path.name + ".old")  # a save killed between its two renames (src/checkpoint/files.py)
        hint = (
            f" A save of it was interrupted: {old.name} holds the previous one (resume=auto puts it back)."
            if old.exists()
            else ""
        )
        raise CheckpointError(f"{path} does not exist. Point at a .ckpt file or a sharded checkpoint dir.{hint}")

    why = problem(path)
    if why is not None:
        raise CheckpointError(
            f"{path} cannot be read as a checkpoint: {why}. Point at a .ckpt file or a sharded "
            "checkpoint dir written by train.py."
        )
    if is_deepspeed(path):
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        safe_load.check_dir(path)  # zero_to_fp32 unpickles the files with plain pickle
        with tempfile.TemporaryDirectory() as tmp:  # zero_to_fp32: gathers the ZeRO partitions into fp32 weights
            convert_zero_checkpoint_to_fp32_state_dict(path, Path(tmp) / "full.ckpt")
            return safe_load.load(Path(tmp) / "full.ckpt", map_location="cpu")
    if not is_dcp(path):
        return safe_load.load(path, map_location="cpu")
    weights = dcp_model_weights(path)  # checks the dir first
    meta = safe_load.load(path / "meta.pt", map_location="cpu") if (path / "meta.pt").exists() else {}
    layout = meta.pop(LAYOUT_KEY, None)  # trainer=tp's Linear layout -> GPT-2's own Conv1D one
    if layout is not None:
        weights = to_hf(weights, layout)
    return {**meta, "state_dict": weights}


def dcp_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors from a DCP dir, every rank's shards joined, without the optimizer state
    (two thirds of an Adam checkpoint). No process group needed."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    safe_load.check_dir(path)  # DCP's reader unpickles .metadata with plain pickle
    reader = FileSystemReader(str(path))
    prefix = "state_dict."  # Lightning saves {"state_dict": model, "optimizer_0": ...}; DCP flattens the keys
    weights = {
        key: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in safe_load.dcp_metadata(path).state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    load(weights, storage_reader=reader, no_dist=True)
    return {key[len(prefix) :]: tensor for key, tensor in weights.items()}


def read_config(path: str | Path) -> dict[str, Any] | None:
    """The model/data config train.py stored in a checkpoint (see `read_stored`), as this version reads it; one
    naming a `_target_` the template cannot build is refused."""
    config = read_stored(path, "config")
    if config is None:
        return None
    config = upgraded(config)
    safe_load.check_targets(config, path)
    return config


# the objectives a checkpoint written before objectives were a config group can name
OBJECTIVES = {"sft": "src.lm.objectives.sft.SFT", "dpo": "src.lm.objectives.dpo.DPO"}
# where a stored `_target_` of an objective, a reward function or the token loss lived before src/lm/objectives/
MOVED = re.compile(r"^src\.models\.(objective|sft|dpo|reward|grpo|verifiers|loss|moe)\.")
# where a stored `_target_`'s module lived before the language model had its own floor (src/lm/)
MOVED_MODULES = {
    "src.models.causal_lm": "src.lm.models.causal_lm",
    "src.models.gpt2": "src.lm.models.gpt2_module",
    "src.models.bottleneck": "src.lm.features.bottleneck",
    **{
        f"src.datamodules.{m}": f"src.lm.data.{m}"
        for m in ("text", "instruct", "chat", "preference", "prompts", "shards")
    },
    **{f"src.objectives.{m}": f"src.lm.objectives.{m}" for m in ("base", "sft", "dpo", "reward", "grpo", "verifiers")},
}


def upgraded(config: Any) -> Any:
    """A stored config as this version builds it: one from before objectives were a config group (`model.objective:
    dpo` with `model.dpo: {beta: ...}`) gets `model.objective: {_target_: src.lm.objectives.dpo.DPO, beta: ...}`; a
    `_target_` under src/models/, src/datamodules/ or src/objectives/ that moved to src/lm/ is named where it is now."""
    config = _moved(config)
    model = config.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("objective"), str):
        return config
    name, settings = model["objective"], model.get("dpo") or {}
    model = {k: v for k, v in model.items() if k != "dpo"}
    model["objective"] = {"_target_": OBJECTIVES[name], **(settings if name == "dpo" else {})}
    return {**config, "model": model}


def _moved(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _moved(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_moved(v) for v in node]
    if isinstance(node, str) and MOVED.match(node):
        name = MOVED.match(node).group(1)
        return MOVED.sub(f"src.lm.objectives.{'base' if name == 'objective' else name}.", node)
    if isinstance(node, str) and node.rpartition(".")[0] in MOVED_MODULES:
        module, _, name = node.rpartition(".")
        return f"{MOVED_MODULES[module]}.{name}"
    return node


def read_stored(path: str | Path, key: str) -> Any:
    """What train.py stored under `key` in a checkpoint (its config, its tracker runs), read without loading or
    gathering weights: a DCP dir's meta.pt, a DeepSpeed dir's client state, a single file memory-mapped."""
    path = Path(path)
    if is_dcp(path):
        files = [path / "meta.pt"]
    elif is_deepspeed(path):  # Lightning hands the non-tensor state to DeepSpeed as client_state
        files = sorted((path / (path / "latest").read_text().strip()).glob("*model_states.pt"))
    else:
        files = [path]
    for file in files:
        if file.is_file():
            state = safe_load.load(file, map_location="cpu", mmap=True)
            if isinstance(state, dict) and key in state:
                return state[key]
    return None


def consolidate(path: str | Path, out: str | Path | None = None) -> Path:
    """One .ckpt file from a sharded dir, written under a temporary name and renamed: `out` is whole or absent.

    More than torch's `dcp_to_torch_save`: it reads ZeRO dirs too (DeepSpeed's zero_to_fp32), puts trainer=tp's
    Linear layout back into the model's own (GPT-2's Conv1D), and keeps the stored config, so the file loads like
    one train.py wrote (eval.py, export-hf)."""
    out = Path(out) if out else Path(str(path).rstrip("/") + ".consolidated.ckpt")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        torch.save(load_checkpoint(path), tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def build_module(checkpoint: dict[str, Any]):
    """The LightningModule and datamodule of a train.py checkpoint, weights loaded."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    if "config" not in checkpoint:
        raise CheckpointError(
            "This checkpoint has no stored config (it was not written by train.py), so the model "
            "cannot be rebuilt from it."
        )
    config = upgraded(checkpoint["config"])
    safe_load.check_targets(config, "The checkpoint")
    cfg = OmegaConf.create(config)
    datamodule = instantiate(cfg.data)
    module = instantiate(cfg.model, **getattr(datamodule, "model_kwargs", {}))
    module.load_state_dict(checkpoint["state_dict"])
    return module.eval(), datamodule


def export_hf(path: str | Path, out_dir: str | Path) -> Path:
    """Write `save_pretrained` files that `AutoModelForCausalLM.from_pretrained(out_dir)` loads (a sequence classifier's,
    model=sequence_classifier: `AutoModelForSequenceClassification`, its labels as id2label), with the data's tokenizer.

    With a peft adapter, `out_dir/adapter/` gets the adapter alone (peft's save_pretrained); LoRA is
    also merged into the weights, so `out_dir` holds a plain model. Prompt/prefix/P-tuning cannot be
    merged: `out_dir/base/` gets the frozen base model, for peft's PeftModel.from_pretrained. Bottleneck adapters: `out_dir/base/` (the
    frozen base, a plain model) and `out_dir/adapter/` (their weights and loader, src/lm/features/bottleneck.py's `load`).
    """
    module, datamodule = build_module(load_checkpoint(path))
    if not hasattr(module, "model") or not hasattr(module.model, "save_pretrained"):
        raise CheckpointError(
            f"{type(module).__name__} is not a Hugging Face model; only language-model checkpoints (model=gpt2, llama, "
            "qwen2, mistral, causal_lm) and sequence classifiers (model=sequence_classifier) export."
        )
    out_dir = Path(out_dir)
    model = module.model
    if hasattr(model, "bottleneck_config"):  # the template's bottleneck adapters (src/lm/features/bottleneck.py)
        model.bottleneck_config.export(model, out_dir)  # the base alone (a plain model), then the adapters
        _save_tokenizer(datamodule, out_dir / "base")
        print(f"Base model written to {out_dir / 'base'}, its bottleneck adapters and loader to {out_dir / 'adapter'}.")
        return out_dir
    if hasattr(model, "peft_config"):
        model.save_pretrained(out_dir / "adapter")
        if not hasattr(model, "merge_and_unload"):  # prompt learning: the frozen base beside it, a plain model
            model.get_base_model().save_pretrained(out_dir / "base")
            _save_tokenizer(datamodule, out_dir / "base")
            print(f"Adapter written to {out_dir / 'adapter'}, its base to {out_dir / 'base'}; it does not merge.")
            return out_dir
        model = model.merge_and_unload()
    vocab = getattr(module, "unpadded_vocab", None)  # model.pad_vocab_multiple's rows are never exported
    if vocab is not None and model.config.vocab_size != vocab:
        model.resize_token_embeddings(vocab)
    if hasattr(module, "objective"):  # a reward model: transformers' sequence-classification model
        model = module.objective.export(model, getattr(datamodule.tokenizer, "eos_id", None))
    model.save_pretrained(out_dir)
    _save_tokenizer(datamodule, out_dir)
    return out_dir


def _save_tokenizer(datamodule: Any, out_dir: Path) -> None:
    hf_tokenizer = getattr(datamodule.tokenizer, "hf", None)
    if hf_tokenizer is not None:
        hf_tokenizer.save_pretrained(out_dir)
    else:  # the byte tokenizer has no HF form: ids are UTF-8 bytes, 256 = EOS
        (out_dir / "TOKENIZER.md").write_text("Token ids are UTF-8 bytes (0-255); 256 is end-of-text.\n")


def is_checkpoint(path: str | Path) -> bool:
    """A train.py checkpoint in any form (file, DCP dir, ZeRO dir), as opposed to a Hugging Face dir."""
    return Path(path).is_file() or is_sharded(path)


def as_pretrained(path: str | Path, cache_dir: str | Path) -> Path:
    """A Hugging Face dir with the weights of the train.py checkpoint `path` (model.pretrained=CKPT: SFT -> DPO),
    exported once per version of the checkpoint into cache_dir/pretrained/<key>/. One process exports under a
    file lock while the others wait; the dir appears whole (renamed into place) or not at all."""
    import hashlib
    import shutil

    from filelock import FileLock

    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stamp = "\n".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    out = Path(cache_dir) / "pretrained" / hashlib.sha256(stamp.encode()).hexdigest()[:16]
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "config.json").is_file():
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            try:
                export_hf(path, tmp)
                if not (tmp / "config.json").is_file():
                    raise CheckpointError(
                        f"{path} holds an adapter that does not merge into the weights (prompt learning, "
                        "bottleneck adapters): it cannot be model.pretrained; start from its base model instead."
                    )
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out
