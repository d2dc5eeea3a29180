"""The generic floor: what makes any LightningModule and DataModule train on N ranks as on 1 (the base classes, keyed
randomness, a plain datamodule's loaders dealt exactly, epoch metrics, the probes). It knows nothing of the models and
data built on it: the language model and the user's own modules stand on it alike (tests/test_layers.py)."""
