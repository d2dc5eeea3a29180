"""The language model's callbacks: samples during training, lm-evaluation-harness on the model being trained."""
