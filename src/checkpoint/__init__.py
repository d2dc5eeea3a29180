"""Checkpoints: written whole or not at all, read in any form, resumed on any number of ranks and any strategy, converted for eval.py and Hugging Face."""
