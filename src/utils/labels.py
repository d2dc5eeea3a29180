"""The label value that counts as no target: torch's cross-entropy, Hugging Face models and our metrics skip it.
Prompts, padding and evaluation's padding samples carry it (src/datamodules, src/models)."""

IGNORE_INDEX = -100
