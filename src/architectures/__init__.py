"""What the code knows of an architecture without building it: the transformers config a `model:` node builds
(config.py), and the one hand-written adapter, GPT-2's (gpt2_adapter.py, behind handwritten.py's interface), for the model
transformers ships no tensor-parallel or pipeline plan for."""

from __future__ import annotations

from typing import Optional

from src.architectures.gpt2_adapter import GPT2
from src.architectures.handwritten import Adapter

ADAPTERS: dict[str, Adapter] = {"gpt2": GPT2}


def adapter_for(model_type: Optional[str]) -> Optional[Adapter]:
    """The hand-written adapter of `model_type`; None for every architecture whose config carries its plans."""
    return ADAPTERS.get(model_type)
