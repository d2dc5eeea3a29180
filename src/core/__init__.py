"""The generic floor: what makes any LightningModule and DataModule train on N ranks as on 1 (the base classes, keyed
randomness, a plain datamodule's loaders dealt exactly, the probes). It knows no tokens, objectives or experts: the
language model (src/lm/) and the user's own modules (src/models/, src/datamodules/) are built on it alike."""
