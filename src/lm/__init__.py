"""The language-model floor, built on src/core/ as a user's module is: the LM module and its features (models/,
features/), what a step optimises (objectives/) and the token data (data/)."""
