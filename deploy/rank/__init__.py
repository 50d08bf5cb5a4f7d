"""One rank's life: its setup, training loop, cross-site sync, checkpoints, evaluation
and what it reports after each step (run as ``python -m isthmus.deploy.rank.program``)."""
