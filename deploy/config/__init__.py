"""The job config: its typed sections (a TOML file plus overrides) and their checks."""
