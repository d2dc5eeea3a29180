"""Does a method learn what it should? A training method run end to end on a task with a known answer."""
