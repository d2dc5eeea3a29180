"""What every datamodule of token sequences shares (data=text, litdata, instruct, chat, preference, prompts): its
tokenizer and the vocabulary the model is built for, and the data.* keys typed and checked here, once
(data.tokenizer, seq_len, val_fraction, test_fraction); each subclass takes its own keys and passes the rest on
(`**shared`), down to ShardedDataModule's."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any, Callable

from src.core.datamodule import ShardedDataModule
from src.lm.data.corpus import CorpusError
from src.lm.data.tokenizers import Tokenizer, load_tokenizer
from src.utils.config import check_fractions, check_int


def split_counts(
    n: int, val_fraction: float, test_fraction: float, too_few: Callable[[int, int], str]
) -> tuple[int, int, int]:
    """(train, val, test) counts of `n` items cut in order, val and test at least one each when asked for; a
    CorpusError of the caller's sentence `too_few(n_val, n_test)` when no training item is left."""
    n_val = max(1, round(n * val_fraction)) if val_fraction > 0 else 0
    n_test = max(1, round(n * test_fraction)) if test_fraction > 0 else 0
    if n - n_val - n_test < 1:
        raise CorpusError(too_few(n_val, n_test))
    return n - n_val - n_test, n_val, n_test


LANGUAGE_KINDS = ("tokens", "pairs", "prompts")  # the batch kinds of a language model's data (src/lm/objectives/)


class TokenDataModule(ShardedDataModule):
    # what a batch holds, for the LM's objective (src/lm/objectives/base.py): tokens (input ids and their shifted
    # targets) | pairs (a chosen and a rejected answer per prompt: data=preference) | prompts (data=prompts, for GRPO)
    batch_kind = "tokens"
    pad_evaluation = True  # batches of one shape; the token metrics leave the padding's ignored labels out (GRPO
    # gathers the generations of each position)
    indexes_samples = True  # the LM keys its dropout by each row's sample index (src/core/dropout.py)
    special_tokens: Sequence[str] = ()  # added to a HF tokenizer's vocabulary (data.special_tokens, where taken)

    def __init__(
        self,
        tokenizer: str = "bytes",
        seq_len: int = 128,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        **shared: Any,
    ) -> None:
        super().__init__(**shared)
        check_int("data.seq_len", seq_len)
        check_fractions("data.val_fraction", val_fraction, "data.test_fraction", test_fraction)
        self.tokenizer_name, self.seq_len = tokenizer, seq_len
        self.val_fraction, self.test_fraction = val_fraction, test_fraction

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer_name, self.special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def model_kwargs(self) -> dict[str, int]:
        """What the model must be built with to fit this data (train.py passes it to the model)."""
        return {"vocab_size": self.vocab_size}
