"""How does it scale? Communication, the pipeline bubble and the data path as ranks and corpora grow."""
