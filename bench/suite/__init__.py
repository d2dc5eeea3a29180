"""What do the tests' train.py runs cost? Fresh interpreters against the tests' forking stand-in."""
