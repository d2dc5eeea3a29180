"""How does the template compare with another tool? The template against a raw loop, transformers, nanoGPT, TRL."""
