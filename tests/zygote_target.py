"""What the zygote tests' children run (tests/deploy/test_zygote.py): told by their
environment what to do, as a rank is told by its own."""

from __future__ import annotations

import os
import signal
import sys
import time


def main() -> None:
    mode = os.environ.get("TARGET_MODE", "")
    print(
        f"say={os.environ.get('TARGET_SAY', '')} cwd={os.getcwd()} ppid={os.getppid()} "
        f"launcher={os.environ.get('ISTHMUS_LAUNCHER_PID', '')} "
        f"leaked={os.environ.get('ONLY_THE_ZYGOTE', '')}",
        flush=True,
    )
    if mode == "import":
        module = __import__(os.environ["TARGET_IMPORT"])
        print(f"imported={module.VALUE}", flush=True)
    if mode == "burn":  # CPU time, for the accounting test
        until = time.process_time() + float(os.environ.get("TARGET_BURN_S", "0.5"))
        while time.process_time() < until:
            pass
    if mode == "sleep":  # until a signal ends it (the tests send one, or its parent dies)
        while True:
            signal.pause()
    if mode == "raise":
        raise ValueError("the target raised")
    sys.exit(int(os.environ.get("TARGET_CODE", "0")))
