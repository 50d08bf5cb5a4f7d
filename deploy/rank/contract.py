"""What a launcher (deploy/launch/) tells the ranks it starts, beyond the job config:
the environment variables both sides read. Imports nothing, so a launcher names them
without importing torch."""

from __future__ import annotations

STORE_ENV = "ISTHMUS_STORE"
"""The FileStore a site's ranks meet in (a file in the launcher's 0700 folder)."""

SCRIPT_ENV = "ISTHMUS_SCRIPT"
"""JSON ``[path, arg, ...]``: the launcher's ``--script``, which every rank runs
(deploy/api.py); the ranks inherit it from the launcher's environment."""

AGENT_ENV = "ISTHMUS_HOST_AGENT"
"""Where the ranks' host agent listens ("unix:/path"; inter/control/host_agent.py): their
votes and watches go there. Unset: each rank votes and watches at its coordinator."""
