"""Launchers: a job's sites on one machine (`isthmus local`) or one site of it
(`isthmus site`), the rank processes they start, the progress line they print, and the
probe of the links before a job (`isthmus probe`: probe*.py)."""
