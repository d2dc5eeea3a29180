"""The language-model floor, built on src/core/ as a user's module is: the LM module and its features (models/,
features/), what a step optimises (objectives/), the token data (data/) and its callbacks (callbacks/: samples,
lm-eval)."""
