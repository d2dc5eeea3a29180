"""The sharded save and the resharding load that FSDP2, tensor parallel and the pipeline share, and DeepSpeed its
save: `ShardedCheckpoints`, a mixin placed before the Lightning strategy whose save and load it wraps."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from src.checkpoint import resharding, safe_load
from src.checkpoint.files import save_sharded
from src.checkpoint.resharding import LAYOUT_KEY


class ShardedCheckpoints:
    """A checkpoint is a dir of every rank's shards, written beside its path and renamed into place once all are on
    disk (files.py `save_sharded`). Reading, a dir of the strategy's own form (`native_form`, with its weight
    layout) goes through its own loader; files and every other form through the full form (resharding.py)."""

    checkpoint_form: ClassVar[str] = "dcp"  # src/parallel/capabilities.py's: what it writes
    native_form: ClassVar[str] = "dcp"  # resharding.form_of its own dirs ("dcp_flat": the pipeline's)

    def weight_layout(self) -> Optional[dict]:
        """The weight layout its checkpoints are marked with (tensor parallel's, resharding.py LAYOUT_KEY), or None."""
        return None

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        entry = self.weight_layout()
        if entry is not None:
            checkpoint[LAYOUT_KEY] = entry
        base = super(ShardedCheckpoints, self)
        save_sharded(self, lambda tmp: base.save_checkpoint(checkpoint, str(tmp), storage_options), filepath)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        """Its own dirs (the same layout: any number of data-parallel ranks) through `load_own_checkpoint`; files,
        other strategies' dirs and dirs of another weight layout through the full form."""
        own = lambda: self.load_own_checkpoint(checkpoint_path)  # noqa: E731
        return resharding.load(self, checkpoint_path, (self.native_form, self.weight_layout()), own)

    def load_own_checkpoint(self, checkpoint_path) -> dict[str, Any]:
        """Lightning's resharding load of a DCP dir."""
        return super().load_checkpoint(checkpoint_path, safe_load.weights_only())
