"""A checkpoint is data: every checkpoint file the template reads is unpickled here, with torch's weights-only
unpickler and an allowlist of exactly the types the template and Lightning write (ALLOWED), so loading one somebody
else wrote never runs their code. Anything else is refused in one sentence naming the type.

Where a library unpickles a checkpoint's files itself, with plain pickle (torch.distributed.checkpoint's `.metadata`
and the non-tensor items in its shards; DeepSpeed's ZeRO files), `check_dir` first unpickles each of those files
here the same way: a dir holding anything the template did not write is refused before the library opens it.

`trust_checkpoint=true` (train.py, eval.py; `--trust-checkpoint` in src.tools.checkpoints) loads with plain pickle,
for a user's own checkpoint that holds other types: only for a file whose writer you trust.
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from src.utils.errors import CheckpointError

# torch.save files: beyond what torch's weights-only unpickler allows itself (tensors, dicts, lists, sets,
# OrderedDict, numbers, strings, torch.Size, dtypes). Lightning's and train.py's files under every strategy need
# nothing more today (torch.serialization.get_unsafe_globals_in_checkpoint finds no other type in them); a type a
# future writer adds goes here, or the checkpoints it writes are refused
ALLOWED: list[Any] = []
# a DCP dir's .metadata (plain pickle, protocol 5, which torch's weights-only unpickler does not read): its dataclasses
# and what they hold; a name in the module `torch` is allowed only where it is a dtype (torch.float32)
DCP_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}
# a ZeRO dir's optimizer files (DeepSpeed's own classes, plain data: their state is set, no method runs), allowed for
# DeepSpeed's dirs only and imported then (DeepSpeed is optional)
DEEPSPEED = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
OPT_IN = "trust_checkpoint=true"
_trusted, _opt_in = False, OPT_IN  # set once per process from the run's config or command line: trust()


def trust(value: bool, how: str = OPT_IN) -> None:
    """Load checkpoints with plain pickle (`value` True) or as data only; `how`: the opt-in the refusals name."""
    global _trusted, _opt_in
    _trusted, _opt_in = bool(value), how


def weights_only() -> bool:
    """What to pass a library's torch.load (Lightning's) for a checkpoint: data only, unless trusted."""
    return not _trusted


@contextmanager
def allowed() -> Iterator[None]:
    """The allowlist for the torch.load calls made inside (Lightning's, DCP's), weights-only refusals in one
    sentence."""
    try:
        with torch.serialization.safe_globals(ALLOWED):
            yield
    except pickle.UnpicklingError as e:
        raise CheckpointError(refusal("The checkpoint", e)) from None


def refusal(what: Any, error: BaseException) -> str:
    found = re.search(r"GLOBAL (\S+)", str(error))
    holds = f"a {found.group(1)}" if found else "something other than tensors and plain values"
    detail = "" if found else f" ({str(error).split('WeightsUnpickler error: ')[-1].splitlines()[0][:200]})"
    return (
        f"{what} holds {holds}{detail}, which is not a type the template writes, and loading it could run code "
        f"from the file: load it only if you trust whoever wrote it, with {_opt_in}."
    )


def load(file: str | Path, also: tuple[Any, ...] = (), **kwargs: Any) -> Any:
    """torch.load of a checkpoint file, as data unless trusted (`also`: more allowed types, for this file only)."""
    try:
        with torch.serialization.safe_globals(ALLOWED + list(also)):
            return torch.load(file, weights_only=not _trusted, **kwargs)
    except pickle.UnpicklingError as e:
        raise CheckpointError(refusal(file, e)) from None


class _DataUnpickler(pickle.Unpickler):
    """pickle's own way to restrict what a pickle may build (its docs' "Restricting Globals"): every class or
    function a pickle names goes through find_class, so one outside DCP_GLOBALS is never imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed")


def unpickle(data: bytes, what: Any) -> Any:
    """A plain pickle (a DCP dir's .metadata), as data unless trusted."""
    if _trusted:
        return pickle.loads(data)
    try:
        return _DataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(refusal(what, e)) from None


def dcp_metadata(path: str | Path) -> Metadata:
    """A DCP dir's .metadata, read as data (torch's own reader unpickles it with plain pickle)."""
    return unpickle((Path(path) / ".metadata").read_bytes(), Path(path) / ".metadata")


def check_dir(path: str | Path) -> None:
    """Refuse a DCP or DeepSpeed dir holding a type the template does not write, before a library that trusts its
    files (DCP's loaders, DeepSpeed's) opens them: every pickle in it is unpickled here as data first."""
    path = Path(path)
    if _trusted or not path.is_dir():
        return
    if (path / "latest").is_file():  # DeepSpeed: `latest` names the tag dir of torch.save files
        also = tuple((_named(name), name) for name in DEEPSPEED)
        for file in sorted((path / (path / "latest").read_text().strip()).glob("*.pt")):
            load(file, also, map_location="cpu", mmap=True)
        return
    if not (path / ".metadata").is_file():
        return
    metadata = dcp_metadata(path)
    for key, info in (metadata.storage_data or {}).items():  # DCP torch.loads non-tensor items with plain pickle
        if isinstance(metadata.state_dict_metadata.get(key.fqn), BytesStorageMetadata):
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = io.BytesIO(f.read(info.length))
            try:
                with torch.serialization.safe_globals(ALLOWED):
                    torch.load(data, weights_only=True)
            except Exception as e:  # noqa: BLE001  (also an item stored transformed, which the template never does)
                raise CheckpointError(refusal(f"{path}'s {key.fqn}", e)) from None
    if (path / "meta.pt").is_file():
        load(path / "meta.pt", map_location="cpu", mmap=True)


def _named(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


# ---- a stored config builds only what the template can build ----


def conf_targets(root: Path = Path(__file__).resolve().parents[2] / "conf") -> set[str]:
    """Every `_target_` conf/ names."""
    found = re.compile(r"^[\s-]*_target_:\s*([A-Za-z_][\w.]*)", re.MULTILINE)
    return {t for file in root.rglob("*.yaml") for t in found.findall(file.read_text())}


def buildable(target: str, named: set[str]) -> bool:
    """In conf/, or a module (model, objective) or datamodule class under src/ (a user's own model there too)."""
    if target in named:
        return True
    if not target.startswith("src."):
        return False
    import lightning as L

    try:  # not hydra's get_class, which logs an ERROR line of its own for a name that is not a class
        cls = _named(target)
    except Exception:  # noqa: BLE001  (no such module or name: not buildable)
        return False
    kinds = (L.LightningDataModule, torch.nn.Module)
    return isinstance(cls, type) and cls.__module__.startswith("src.") and issubclass(cls, kinds)


def check_targets(config: Any, what: Any) -> None:
    """Refuse, before anything is built, a stored config naming a `_target_` the template cannot build (Hydra's
    instantiate would import and call whatever it names)."""
    if _trusted:
        return
    named, stack = conf_targets(), [config]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            target = node.get("_target_")
            if target is not None and not (isinstance(target, str) and buildable(target, named)):
                raise CheckpointError(
                    f"{what}'s stored config names _target_: {target!r}, which is no class or function conf/ names "
                    f"nor a module or datamodule class under src/, and building it could run any code: load it only "
                    f"if you trust whoever wrote it, with {_opt_in}."
                )
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
