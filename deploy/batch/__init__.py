"""Batch policy: the global batch over time and how the sites split it each step."""
