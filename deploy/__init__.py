"""Composition root: job config, the isthmus CLI, the per-rank program, launchers."""
