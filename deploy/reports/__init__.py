"""A finished run, read back: its summary, plots, and several runs compared."""
