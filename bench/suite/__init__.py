"""What does the test suite spend its time on? The tests' own train.py runs."""
