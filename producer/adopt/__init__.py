"""``python -m producer adopt``: an earlier run's files taken into this run, proven compatible."""
