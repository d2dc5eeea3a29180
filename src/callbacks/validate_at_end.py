"""A short run ends with a validation: its last step gives val metrics and a best checkpoint."""

from __future__ import annotations

from typing import Any

import lightning as L


class ValidateAtEnd(L.Callback):
    """Validate once more at the end of training when the last step was not a validation step.

    Without it, max_steps=6 with val_check_interval=100 ends without any validation: no val metrics,
    no best checkpoint, and nothing for a sweeper to read. Asking the loop to stop at the last step
    makes Lightning run its validation there (as for early stopping); a run whose last step already
    validates is unchanged.
    """

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps and trainer.limit_val_batches != 0:
            trainer.should_stop = True
