"""The dtype a statistic or a loss is computed in: never below fp32, never below its input (a float64 run or test
keeps float64). Used by the token loss, DPO's log-probs and GlooSyncBatchNorm's statistics."""

import torch


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 upcast to fp32; fp32 and fp64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
