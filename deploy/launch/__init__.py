"""Launchers: a job's sites on one machine (`isthmus local`) or one site of it
(`isthmus site`), the rank processes they start, and the progress line they print."""
