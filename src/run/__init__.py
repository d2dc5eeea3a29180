"""What a train.py / eval.py job does around the Trainer: the checks before any rank starts (checks.py), the
config's paths, seed and tree, resume decisions and hyperparameters (job.py). The top layer of src/: it may import
every other package; nothing of src/ imports it."""
