"""trainer=pipeline: the model cut into stages (stages.py), the schedules that run them (schedule.py), the strategy (strategy.py)."""
