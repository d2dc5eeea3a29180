"""trainer=tp: a block split by the model's tensor-parallel plan (plan.py), a MoE layer's experts over the tensor ranks (experts.py), the strategy (strategy.py)."""
